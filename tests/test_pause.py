"""ParkingLot: a training thread parks at a step boundary, runs work there, and is let go."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import support

from nicswitch_agent.coordination.parking import ParkingLot, TrainingStopped

pytestmark = pytest.mark.timeout(20)


class Trainer:
    """A training thread that calls the lot at every step boundary, like agent.step()."""

    def __init__(self, lot: ParkingLot, steps: int = 10_000_000) -> None:
        self.lot = lot
        self.step = 0
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.finished = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(steps,), daemon=True)

    def _run(self, steps: int) -> None:
        try:
            while self.step < steps and not self.stop.is_set():
                self.step += 1
                if self.lot.request_epoch != self.lot.handled_epoch:
                    self.lot.at_step_boundary(self.step)
        except BaseException as exc:
            self.error = exc
        finally:
            self.finished.set()

    def __enter__(self) -> Trainer:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.lot.release()
        self.thread.join(5)


def test_park_run_work_on_the_training_thread_and_release() -> None:
    lot = ParkingLot()
    with Trainer(lot) as trainer:
        epoch = lot.request()
        assert lot.wait_parked(epoch, 10)
        parked_step = lot.parked_step
        assert parked_step is not None and trainer.step == parked_step  # it really stopped stepping
        ran_on = lot.run_parked(lambda: threading.current_thread()).result(5)
        assert ran_on is trainer.thread
        assert trainer.step == parked_step
        assert lot.release() is True
        with pytest.raises(RuntimeError, match="not parked"):  # released: refused, not queued
            lot.run_parked(lambda: None).result(5)


def test_work_that_raises_is_returned_not_raised_on_the_training_thread() -> None:
    lot = ParkingLot()
    with Trainer(lot) as trainer:
        assert lot.wait_parked(lot.request(), 10)
        future = lot.run_parked(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            future.result(5)
        assert lot.parked and trainer.error is None


def test_a_pause_that_times_out_is_withdrawn_and_never_parks_later() -> None:
    lot = ParkingLot()
    epoch = lot.request()
    assert lot.wait_parked(epoch, 0.01) is False  # nobody is stepping
    with Trainer(lot, steps=50) as trainer:
        assert trainer.finished.wait(10)
        assert trainer.step == 50 and not lot.parked
        assert lot.handled_epoch == epoch


def test_each_request_is_a_new_epoch_and_parks_again() -> None:
    lot = ParkingLot()
    with Trainer(lot):
        for _ in range(5):
            epoch = lot.request()
            assert lot.wait_parked(epoch, 10)
            lot.release()


def test_release_with_stop_reason_raises_training_stopped_in_the_training_thread(
        caplog: pytest.LogCaptureFixture) -> None:
    lot = ParkingLot()
    lot.rank = 5  # as a Member sets it: every line names the rank
    with caplog.at_level("INFO", logger="nicswitch_agent"), Trainer(lot) as trainer:
        assert lot.wait_parked(lot.request(), 10)
        lot.release(stop_reason="ClusterD chose exit")
        assert trainer.finished.wait(10)
    assert isinstance(trainer.error, TrainingStopped)
    assert "ClusterD chose exit" in str(trainer.error)
    said = [r.getMessage() for r in caplog.records]
    assert not any("training resumed" in m for m in said), said  # it does not resume: it stops
    assert any(m.startswith("rank 5: training leaves its parking spot") and "to stop: ClusterD chose exit" in m
               for m in said), said
    assert any(m.startswith("rank 5: training parked at step ") for m in said), said


def test_stop_while_not_parked_raises_at_the_next_step() -> None:
    lot = ParkingLot()
    lot.release(stop_reason="killMaster")
    with Trainer(lot) as trainer:
        assert trainer.finished.wait(10)
    assert isinstance(trainer.error, TrainingStopped)
    assert trainer.step == 1


def test_let_go_stops_a_parked_thread_and_leaves_one_that_is_not_parked_training() -> None:
    """The agent's stop: a parked thread raises TrainingStopped, one that is not parked trains on."""
    lot = ParkingLot()
    with Trainer(lot) as trainer:
        assert lot.let_go(stop_reason_if_parked="the agent on rank 1 stopped") is False
        assert not lot.pending  # nothing armed for the next step: it trains on
        step = trainer.step
        assert support.poll(lambda: trainer.step > step + 1000, 10)
        assert trainer.error is None
        assert lot.wait_parked(lot.request(), 10)
        assert lot.let_go(stop_reason_if_parked="the agent on rank 1 stopped") is True
        assert trainer.finished.wait(10)
    assert isinstance(trainer.error, TrainingStopped)
    assert "the agent on rank 1 stopped" in str(trainer.error)


