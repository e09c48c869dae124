"""MindSpore's TCPStore as the coordination Store, behind the calls :class:`~.kv.KV` uses.

A MindSpore job has no torch Store: it coordinates through ``mindspore.mint.distributed.TCPStore``,
MindSpore's own key-value engine (no network layer of ours). Its client has four calls, ``set``,
``get``, ``add`` and ``delete_key``; what MindSpore 2.10 does with them, measured here and pinned by
``tests/test_ms_store.py`` (docs/architecture.md#mindspores-tcpstore has the numbers):

- ``get`` of a missing key waits for it, but by asking again every 10 ms until the client's
  timeout (the one given to the constructor, 300 s by default), then raises RuntimeError "TCP get
  operation failed.". It **holds the GIL the whole time**: every other thread of the process,
  the training thread included, stands still until the key comes or the timeout passes. So a
  ``get`` here is issued only for a key seen to exist; waiting is done by polling.
- ``add`` returns the new value and creates a missing key (``add(key, 0)`` on a missing key
  leaves "0" behind); on a key holding a non-integer it raises and the client stays usable.
- ``delete_key`` returns whether the key existed. Keys must be under 4 KB. There is no ``check``,
  ``wait``, ``multi_get`` or per-call timeout, and a master on port 0 fails (it dials itself on
  port 0), so a host picks a free port first.

How the missing calls are built (each call below is one round trip, ~0.1 ms on loopback):

- ``set`` also bumps a companion counter (``key + MARK``): two round trips instead of one.
- ``check(keys)`` reads each key's companion with ``add(mark, 0)``: one round trip per key.
- ``get``, ``wait`` and a timed get (``set_timeout`` then ``get``, as :meth:`KV.get_when_set`
  does) poll ``check`` from 1 ms, doubling to ``poll_max_s`` (20 ms; 5 ms within 5 s of a wait
  that found its key, so a switch's later events are seen sooner), until the keys exist or the
  timeout passes (StoreTimeout), then ``get``: one extra round trip per key read, and an idle wait
  costs one round trip every 20 ms (MindSpore's own blocking ``get`` costs one every 10 ms, with
  the GIL held). A key written by this process (a member's stop writing its own wake-up key, a
  relay, threads as ranks) wakes the pollers of this process at once, not at their next poll.
- ``delete_key`` deletes the companion, then the key: two round trips.
- no ``multi_set``/``multi_get``: :class:`~.kv.KV` falls back to one key at a time.

Destroying a MindSpore TCPStore client can crash the process (a segmentation fault in its
teardown: 2 of 3 runs of 200 clients made and dropped one after another; none in 4 runs with every
client kept). At exit too: under msrun, a worker that had stopped its agent cleanly died of SIGSEGV
in the interpreter's teardown in about 1 run of 10 on a loaded machine (the garbage collector
destroyed the job's TCPStore, whose client joined its event thread while that thread crashed,
its master's process exiting at the same moment). So every MindSpore TCPStore made here, and the
one a job passes as ``store=``, is never destroyed (:func:`_keep`: a reference never given back):
the operating system closes its socket when the process ends. A socket each, a handful per
``start()``.
"""

from __future__ import annotations

import ctypes
import datetime
import socket
import threading
import time
from typing import Any

from nicswitch_agent.coordination.kv import StoreTimeout
from nicswitch_agent.errors import ConfigError

MARK = "/~set"  # suffix of a key's companion counter: how many times it was set since its last delete
POLL_START_S = 0.001
POLL_MAX_S = 0.02  # an idle wait's round trips: 50 a second (MindSpore's own get: 100, GIL held); mindspore_poll_s
ACTIVE_POLL_MAX_S = 0.005  # within ACTIVE_S of a wait that found its key: a switch's next event
ACTIVE_S = 5.0
HOST_ATTEMPTS = 5  # a free port found and taken by another process before we bind it: try another


def _keep(obj: Any) -> Any:
    """``obj``, never to be destroyed, not even by the interpreter's teardown at exit (see the module
    doc): a strong reference nothing holds, so no refcount or garbage collection reaches zero."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
    return obj


class _Wakeups:
    """Per Store address in this process: a condition every local ``set`` notifies."""

    _lock = threading.Lock()
    _by_address: dict[tuple[str, int], _Wakeups] = {}

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.generation = 0

    @classmethod
    def of(cls, host: str, port: int) -> _Wakeups:
        with cls._lock:
            return cls._by_address.setdefault((host, port), cls())

    def notify(self) -> None:
        with self.cond:
            self.generation += 1
            self.cond.notify_all()

    def pause(self, seen: int, seconds: float) -> None:
        """Wait ``seconds``, or less if a local ``set`` came after generation ``seen``."""
        with self.cond:
            self.cond.wait_for(lambda: self.generation != seen, seconds)


def mindspore_store_class() -> Any:
    """``mindspore.mint.distributed.TCPStore``; ConfigError if MindSpore is not installed."""
    try:
        from mindspore.mint.distributed import TCPStore
    except ImportError as exc:
        raise ConfigError(
            "framework mindspore needs MindSpore's TCPStore (mindspore.mint.distributed.TCPStore): "
            f"python3 -m pip install '.[mindspore]' in the nicswitch-agent checkout ({exc})") from exc
    return TCPStore


def is_mindspore_store(store: Any) -> bool:
    """Whether ``store`` is MindSpore's TCPStore (the object a MindSpore job made), not ours."""
    cls = type(store)
    return cls.__name__ == "TCPStore" and cls.__module__.startswith("mindspore")


