"""Coordinator: the leader's side of coordination (pause every rank at one step, run, release).

Used by the leader's agent threads only; one operation at a time (a lock), on the leader's own
Store connection. Every wait is bounded: a member that died or hangs shows up as a missing key
when the budget runs out, and the caller answers ClusterD false instead of waiting for ever.

A switch whose ranks have a verify hook is two rounds in one epoch: the order, and once every
rank's switch hook succeeded (never before: a probe must not meet a rank still switching), a
``verify`` order run the same way. A verification failure is the switch's failure (attempted:
its links moved), so the caller's failed-switch path (rollback in pause mode agent) runs. Where
the leader expects verification (``verify_expected``) the switch order says so, every rank that
switched waits on its go key, and the verify order is that key's value: one multi-set, no queue
head, and no queue read on the ranks (messages.py, ``e/<E>/go/<K>/<r>``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from nicswitch_agent.coordination import messages as p
from nicswitch_agent.coordination import queues
from nicswitch_agent.coordination.kv import KV, Wake, done_key
from nicswitch_agent.coordination.topology import Layout
from nicswitch_agent.orders import SwitchOrder

logger = logging.getLogger("nicswitch_agent.coordination")

RESULT_SLACK_S = 2.0  # members enforce the hook budgets; the leader waits this much longer


@dataclass(frozen=True)
class PauseOutcome:
    ok: bool
    step: int | None = None
    reason: str = ""
    duration_s: float = 0.0


@dataclass(frozen=True)
class RunOutcome:
    ok: bool
    reason: str
    attempted: bool = False  # some rank called the switch hook (its links may have moved)
    guard_ok: bool = False  # every rank has a checkpoint of the parked step
    duration_s: float = 0.0
    interrupted: int | None = None  # a rank whose training thread was interrupted during it (Ctrl-C)
    verify_s: float = 0.0  # the largest verify budget a rank asked for (0: no verify round)
    verified: bool = False  # the verify round ran and every rank passed it
    unsafe: bool = False  # a failed verification may have left communicators unusable (messages.MemberResult)
    guard_failed: bool = False  # a switch's guard round failed: a checkpoint of the parked step is not to be had
    # A failed order whose failure came from its own round (not its verification): the ranks whose
    # hook had returned True when it was decided, as far as the leader read (a node or group answers
    # for all of its ranks or none). Those ranks are on the order's link; the others are in doubt.
    ok_ranks: frozenset[int] = frozenset()
    # The rank whose failure decided it, when it said no hook ran there (a rank not parked, say):
    # its link is as it was.
    unmoved_ranks: frozenset[int] = frozenset()
    verify_failed: bool = False  # the switch ran on every rank and its verification failed


class Coordinator:
    """Publishes events to every member and gathers their answers.

    ``world_size`` counts who answers on this Store: ranks, or, with node-local fan-out
    (``ranks_per_node`` given), nodes, each answering for its ranks through its relay (relay.py),
    or, with groups of nodes (``layout`` given), groups.
    """

    def __init__(self, kv: KV, world_size: int, *, stop: threading.Event | None = None,
                 ranks_per_node: int | None = None, layout: Layout | None = None, drain_s: float = 1.0,
                 warm_up_s: float = 0.0, verify_expected: bool = False) -> None:
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be positive")
        if ranks_per_node is not None and ranks_per_node < 1:
            raise ValueError(f"ranks_per_node={ranks_per_node} must be positive")
        if layout is None:
            layout = Layout(world_size * ranks_per_node, ranks_per_node) if ranks_per_node else Layout(world_size)
        if kv.queues:  # the leader is on the job's Store, which keeps keys (queues.py)
            raise ValueError("the leader's Store must not be one with queues (only node and group Stores have them)")
        if layout.answerers != world_size:
            raise ValueError(f"world_size={world_size} but the layout has {layout.answerers} {layout.unit}(s)")
        self.kv = kv
        self.world_size = world_size
        self.layout = layout
        self.drain_s = drain_s  # drain(): how long to wait for every answerer to take the last release
        # A switch order may take this much longer: a verify hook's warm-up before the switch hook
        # (the verify timeout where verification is configured, or may be: a launcher's leader).
        self.warm_up_s = warm_up_s
        # Switch orders ask the ranks to wait on a go key for the verify round (see the module docstring).
        self.verify_expected = verify_expected
        self._undrained = 0  # the last release's queue index, until drain() saw it taken
        # A successful order's outcome, sent with the next event (normally the release right after
        # it): one event fewer per switch on every level. A failure's is published at once.
        self._outcome: dict[str, object] | None = None
        self._stop = stop or threading.Event()
        # A connection of its own, opened now (while the Store is surely up): wake() sets the key a
        # wait blocks on through it, and every cleanup clones it.
        self._cleanup_kv = kv.clone()
        self._wake = Wake(self._cleanup_kv, self._stop)
        self._lock = threading.Lock()  # one operation at a time; guards the fields below
        self._n = 0  # events published (each member's queue index)
        self._epoch = 0
        self._paused = False
        # In this pause, an order that moves links (switch, rollback) ran and did not end OK, or
        # is running: ranks resumed now would train on links in an unknown state (release_at_stop).
        self._links_unsettled = False
        self._garbage: list[str] = []  # keys of the last epoch, deleted when the next one starts
        # Go keys live one epoch longer: a rank still in its switch hook when the leader decided
        # without it answers later and must find its wake (pause mode external: an epoch per order).
        self._go_garbage: tuple[list[str], list[str]] = ([], [])  # (this epoch's, the last one's)
        self.last_pause: PauseOutcome | None = None
        # Told every decided order (the agent's link map: observability/links.py); must not raise.
        self.on_decided: Callable[[SwitchOrder, str, RunOutcome], None] | None = None
        if kv.check([p.QUEUE_HEAD]):  # a leader restarted on a Store that outlived it: continue the count
            self._n = int(kv.get(p.QUEUE_HEAD))

    def wake(self) -> None:
        """Cut the operation under way short (the agent's stop): sets ``stop`` and wakes the wait
        it blocks in. Safe from any thread; the operation then fails as if its time ran out."""
        self._wake()

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def stopping(self) -> bool:
        """The agent's stop has cut (or will cut) the operation under way short (:meth:`wake`)."""
        return self._stop.is_set()

    @property
    def epoch(self) -> int:
        return self._epoch

    def _publish(self, message: dict[str, object]) -> None:
        self._n += 1
        text = self._event(message, self._outcome)
        self._outcome = None
        queues.publish(self.kv, self.world_size, self._n, text)  # every answerer's queue, then the head

    def _event(self, message: dict[str, object], outcome: dict[str, object] | None = None) -> str:
        """An event as it is written: with "at", this leader's wall clock as it publishes (members
        put it in their events so that a timeline can line up ranks whose hosts' clocks differ:
        observability/timeline), "n", how many answer on this Store (the answer that completes
        a phase wakes the waiter), and a pending outcome (``"oc"``: members take it first)."""
        if message["t"] in (p.PAUSE, p.TARGET, p.ORDER):
            message = {**message, "n": self.world_size}
        if outcome is not None:
            message = {**message, p.CARRIED_OUTCOME: outcome}
        return p.encode({**message, "at": time.time()})

    def _new_epoch(self) -> int:
        current, last = self._go_garbage
        self._go_garbage = ([], current)
        if self._garbage or last:
            # Off the switch's path: one delete per key (the Store has no multi-delete) is a round
            # trip per rank per key kind, seconds at tens of thousands of ranks.
            garbage, self._garbage = self._garbage + last, []
            threading.Thread(target=_delete_keys, args=(self._cleanup_kv, garbage), name="nicswitch-store-cleanup",
                             daemon=True).start()
        self._epoch += 1
        return self._epoch

    # -- operations ----------------------------------------------------------------------------

    def pause(self, timeout_s: float) -> PauseOutcome:
        """Park every rank at one step boundary, S = max(last completed step) + 1."""
        with self._lock:
            started = time.monotonic()
            deadline = started + timeout_s
            epoch = self._new_epoch()
            self._name_pause_in_flight(epoch)  # then look (as in _unanswerable): one that leaves now ends the pause
            left = self._left()
            if left:  # they will never park: no use waiting for them
                return self._abandon(epoch, started, f"{left} and cannot park")
            self._publish({"t": p.PAUSE, "e": epoch, "timeout": timeout_s})
            c_keys = [p.c_key(epoch, r) for r in range(self.world_size)]
            self._garbage += [*c_keys, p.c_counter_key(epoch), done_key(p.c_counter_key(epoch))]
            if self.kv.wait_count(p.c_counter_key(epoch), self.world_size, deadline, self._wake) < self.world_size:
                missing = self._missing(c_keys)
                why = self._nodes_say_why(epoch, missing, deadline) or \
                    f"no answer to the pause from rank(s) {_ranks(missing)}"
                return self._abandon(epoch, started, why + self._restarted(epoch))
            target = max(int(v) for v in self.kv.get_many(c_keys)) + 1
            self._publish({"t": p.TARGET, "e": epoch, "S": target,
                           "timeout": max(0.0, deadline - time.monotonic())})
            parked_keys = [p.parked_key(epoch, r) for r in range(self.world_size)]
            self._garbage += [*parked_keys, p.parked_counter_key(epoch), done_key(p.parked_counter_key(epoch))]
            count = self.kv.wait_count(p.parked_counter_key(epoch), self.world_size, deadline, self._wake)
            if count < self.world_size:
                missing = self._missing(parked_keys)
                return self._abandon(epoch, started, self._why_not_parked(epoch, missing, target, deadline)
                                     + self._restarted(epoch))
            self._name_in_flight(None, None)
            self._paused, self._links_unsettled = True, False
            outcome = PauseOutcome(True, target, "parked", time.monotonic() - started)
            self.last_pause = outcome
            logger.info("all %s parked at step %d in %.1f ms", self._who(), target, outcome.duration_s * 1000)
            return outcome

    def _nodes_say_why(self, epoch: int, missing: list[str], deadline: float) -> str:
        """With node-local fan-out: what the silent nodes' relays said (first: a relay that failed
        the phase early ended the wait), then which nodes were silent (their relay is gone; or,
        before ``deadline``, not done yet); "" without fan-out."""
        if self.layout.ranks_per_node is None:
            return ""
        said, silent = [], []
        unit = self.layout.unit
        early = time.monotonic() < deadline and not self.stopping
        for index in (int(k.rsplit("/", 1)[-1]) for k in missing):
            if self.kv.check([p.why_key(epoch, index)]):
                said.append(f"{unit} {index}: {self.kv.get(p.why_key(epoch, index))}")
                self._garbage.append(p.why_key(epoch, index))
            else:
                ranks = self.layout.ranks_of(index)
                silent.append(f"{unit} {index} (ranks {ranks[0]}-{ranks[-1]}) "
                              f"{'had not answered yet' if early else 'did not answer'}")
        reasons = said + silent
        return "; ".join(reasons[:8]) + (f" (+{len(reasons) - 8} more {unit}s)" if len(reasons) > 8 else "")

    def _why_not_parked(self, epoch: int, missing: list[str], target: int, deadline: float) -> str:
        """Why the pause failed, in words; names the ranks whose step() was never called."""
        if self.layout.ranks_per_node is not None:
            nostep_all = all(self.kv.check([p.nostep_key(epoch, int(k.rsplit("/", 1)[-1]))]) for k in missing)
            if nostep_all and len(missing) == self.world_size:
                return ("no rank reached a step boundary: step() was never called (is agent.step() called in the "
                        "training loop?)")
            return self._nodes_say_why(epoch, missing, deadline)
        ranks = [int(k.rsplit("/", 1)[-1]) for k in missing]
        nostep = [f"{r}" for r in ranks if self.kv.check([p.nostep_key(epoch, r)])]
        self._garbage += [p.nostep_key(epoch, int(r)) for r in nostep]
        if nostep and len(nostep) == len(ranks) == self.world_size:
            return ("no rank reached a step boundary: step() was never called (is agent.step() called in the "
                    "training loop?)")
        reason = f"rank(s) {_ranks(missing)} did not park at step {target}"
        if nostep:
            reason += f"; step() was never called on rank(s) {_ranks(nostep)}"
        return reason

    def _who(self) -> str:
        layout = self.layout
        if layout.ranks_per_node is None:
            return f"{self.world_size} rank(s)"
        groups = f" in {layout.groups} group(s)" if layout.nodes_per_group else ""
        return f"{layout.world_size} rank(s) on {layout.nodes} node(s){groups}"

    def _missing(self, keys: list[str]) -> list[str]:
        """Which of ``keys`` are missing (the failure path only: one round trip per key)."""
        return [k for k in keys if not self.kv.check([k])]

    def _abandon(self, epoch: int, started: float, reason: str) -> PauseOutcome:
        self._name_in_flight(None, None)
        if self.stopping:  # cut short by the agent's stop, not a timeout
            reason = f"the agent stopped before the pause completed ({reason})"
        self._publish({"t": p.RELEASE, "e": epoch, "stop": None, "cancel": True})
        outcome = PauseOutcome(False, None, reason, time.monotonic() - started)
        self.last_pause = outcome
        logger.error("pause failed: %s", reason)
        return outcome

    def run(self, order: SwitchOrder, *, kind: str, budget_s: float, guard_budget_s: float | None = None) -> RunOutcome:
        """Run ``order`` on every rank (``kind``: switch, rollback or checkpoint). The first
        failing rank decides at once; a rank silent past the budget counts as failed.

        A switch whose ranks run a checkpoint guard (``guard_budget_s``: its timeout) or a verify
        warm-up runs those first, as a round of their own decided once every rank answered
        (:func:`messages.waits_for_every_rank`); the switch order follows only if every one
        succeeded, with ``budget_s`` for the switch alone. No rank's links move while another
        rank's guard may still refuse, or is still inside its hook."""
        with self._lock:
            started = time.monotonic()
            session = not self._paused  # pause mode external: a session of its own
            epoch = self._new_epoch() if session else self._epoch
            name = f"{epoch}.{order.seq}.{kind}"
            guarded = kind == p.KIND_SWITCH and (guard_budget_s is not None or self.warm_up_s > 0)
            # A rank whose agent stopped will never answer: no use waiting out the budget for it
            # (a rollback after a failed switch, with every other rank parked). Nothing is sent.
            outcome = self._unanswerable(epoch, f"{epoch}.{order.seq}.{p.KIND_GUARD}" if guarded else name)
            text = p.encode_order(order)
            if outcome is None:  # for a member or relay of an earlier version, and large orders
                self.kv.set(p.order_key(name), text)
            if guarded and outcome is None:
                guard = self._guard_round(epoch, order, name, text, (guard_budget_s or 0.0) + self.warm_up_s,
                                          started, session)
                if not guard.ok:
                    outcome = replace(guard, guard_failed=True)
            if outcome is None:
                outcome = self._order_round(epoch, order, name, kind, text, budget_s, started, session,
                                            guard_ok=guard.guard_ok if guarded else None)
            self._name_in_flight(None, None)
            self._tell_outcome(epoch, name, kind, order.seq, outcome)
            if session:
                self._publish({"t": p.RELEASE, "e": epoch, "stop": None, "cancel": False})
            if self.on_decided is not None:
                try:
                    self.on_decided(order, kind, outcome)
                except Exception:  # bookkeeping must never cost the reply
                    logger.exception("recording the decided order failed; ignored")
            return outcome

    def _guard_round(self, epoch: int, order: SwitchOrder, switch_name: str, text: str, budget_s: float,
                     started: float, session: bool) -> RunOutcome:
        """Every rank's guard and warm-up, and nothing else (run()). Its failure moved no link."""
        name = f"{epoch}.{order.seq}.{p.KIND_GUARD}"  # named in flight by run(), as it looked for ranks that left
        self._publish({"t": p.ORDER, "e": epoch, "key": name, "kind": p.KIND_GUARD, "budget": budget_s,
                       "seq": order.seq, "order": switch_name, **p.inline_order(text), **({} if session else {"p": 1})})
        outcome = self._gather(epoch, name, started + budget_s + RESULT_SLACK_S, started)
        self._collect(epoch, name)
        if not outcome.ok:
            self._go(epoch, name, p.encode({"t": p.WAKE}))  # the ranks whose guard passed wait on it
            # The caller logs the switch's failure with the same reason (and "switch not attempted").
            logger.debug("switch #%d: not started on any rank, its guard failed: %s", order.seq, outcome.reason)
        return outcome

    def _order_round(self, epoch: int, order: SwitchOrder, name: str, kind: str, text: str, budget_s: float,
                     started: float, session: bool, *, guard_ok: bool | None) -> RunOutcome:
        """The order itself (run()); with ``guard_ok`` (a switch whose guard round ran and
        succeeded) without the guard and warm-up, and with the guard round's verdict."""
        go = kind == p.KIND_SWITCH and self.verify_expected  # the ranks that switch wait on a go key
        moves_links = not session and kind in (p.KIND_SWITCH, p.KIND_ROLLBACK)
        warm_up_s = self.warm_up_s if kind == p.KIND_SWITCH and guard_ok is None else 0.0
        if guard_ok is not None:  # named now; a rank may have left during the guard round (run() looked before it)
            left = self._unanswerable(epoch, name)
            if left is not None:
                self._go(epoch, f"{epoch}.{order.seq}.{p.KIND_GUARD}", p.encode({"t": p.WAKE}))
                return replace(left, guard_ok=guard_ok)
        # (else run() named it, as it looked for ranks that left)
        # "p": the ranks were paused for this order (pause mode agent): a rank that is not parked
        # (a process restarted since the pause) must not run it next to a running step.
        event = {"t": p.ORDER, "e": epoch, "key": name, "kind": kind, "budget": budget_s, "seq": order.seq,
                 **p.inline_order(text), **({"v": 1, "w": warm_up_s} if go else {}),
                 **({"g": 1} if guard_ok is not None else {}), **({} if session else {"p": 1})}
        if moves_links:  # from its publication on (an error out of this run leaves it set): unknown links
            self._links_unsettled = True
        if guard_ok is not None:  # after the guard round every rank waits on its go key for it
            self._go(epoch, f"{epoch}.{order.seq}.{p.KIND_GUARD}", self._event(event))
        else:
            self._publish(event)
        deadline = time.monotonic() + budget_s + warm_up_s + RESULT_SLACK_S
        outcome = self._gather(epoch, name, deadline, started)
        if guard_ok is not None:
            outcome = replace(outcome, guard_ok=guard_ok)
        self._collect(epoch, name)
        if kind == p.KIND_SWITCH and outcome.ok and outcome.verify_s > 0:
            outcome = self._verify(epoch, order, outcome, started, text, go=go)
        elif go:  # no verify round: the ranks that switched go back to their queues
            self._go(epoch, name, p.encode({"t": p.WAKE}))
        if moves_links:  # switched (and verified) on every rank, or rolled back: settled
            self._links_unsettled = not outcome.ok
        return outcome

    def _verify(self, epoch: int, order: SwitchOrder, switched: RunOutcome, started: float,
                text: str, *, go: bool) -> RunOutcome:
        """The second round: every rank runs its verify hook; the first failure decides. With
        ``go`` the ranks wait on the switch's go keys for it, else it is a queue event."""
        name = f"{epoch}.{order.seq}.{p.KIND_VERIFY}"
        verify_started = time.monotonic()
        # The order is the switch's, already on every Store (o/<switch's name>, deleted with the epoch).
        switch_name = f"{epoch}.{order.seq}.{p.KIND_SWITCH}"
        event = {"t": p.ORDER, "e": epoch, "key": name, "kind": p.KIND_VERIFY, "budget": switched.verify_s,
                 "seq": order.seq, "order": switch_name, **p.inline_order(text), **({"p": 1} if self._paused else {})}
        self._name_in_flight(epoch, name)
        if go:
            self._go(epoch, switch_name, self._event(event))
        else:
            self._publish(event)
        outcome = self._gather(epoch, name, verify_started + switched.verify_s + RESULT_SLACK_S, started)
        self._collect(epoch, name)
        took = (time.monotonic() - verify_started) * 1000
        if not outcome.ok:
            logger.error("switch #%d: verification failed after %.1f ms: %s", order.seq, took, outcome.reason)
            # A rank silent in the verify round may be stuck in its collective: as unsafe as one
            # that said its op is still pending.
            unsafe = outcome.unsafe or "did not answer" in outcome.reason
            return RunOutcome(False, f"verification failed: {outcome.reason}", attempted=True,
                              guard_ok=switched.guard_ok, duration_s=outcome.duration_s,
                              interrupted=outcome.interrupted, verify_s=switched.verify_s, unsafe=unsafe,
                              verify_failed=True)
        logger.info("switch #%d verified on every rank in %.1f ms", order.seq, took)
        return RunOutcome(True, switched.reason, attempted=True, guard_ok=switched.guard_ok,
                          duration_s=outcome.duration_s, verify_s=switched.verify_s, verified=True)

    def _unanswerable(self, epoch: int, name: str) -> RunOutcome | None:
        """Name order ``name`` as in flight, then see whether a rank's agent has stopped: the
        outcome of an order it can never answer, or None. In this order, against joining.leave's
        (count itself, then read what is in flight): of a rank leaving and an order starting, one
        sees the other, so a rank that leaves now fails the order at once as its result."""
        self._name_in_flight(epoch, name)
        left = self._left()
        return RunOutcome(False, f"{left} and cannot answer") if left else None

    def _left(self) -> str:
        """Who stopped their agent and has not come back (joining.leave), in words; "" if nobody."""
        left = self.kv.count(p.LEFT_COUNT)
        if left <= 0:
            return ""
        last = self.kv.get(p.LEFT_LAST) if self.kv.check([p.LEFT_LAST]) else "a rank"
        if left == 1:
            return f"{last} stopped its agent (training ended, or its process is ending or restarting)"
        return f"{left} ranks stopped their agent (the last: {last})"

    def _name_in_flight(self, epoch: int | None, name: str | None) -> None:
        """Name the order about to be published (before it is: joining.py relies on that order), or,
        with None, say that none is in flight."""
        text = "" if name is None else p.encode({"e": epoch, "key": name, "n": self.world_size})
        self.kv.set(p.IN_FLIGHT, text)

    def _name_pause_in_flight(self, epoch: int) -> None:
        """A process taking a rank's place during pause ``epoch``, or a rank whose agent stops, fails
        it at once (joining.py): it will never park in it. Named before the pause is published."""
        self.kv.set(p.IN_FLIGHT, p.encode({"e": epoch, "pause": 1}))
        self._garbage += [done_key(p.parked_counter_key(epoch)), p.restarted_key(epoch)]

    def _restarted(self, epoch: int) -> str:
        """For a failed pause's reason: which rank's process was restarted (or its agent stopped)
        during it, if one was."""
        if not self.kv.check([p.restarted_key(epoch)]):
            return ""
        return f"; {self.kv.get(p.restarted_key(epoch))}"

    def _go(self, epoch: int, name: str, text: str) -> None:
        """Tell the ranks waiting on switch ``name``'s go keys what follows (one multi-set)."""
        keys = [p.go_key(epoch, name, rank) for rank in range(self.world_size)]
        self.kv.set_many(keys, [text] * self.world_size)
        self._go_garbage[0].extend(keys)

    def _collect(self, epoch: int, name: str) -> None:
        """An order's keys become garbage once it is decided (deleted when the next epoch starts)."""
        self._garbage += [p.result_key(epoch, name, i) for i in range(1, self.world_size + 1)]
        self._garbage += [p.result_counter_key(epoch, name), done_key(p.result_counter_key(epoch, name))]
        if not name.endswith((f".{p.KIND_VERIFY}", f".{p.KIND_GUARD}")):  # these use the switch's order key
            self._garbage.append(p.order_key(name))

    def _tell_outcome(self, epoch: int, name: str, kind: str, seq: int, outcome: RunOutcome) -> None:
        """Let every member know the decision (members that are not the leader learn it only so).

        A success rides on the next event (the release that follows it, at once in pause mode
        external, after ClusterD's word in pause mode agent); a failure is published now: what
        follows it may be a wait for ClusterD's choice of strategy."""
        message: dict[str, object] = {"t": p.OUTCOME, "e": epoch, "key": name, "kind": kind, "seq": seq,
                                      "ok": outcome.ok, "reason": outcome.reason[:512], "at": time.time()}
        if not outcome.ok and not outcome.verify_failed:
            message["stands"] = 1  # a rank whose hook returned True in this order is on its link
        self._flush_outcome()
        self._outcome = message
        if not outcome.ok:
            self._flush_outcome()

    def _flush_outcome(self) -> None:
        """Publish a pending outcome on its own (nothing else is about to carry it)."""
        outcome, self._outcome = self._outcome, None
        if outcome is None:
            return
        try:
            self._publish(outcome)
        except RuntimeError:  # the Store is gone: the members cannot hear it anyway
            logger.debug("could not publish the outcome of %s", outcome.get("key"), exc_info=True)

    def _gather(self, epoch: int, name: str, deadline: float, started: float) -> RunOutcome:
        """Read the results as they arrive; the first failure decides at once (a guard round's
        once every rank answered: p.waits_for_every_rank)."""
        every = p.waits_for_every_rank(name)
        attempted, guards, seen, verify_s, unsafe = False, 0, 0, 0.0, False
        failed: p.MemberResult | None = None
        succeeded: list[int] = []  # the rank each success names (a relay's: its first rank)
        for result in p.arriving_results(self.kv, epoch, name, self.world_size, deadline, self._wake):
            seen += 1
            if result.ok:
                succeeded.append(result.rank)
            attempted = attempted or result.attempted
            guards += int(result.guard_ok)
            verify_s = max(verify_s, result.verify_s)
            if not result.ok and every:
                failed, unsafe = failed or result, unsafe or result.unsafe
            elif not result.ok:
                # Known only if every rank answered: a guard that checkpointed everywhere counts
                # for a later dump (otherwise the guard is asked again and skips a step it has).
                everyone = seen == self.world_size and guards == self.world_size
                # A rank not heard from yet may have switched, or may still: links may have moved.
                return RunOutcome(False, f"rank {result.rank}: {result.reason}",
                                  attempted=attempted or seen < self.world_size,
                                  guard_ok=everyone, duration_s=time.monotonic() - started,
                                  interrupted=result.rank if result.interrupted else None,
                                  unsafe=result.unsafe, ok_ranks=self._ranks_behind(succeeded),
                                  unmoved_ranks=frozenset() if result.attempted else frozenset({result.rank}))
        if failed is not None:  # a guard round: nothing moved; a rank still in its hook keeps training parked
            return RunOutcome(False, f"rank {failed.rank}: {failed.reason}", duration_s=time.monotonic() - started,
                              interrupted=failed.rank if failed.interrupted else None,
                              unsafe=unsafe or seen < self.world_size)
        if seen < self.world_size:
            who = f"{self.world_size - seen} {self.layout.unit}(s)"
            why = f"{who} did not answer {'before the agent stopped' if self.stopping else 'within the budget'}"
            return RunOutcome(False, why, attempted=not every, duration_s=time.monotonic() - started, unsafe=every,
                              ok_ranks=frozenset() if every else self._ranks_behind(succeeded))
        return RunOutcome(True, "ok on every rank", attempted=attempted, guard_ok=guards == self.world_size,
                          duration_s=time.monotonic() - started, verify_s=verify_s)

    def _ranks_behind(self, answered: list[int]) -> frozenset[int]:
        """Every rank that the answerers naming ``answered`` speak for (a failed order's successes;
        the set is built only for a failure)."""
        layout = self.layout
        return frozenset(rank for named in answered for rank in layout.ranks_of(layout.answerer_of(named)))

    def release(self, *, stop_reason: str | None = None) -> None:
        """Let every rank go on (or stop, with ``stop_reason``)."""
        with self._lock:
            if not self._paused and stop_reason is None:
                self._flush_outcome()
                return
            self._release(stop_reason)

    def release_if_settled(self) -> bool:
        """Let every rank go on, unless an order that moves links ran in this pause and did not end
        OK (a failed switch not rolled back yet): then publish nothing and return False, so the
        caller can roll back or stop first. Decided under the lock an order runs under: an order
        still running is waited for."""
        with self._lock:
            if self._paused and self._links_unsettled:
                return False
            if self._paused:
                self._release(None)
            else:
                self._flush_outcome()
            return True

    def release_at_stop(self, why: str) -> str | None:
        """The agent stops while every rank is parked (``why``: the stop's reason): release them,
        to stop training (TrainingStopped) when an order that moves links ran in this pause and did
        not end OK (or still runs, cut short by the stop), else to go on: nothing moved, or what
        moved was switched on every rank or rolled back. Returns the stop reason given (None: go on).
        """
        with self._lock:
            if not self._paused:
                return None
            stop = (f"the job's leader stopped ({why}) during a switch that had not ended: the links may have "
                    "moved, and training must not resume on them") if self._links_unsettled else None
            self._release(stop)
            return stop

    def _release(self, stop_reason: str | None) -> None:
        """Publish the release (the caller holds the lock); the pause is over."""
        self._publish({"t": p.RELEASE, "e": self._epoch, "stop": stop_reason, "cancel": False})
        self._paused, self._links_unsettled = False, False
        self._undrained = self._n

    def drain(self) -> None:
        """Wait (up to ``drain_s``) until every member (or relay) has taken the last release from its
        queue. For the leader's stop: its process may end next, and the Store with it (rank 0 hosts
        it without torchrun), before a member has read that it must stop or may go on."""
        with self._lock:
            n, self._undrained = self._undrained, 0
            if not n:
                return
            try:
                untaken = len(queues.untaken(self.kv, range(self.world_size), n, time.monotonic() + self.drain_s))
            except RuntimeError:  # the Store is gone: nobody can read anything from it any more
                logger.debug("could not wait for the release to be taken", exc_info=True)
                return
        if untaken:
            logger.info("%d %s(s) had not taken the release after %.1f s (gone?); going on", untaken,
                        self.layout.unit, self.drain_s)


def _delete_keys(kv: KV, keys: list[str]) -> None:
    """Delete the last epoch's keys on a connection of its own (nobody reads them any more)."""
    try:
        kv.clone().delete(keys)
    except Exception:  # the Store went away: nothing left to clean
        logger.debug("could not delete %d coordination keys", len(keys), exc_info=True)


def _ranks(keys: list[str]) -> str:
    ranks = [k.rsplit("/", 1)[-1] for k in keys]
    return ", ".join(ranks[:16]) + (f" (+{len(ranks) - 16} more)" if len(ranks) > 16 else "")
