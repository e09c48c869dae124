"""NodeRelay: one rank per node speaks to the job's Store for the whole node (node-local fan-out).

Without it every rank follows the leader on the job's Store: tens of round trips per rank per
switch, two sockets per rank on the Store's host, and a single-threaded Store server doing
~0.45 ms of work per rank per switch (docs/performance.md). With it the job's Store sees nodes:

- the leader's :class:`~nicswitch_agent.coordination.leader.Coordinator` counts nodes, not ranks
  (one queue per node, one answer per node);
- local rank 0 of each node runs this relay (``nicswitch-relay``): it reads its node's queue on
  the job's Store and republishes every event, unchanged, to the node's ranks over a node-local
  Store (a TCPStore on 127.0.0.1 that it hosts); the node's members run exactly as they do
  without a relay, on that local Store;
- it answers the leader once for the node: for a pause, the largest ``c_r`` of its ranks; for the
  target, "parked" once every local rank parked; for an order, the first local failure at once
  (a guard round or a checkpoint: once every local rank answered), or one success once every local
  rank succeeded (any rank attempted, every rank checkpointed,
  the largest verify budget a rank asked for). A switch's ``verify`` round is an order like any
  other here; where the switch order says one may follow (``"v"``), the relay that answered it
  blocks on its go key above and writes what it holds to its slots' go keys below (the verify
  order, or a wake), then answers the verify round: one multi-set per level (messages.py). A
  guard round is followed the same way by the switch order.

Why the step-aligned pause stays deadlock-free: each member still sets its flag before it reads
its ``c_r``, and the leader's target is ``max`` over nodes of ``max`` over ranks, which is the
same ``S = max(c_r) + 1`` over every rank (docs/architecture.md).

Every local wait is bounded by the leader's own (the pause's and target's ``timeout``, the
order's ``budget``), so a dead or hung local rank makes the node answer late or fail, never hang
the relay; where a phase fails the relay writes why (``e/<E>/why/<node>``) for the leader's
message. The relay handles one event at a time, as a member does.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Any

from nicswitch_agent.coordination import messages as p
from nicswitch_agent.coordination import queues
from nicswitch_agent.coordination.kv import KV, Wake, done_key

logger = logging.getLogger("nicswitch_agent.coordination")

IDLE_WAIT_S = 3600.0  # one blocking wait per hour when idle; stop() wakes it at once
DEFAULT_PHASE_TIMEOUT_S = 60.0  # a leader of an earlier version sent no timeout with its pause
ORDER_SLACK_S = 1.0  # the relay answers this long after the budget; the leader waits 2 s past it
ORDER_READ_S = 10.0  # reading an order whose key was there a moment ago
WHY_MARGIN_S = 0.5  # a failing phase is told this much before the leader's deadline, so it can say why


class NodeRelay:
    """The relay thread of one node (see the module docstring).

    Args:
        job_kv: a connection of its own to the job's Store (the relay blocks on it when idle).
        wake_kv: a connection :meth:`stop` may write through (the rank's existing one: no socket
            is opened for it).
        local_kv: a connection of its own to the node-local Store.
        local_wake: another connection to the node-local Store, through which :meth:`stop` wakes
            a wait for the node's ranks (the rank's existing one: no socket is opened for it);
            without it a stop waits for that phase's deadline.
        node: the node's index (global rank // ranks per node): its queue on the job's Store.
        ranks: the node's global ranks, in local-rank order (local rank i answers at slot i).
        names, label: for messages. A group relay (the same class, one level up: ``job_kv`` the
            job's Store, ``local_kv`` the group's, its slots the group's node relays) names its
            slots by node and itself as a group; ``ranks`` are then each node's first rank.
    """

    def __init__(self, job_kv: KV, wake_kv: KV, local_kv: KV, node: int, ranks: list[int], *,
                 stop_timeout_s: float = 1.0, names: list[str] | None = None, label: str | None = None,
                 local_wake: KV | None = None) -> None:
        if not ranks:
            raise ValueError("a node relay needs at least one rank")
        if names is not None and len(names) != len(ranks):
            raise ValueError(f"{len(names)} names for {len(ranks)} slots")
        self.job, self.local, self._wake_kv = job_kv, local_kv, wake_kv
        self.node, self.ranks = node, list(ranks)
        self.size = len(self.ranks)  # its slots (an attribute: read a few times per event)
        # How messages name the slots ("rank(s) 17, 18", or for a group relay "node(s) 3 (ranks 48-63)")
        # and this relay ("node 5", "group 2").
        self._names = names or [str(rank) for rank in ranks]
        self._slots_are = "rank(s)" if names is None else "node(s)"
        self._label = label or f"node {node}"
        self._stop = threading.Event()
        self._wake = Wake(local_wake, self._stop)  # wakes a wait for the slots' answers (stop)
        self._stop_timeout_s = stop_timeout_s
        self._next = 1  # the job queue index this relay waits for
        self._local_n = 0  # events published to the local queues
        self._garbage: list[str] = []  # local keys of the last epoch
        self._unread: list[str] = []  # local queues of answers maybe not read to the end (queues.py)
        self._nostep: tuple[int, set[int]] = (0, set())  # (epoch, slots that said step() was never called)
        self._go_garbage: tuple[list[str], list[str]] = ([], [])  # go keys live one epoch longer (leader.py)
        self._go: str | None = None  # the go key above being waited on (stop wakes it)
        self._thread: threading.Thread | None = None
        self.events_relayed = 0
        self.lost = ""
        self._job_stopping = False  # it relayed a release that stops training

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("NodeRelay already started")
        self._thread = threading.Thread(target=self._run, name="nicswitch-relay", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        """Stop the thread (bounded): wake its idle wait through ``wake_kv``, a wait for the
        slots' answers through ``local_wake``."""
        self._wake()  # sets _stop
        try:
            go = self._go  # set before the relay looks at _stop: one of the two sees the other
            if go is not None and not self.lost:
                self._wake_kv.set(go, p.encode({"t": p.WAKE}))
            # An event already there (a release published just before this stop) wakes it anyway,
            # and is relayed first: a wake written over it would lose it for the node's ranks.
            if not self.lost:
                queues.wake(self._wake_kv, self.node, self._next, keep_event=True)
        except Exception:
            logger.debug("could not wake the relay thread", exc_info=True)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(self._stop_timeout_s)

    # -- the loop ------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # RuntimeError: DistNetworkError and friends, a Store is gone; else a bug
            self.lost = f"{type(exc).__name__}: {exc}"
            if self._stop.is_set():
                return
            if isinstance(exc, RuntimeError):  # after a stop of training its Stores' hosts end: no error then
                logger.log(logging.INFO if self._job_stopping else logging.ERROR,
                           "%s: coordination store lost (%s); switches cannot run there", self._label, self.lost)
            else:
                logger.exception("%s: the relay thread failed; switches cannot run there", self._label)
            self._tell_below(self.lost)

    def _tell_below(self, why: str) -> None:
        """The level below hears of the loss at once: its parked ranks let training go on (each
        says why), as ranks do that lose their own Store, instead of waiting out ``max_parked_s``."""
        try:
            why = f"the relay of {self._label} lost the Store above it: {why}"
            self._publish_local(p.encode({"t": p.LOST, "why": why}))
        except Exception:  # the Store below is gone too: its readers see that themselves
            logger.debug("%s: could not tell the level below", self._label, exc_info=True)

    def _loop(self) -> None:
        self._next = queues.start(self.job, self.node)  # joining a leader that already published
        while not self._stop.is_set():
            n = self._next
            text = queues.read(self.job, self.node, n, IDLE_WAIT_S)
            if text is None:
                continue
            self._next += 1
            try:
                message = p.decode(text)
            except ValueError as exc:
                queues.done(self.job, self.node, n)
                logger.error("%s: ignoring a malformed coordination message: %s", self._label, exc)
                continue
            if message["t"] == p.WAKE:
                queues.done(self.job, self.node, n)
                continue
            if message["t"] == p.LOST:  # the group relay above lost the job's Store: so did this level
                raise p.LevelLost(str(message.get("why", "the relay above lost its Store")))
            self._relay(message, text)
            self.events_relayed += 1
            # The key goes once the event is relayed and answered (off the phase's critical
            # path). Training must stop: the key (what the leader waits on before its process
            # may end, and the Store with it) goes only once the slots have taken the stop.
            # (On a queue the event left it when it was read: the leader above waits for that.)
            if message["t"] == p.RELEASE and message.get("stop") is not None:
                self._job_stopping = True
                queues.untaken(self.local, range(self.size), self._local_n,
                               time.monotonic() + self._stop_timeout_s, self._stop)
            queues.done(self.job, self.node, n)

    def _relay(self, message: dict[str, Any], text: str) -> None:
        kind, epoch = message["t"], int(message.get("e", 0))
        if kind == p.ORDER and "o" not in message and p.order_key(p.order_name(message)) not in self._garbage:
            # The order itself first: members read it when the event arrives (a verify round runs
            # the switch's order, copied already).
            name = p.order_name(message)
            # A relay that fell an epoch behind (busy past a budget) finds the order deleted: the
            # leader has decided it without this node. A plain get would wait for the key for the
            # connection's timeout (an hour, the idle wait's).
            order = self.job.get_when_set(p.order_key(name), ORDER_READ_S) \
                if self.job.check([p.order_key(name)]) else None
            if order is None:
                logger.warning("%s: skipping order %s: the leader has decided it without it", self._label, name)
                return
            self.local.set(p.order_key(name), order)
            self._garbage.append(p.order_key(name))
        self._publish_local(_for_the_level_below(message, text, self.size))
        # How many answer on the Store above (the leader's or the group relay's count): the answer
        # that completes it sets the done key its waiter blocks on.
        above = int(message["n"]) if message.get("n") is not None else None
        if kind == p.PAUSE:
            self._answer_pause(epoch, float(message.get("timeout", DEFAULT_PHASE_TIMEOUT_S)), above)
        elif kind == p.TARGET:
            self._answer_parked(epoch, int(message["S"]), float(message.get("timeout", DEFAULT_PHASE_TIMEOUT_S)),
                                above)
        elif kind == p.ORDER:
            self._answer_and_follow(epoch, message, above)
        elif kind == p.RELEASE:
            self._clean_up()

    def _answer_and_follow(self, epoch: int, message: dict[str, Any], above: int | None) -> None:
        """Answer order ``message`` for the node; then, where the order is followed by a go key
        (a guard round, or a switch a verify round may follow), forward what follows."""
        self._answer_order(epoch, str(message["key"]), float(message["budget"]),
                           float(message.get("slack", ORDER_SLACK_S)), above,
                           verify=message.get("kind") == p.KIND_VERIFY)
        if p.followed_by_go(message):
            self._forward_go(epoch, str(message["key"]), message)

    def _forward_go(self, epoch: int, name: str, message: dict[str, Any]) -> None:
        """What follows order ``name`` (this relay's go key above) to its slots' go keys below: the
        switch order after a guard round, the verify order after a switch, answered as any order.
        A leader silent past the order's bound (or a stop) sends the slots back to their queues."""
        self._go = p.go_key(epoch, name, self.node)
        text = None if self._stop.is_set() else self.job.get_when_set(self._go, p.go_wait_s(message))
        self._go = None
        try:
            follow = p.decode(text) if text is not None else {"t": p.WAKE}
        except ValueError as exc:
            logger.error("%s: ignoring a malformed go message: %s", self._label, exc)
            follow = {"t": p.WAKE}
        below = [p.go_key(epoch, name, slot) for slot in range(self.size)]
        readers = [queues.queue_name(slot) for slot in range(self.size)]  # each key is its slot's alone
        self._go_garbage[0].extend(below)
        if follow["t"] != p.ORDER or self._stop.is_set():
            self.local.set_for_readers(below, [p.encode({"t": p.WAKE})] * self.size, readers)
            return
        assert text is not None
        self.local.set_for_readers(below, [_for_the_level_below(follow, text, self.size)] * self.size, readers)
        self._answer_and_follow(epoch, follow, int(follow["n"]) if follow.get("n") is not None else None)

    def _publish_local(self, text: str) -> None:
        self._local_n += 1
        queues.publish(self.local, self.size, self._local_n, text)

    def _answer_pause(self, epoch: int, timeout_s: float, above: int | None) -> None:
        deadline = time.monotonic() + _before_the_leader(timeout_s)
        if self.local.queues:  # the slots' answers, popped as they come (queues.py)
            got = queues.gather(self.local, epoch, "c", self.size, deadline, self._wake)
            self._nostep = (epoch, {slot for slot, answer in got.items() if answer.get("nostep")})
            if len(got) < self.size:
                self._left_unread(epoch, "c")
                missing = [name for slot, name in enumerate(self._names) if slot not in got]
                self._why(epoch, f"no answer to the pause from {self._slots_are} {_listed(missing)}"
                          f"{self._gone_note(got)}", missing)
                self._fail_early(epoch, "c", deadline)
                return
            steps = [int(got[slot]["v"]) for slot in range(self.size)]
        else:
            keys = [p.c_key(epoch, slot) for slot in range(self.size)]
            counter = p.c_counter_key(epoch)
            self._garbage += [*keys, counter, done_key(counter)]
            if self.local.wait_count(counter, self.size, deadline, self._wake) < self.size:
                missing = self._missing(keys)
                self._garbage += [p.nostep_key(epoch, slot) for slot in range(self.size)]
                self._why(epoch, f"no answer to the pause from {self._slots_are} {_listed(missing)}", missing)
                self._fail_early(epoch, "c", deadline)
                return
            steps = [int(v) for v in self.local.get_many(keys)]
            # A rank whose step() was never called says 0 (and sets its nostep key): only then look,
            # and delete (most pauses have no such key to delete).
            self._garbage += [p.nostep_key(epoch, slot) for slot, step in enumerate(steps) if step == 0]
        never = max(steps) == 0 and len(self._never_stepped(epoch)) == self.size  # for the leader's message
        queues.answer_pause(self.job, epoch, self.node, None if never else max(steps), above)

    def _answer_parked(self, epoch: int, target: int, timeout_s: float, above: int | None) -> None:
        deadline = time.monotonic() + _before_the_leader(timeout_s)
        if self.local.queues:
            got = queues.gather(self.local, epoch, "parked", self.size, deadline, self._wake)
            missing = [name for slot, name in enumerate(self._names) if slot not in got]
            if missing:
                self._left_unread(epoch, "parked")
        else:
            keys = [p.parked_key(epoch, slot) for slot in range(self.size)]
            counter = p.parked_counter_key(epoch)
            self._garbage += [*keys, counter, done_key(counter)]
            complete = self.local.wait_count(counter, self.size, deadline, self._wake) >= self.size
            missing = [] if complete else self._missing(keys)
        if missing:
            reason = f"{self._slots_are} {_listed(missing)} did not park at step {target}"
            if self.local.queues:
                reason += self._gone_note(got)
            nostep = [self._names[slot] for slot in self._never_stepped(epoch)]
            if nostep:
                reason += f"; step() was never called on {self._slots_are} {_listed(nostep)}"
            self._why(epoch, reason, missing)
            self._fail_early(epoch, "parked", deadline)
            return
        queues.answer_parked(self.job, epoch, self.node, target, above)

    def _answer_order(self, epoch: int, name: str, budget_s: float, slack_s: float, above: int | None, *,
                      verify: bool = False) -> None:
        """Forward the first local failure at once; else one success once every rank succeeded. A
        guard round or a checkpoint answers once every slot did (p.waits_for_every_rank): its first
        failure then, unsafe if a slot may still be inside its hook."""
        if not self.local.queues:
            counter = p.result_counter_key(epoch, name)
            self._garbage += [counter, done_key(counter),
                              *(p.result_key(epoch, name, i) for i in range(1, self.size + 1))]
        deadline = time.monotonic() + budget_s + slack_s
        every = p.waits_for_every_rank(name)
        attempted, guards, seen, answered, verify_s, unsafe = False, 0, 0, set(), 0.0, False
        failed: p.MemberResult | None = None
        for result in queues.arriving_results(self.local, epoch, name, self.size, deadline, self._wake,
                                              ranks=self.ranks):
            seen += 1
            answered.add(result.rank)
            attempted = attempted or result.attempted
            guards += int(result.guard_ok)
            verify_s = max(verify_s, result.verify_s)
            if not result.ok and every:
                failed, unsafe = failed or result, unsafe or result.unsafe
            elif not result.ok:
                self._left_unread(epoch, f"res/{name}")
                self._answer(epoch, name, result, above)  # as the rank said it: the leader names the rank
                return
        if failed is not None:  # a guard round: every slot answered, or a silent one may still be in its hook
            if seen < self.size:
                self._left_unread(epoch, f"res/{name}")
            self._answer(epoch, name, replace(failed, unsafe=unsafe or seen < self.size), above)
            return
        if seen < self.size:
            self._left_unread(epoch, f"res/{name}")
            silent = [slot for slot, rank in enumerate(self.ranks) if rank not in answered]
            gone = queues.gone(self.local, self.size)
            reason = "gone, the link to the relay closed" if silent and set(silent) <= gone else \
                "did not answer within the budget"
            self._answer(epoch, name, p.MemberResult(
                self.ranks[silent[0]] if silent else self.ranks[0], False,
                f"{reason} ({len(silent)} {self._slots_are} of {self._label}: "
                f"{_listed([self._names[slot] for slot in silent])})", attempted=True, unsafe=verify or every), above)
            return
        self._answer(epoch, name, p.MemberResult(self.ranks[0], True, "ok", attempted=attempted,
                                                 guard_ok=guards == self.size, verify_s=verify_s), above)

    def _gone_note(self, answered: dict[int, Any]) -> str:
        """For a phase's failure: which of the silent slots are gone (the node link knows)."""
        gone = sorted(queues.gone(self.local, self.size).difference(answered))
        return f"; {self._slots_are} {_listed([self._names[slot] for slot in gone])} gone: their link to the " \
               "relay closed (the process ended, or its agent stopped)" if gone else ""

    def _left_unread(self, epoch: int, phase: str) -> None:
        """A phase decided before every slot's answer was read: on queues, empty it at the release."""
        if self.local.queues:
            self._unread.append(queues.answers(epoch, phase))

    def _answer(self, epoch: int, name: str, result: p.MemberResult, above: int | None) -> None:
        queues.answer_result(self.job, epoch, name, result, above)

    def _why(self, epoch: int, reason: str, missing: list[str]) -> None:
        """Why this relay cannot answer a phase, for the leader's message (failure path only); with
        what the silent slots' own relays said, when they are relays (a group's nodes)."""
        said = []
        for slot, name in enumerate(self._names if self._slots_are == "node(s)" else []):  # ranks say no why
            if name in missing and self.local.check([p.why_key(epoch, slot)]):
                said.append(f"node {name}: {self.local.get(p.why_key(epoch, slot))}")
                self._garbage.append(p.why_key(epoch, slot))
        if said:
            reason += " (" + "; ".join(said[:8]) + (f"; +{len(said) - 8} more" if len(said) > 8 else "") + ")"
        logger.warning("%s: %s", self._label, reason)
        self.job.set(p.why_key(epoch, self.node), reason)

    def _fail_early(self, epoch: int, phase: str, deadline: float) -> None:
        """The phase failed before its deadline (a rank of this node gone, or a relay below gave
        up): the level above need not wait out its timeout for an answer that cannot come."""
        if time.monotonic() < deadline and not self._stop.is_set():
            queues.fail_early(self.job, epoch, phase, self.node)

    def _never_stepped(self, epoch: int) -> list[int]:
        """The slots whose step() had never been called when the pause came (all ranks of a node)."""
        if self.local.queues:  # they said so in their answer to the pause
            said_epoch, slots = self._nostep
            return sorted(slots) if said_epoch == epoch else []
        return [slot for slot in range(self.size) if self.local.check([p.nostep_key(epoch, slot)])]

    def _missing(self, keys: list[str]) -> list[str]:
        """The names of the slots whose key is missing (the failure path only: a round trip per key)."""
        return [self._names[slot] for slot, key in enumerate(keys) if not self.local.check([key])]

    def _clean_up(self) -> None:
        """Delete the epoch's local keys (the switch is over on this node; nobody reads them), and
        the go keys of the epoch before (a rank may still answer a switch late and read its wake);
        empty the queues of answers that a failure decided before every slot's was read."""
        current, last = self._go_garbage
        self._go_garbage = ([], current)
        garbage, self._garbage = self._garbage + last, []
        self.local.delete(garbage)
        unread, self._unread = self._unread, []
        for queue in unread:
            queues.drop(self.local, queue)


def _for_the_level_below(message: dict[str, Any], text: str, size: int) -> str:
    """The event as the slots get it: with the phase's time shortened to this relay's share, so a
    relay below (a group's node relays) answers, or says why, before this one stops waiting; and
    with ``n``, how many answer on this relay's Store (``size``, for the done key it waits on)."""
    if message["t"] in (p.PAUSE, p.TARGET):
        below = {**message, "n": size}
        if "timeout" in message:
            below["timeout"] = _before_the_leader(float(message["timeout"]))
        return p.encode(below)
    if message["t"] == p.ORDER:
        return p.encode({**message, "n": size, "slack": float(message.get("slack", ORDER_SLACK_S)) / 2})
    return text


def _before_the_leader(timeout_s: float) -> float:
    """The relay's share of a phase the leader gives ``timeout_s``: it must answer (or say why)
    before the leader stops reading."""
    return max(0.0, timeout_s - min(WHY_MARGIN_S, timeout_s / 10))


def _listed(names: list[str]) -> str:
    return ", ".join(names[:16]) + (f" (+{len(names) - 16} more)" if len(names) > 16 else "")


__all__ = ["NodeRelay"]
