"""KV's timed waits on a torch Store: the connection's timeout is set only when a wait needs another
one (torch's ``set_timeout`` releases the GIL; a relay and a flat member would pay a wait for it on
every event), and a wait with a shorter bound after a longer one still ends at its own."""

from __future__ import annotations

import datetime
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from nicswitch_agent.coordination import KV

torch_distributed = pytest.importorskip("torch.distributed")

pytestmark = pytest.mark.timeout(60)


class CountingTimeouts(torch_distributed.TCPStore):  # type: ignore[misc,name-defined]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.set_timeouts: list[datetime.timedelta] = []

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.set_timeouts.append(timeout)
        super().set_timeout(timeout)


def test_a_timed_get_sets_the_connections_timeout_only_when_it_changes() -> None:
    store = CountingTimeouts("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    kv = KV(store, "nicswitch/job/0")
    kv.set("q/0/1", "an event")
    kv.set("q/0/2", "the next")
    assert kv.get_when_set("q/0/1", 3600.0) == "an event"
    assert kv.get_when_set("q/0/2", 3600.0) == "the next"
    assert store.set_timeouts == [datetime.timedelta(seconds=3600)]  # once: the second read kept it
    with ThreadPoolExecutor(1) as pool:  # a shorter bound after the hour's: its own, not the hour
        assert pool.submit(kv.get_when_set, "q/0/3", 0.2).result(30) is None
    assert store.set_timeouts[1:2] == [datetime.timedelta(seconds=0.2)]


def test_a_store_whose_timeout_cannot_be_read_gets_it_set_for_every_wait() -> None:
    class Plain:
        """A Store without a readable timeout (as MindSpore's client, or a wrapper)."""

        def __init__(self) -> None:
            self.inner = torch_distributed.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30),
                                                    wait_for_workers=False)
            self.set_timeouts: list[datetime.timedelta] = []

        def set_timeout(self, timeout: datetime.timedelta) -> None:
            self.set_timeouts.append(timeout)
            self.inner.set_timeout(timeout)

        def get(self, key: str) -> bytes:
            return bytes(self.inner.get(key))

        def set(self, key: str, value: str) -> None:
            self.inner.set(key, value)

    plain = Plain()
    kv = KV(plain, "nicswitch/job/0")  # type: ignore[arg-type]
    kv.set("k", "v")
    assert kv.get_when_set("k", 10.0) == "v" and kv.get_when_set("k", 10.0) == "v"
    assert plain.set_timeouts == [datetime.timedelta(seconds=10)] * 2
