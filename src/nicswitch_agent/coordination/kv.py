"""The few key-value operations leader and members need, over torch.distributed's Store or in-process.

Coordination rides on the job's own torch Store (the TCPStore every torch job already has), not
on a network layer of our own. Facts that shape this wrapper (torch-store-notes.md):

- one Store client is one socket and one lock: a thread blocked in ``wait`` stalls every other
  call on that client, so every thread works on its own ``clone()``;
- a timed-out ``wait`` logs two C++ warnings and may stall 5 s on reverse DNS, so waits that are
  expected to time out are done by polling ``check`` instead (see :meth:`KV.poll_all`), and the
  long idle wait of a member is woken by a key it sets itself;
- ``add`` on a key holding a non-integer kills the connection, so counters have keys of their own;
- the Store's server (rank 0 or torchrun's agent) dying makes calls raise ``DistNetworkError``
  (a RuntimeError); callers treat any RuntimeError as "coordination lost".

:class:`InProcessStore` implements the same calls for one process (threads as ranks, or a job
without torch), so the same coordination code serves one rank and many.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, Protocol


class StoreLike(Protocol):
    """The subset of ``torch.distributed.Store`` used here."""

    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...
    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None: ...
    def add(self, key: str, value: int) -> int: ...
    def delete_key(self, key: str) -> bool: ...
    def clone(self) -> Any: ...


class StoreTimeout(RuntimeError):
    """InProcessStore's wait timed out (torch raises DistStoreError, also a RuntimeError)."""


class InProcessStore:
    """A thread-safe in-memory store with torch's Store calls; ``clone()`` returns itself."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()

    def set(self, key: str, value: str | bytes) -> None:
        with self._cond:
            self._data[key] = value.encode() if isinstance(value, str) else bytes(value)
            self._cond.notify_all()

    def get(self, key: str) -> bytes:
        with self._cond:
            if not self._cond.wait_for(lambda: key in self._data, 300):
                raise StoreTimeout(f"get timeout: {key}")
            return self._data[key]

    def check(self, keys: list[str]) -> bool:
        with self._cond:
            return all(k in self._data for k in keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: all(k in self._data for k in keys), timeout.total_seconds()):
                raise StoreTimeout(f"wait timeout, keys: {keys}")

    def add(self, key: str, value: int) -> int:
        with self._cond:
            current = int(self._data.get(key, b"0")) + value
            self._data[key] = str(current).encode()
            self._cond.notify_all()
            return current

    def delete_key(self, key: str) -> bool:
        with self._cond:
            return self._data.pop(key, None) is not None

    def clone(self) -> InProcessStore:
        return self

    def keys(self) -> list[str]:
        with self._cond:
            return sorted(self._data)


class KV:
    """Prefixed Store access for one thread. Values are UTF-8 strings."""

    def __init__(self, store: StoreLike, prefix: str) -> None:
        self.store = store
        self.prefix = prefix.rstrip("/") + "/"

    def clone(self) -> KV:
        """A KV over a new connection (same prefix): one per thread."""
        return KV(self.store.clone(), self.prefix)

    def _k(self, key: str) -> str:
        return self.prefix + key

    def set(self, key: str, value: str) -> None:
        self.store.set(self._k(key), value)

    def get(self, key: str) -> str:
        return self.store.get(self._k(key)).decode()

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self.store.check([self._k(k) for k in keys]))

    def add(self, key: str, value: int = 1) -> int:
        return int(self.store.add(self._k(key), value))

    def delete(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.store.delete_key(self._k(key))

    def wait(self, keys: Sequence[str], timeout_s: float) -> bool:
        """Block until every key exists (True) or ``timeout_s`` passes (False). For waits that
        normally succeed; use :meth:`poll_all` where a timeout is a normal outcome."""
        try:
            self.store.wait([self._k(k) for k in keys], datetime.timedelta(seconds=timeout_s))
            return True
        except RuntimeError as exc:
            if "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower():
                raise
            return self.check(keys)  # a key set right at the boundary can still raise

    def poll_all(self, keys: Sequence[str], deadline: float, stop: threading.Event | None = None,
                 interval_s: float = 0.001, max_interval_s: float = 0.02) -> list[str]:
        """Poll until every key exists or ``deadline`` (monotonic) passes; returns the missing keys.

        Polling ``check`` logs nothing and never stalls on DNS; the interval grows from 1 ms to
        20 ms, so a quick answer is seen fast and a slow one costs little.
        """
        pending = list(keys)
        interval = interval_s
        while True:
            if self.check(pending):
                return []
            if len(pending) > 1:
                pending = [k for k in pending if not self.check([k])]
                if not pending:
                    return []
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (stop is not None and stop.is_set()):
                return pending
            if stop is not None:
                stop.wait(min(interval, remaining))
            else:
                time.sleep(min(interval, remaining))
            interval = min(max_interval_s, interval * 2)
