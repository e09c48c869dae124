"""Test hook: faults the simulator injects on request, for fault tests and the soak (``tests/soak.py``).

Never armed in normal use: a :class:`Simulator` always has a ``faults`` object, and an empty one
changes nothing. A test arms a fault for the next matching RPC (``sim.faults.arm(kind)``); the
handler that meets it consumes it (:meth:`SimFaults.take`) and ``fired`` counts what happened.

Kinds (the strings are the soak report's names):

- ``notify_drop_before_send``: the next rank list is put back into its slot and its
  SubscribeNotifySwitch stream ends with UNAVAILABLE before the send; the list waits for the next
  subscriber, as on the real server when a subscriber goes away first (docs/clusterd.md#the-reconnect-race).
- ``notify_drop_after_send``: the stream ends with UNAVAILABLE right after a list was sent.
- ``reply_unavailable_lost``: the next ReplySwitchNicResult fails with UNAVAILABLE before
  ClusterD sees it (the client cannot tell it from the next kind, so it must not resend).
- ``reply_unavailable_delivered``: ClusterD takes the reply, then the call fails with UNAVAILABLE.
- ``reply_qps_exceeded``: UNKNOWN "qps exceeded" before the handler runs (ClusterD's rate
  limiter): the one reply failure that proves non-delivery, so a client may retry it.
"""

from __future__ import annotations

import threading
from collections import Counter

__all__ = ["FAULT_KINDS", "SimFaults"]

NOTIFY_DROP_BEFORE_SEND = "notify_drop_before_send"
NOTIFY_DROP_AFTER_SEND = "notify_drop_after_send"
REPLY_UNAVAILABLE_LOST = "reply_unavailable_lost"
REPLY_UNAVAILABLE_DELIVERED = "reply_unavailable_delivered"
REPLY_QPS_EXCEEDED = "reply_qps_exceeded"

FAULT_KINDS = (
    NOTIFY_DROP_BEFORE_SEND,
    NOTIFY_DROP_AFTER_SEND,
    REPLY_UNAVAILABLE_LOST,
    REPLY_UNAVAILABLE_DELIVERED,
    REPLY_QPS_EXCEEDED,
)


class SimFaults:
    """Armed faults (kind -> how many of the next matching RPCs fail) and what fired. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards _armed and fired
        self._armed: Counter[str] = Counter()
        self.fired: Counter[str] = Counter()

    def arm(self, kind: str, count: int = 1) -> None:
        """Make the next ``count`` RPCs that meet ``kind`` fail that way."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown simulator fault {kind!r}; known: {', '.join(FAULT_KINDS)}")
        with self._lock:
            self._armed[kind] += count

    def disarm(self) -> None:
        """Forget every armed fault that has not fired."""
        with self._lock:
            self._armed.clear()

    def armed(self, kind: str) -> int:
        with self._lock:
            return self._armed[kind]

    def take(self, kind: str) -> bool:
        """Called by a handler: True (and counted in ``fired``) if ``kind`` was armed."""
        with self._lock:
            if self._armed[kind] <= 0:
                return False
            self._armed[kind] -= 1
            self.fired[kind] += 1
            return True

    def fired_count(self, kind: str) -> int:
        with self._lock:
            return self.fired[kind]
