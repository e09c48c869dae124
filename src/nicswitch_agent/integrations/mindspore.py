"""MindSpore: ``NicSwitchMindSporeCallback``, a ``mindspore.train.Callback`` for ``Model.train``.

Install with ``python3 -m pip install '.[mindspore]'`` in the checkout.

::

    from mindspore.mint.distributed import TCPStore
    from nicswitch_agent.hooks import MindSporeCheckpointGuard
    from nicswitch_agent.integrations.mindspore import NicSwitchMindSporeCallback

    store = TCPStore(host, port, world_size, is_master=(rank == 0))   # the job's coordination Store
    callback = NicSwitchMindSporeCallback(store=store)
    callback.guard(MindSporeCheckpointGuard(lambda: net, f"/ckpt/rank{rank}", step=callback.last_step))
    model.train(epochs, dataset, callbacks=[callback])

As the Lightning and Hugging Face callbacks, it is thin: ``on_train_begin`` creates and starts a
:class:`~nicswitch_agent.SwitchAgent`, ``on_train_step_end`` forwards ``cur_step_num`` (the global
step, counted from 1) to ``agent.step()``, ``on_train_end`` stops the agent. In pause mode
``agent`` a pause parks training inside ``on_train_step_end``, at the same step on every rank, and
the guard and the switch run there, on the training thread.
"""

from __future__ import annotations

import logging
from typing import Any

try:
    from mindspore.train import Callback
except ImportError as exc:
    raise ImportError(
        "nicswitch_agent.integrations.mindspore needs MindSpore: python3 -m pip install '.[mindspore]' in the "
        "nicswitch-agent checkout"
    ) from exc

from nicswitch_agent.agent import SwitchAgent
from nicswitch_agent.coordination.parking import TrainingStopped
from nicswitch_agent.hooks.base import CheckpointHook

__all__ = ["NicSwitchMindSporeCallback"]

logger = logging.getLogger("nicswitch_agent.integrations")


class NicSwitchMindSporeCallback(Callback):
    """Runs a :class:`~nicswitch_agent.SwitchAgent` for the duration of ``Model.train()``.

    Args:
        raise_on_stop: When ClusterD's recovery decides that training must stop (``agent.step()``
            raises :class:`~nicswitch_agent.TrainingStopped`): True (default) request the stop,
            stop the agent and re-raise, so ``train()`` raises and the process can exit non-zero
            for MindCluster to restart it; False: only ``run_context.request_stop()``, and
            :attr:`stop_reason` says why.
        **agent_kwargs: Passed to :class:`~nicswitch_agent.SwitchAgent` (``store``, ``server``,
            ``job_id``, ``switch_hook``, ``checkpoint_hook``, any ``AgentConfig`` field, ...).

    Attributes:
        agent: The running agent during ``train()`` (None otherwise).
        stop_reason: Why ClusterD stopped training, if it did.

    Raises:
        ConfigError: a setting is invalid or missing (checked here, not at ``train()``).
    """

    def __init__(self, *, raise_on_stop: bool = True, **agent_kwargs: Any) -> None:
        super().__init__()
        SwitchAgent(**agent_kwargs)  # validates the settings now; starts nothing
        self._raise_on_stop = raise_on_stop
        self._agent_kwargs = agent_kwargs
        self.agent: SwitchAgent | None = None
        self.stop_reason: str | None = None
        self._step: int | None = None

    def guard(self, checkpoint_hook: CheckpointHook) -> None:
        """Set the checkpoint guard (built after the callback, as it reads :meth:`last_step`)."""
        self._agent_kwargs["checkpoint_hook"] = checkpoint_hook
        SwitchAgent(**self._agent_kwargs)

    def last_step(self) -> int | None:
        """The last step handed to the agent (the parked step while parked): a guard's ``step``."""
        return self._step

    def on_train_begin(self, run_context: Any) -> None:
        self._stop_agent("a new train() began")  # an earlier train() that raised
        self.stop_reason = None
        self.agent = SwitchAgent(**self._agent_kwargs).start()

    def on_train_step_end(self, run_context: Any) -> None:
        agent = self.agent
        if agent is None:
            return
        step = int(run_context.original_args().cur_step_num)
        self._step = step
        try:
            agent.step(step)
        except TrainingStopped as exc:
            self.stop_reason = str(exc)
            run_context.request_stop()
            logger.error("ClusterD stopped training at step %d: %s", step, exc)
            if self._raise_on_stop:
                self._stop_agent(f"ClusterD stopped training: {exc}")
                raise

    def on_train_end(self, run_context: Any) -> None:
        self._stop_agent("training finished")

    def _stop_agent(self, reason: str) -> None:
        agent, self.agent = self.agent, None
        if agent is not None:
            agent.stop(reason)
