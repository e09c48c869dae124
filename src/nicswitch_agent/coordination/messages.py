"""Keys and messages between the leader and the members, in one place.

All keys live under ``nicswitch/<job>/<restart count>/`` (torchrun keeps its store's keys
across restarts, so a new incarnation must not read the old one's keys).

Leader -> each member ``r``, a numbered queue (one key per event, deleted by the member once read;
on the node and group Stores the agent hosts, the Store queue ``q/<r>`` instead: queues.py);
every event also carries ``"at"``, the leader's wall clock when it published it (members copy it
into their events as ``sent_at``, for aligning clocks across hosts)::

    q/<r>/<n>                  {"t": "pause", "e": E, "timeout": seconds}
                               {"t": "target", "e": E, "S": S, "timeout": seconds}
                               {"t": "order", "e": E, "key": K, "kind": "guard|switch|verify|rollback|checkpoint",
                                "budget": seconds, "seq": N [, "order": K0] [, "o": the order, if short]}
                                   (pause, target and order events also carry "n": how many answer
                                   them on this Store, so the answer that completes the count can set
                                   its done key, e/<E>/.../done, which the waiter blocks on)
                                   (verify: a switch's second round, only once every rank's switch hook
                                   succeeded; K = "<E>.<seq>.verify", its order is the switch's, o/<K0>)
                                   (a switch order with "v": 1 says a verify round may follow: see go/)
                                   (guard: a switch's first round, where a checkpoint guard or a verify
                                   warm-up runs: those hooks only; K = "<E>.<seq>.guard", its order the
                                   switch's, o/<K0>; decided once every rank answered. The switch
                                   order then carries "g": 1: its guard and warm-up ran already)
                               {"t": "outcome", "e": E, "key": K, "kind": ..., "seq": N, "ok": bool,
                                "reason": text}   (the leader's decision on order K; a success
                                   rides on the next event instead, as its "oc": members handle
                                   it first. One event fewer per switch on every level)
                               {"t": "release", "e": E, "stop": reason | null, "cancel": bool}
                               {"t": "lost", "why": text}   (from a relay only: it lost the Store
                                   above it; the level below takes it as its own Store lost)
    o/<K>                      the order itself (written once, read by every member)
    e/<E>/go/<K>/<r>           after a switch order K with "v": 1, what follows it for r: the verify
                               order event, or {"t": "wake"} (no verify round). A rank (or relay)
                               that answered K ok blocks on it instead of its queue, so the verify
                               round costs the leader one multi-set and no queue head, and each
                               rank no delete and no look at its queue (with "w": the verify
                               warm-up's seconds, which the wait's bound adds). One key per rank,
                               not one shared, so that a rank's stop can wake its own wait with a
                               wake of its own without sending the others back to their queues

Member ``r`` -> leader, per pause/session ``E`` (on a Store with queues, the node and group Stores
the agent hosts, the answers are pushed to ``a/<E>/c``, ``a/<E>/parked`` and ``a/<E>/res/<K>``
instead: queues.py; there a relay that cannot answer a pause or target phase for good pushes
``{"t": "a", "s": slot, "fail": 1}``, and on the job's Store it sets the phase's done key to
``failed``: queues.fail_early)::

    e/<E>/c/<r>                the last step r completed when it saw the pause (c_r)
    e/<E>/c/n                  how many ranks have written theirs (add() only)
    e/<E>/nostep/<r>           only if r's step() had never been called when it saw the pause
    e/<E>/parked/<r>           the step r parked at
    e/<E>/parked/n             how many ranks have parked (add() only)
    e/<E>/res/<K>/n            results counter (an integer key: add() only)
    e/<E>/c/done, e/<E>/parked/done, e/<E>/res/<K>/done
                               set by the answer that completes the count (its "n"-th), and for
                               results also by a failure: the leader (or relay) blocks on it
    e/<E>/res/<K>/<i>          the i-th result to arrive: {"rank", "ok", "reason", "attempted", "guard"
                               [, "interrupted": true] [, "verify": seconds: run the verify round, with
                               this budget]}

With node-local fan-out (relay.py) the same keys carry nodes instead of ranks on the job's Store
(``r`` is a node's index, a node's ``c`` is the largest of its ranks', its result the first
failure or one success), and each node's ranks use them on the node's own Store::

    e/<E>/why/<node>           why the node could not answer a phase (failure path only)
    node/<node>/store          ``host:port`` of the node-local Store (written by its relay)

With groups of nodes, each group relay answers for its group on the job's Store (``r`` is a
group's index) and each node relay of the group for its node on the group's Store (``r`` is the
node's index within the group)::

    group/<group>/store        ``host:port`` of the group's Store (written by its relay)

How ranks come and go (joining.py; every leader mode, on the job's Store)::

    joined/<r>                 rank r's member has taken its queue position (its pid); written
                               again by each process (or agent) that takes rank r's place; a
                               launcher-hosted leader registers once every rank's is there
    inflight                   {"e": E, "key": K, "n": N} while the leader waits for order K's
                               results, "" once it decided: a process that takes the place of one
                               that had joined fails K at once (its predecessor will never answer);
                               {"e": E, "pause": 1} while pause E runs: the process fails it at
                               once (it will never park in it: it starts after its events); a
                               rank whose agent stops fails either (the leader names it before
                               it looks at ``left/n``: one of the two sees the other)
    e/<E>/restarted            that process's words for the leader's message (last one wins)
    left/<r>, left/n,          rank r's agent stopped (its pid), how many have not come back, and
    left/last                  the last of them in words: a pause or an order then fails at once
                               instead of waiting for ranks that left

``q/head`` holds the number of the last event published, so a member that starts late (a training
process restarted under a launcher-hosted leader, or an agent started again) begins with the next
event instead of replaying old ones. A member stopping wakes its own idle wait by writing
``{"t": "wake"}`` to the queue key it waits on; nobody else reads a member's queue.
"""

