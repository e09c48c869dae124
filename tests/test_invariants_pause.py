"""The step-aligned pause under forced interleavings (docs/architecture.md, "Why no rank passes S").

The proof that no rank runs past ``S = max(c_r) + 1`` rests on two orders:

- the member sets the rank's pause flag, *then* reads the last completed step ``c_r`` (member.py);
- ``agent.step(k)`` records ``k`` as completed, *then* checks the flag (agent.py).

Swap either pair and the pause still works almost always: the window is one line wide. So these
tests do not hope for the bad schedule, they force it with events. The training threads take one
step per permit the test gives; the member thread or the training thread is held at the exact line
where a swapped order would let a step slip by; the test moves the other thread through that
window, then lets everything go on as a real training loop would (every rank keeps stepping).
Every rank must then park at the same S.

The ranks are real member-only :class:`SwitchAgent` objects on one in-process Store; the leader's
side is a real :class:`Coordinator` on that Store (where the launcher's leader would be). There
is no collective between the training threads: a rank that parks past S is exactly the rank that
would wait for ever in step S+1's all-reduce in a real job, so the tests assert the parked steps
instead of waiting for a deadlock, and fail in milliseconds rather than at a timeout.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import pytest

from nicswitch_agent import SwitchAgent
from nicswitch_agent.coordination import KV, Coordinator, InProcessStore, PauseOutcome, key_prefix
from nicswitch_agent.coordination.parking import ParkingLot, TrainingStopped
from nicswitch_agent.observability.events import AgentEvent

pytestmark = pytest.mark.timeout(60)

JOB = "job-invariants"
WORLD = 2
WAIT_S = 20.0  # bound of every wait; the passing path takes milliseconds
PAUSE_TIMEOUT_S = 30.0


class Hold:
    """One point where a thread stops until the test lets it go; tells the test it arrived."""

    def __init__(self) -> None:
        self.arrived = threading.Event()
        self._go = threading.Event()
        self.value: Any = None

    def stop_here(self, value: Any) -> None:
        self.value = value
        self.arrived.set()
        self._go.wait(WAIT_S)

    def wait_arrived(self) -> Any:
        assert self.arrived.wait(WAIT_S), "the thread never reached the hold point"
        return self.value

    def release(self) -> None:
        self._go.set()


class GatedAgent(SwitchAgent):
    """A SwitchAgent whose ``last_step`` and ``_armed`` the test can watch and hold.

    SwitchAgent keeps both in slots: ``step()`` writes ``last_step`` then reads ``_armed``; the
    member thread reads ``last_step`` (through ``lambda: self.last_step``) right after arming.
    These properties shadow the slots, so the real ``step()`` and the real member run unchanged
    while the test decides when each access completes.
    """

    def __init__(self, **kwargs: Any) -> None:
        # Before SwitchAgent.__init__, whose own assignments already go through the setters.
        self.__dict__.update(_step_value=None, _flag_value=False, _read_hold=None, _record_hold=None,
                             stepping=None, flag_checks=[], _checks_cond=threading.Condition())
        super().__init__(**kwargs)

    # -- last_step ---------------------------------------------------------------------------

    @property
    def last_step(self) -> int | None:
        value: int | None = self.__dict__["_step_value"]
        hold: Hold | None = self.__dict__["_read_hold"]
        if hold is not None and threading.current_thread().name == "nicswitch-member":
            self.__dict__["_read_hold"] = None
            hold.stop_here(value)  # the member has read c_r; it goes on only when released
        return value

    @last_step.setter
    def last_step(self, value: int | None) -> None:
        hold = self.__dict__["_record_hold"]
        if hold is not None and hold[0] == value:
            self.__dict__["_record_hold"] = None
            hold[1].stop_here(value)  # step(value) is under way, the step not yet recorded
        self.__dict__["_step_value"] = value

    def hold_member_after_reading_last_step(self) -> Hold:
        hold = Hold()
        self.__dict__["_read_hold"] = hold
        return hold

    def hold_step_before_recording(self, step: int) -> Hold:
        hold = Hold()
        self.__dict__["_record_hold"] = (step, hold)
        return hold

    # -- the pause flag step() tests -----------------------------------------------------------

    @property
    def _armed(self) -> bool:
        value: bool = self.__dict__["_flag_value"]
        cond: threading.Condition = self.__dict__["_checks_cond"]
        with cond:  # only step() reads the flag: one entry per step boundary
            self.__dict__["flag_checks"].append((self.__dict__["stepping"], value))
            cond.notify_all()
        return value

    @_armed.setter
    def _armed(self, value: bool) -> None:
        self.__dict__["_flag_value"] = value

    def wait_flag_checked(self, step: int) -> bool:
        """Wait until ``step(step)`` looked at the flag; returns what it saw."""
        cond: threading.Condition = self.__dict__["_checks_cond"]
        checks: list[tuple[int | None, bool]] = self.__dict__["flag_checks"]
        with cond:
            assert cond.wait_for(lambda: any(s == step for s, _ in checks), WAIT_S), f"step({step}) never checked"
            return next(v for s, v in checks if s == step)


class Trainer:
    """A training thread that runs ``agent.step(k)`` once per permit, k = 1, 2, 3 ..."""

    def __init__(self, rank: int, agent: SwitchAgent) -> None:
        self.agent = agent
        self._permits = threading.Semaphore(0)
        self._cond = threading.Condition()
        self.started = 0  # the last step whose step() call began
        self.returned = 0  # the last step whose step() call returned
        self.error: BaseException | None = None
        self._closing = False
        self.thread = threading.Thread(target=self._run, name=f"train-{rank}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        step = 0
        try:
            while self._permits.acquire(timeout=WAIT_S * 3) and not self._closing:
                step += 1
                self.started = step
                self.agent.__dict__["stepping"] = step  # which call GatedAgent's flag checks belong to
                self.agent.step(step)
                with self._cond:
                    self.returned = step
                    self._cond.notify_all()
        except TrainingStopped:
            pass
        except BaseException as exc:
            self.error = exc

    def allow(self, steps: int) -> None:
        self._permits.release(steps)

    def train_to(self, step: int) -> None:
        """Permits up to ``step`` (counting the steps already begun), and wait until it returned."""
        self.allow(step - self.started)
        with self._cond:
            assert self._cond.wait_for(lambda: self.returned >= step, WAIT_S), f"did not reach step {step}"

    def close(self) -> None:
        self._closing = True
        self._permits.release()
        self.thread.join(5)


class Job:
    """WORLD member-only agents and their training threads, led by a Coordinator on the Store."""

    def __init__(self) -> None:
        self.store = InProcessStore()
        self._cond = threading.Condition()
        self.events: list[list[AgentEvent]] = [[] for _ in range(WORLD)]
        self.agents = [
            GatedAgent(server="127.0.0.1:9", job_id=JOB, pause="agent", leader="launcher", rank=r, world_size=WORLD,
                       store=self.store, switch_hook=lambda order: True,
                       on_event=lambda event, r=r: self._record(r, event))
            for r in range(WORLD)
        ]
        for agent in self.agents:
            agent.start()
        self.trainers = [Trainer(r, agent) for r, agent in enumerate(self.agents)]
        self.coordinator = Coordinator(KV(self.store, key_prefix(JOB, "launcher")), WORLD)
        self._pool = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="leader")

    def _record(self, rank: int, event: AgentEvent) -> None:
        with self._cond:
            self.events[rank].append(event)
            self._cond.notify_all()

    def wait_event(self, rank: int, kind: str) -> dict[str, Any]:
        with self._cond:
            assert self._cond.wait_for(lambda: any(e.kind == kind for e in self.events[rank]), WAIT_S), (
                f"rank {rank}: no {kind} event")
            return next(e.detail for e in self.events[rank] if e.kind == kind)

    def pause(self) -> futures.Future[PauseOutcome]:
        return self._pool.submit(self.coordinator.pause, PAUSE_TIMEOUT_S)

    def parked_steps(self) -> list[int]:
        return [self.wait_event(r, "parked")["step"] for r in range(WORLD)]

    def close(self) -> None:
        self.coordinator.release()
        for trainer in self.trainers:
            trainer.close()
        for agent in self.agents:
            agent.stop()
        self._pool.shutdown(wait=False)


@pytest.fixture
def job() -> Iterator[Job]:
    made = Job()
    try:
        yield made
    finally:
        made.close()


def _every_rank_parks_at(job: Job, pause: futures.Future[PauseOutcome], expected: int) -> None:
    """Let every rank train on as a real loop would (one step past S at most), then check that
    each parked at S: a rank parked above S is one that a collective would have deadlocked."""
    for trainer in job.trainers:
        trainer.allow(expected + 1 - trainer.started)
    outcome = pause.result(WAIT_S + PAUSE_TIMEOUT_S)
    assert outcome.ok, outcome.reason
    assert outcome.step == expected
    assert job.parked_steps() == [expected] * WORLD, (
        f"ranks parked at different steps (S={outcome.step}): a rank completed a step after its c_r was read "
        "without seeing the pause flag, and ran past S")
    assert all(t.error is None for t in job.trainers)


def test_a_step_completed_while_the_member_reads_c_r_is_seen(job: Job) -> None:
    """member.py: flag first, then c_r. Hold rank 0's member right after it read c_r = 3, let
    rank 0's training thread complete step 4 (record it and look at the flag), then let the
    member go on. With the flag set before the read, step 4 sees it and parks at S = 4; with the
    read first, step 4 slips through unseen, S is still 4, and rank 0 parks at 5."""
    for trainer in job.trainers:
        trainer.train_to(3)
    hold = job.agents[0].hold_member_after_reading_last_step()
    pause = job.pause()
    assert hold.wait_arrived() == 3
    job.trainers[0].allow(1)  # step 4, inside the window between the member's two lines
    job.agents[0].wait_flag_checked(4)
    hold.release()
    assert job.wait_event(0, "pause_requested")["completed_step"] == 3
    assert job.wait_event(1, "pause_requested")["completed_step"] == 3  # both c_r are in: S = 4
    _every_rank_parks_at(job, pause, 4)


def test_a_step_under_way_when_the_flag_is_set_is_seen(job: Job) -> None:
    """agent.py: step(k) records k, then checks the flag. Hold rank 0's step(4) just before it
    records 4, run the whole pause request on every member (flag up, c_0 = 3 read), then let
    step(4) finish. Recording first, step 4 sees the flag and parks at S = 4; checking first, it
    saw no flag, completes step 4 past c_0, and rank 0 parks at 5."""
    for trainer in job.trainers:
        trainer.train_to(3)
    hold = job.agents[0].hold_step_before_recording(4)
    job.trainers[0].allow(1)
    hold.wait_arrived()
    pause = job.pause()
    assert job.wait_event(0, "pause_requested")["completed_step"] == 3
    assert job.wait_event(1, "pause_requested")["completed_step"] == 3  # both c_r are in: S = 4
    hold.release()
    _every_rank_parks_at(job, pause, 4)


def test_a_request_made_as_training_leaves_its_parking_spot_is_not_lost() -> None:
    """coordination/parking.py: only the member thread writes ``request_epoch``, and the training thread, leaving
    its parking spot, marks handled only the epoch it parked for (and disarms only if that is still
    the latest). Pin the parked training thread in a piece of work, release its pause and make
    the next request meanwhile (a continue followed at once by the next switch's pause), then let
    it go: it must park again at its next step. A training thread that marks the newest request
    handled, or disarms regardless, loses that request; in a real job that rank then runs into a
    collective the parked ranks never join."""
    armed = [False]
    cond = threading.Condition()

    def parked_or_resumed(kind: str, detail: dict[str, Any]) -> None:
        with cond:
            cond.notify_all()

    lot = ParkingLot(on_event=parked_or_resumed, on_armed=lambda value: armed.__setitem__(0, value))
    permits = threading.Semaphore(0)
    returned = [0]
    closing = threading.Event()

    def train() -> None:  # agent.step(): record, then test the flag the lot keeps
        step = 0
        while permits.acquire(timeout=WAIT_S * 3) and not closing.is_set():
            step += 1
            if armed[0]:
                lot.at_step_boundary(step)
            with cond:
                returned[0] = step
                cond.notify_all()

    thread = threading.Thread(target=train, name="train", daemon=True)
    thread.start()
    try:
        first = lot.request()
        permits.release()
        assert lot.wait_parked(first, WAIT_S) and lot.parked_step == 1
        inside, leave = threading.Event(), threading.Event()

        def hold_the_training_thread() -> None:
            inside.set()
            leave.wait(WAIT_S)

        work = lot.run_parked(hold_the_training_thread)
        assert inside.wait(WAIT_S)  # the training thread runs the work, outside the lot's lock
        lot.release()  # continue: the training thread will leave once the work returns ...
        second = lot.request()  # ... but the next pause comes first
        leave.set()
        work.result(WAIT_S)
        with cond:
            assert cond.wait_for(lambda: returned[0] >= 1, WAIT_S)  # step 1 is over: it left
        permits.release()  # step 2
        with cond:
            assert cond.wait_for(lambda: returned[0] >= 2 or lot.parked, WAIT_S)
        assert lot.parked and lot.parked_step == 2, f"request #{second} was lost: step 2 did not park"
        assert lot.wait_parked(second, WAIT_S)
    finally:
        closing.set()
        lot.release()
        permits.release()
        thread.join(5)
