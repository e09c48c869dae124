"""The plain training loop: ``enumerate`` that marks a step boundary after every step.

``agent.step(step)`` at the end of each step is the whole integration; this helper only makes it
impossible to forget, and puts the boundary where it belongs (after the step's body, before the
next batch is fetched)::

    from nicswitch_agent import SwitchAgent
    from nicswitch_agent.integrations.loop import enumerate_steps

    with SwitchAgent() as agent:
        for step, batch in enumerate_steps(agent, loader, start=1):
            train_step(batch)             # agent.step(step) runs when the loop asks for the next batch

No framework is imported here.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol, TypeVar

T = TypeVar("T")


class _Steps(Protocol):
    """What the loop needs of an agent: :meth:`nicswitch_agent.SwitchAgent.step`."""

    def step(self, step: int | None = None) -> None: ...


def enumerate_steps(agent: _Steps, iterable: Iterable[T], *, start: int = 0) -> Iterator[tuple[int, T]]:
    """Like ``enumerate(iterable, start)``, calling ``agent.step(step)`` after each step's body.

    The boundary of step ``s`` is marked when the loop asks for the item after it (also after the
    last item, before the loop ends); a ``break`` leaves the step it happened in unmarked.

    Args:
        agent: A started :class:`~nicswitch_agent.SwitchAgent` (anything with ``step(int)``).
        iterable: The batches (a DataLoader, a range, ...).
        start: The number of the first step.

    Yields:
        ``(step, item)``, like ``enumerate``.

    Raises:
        TrainingStopped: from ``agent.step()``, when ClusterD's recovery decided that training
            must stop; it comes out of the ``for`` statement.
    """
    step = start
    for item in iterable:
        yield step, item
        agent.step(step)
        step += 1
