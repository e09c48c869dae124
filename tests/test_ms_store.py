"""MindSpore's TCPStore as the coordination Store (coordination/ms_store.py), on a real TCPStore.

First what MindSpore 2.10's TCPStore does that the backend is built on (pinned, so an upgrade that
changes it goes red here), then the calls the backend builds on it: ``check`` through the
companion counter, ``get``/``wait``/timed get by polling (never MindSpore's blocking ``get`` of a
missing key, which holds the GIL), a local ``set`` waking a local waiter at once, a dead master
read as "coordination lost". Run in CI's MindSpore step (``mindspore==2.10.0`` pinned); skipped
without MindSpore.
"""

from __future__ import annotations

import datetime
import gc
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from support import free_port

from nicswitch_agent.coordination.kv import KV, StoreTimeout
from nicswitch_agent.coordination.ms_store import MARK, MindSporeStore, host_store, is_mindspore_store
from nicswitch_agent.errors import ConfigError

ms_dist = pytest.importorskip("mindspore.mint.distributed",
                              reason="MindSpore is not installed (CI's MindSpore step installs mindspore==2.10.0)")
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def master() -> Iterator[Any]:
    port = free_port()
    store = ms_dist.TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    yield store
    _RAW.append(store)


@pytest.fixture
def store(master: Any) -> MindSporeStore:
    return MindSporeStore.of(master, 10.0)


@pytest.fixture
def key() -> str:
    return f"t/{uuid.uuid4().hex}"


_RAW: list[Any] = []  # kept: destroying a MindSpore client can crash the process (ms_store.py)


def raw_client(master: Any, timeout_s: float = 10.0) -> Any:
    _RAW.append(ms_dist.TCPStore("127.0.0.1", master.port, None, False, datetime.timedelta(seconds=timeout_s)))
    return _RAW[-1]


# -- what MindSpore's TCPStore does (the facts the backend stands on) --------------------------

def test_fact_add_returns_the_new_value_and_creates_a_missing_key(master: Any, key: str) -> None:
    raw = raw_client(master)
    assert raw.add(key, 3) == 3
    assert raw.add(key, 0) == 3
    assert raw.add(key, 2) == 5
    assert raw.add(key + "z", 0) == 0  # a check through add(key, 0) leaves "0" behind
    assert raw.get(key + "z") == b"0"


def test_fact_add_on_a_non_integer_raises_and_the_client_survives(master: Any, key: str) -> None:
    raw = raw_client(master)
    raw.set(key, "text")
    with pytest.raises(RuntimeError):
        raw.add(key, 1)
    raw.set(key + "n", "41")
    assert raw.add(key + "n", 1) == 42  # a numeric string is a counter


def test_fact_delete_key_says_whether_the_key_existed(master: Any, key: str) -> None:
    raw = raw_client(master)
    raw.set(key, b"\x00\xffbytes")
    assert raw.get(key) == b"\x00\xffbytes"
    assert raw.delete_key(key) is True
    assert raw.delete_key(key) is False


def short_deadline_client(master: Any, timeout_s: float, attempts: int = 20) -> Any:
    """A client whose deadline is ``timeout_s``. The same timeout also bounds connecting, and on a
    loaded 2-core CI machine registering with the master took longer than 0.3 s once (CI, 12-05):
    retry the connect, since the fact under test is get's deadline, not connect's."""
    for attempt in range(attempts):
        try:
            return raw_client(master, timeout_s=timeout_s)
        except RuntimeError as error:
            if "trying to connect" not in str(error) or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def test_fact_get_of_a_missing_key_fails_at_the_clients_timeout(master: Any, key: str) -> None:
    raw = short_deadline_client(master, timeout_s=0.3)  # the constructor's timeout is get's deadline
    with pytest.raises(RuntimeError, match="TCP get operation failed"):
        raw.get(key)
    raw.set(key, "v")  # and the client is still usable
    assert raw.get(key) == b"v"


def test_fact_the_client_has_no_check_wait_or_multi_get(master: Any) -> None:
    raw = raw_client(master)
    for name in ("check", "wait", "multi_get", "multi_set", "set_timeout", "clone"):
        assert not hasattr(raw, name), name
    assert is_mindspore_store(raw) and not is_mindspore_store(object())


# -- the backend -------------------------------------------------------------------------------

