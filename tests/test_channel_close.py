"""Closing a channel waits for grpcio's call thread to finish the calls' last events
(clusterd/channel.py ``close_channel``).

``Channel.close()`` returns once the C core is done with the calls, while grpcio's Python thread
that serves streaming calls may still be running a call's event handler, holding the call's lock.
A command that exits then (``watch`` right after Ctrl-C: CI, 12-07) has that thread ended at the
interpreter's shutdown with the lock held, and the final collection of the call waits for it
forever. Here the handler is held (a real stream to the simulator, grpcio's real thread) until
the test lets it go: ``OmClient.close()`` must not return meanwhile.
"""

from __future__ import annotations

import threading
from typing import Any

import grpc._channel as grpc_channel
import pytest
from support import wait_until

from nicswitch_agent.ops.om import OmClient
from nicswitch_agent.sim import SimJob, Simulator

pytestmark = pytest.mark.timeout(60)


def test_close_returns_once_grpcs_call_thread_has_handled_the_calls_last_events(monkeypatch: Any) -> None:
    assert callable(getattr(grpc_channel, "_event_handler", None)), "grpcio moved what this test holds"
    # ``state.due``: the operation types the call still waits for, each event's batch takes its own
    # off (grpc/_channel.py _handle_event)
    closing, held, release = threading.Event(), threading.Event(), threading.Event()
    handler_for = grpc_channel._event_handler

    def held_once_closing(state: Any, deserializer: Any) -> Any:
        handle = handler_for(state, deserializer)

        def handle_event(event: Any) -> Any:
            # The call's last event after close() (close() waits for the C core to deliver every
            # other one first): its handler is held until the test lets go.
            last = not set(state.due) - {operation.type() for operation in event.batch_operations}
            if closing.is_set() and last:
                held.set()
                assert release.wait(30)
            return handle(event)

        return handle_event

    monkeypatch.setattr(grpc_channel, "_event_handler", held_once_closing)
    # The stand-in takes the pause and no agent takes the list: the switch runs, its stream stays open
    with Simulator(jobs=[SimJob(job_id="j", nodes={"node-0": ["0"]})], standin=True) as sim:
        client = OmClient(sim.address)
        try:
            client.switch("j", {"node-0": (("0",), (True,))})
            followed: list[Any] = []
            follower = threading.Thread(target=lambda: followed.append(client.follow("j", 30)), daemon=True)
            follower.start()
            calls = client._channel._call_state  # type: ignore[attr-defined]
            assert wait_until(lambda: calls.managed_calls == 1, 20), "the result stream never opened"
            closing.set()
            closer = threading.Thread(target=client.close, daemon=True)
            closer.start()
            assert held.wait(20), "no event of the cancelled call reached grpcio's handler"
            closer.join(0.5)  # an early return shows by now (with the wait it cannot happen at all)
            assert closer.is_alive(), "close() returned while grpcio's thread was still in the call's handler"
        finally:
            release.set()
        closer.join(20)
        follower.join(20)
        assert not closer.is_alive() and calls.managed_calls == 0
        assert followed and followed[0].kind.value == "cancelled", followed
