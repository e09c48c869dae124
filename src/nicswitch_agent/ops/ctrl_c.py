"""Ctrl-C beside a gRPC call: the CLI's calls run on a worker thread, the main thread only waits.

Python raises ``KeyboardInterrupt`` in the main thread, in whatever frame it is running. Inside
grpcio's own Python code that can break the channel: a Ctrl-C landing in the lines where grpcio
registers a new streaming call and starts the thread that serves the channel's calls
(``grpc/_channel.py``, ``_channel_managed_call_management``) leaves a call that no thread will
ever complete, and ``Channel.close()`` then waits for it forever. ``switch`` hung that way after
Ctrl-C, about one try in 15 when the signal came right after "waiting for the result"
(tests/test_cli_interrupt.py stalls a real process at that line to make it happen every time).

So the commands' waits run through :func:`call_beside_ctrl_c`: the call runs on a worker thread,
the main thread waits in ``select`` on Python's signal wakeup fd (demo/wakeup.py: a plain
``Event.wait`` sleeps through a SIGINT that the kernel gave to another thread; a
``KeyboardInterrupt`` in our own wait breaks nothing), and on Ctrl-C it stops the call from
outside (the client's ``close()``), as any other thread would, then lets the
``KeyboardInterrupt`` go on to the command's own handler.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import TypeVar

from nicswitch_agent.demo.wakeup import SignalWakeup

T = TypeVar("T")

# After Ctrl-C the call is cancelled, so the worker ends at once; a bound all the same, so that a
# worker stuck elsewhere (a line it prints to a full pipe) cannot keep Ctrl-C from ending the command.
_WORKER_END_S = 5.0


def call_beside_ctrl_c(call: Callable[[], T], stop: Callable[[], None]) -> T:
    """``call()`` on a worker thread: its result, or what it raised. On ``KeyboardInterrupt`` in
    the waiting main thread: ``stop()`` (a second Ctrl-C is ignored meanwhile: the command's
    result is decided), wait for the worker to end, and re-raise. Off the main thread, where no
    ``KeyboardInterrupt`` lands, ``call()`` runs in place."""
    if threading.current_thread() is not threading.main_thread():
        return call()
    outcome: list[tuple[bool, object]] = []
    ended = threading.Event()
    with SignalWakeup() as wakeup:  # woken by Ctrl-C even when the kernel gave SIGINT to a gRPC thread

        def work() -> None:
            try:
                outcome.append((True, call()))
            except BaseException as exc:  # handed to the main thread, raised there
                outcome.append((False, exc))
            finally:
                ended.set()
                wakeup.wake()

        worker = threading.Thread(target=work, name="nicswitch-cli-call", daemon=True)
        try:
            worker.start()
            wakeup.wait(ended.is_set)
        except KeyboardInterrupt:
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                stop()
                ended.wait(_WORKER_END_S)
            finally:
                if previous is not None:  # None: a handler set outside Python, which we cannot put back
                    signal.signal(signal.SIGINT, previous)
            raise
    succeeded, value = outcome[0]
    if succeeded:
        return value  # type: ignore[return-value]
    assert isinstance(value, BaseException)
    raise value


__all__ = ["call_beside_ctrl_c"]