def test_idle_step_check_is_a_plain_comparison() -> None:
    lot = ParkingLot()
    assert lot.request_epoch == lot.handled_epoch and not lot.pending


def test_the_armed_flag_step_reads_never_loses_a_request() -> None:
    """agent.step() tests one flag the lot keeps through ``on_armed``; hammer request/withdraw/park."""
    armed = [False]
    lot = ParkingLot(on_armed=lambda value: armed.__setitem__(0, value))
    stop = threading.Event()
    steps = [0]

    def train() -> None:
        while not stop.is_set():
            steps[0] += 1
            if armed[0]:
                lot.at_step_boundary(steps[0])

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    try:
        for i in range(300):
            epoch = lot.request()
            if i % 3 == 0:
                lot.release()  # withdrawn before (or after) the training thread got to it
                continue
            assert lot.wait_parked(epoch, 10), f"request #{epoch} was lost"
            if i % 3 == 1:
                lot.request()  # a newer request while parked: still armed after this release
            lot.release()
        epoch = lot.request()
        assert lot.wait_parked(epoch, 10)
        lot.release()
    finally:
        stop.set()
        lot.release()
        thread.join(5)
    # The flag changes under the lot's lock together with the epochs: it always says "pending".
    assert armed[0] == lot.pending


def test_a_pause_right_after_a_release_waits_for_the_park_of_its_own_request() -> None:
    """Found in CI (test_signal_sequences, ClusterD's retry then the next pause): a release and the
    next request before the training thread woke from the released parking found it "parked",
    so the leader heard every rank parked at S while the thread was about to leave, and the next
    order failed with "training is no longer parked". Here the test holds the lot's lock through
    the release, the request and the wait's first look, so the thread cannot wake before it."""
    lot = ParkingLot()
    with Trainer(lot) as trainer:
        first = lot.request()
        assert lot.wait_parked(first, 10)
        parked_at = lot.parked_step
        assert parked_at is not None
        with lot._lock:  # the training thread stays in the first parking until the wait lets go of the lock
            lot.release()
            second = lot.request(aligned=True)
            lot.set_target(second, parked_at + 1)
            assert lot.wait_parked(second, 10)
        assert lot.parked_step == parked_at + 1 and trainer.step == parked_at + 1
        assert lot.run_parked(lambda: threading.current_thread()).result(5) is trainer.thread


def test_work_is_refused_by_a_parking_released_for_an_earlier_request() -> None:
    """The same moment: the thread is still in the released parking. Work handed to it there would
    run beside a resuming step; it is refused as for a thread that is not parked."""
    lot = ParkingLot()
    with Trainer(lot):
        assert lot.wait_parked(lot.request(), 10)
        ran: list[bool] = []
        with lot._lock:
            lot.release()
            lot.request(aligned=True)
            future = lot.run_parked(lambda: ran.append(True))
        with pytest.raises(RuntimeError, match="not parked"):
            future.result(5)
        assert ran == []


def test_a_wait_for_the_parking_and_for_its_end_is_woken_by_it_not_by_its_timeout() -> None:
    """A change notifies only when a thread waits (ParkingLot._waiters, no Python call when none
    does): a waiter that were not counted would sleep out its whole timeout, an hour here (the
    module's timeout fails it). Each wait starts under the lock, before the change can happen."""
    lot = ParkingLot()
    with Trainer(lot):
        with lot._lock:
            epoch = lot.request()
            assert lot.wait_parked(epoch, 3600)  # its wait lets go of the lock: only then can the thread park
        with lot._lock:
            assert lot.release()
            assert lot.wait_unparked(3600)