def test_set_check_get_delete(store: MindSporeStore, key: str) -> None:
    assert store.check([key]) is False
    store.set(key, "v1")
    assert store.check([key]) is True and store.check([key, key + "x"]) is False
    assert store.get(key) == b"v1"
    store.set(key, "v2")  # a second set: still there, the last value
    assert store.get(key) == b"v2"
    assert store.delete_key(key) is True
    assert store.check([key]) is False
    assert store.delete_key(key) is False


def test_check_sees_a_key_set_by_another_client(store: MindSporeStore, key: str) -> None:
    other = store.clone()
    other.set(key, "x")
    assert store.check([key]) and store.get(key) == b"x"


def test_counters_are_plain_adds(store: MindSporeStore, key: str) -> None:
    assert store.add(key, 1) == 1 and store.add(key, 0) == 1 and store.add(key, 4) == 5
    assert not store.check([key])  # a counter is never "set": callers read it with add(key, 0)


def test_delete_removes_the_mark_too(master: Any, store: MindSporeStore, key: str) -> None:
    store.set(key, "v")
    store.delete_key(key)
    assert raw_client(master).delete_key(key + MARK) is False  # already gone: nothing left on the server


def test_get_of_a_missing_key_times_out_as_torch_does(store: MindSporeStore, key: str) -> None:
    store.set_timeout(datetime.timedelta(seconds=0.05))
    with pytest.raises(StoreTimeout, match="timeout"):
        store.get(key)
    with pytest.raises(StoreTimeout, match="timeout"):
        store.wait([key], datetime.timedelta(seconds=0.05))


def test_kv_timed_get_returns_none_then_the_value(store: MindSporeStore, key: str) -> None:
    kv = KV(store, "p")
    assert kv.get_when_set("k" + key, 0.05) is None
    assert kv.wait(["k" + key], 0.05) is False
    store.clone().set("p/k" + key, "late")
    assert kv.get_when_set("k" + key, 5.0) == "late"
    assert kv.wait(["k" + key], 5.0) is True
    assert kv.poll_all(["k" + key], 0.0) == []


def test_a_waiter_is_woken_by_a_write_from_another_process_client(master: Any, store: MindSporeStore,
                                                                  key: str) -> None:
    got: list[str | None] = []
    waiter = threading.Thread(target=lambda: got.append(KV(store, "q").get_when_set(key, 60.0)))
    waiter.start()
    raw_client(master).set(f"q/{key}", "x")  # a raw client: no local wake-up, the poll finds it
    raw_client(master).add(f"q/{key}{MARK}", 1)
    waiter.join(30)
    assert got == ["x"]


def test_a_local_set_wakes_a_local_waiter_without_waiting_for_its_poll(store: MindSporeStore, key: str) -> None:
    """A member's stop writes its own wake-up key through another client of this process: the
    waiter's next poll is not awaited (the pause is cut short by the local notification)."""
    slow = MindSporeStore(store.host, store.port, 10.0, poll_max_s=3600.0)  # a poll an hour apart
    started = threading.Event()
    got: list[bytes] = []

    def wait() -> None:
        started.set()
        got.append(slow.get(key))

    slow.set_timeout(datetime.timedelta(seconds=3600))
    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    started.wait(10)
    for _ in range(12):  # past the doubling pauses' start: the waiter sits in an hour-long pause
        store.clone().add("noise/" + key, 1)
    store.clone().set(key, "wake")
    waiter.join(30)
    assert got == [b"wake"]


def test_a_dead_master_is_coordination_lost_not_a_timeout(key: str) -> None:
    port = free_port()
    code = ("import datetime, sys; from mindspore.mint.distributed import TCPStore; "
            f"m = TCPStore('127.0.0.1', {port}, None, True, datetime.timedelta(seconds=30), wait_for_workers=False); "
            "print('up', flush=True); sys.stdin.read()")
    host = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    try:
        assert host.stdout is not None and host.stdout.readline().strip() == b"up"
        store = MindSporeStore("127.0.0.1", port, 10.0)
        store.set(key, "v")
    finally:
        host.kill()
        host.wait()
    with pytest.raises(RuntimeError) as caught:
        store.set(key, "w")  # MindSpore's set returns silently on a dead master; the mark's add raises
    assert "timeout" not in str(caught.value).lower()


