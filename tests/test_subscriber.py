"""Error classification and pacing of the notify stream (the loop itself is in test_agent.py)."""

from __future__ import annotations

import itertools
import random

import grpc
import pytest

from nicswitch_agent.subscriber import backoff_delays, should_recover, should_terminate


class _Err(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "d"


@pytest.mark.parametrize(
    ("code", "terminal"),
    [
        (grpc.StatusCode.UNAVAILABLE, False),
        (grpc.StatusCode.UNKNOWN, False),  # "not registed, please wait agent register", "qps exceeded"
        (grpc.StatusCode.INTERNAL, False),  # a message we could not decode
        (grpc.StatusCode.RESOURCE_EXHAUSTED, False),  # an oversized message
        (grpc.StatusCode.DEADLINE_EXCEEDED, False),
        (grpc.StatusCode.CANCELLED, False),
        (grpc.StatusCode.UNIMPLEMENTED, True),  # not ClusterD (or a packaged path)
        (grpc.StatusCode.UNAUTHENTICATED, True),
        (grpc.StatusCode.PERMISSION_DENIED, True),
    ],
)
def test_recover_and_terminate_are_complementary(code: grpc.StatusCode, terminal: bool) -> None:
    exc = _Err(code)
    assert should_terminate(exc) is terminal
    assert should_recover(exc) is (not terminal)


def test_non_grpc_errors_are_neither() -> None:
    assert not should_recover(ValueError()) and not should_terminate(ValueError())


def test_backoff_is_capped_jittered_and_growing() -> None:
    delays = list(itertools.islice(backoff_delays(0.2, 5.0, random.Random(1)), 12))
    assert 0.1 <= delays[0] <= 0.2
    assert all(0 < d <= 5.0 for d in delays)
    assert max(delays[-4:]) > 2.5  # reached the cap region
    assert delays[1] <= 0.4 and delays[2] <= 0.8