class MindSporeStore:
    """A client of a MindSpore TCPStore at ``host:port`` with the calls of torch's Store (see the
    module doc for how each is built). One client is one connection: every thread works on its
    own :meth:`clone`, as with torch.

    Args:
        host, port: where the TCPStore's master listens.
        timeout_s: how long connecting may take, and the default deadline of ``get``/``wait``.
        poll_max_s: the longest pause between two polls of a wait.
    """

    def __init__(self, host: str, port: int, timeout_s: float, *, client: Any = None,
                 poll_max_s: float = POLL_MAX_S) -> None:
        self.host, self.port = host, port
        self.connect_timeout_s = timeout_s
        self._timeout_s = timeout_s
        self._poll_max_s = poll_max_s
        self._wakeups = _Wakeups.of(host, port)
        self._last_found = -ACTIVE_S  # monotonic time a wait last found its keys
        self._client = client if client is not None else connect(host, port, timeout_s)

    @classmethod
    def of(cls, store: Any, timeout_s: float, poll_max_s: float = POLL_MAX_S) -> MindSporeStore:
        """Our client of the TCPStore ``store`` (a MindSpore TCPStore the job made): a connection of
        our own, so that the job's client and its timeout stay the job's. The job's client is then
        never destroyed (see the module doc): the agent's references would make the garbage collector
        destroy it late in the interpreter's teardown, where it crashed."""
        _keep(store)
        return cls(str(store.host), int(store.port), timeout_s, poll_max_s=poll_max_s)

    @property
    def poll_max_s(self) -> float:
        """The longest pause between two polls of a wait (stores this one leads to inherit it)."""
        return self._poll_max_s

    def clone(self) -> MindSporeStore:
        return MindSporeStore(self.host, self.port, self.connect_timeout_s, poll_max_s=self._poll_max_s)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        """The deadline of the following ``get`` calls on this client (as torch's ``set_timeout``)."""
        self._timeout_s = timeout.total_seconds()

    def set(self, key: str, value: str | bytes) -> None:
        self._client.set(key, value)
        self._client.add(key + MARK, 1)  # after the value: whoever sees the mark finds the key
        self._wakeups.notify()

    def check(self, keys: list[str]) -> bool:
        return all(int(self._client.add(key + MARK, 0)) > 0 for key in keys)

    def get(self, key: str) -> bytes:
        if not self.check([key]) and not self._await([key], self._timeout_s):
            raise StoreTimeout(f"get timeout after {self._timeout_s:g} s: {key}")
        return bytes(self._client.get(key))

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
        if not self._await(list(keys), timeout.total_seconds()):
            raise StoreTimeout(f"wait timeout after {timeout.total_seconds():g} s, keys: {keys}")

    def add(self, key: str, value: int) -> int:
        return int(self._client.add(key, value))

    def delete_key(self, key: str) -> bool:
        self._client.delete_key(key + MARK)  # the mark first: nobody is told of a key going away
        return bool(self._client.delete_key(key))

    def _await(self, keys: list[str], timeout_s: float) -> bool:
        """Poll until every key exists (True) or ``timeout_s`` passes (False)."""
        start = time.monotonic()
        deadline = start + timeout_s
        # Right after a wait that found its keys (a switch under way) polls stay at most 5 ms apart.
        cap = min(self._poll_max_s, ACTIVE_POLL_MAX_S) if start - self._last_found < ACTIVE_S else self._poll_max_s
        interval = POLL_START_S
        pending = keys
        while True:
            seen = self._wakeups.generation
            pending = [key for key in pending if not self.check([key])]
            if not pending:
                self._last_found = time.monotonic()
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._wakeups.pause(seen, min(interval, remaining))
            interval = min(cap, interval * 2)
            if cap < self._poll_max_s and time.monotonic() - self._last_found >= ACTIVE_S:
                cap = self._poll_max_s  # no longer a switch under way: idle polls


def connect(host: str, port: int, timeout_s: float) -> Any:
    """A MindSpore TCPStore client of ``host:port``; ConfigError (naming the setting) if it cannot connect."""
    store_class = mindspore_store_class()
    try:
        return _keep(store_class(host, port, None, False, datetime.timedelta(seconds=timeout_s)))
    except RuntimeError as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"cannot connect to the MindSpore TCPStore at {host}:{port} within "
                          f"store_connect_timeout_s={timeout_s:g} ({first}): is its master (is_master=True) "
                          f"up, and is the port right?") from exc


def host_store(listen: str, timeout_s: float, poll_max_s: float = POLL_MAX_S, *,
               port: int = 0) -> tuple[MindSporeStore, Any]:
    """(a client, the master) of a new MindSpore TCPStore listening on ``listen`` at ``port`` (0: a free port)."""
    store_class = mindspore_store_class()
    failure: RuntimeError | None = None
    wanted = port
    for _ in range(HOST_ATTEMPTS if wanted == 0 else 1):
        if wanted == 0:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                probe.bind((listen, 0))
                port = probe.getsockname()[1]
        try:
            master = _keep(store_class(listen, port, None, True, datetime.timedelta(seconds=timeout_s),
                                       wait_for_workers=False))
        except RuntimeError as exc:  # taken meanwhile by another process
            failure = exc
            continue
        dial = "127.0.0.1" if listen == "0.0.0.0" else listen
        return MindSporeStore(dial, port, timeout_s, poll_max_s=poll_max_s), master
    if wanted:
        raise ConfigError(f"could not host a MindSpore TCPStore on {listen}:{wanted}: {failure}")
    raise ConfigError(f"could not host a MindSpore TCPStore on {listen} in {HOST_ATTEMPTS} attempts: {failure}")


__all__ = ["MARK", "MindSporeStore", "connect", "host_store", "is_mindspore_store"]