from __future__ import annotations

import array
import base64
import json
import json.encoder
import json.scanner
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nicswitch_agent.coordination.kv import done_key, timed_out
from nicswitch_agent.orders import SwitchOrder

if TYPE_CHECKING:
    from nicswitch_agent.coordination.kv import KV, Wake

PAUSE, TARGET, ORDER, OUTCOME, RELEASE, WAKE = "pause", "target", "order", "outcome", "release", "wake"
CARRIED_OUTCOME = "oc"  # an outcome event carried by the next event (leader.py _tell_outcome)
KIND_SWITCH, KIND_ROLLBACK, KIND_CHECKPOINT = "switch", "rollback", "checkpoint"
# The second round of a switch, once the switch hook succeeded on every rank: an order event of its
# own (its own result keys), so relays forward and aggregate it as they do any order.
KIND_VERIFY = "verify"
# The first round of a guarded switch: every rank runs its checkpoint guard (and the verify hook's
# warm-up) and nothing else; the switch order follows only once every rank's succeeded. A
# rank's switch must not start while another rank's guard may still refuse: HCCL switches a link
# only when both of its ends ask for it, so a rank left out blocks the others' switch for minutes
# (docs/protocol.md). Its failure decides only once every rank answered (waits_for_every_rank).
KIND_GUARD = "guard"
# A relay that lost the level above (its Store gone, or its thread failed) tells the level below, so
# that a parked rank lets training go on at once, as a rank that loses its own Store does.
LOST = "lost"
GO_SLACK_S = 5.0  # a go key is awaited this much past the switch's budget (the leader waits 2 s past it)


class LevelLost(RuntimeError):
    """The level above this one is lost (a relay's ``LOST`` event): raised where a lost Store is."""


class LevelStopped(RuntimeError):
    """The level above ended on purpose (its agent stopped) and said so: coordination is lost
    here as with :class:`LevelLost`, but nothing failed, so it is not logged as an error."""


def waits_for_every_rank(name: str) -> bool:
    """Whether order ``name`` is decided only once every rank answered, a failure included: a
    guard round or a checkpoint, whose ranks may still be inside a hook (a collective save) when
    one refuses, and must not be released beside them."""
    return name.endswith((f".{KIND_GUARD}", f".{KIND_CHECKPOINT}"))


def order_name(message: dict[str, Any]) -> str:
    """The name of the order an order event runs: its own key, or (a verify round) the switch's."""
    return str(message.get("order", message["key"]))


def key_prefix(job_id: str, restart_count: str | None = None) -> str:
    restart = restart_count if restart_count is not None else os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"nicswitch/{job_id}/{restart}"


QUEUE_HEAD = "q/head"  # the number of the last event published (a member joining late starts after it)


IN_FLIGHT = "inflight"  # the order or pause the leader waits for (see the module docstring)


def joined_key(rank: int) -> str:
    """A member says it started (a launcher's leader registers once all did; joining.py)."""
    return f"joined/{rank}"


def left_key(rank: int) -> str:
    """Rank's agent stopped while its process may run on (joining.py)."""
    return f"left/{rank}"


LEFT_COUNT = "left/n"  # how many ranks' agents have stopped and not come back (joining.py)
LEFT_LAST = "left/last"  # the last of them, in words ("rank 3 (pid 1234)"), for the leader's message


def queue_key(rank: int, n: int) -> str:
    return f"q/{rank}/{n}"


def go_key(epoch: int, name: str, rank: int) -> str:
    return f"e/{epoch}/go/{name}/{rank}"