def test_connecting_to_nothing_names_the_setting() -> None:
    with pytest.raises(ConfigError, match=r"store_connect_timeout_s=0\.3"):
        MindSporeStore("127.0.0.1", free_port(), 0.3)


def test_a_hosted_store_takes_a_free_port(key: str) -> None:
    client, master = host_store("127.0.0.1", 10.0)
    other, master2 = host_store("127.0.0.1", 10.0)
    assert client.port != other.port and master is not None and master2 is not None
    client.set(key, "v")
    assert client.clone().get(key) == b"v" and not other.check([key])


# -- where the coordination takes its Store from (topology.coordination_kv) ----------------------

def test_the_job_store_is_wrapped_reached_or_asked_for(master: Any) -> None:
    from nicswitch_agent import AgentConfig
    from nicswitch_agent.coordination import topology

    cfg = AgentConfig(server="127.0.0.1:8899", job_id="j", framework="mindspore")
    kv = topology.coordination_kv(cfg, 2, store=master, leader_only=False)  # the job's own TCPStore
    assert isinstance(kv.store, MindSporeStore) and kv.store.port == master.port
    reached = topology.coordination_kv(cfg.replace(store_address=f"127.0.0.1:{master.port}"), 2, store=None,
                                       leader_only=False)
    assert isinstance(reached.store, MindSporeStore)
    kv.set("x", "1")
    assert reached.get("x") == "1"  # the same Store
    slow = cfg.replace(mindspore_poll_s=0.25)  # the idle poll is the setting's, on every store it leads to
    assert topology.coordination_kv(slow, 2, store=master, leader_only=False).store.poll_max_s == 0.25
    assert topology.coordination_kv(slow.replace(store_address=f"127.0.0.1:{master.port}"), 2, store=None,
                                    leader_only=False).store.poll_max_s == 0.25
    assert kv.store.poll_max_s == 0.02 and kv.store.clone().poll_max_s == 0.02
    job = topology.coordination_kv(slow, 2, store=master, leader_only=False)
    hosted, node_master = topology.node_kv(job, 7, 0, 10.0)  # local rank 0 hosts the node's Store ...
    joined, _ = topology.node_kv(job, 7, 1, 10.0)  # ... and the node's other ranks join it
    assert node_master is not None and hosted.store.poll_max_s == joined.store.poll_max_s == 0.25
    with pytest.raises(ConfigError, match=r"store=mindspore\.mint\.distributed\.TCPStore"):
        topology.coordination_kv(cfg, 2, store=None, leader_only=False)


def test_under_the_launcher_the_launchers_store_wins_over_the_jobs(master: Any) -> None:
    """``nicswitch-agent launch`` exports NICSWITCH_LEADER=launcher and NICSWITCH_STORE_ADDRESS (the
    leader's MindSpore Store): a rank that also passes its job's TCPStore as ``store=`` (as the
    quickstart's script does) must meet the leader there, not on the job's Store."""
    from nicswitch_agent import AgentConfig
    from nicswitch_agent.coordination import topology

    launchers, _ = host_store("127.0.0.1", 10.0)
    cfg = AgentConfig(server="127.0.0.1:8899", job_id="j", framework="mindspore", leader="launcher",
                      store_address=f"127.0.0.1:{launchers.port}")
    kv = topology.coordination_kv(cfg, 2, store=master, leader_only=False)
    assert isinstance(kv.store, MindSporeStore) and kv.store.port == launchers.port != master.port


def test_no_mindspore_store_made_or_passed_here_is_ever_destroyed(master: Any) -> None:
    """Destroying a MindSpore TCPStore client can crash the process, at exit too (a worker under
    msrun died of SIGSEGV in the interpreter's teardown while the garbage collector destroyed the
    job's Store): the job's Store given to ``MindSporeStore.of`` and every client made for it hold
    one reference more than anyone owns, so no refcount or collection ever reaches zero."""
    before = sys.getrefcount(master)
    ours = MindSporeStore.of(master, 10.0)
    client, clone_client = ours._client, ours.clone()._client
    del ours
    gc.collect()
    assert sys.getrefcount(master) == before + 1
    held = raw_client(master)  # held by a name here and by this file's list: one reference more than the name
    assert sys.getrefcount(client) == sys.getrefcount(clone_client) == sys.getrefcount(held)