def followed_by_go(message: dict[str, Any]) -> bool:
    """Whether a rank that answered order ``message`` ok then blocks on its go key (and a relay,
    whatever its node answered) for what follows, instead of reading it from its queue: after a
    guard round the switch order (or a wake: the guard failed), after a switch that says a verify
    round may follow (``"v"``) the verify order (or a wake). One multi-set per level, where a queue
    event costs a read and a delete per rank (docs/performance.md)."""
    kind = message.get("kind")
    return kind == KIND_GUARD or (kind == KIND_SWITCH and bool(message.get("v")))


def go_wait_s(message: dict[str, Any]) -> float:
    """How long a rank (or relay) that answered order ``message`` (followed_by_go) waits for its go
    key: the leader decides the order within its budget, the warm-up and its slack (it started first)."""
    return float(message["budget"]) + float(message.get("w", 0.0)) + GO_SLACK_S


def c_key(epoch: int, rank: int) -> str:
    return f"e/{epoch}/c/{rank}"


def nostep_key(epoch: int, rank: int) -> str:
    return f"e/{epoch}/nostep/{rank}"


def parked_key(epoch: int, rank: int) -> str:
    return f"e/{epoch}/parked/{rank}"


def c_counter_key(epoch: int) -> str:
    return f"e/{epoch}/c/n"


def parked_counter_key(epoch: int) -> str:
    return f"e/{epoch}/parked/n"


def why_key(epoch: int, node: int) -> str:
    return f"e/{epoch}/why/{node}"


def restarted_key(epoch: int) -> str:
    return f"e/{epoch}/restarted"


def node_store_key(node: int) -> str:
    return f"node/{node}/store"


def group_store_key(group: int) -> str:
    return f"group/{group}/store"


def order_key(name: str) -> str:
    return f"o/{name}"


def result_counter_key(epoch: int, name: str) -> str:
    return f"e/{epoch}/res/{name}/n"


def result_key(epoch: int, name: str, index: int) -> str:
    return f"e/{epoch}/res/{name}/{index}"


# Every event and answer is encoded once and decoded at every level below it: json's C encoder
# and scanner called directly, not json.dumps/json.loads, which build an encoder (non-default
# separators) or walk three Python frames for every message (docs/performance.md). Where the C
# accelerators are missing (not CPython), json's own functions.
_ENCODER = json.JSONEncoder(separators=(",", ":"))
_MAKE_C_ENCODER: Any = getattr(json.encoder, "c_make_encoder", None)  # not in typeshed: private to json
_C_ENCODE: Any = None if _MAKE_C_ENCODER is None else _MAKE_C_ENCODER(
    None, _ENCODER.default, json.encoder.encode_basestring_ascii, None, ":", ",", False, False, True)
_SCAN: Any = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]  # typeshed has it wrong


def encode(message: dict[str, Any]) -> str:
    if _C_ENCODE is None:
        return _ENCODER.encode(message)
    return "".join(_C_ENCODE(message, 0))


def decode(text: str) -> dict[str, Any]:
    try:
        value, end = _SCAN(text, 0)
    except (StopIteration, RecursionError):  # StopIteration: no JSON value at 0 (the scanner's way to say it)
        end = -1
    if end != len(text):  # whitespace around it, more after it, or no JSON: as json.loads says it
        value = json.loads(text)
    if not isinstance(value, dict) or "t" not in value:
        raise ValueError(f"not a coordination message: {text[:200]!r}")
    return value


# Orders travel as JSON whose large fields are strings: the ranks as little-endian uint32s in
# base64, the ops as "0"/"1" characters. A 65,536-rank order encodes in ~1 ms and decodes in ~3 ms
# this way; as JSON lists of numbers (or decimal text) it took 10-15 ms each way, on every rank.
_U32 = next(code for code in "IL" if array.array(code).itemsize == 4)
_OPS_TO_TEXT = bytes.maketrans(b"\x00\x01", b"01")
_TEXT_TO_OPS = bytes.maketrans(b"01", b"\x00\x01")
RANKS_ENCODING = "u32le-b64"


# An order this short (a few hundred ranks listed) travels in its event itself ("o"): every rank
# and relay saves the read of o/<K> (and a relay its copy to its node's Store).
INLINE_ORDER_MAX = 2048


def inline_order(text: str) -> dict[str, str]:
    """The event's ``"o"`` field for an encoded order: the order itself if it is short, else none."""
    return {"o": text} if len(text) <= INLINE_ORDER_MAX else {}


def encode_order(order: SwitchOrder) -> str:
    packed = array.array(_U32, order.ranks)
    if sys.byteorder == "big":
        packed.byteswap()
    return encode({"t": "o", "seq": order.seq, "job": order.job_id, "enc": RANKS_ENCODING,
                   "ranks": base64.b64encode(packed.tobytes()).decode("ascii"),
                   "ops": bytes(order.ops).translate(_OPS_TO_TEXT).decode("ascii")})


def decode_order(text: str) -> SwitchOrder:
    value = decode(text)
    if value.get("enc") == RANKS_ENCODING:
        packed = array.array(_U32)
        packed.frombytes(base64.b64decode(value["ranks"], validate=True))
        if sys.byteorder == "big":
            packed.byteswap()
        ranks = tuple(packed)
        ops = tuple(map(bool, str(value["ops"]).encode("ascii").translate(_TEXT_TO_OPS)))
    else:  # JSON lists: what earlier versions wrote (a launcher-hosted leader may be older)
        ranks = tuple(int(r) for r in value["ranks"])
        ops = tuple(bool(op) for op in value["ops"])
    return SwitchOrder(seq=int(value["seq"]), job_id=str(value["job"]), ranks=ranks, ops=ops)


@dataclass(frozen=True)
class MemberResult:
    rank: int
    ok: bool
    reason: str
    attempted: bool = False  # the switch hook was called (links may have moved)
    guard_ok: bool = False  # a checkpoint of the parked step exists on this rank
    interrupted: bool = False  # the training thread left its parking spot (Ctrl-C, sys.exit) during it
    detail: dict[str, Any] | None = None  # the switch hook's record of the call (hooks.base.hook_record)
    # > 0: the switch hook ran and this rank has a verify hook, which may take this long: the
    # leader runs the verify round (a relay passes on the largest of its ranks').
    verify_s: float = 0.0
    # A verification that failed so that this rank's communicators may be unusable (an op still
    # pending, a group gone, a hook still running): training must not go on on them.
    unsafe: bool = False

    def encode(self) -> str:
        message: dict[str, Any] = {"t": "r", "rank": self.rank, "ok": self.ok, "reason": self.reason,
                                   "attempted": self.attempted, "guard": self.guard_ok}
        if self.interrupted:  # only then: a leader of an earlier version reads the same keys as before
            message["interrupted"] = True
        if self.detail is not None:  # likewise: only when the hook offered a record
            message["detail"] = self.detail
        if self.verify_s > 0:
            message["verify"] = self.verify_s
        if self.unsafe:
            message["unsafe"] = True
        return encode(message)

    @classmethod
    def decode(cls, text: str) -> MemberResult:
        v = decode(text)
        detail = v.get("detail")
        return cls(int(v["rank"]), bool(v["ok"]), str(v["reason"]), bool(v["attempted"]), bool(v["guard"]),
                   bool(v.get("interrupted", False)), detail if isinstance(detail, dict) else None,
                   verify_s=float(v.get("verify", 0.0)), unsafe=bool(v.get("unsafe", False)))


def publish_result(kv: KV, epoch: int, name: str, result: MemberResult, expected: int | None) -> int:
    """Answer order ``name``: the result at the next arrival index (arrival order: the first
    failure is the first one read); then, if it decides the order (the ``expected``-th result, or
    a failure, but in a guard round), the done key its waiter blocks on (:meth:`KV.wait_count`).
    Returns the index."""
    counter = result_counter_key(epoch, name)
    index = kv.add(counter, 1)
    if expected is not None and (index == expected or (not result.ok and not waits_for_every_rank(name))):
        # The result, then the done key, in one request (the Store sets them in this order, so
        # whoever the done key wakes finds the result there): the decisive answer is on the
        # order's critical path, and this saves it a round trip.
        kv.set_many([result_key(epoch, name, index), done_key(counter)], [result.encode(), str(index)])
    else:
        kv.set(result_key(epoch, name, index), result.encode())
    return index


def arriving_results(kv: KV, epoch: int, name: str, expected: int, deadline: float,
                     wake: Wake | None = None) -> Iterator[MemberResult]:
    """The results of order ``name`` in arrival order, once it is decided: all ``expected`` of
    them, or those up to the first failure (which decides at once), or what arrived before
    ``deadline`` (monotonic) or ``wake``. One blocking wait, then one read of every result
    (multi_get, which waits for a result whose sender counted it and is still writing it); the
    caller counts what it got."""
    count = min(kv.wait_count(result_counter_key(epoch, name), expected, deadline, wake), expected)
    keys = [result_key(epoch, name, i) for i in range(1, count + 1)]
    if not keys:
        return
    try:
        texts = kv.get_many(keys)
    except RuntimeError as exc:  # a sender died between its count and its result (failure path)
        if not timed_out(exc):
            raise
        texts = kv.get_many([k for k in keys if kv.check([k])])
    for text in texts:
        yield MemberResult.decode(text)
