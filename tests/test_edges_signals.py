"""Issue 11 §1: signals reach the training script.

A KeyboardInterrupt (Ctrl-C) or SystemExit (a SIGTERM handler calling ``sys.exit``) raised on the
parked training thread while it runs a hook must leave ``step()`` at once, training must not
resume, and the list is answered false exactly once; the other ranks are stopped, never resumed
on links in an unknown state. Hook failures are logged once at ERROR with their traceback.

The signal tests run tests/signal_job/train.py as a real child process (see test_signals.py);
the others run ranks as threads against the simulator.
"""

from __future__ import annotations

import functools
import logging
import signal
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import support
from support import Events
from test_signals import JOB, Child, fast, last_frame, request_switch, streams_ready

from nicswitch_agent import SwitchAgent, SwitchOrder
from nicswitch_agent.coordination import InProcessStore
from nicswitch_agent.coordination.hook_runner import HookRunner, HookStatus, InlineRunner, execute_order
from nicswitch_agent.coordination.parking import TrainingStopped
from nicswitch_agent.sim import SimJob, SimSettings, Simulator

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def child_run() -> Iterator[Any]:
    sims: list[Simulator] = []
    children: list[Child] = []

    def start(scenario: str) -> tuple[Simulator, Child]:
        sim = Simulator(jobs=[SimJob(job_id=JOB, nodes={"node-0": ["0"]})], settings=fast())
        sim.start()
        sims.append(sim)
        child = Child(sim, scenario)
        children.append(child)
        assert child.wait_line("STARTED"), child.output()
        assert sim.wait_until(streams_ready, 20), child.output()
        return sim, child

    yield start
    for child in children:
        child.kill()
    for sim in sims:
        sim.stop()


def test_ctrl_c_during_a_hook_on_the_parked_thread_leaves_step_and_training_does_not_resume(child_run: Any) -> None:
    sim, child = child_run("switching")
    request_switch(sim)
    assert child.wait_line("HOOK"), child.output()  # the hook runs on the parked (main) training thread
    child.proc.send_signal(signal.SIGINT)
    code = child.finish()
    output = child.output()
    assert code == -signal.SIGINT, output  # an uncaught KeyboardInterrupt, as without the agent
    assert "KeyboardInterrupt" in output
    assert "in step" in output  # it went up through agent.step()
    # The user's code, where Ctrl-C found it: the hook, or the print helper it was still in.
    assert "in hook_that_runs_on" in output and "signal_job/train.py" in last_frame(output), output
    assert "STEPPED-AFTER-HOOK" not in child.lines, output  # training did not resume
    assert sim.job_view(JOB).replies == [False], output  # exactly one reply, false
    assert child.lines.count("EVENT reply_sent") == 1, output
    assert sim.job_view(JOB).violations == []


def test_sys_exit_from_a_sigterm_handler_during_a_hook_leaves_step(child_run: Any) -> None:
    sim, child = child_run("user-handler-switching")
    request_switch(sim)
    assert child.wait_line("HOOK"), child.output()
    child.proc.send_signal(signal.SIGTERM)
    code = child.finish()
    output = child.output()
    assert code == 42, output  # the user's handler decided how to exit, from inside the hook
    assert "USER-HANDLER" in child.lines
    assert "STEPPED-AFTER-HOOK" not in child.lines, output
    assert sim.job_view(JOB).replies == [False], output
    assert "EVENT agent_stopped" in child.lines, output  # interpreter exit waited for the stop under way


# -- ranks as threads ----------------------------------------------------------------------------

MR_JOB = "job-edges-sig"
MR_NODES = {"node-0": ["0", "1"]}
FAST = SimSettings(report_timeout_s=30.0, keepalive_interval_s=0.5, fault_flush_s=0.01, force_release_s=0.01,
                   schedule_wait_s=0.01, restart_wait_s=0.01, shuffle_nodes=False)


class Trainer:
    """One rank's training loop on a thread; records how it ended and whether it stepped on."""

    def __init__(self, agent: SwitchAgent, barrier: threading.Barrier) -> None:
        self.agent, self.barrier = agent, barrier
        self.step = 0
        self.steps_after_hook = 0
        self.hook_started = threading.Event()
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.done = threading.Event()
        self._cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name=f"train-{agent.config.rank}", daemon=True)

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                self.barrier.wait()  # the step's "all-reduce"
                with self._cond:
                    self.step += 1
                    self._cond.notify_all()
                self.agent.step(self.step)
                if self.hook_started.is_set():
                    self.steps_after_hook += 1
        except threading.BrokenBarrierError:
            pass
        except BaseException as exc:  # KeyboardInterrupt included: this is what the test looks at
            self.error = exc
            self.barrier.abort()
        finally:
            self.done.set()

    def wait_step(self, step: int, timeout: float = 20) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.step >= step, timeout)


class Interrupting:
    """A switch hook that raises KeyboardInterrupt (what Ctrl-C does in a hook on the main thread)."""

    def __init__(self, trainer_of: dict[int, Trainer], rank: int) -> None:
        self.trainer_of, self.rank = trainer_of, rank

    def __call__(self, order: SwitchOrder) -> bool:
        self.trainer_of[self.rank].hook_started.set()
        raise KeyboardInterrupt


class Passing:
    def __init__(self, trainer_of: dict[int, Trainer], rank: int) -> None:
        self.trainer_of, self.rank = trainer_of, rank

    def __call__(self, order: SwitchOrder) -> bool:
        self.trainer_of[self.rank].hook_started.set()
        return True


@pytest.fixture
def sim() -> Iterator[Simulator]:
    simulator = Simulator(jobs=[SimJob(job_id=MR_JOB, nodes=MR_NODES)], settings=FAST)
    simulator.start()
    yield simulator
    simulator.stop()


mr_streams_ready = functools.partial(support.streams_ready, job=MR_JOB)


def test_a_rank_interrupted_in_its_hook_gets_a_prompt_false_and_no_rank_resumes(sim: Simulator, caplog: Any) -> None:
    """Two ranks; rank 1's hook is interrupted. The reply is false at once (not after the hook
    budget), rank 1 leaves step() with the KeyboardInterrupt, and rank 0, parked, is stopped
    (TrainingStopped) instead of resuming on links that may have moved."""
    caplog.set_level(logging.INFO)
    store, barrier = InProcessStore(), threading.Barrier(2, timeout=30)
    trainers: dict[int, Trainer] = {}
    agents: list[SwitchAgent] = []
    events = Events()
    stops: list[str] = []
    offered = LogLine("offering recovery strategies")
    logging.getLogger("nicswitch_agent.controller").addHandler(offered)
    hooks = {0: Passing(trainers, 0), 1: Interrupting(trainers, 1)}
    try:
        for rank in (0, 1):
            agent = SwitchAgent(server=sim.address, job_id=MR_JOB, pause="agent", switch_hook=hooks[rank],
                                store=store, rank=rank, world_size=2, reconnect_initial_s=0.02,
                                reconnect_max_s=0.1, switch_timeout_s=120.0, on_stop=stops.append,
                                on_event=events if rank == 0 else None)
            agents.append(agent)
            trainers[rank] = Trainer(agent, barrier)
        for agent in agents:
            agent.start()
        for trainer in trainers.values():
            trainer.thread.start()
        assert sim.wait_until(mr_streams_ready, 10)
        assert trainers[0].wait_step(3)
        _switch(sim)
        assert trainers[1].done.wait(20), "rank 1 never left step()"
        assert isinstance(trainers[1].error, KeyboardInterrupt)
        assert sim.wait_until(lambda s: len(s.job_view(MR_JOB).replies) >= 1, 20)  # well within 120 s
        assert trainers[0].done.wait(20), "rank 0 was left parked"
        assert isinstance(trainers[0].error, TrainingStopped), trainers[0].error
        assert "interrupted" in str(trainers[0].error)
        assert trainers[0].steps_after_hook == 0 and trainers[1].steps_after_hook == 0  # nobody resumed
        assert sim.job_view(MR_JOB).replies == [False]
        sent = events.wait("reply_sent", timeout=20)
        assert len(sent) == 1 and "interrupted by KeyboardInterrupt" in sent[0].detail["reason"]
        assert "did not answer within the budget" not in caplog.text
        assert len(stops) == 1 and "rank 1" in stops[0]
        # ClusterD's recovery after the false reply: no rollback can run on a rank whose training
        # thread is gone, so nothing but exit is offered.
        assert offered.wait(30), "no answer to globalFault"
        assert offered.message.endswith("['exit']"), offered.message
    finally:
        for trainer in trainers.values():
            trainer.stop.set()
        barrier.abort()
        for agent in agents:
            agent.stop()
        logging.getLogger("nicswitch_agent.controller").removeHandler(offered)


class LogLine(logging.Handler):
    """Set when a log line containing ``text`` is emitted."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.DEBUG)
        self.text, self.message = text, ""
        self._seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.message = record.getMessage()
            self._seen.set()

    def wait(self, timeout: float) -> bool:
        return self._seen.wait(timeout)


def _switch(sim: Simulator, devs: tuple[str, ...] = ("0", "1")) -> None:
    """Switch ``devs`` of node-0 (ranks 0 and 1 by default; one process is a job of rank 0 alone)."""
    from nicswitch_agent._pb import recover_pb2 as pb
    from nicswitch_agent.clusterd.channel import ChannelSettings, RecoverStub, open_channel

    channel = open_channel(ChannelSettings(target=sim.address))
    try:
        request = pb.SwitchNics(jobID=MR_JOB)
        request.nicOps["node-0"].dev.extend(devs)
        request.nicOps["node-0"].op.extend([True] * len(devs))
        assert RecoverStub(channel).SwitchNicTrack(request, timeout=5).code == 0
    finally:
        channel.close()


# -- hook failures are logged with their traceback -------------------------------------------------


def deep_inside_the_driver(order: SwitchOrder) -> bool:
    raise RuntimeError("HCCL link switch failed (error 7)")


def failing_switch(order: SwitchOrder) -> bool:
    return deep_inside_the_driver(order)


def test_a_hook_that_raises_on_the_parked_thread_is_logged_once_at_error_with_its_traceback(
        sim: Simulator, caplog: Any) -> None:
    caplog.set_level(logging.INFO)
    barrier = threading.Barrier(1, timeout=30)
    agent = SwitchAgent(server=sim.address, job_id=MR_JOB, pause="agent", switch_hook=failing_switch,
                        reconnect_initial_s=0.02, reconnect_max_s=0.1)
    trainer = Trainer(agent, barrier)
    try:
        agent.start()
        trainer.thread.start()
        assert sim.wait_until(mr_streams_ready, 10)
        assert trainer.wait_step(2)
        _switch(sim, ("0",))
        assert sim.wait_until(lambda s: len(s.job_view(MR_JOB).replies) >= 1, 20)
        assert sim.job_view(MR_JOB).replies == [False]
        with_traceback = [r for r in caplog.records if r.levelno == logging.ERROR and r.exc_info]
        assert len(with_traceback) == 1, [r.getMessage() for r in with_traceback]
        assert "switch hook raised on order #1" in with_traceback[0].getMessage()
        assert "deep_inside_the_driver" in caplog.text and "HCCL link switch failed (error 7)" in caplog.text
    finally:
        trainer.stop.set()
        barrier.abort()
        agent.stop()


@pytest.mark.parametrize("runner", [HookRunner, InlineRunner])
def test_both_runners_log_a_raising_hook_once_with_its_traceback(caplog: Any, runner: type[HookRunner]) -> None:
    """HookRunner: mode external (hooks on a thread of their own); InlineRunner: the parked thread."""
    order = SwitchOrder(seq=4, job_id="j", ranks=(1,), ops=(True,))
    execution = execute_order(order, runner=runner(), switch_hook=failing_switch, checkpoint_hook=None,
                              guard_timeout_s=5, switch_timeout_s=5, dry_run=False)
    assert not execution.ok and execution.reason == "switch hook raised RuntimeError: HCCL link switch failed (error 7)"
    records = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(records) == 1 and records[0].exc_info is not None
    assert "deep_inside_the_driver" in caplog.text


@pytest.mark.parametrize("runner", [HookRunner, InlineRunner])
def test_a_guard_that_refuses_on_purpose_is_a_failure_without_a_traceback(
        caplog: Any, runner: type[HookRunner]) -> None:
    """An outside check: a guard's planned refusal (too little free space) was logged at ERROR with a
    traceback on every rank, as if the guard had crashed. A HookRefused (GuardRefused is one) fails
    the order with its words and logs nothing above DEBUG here: the guard logs its own decision,
    and the leader the switch's failure."""
    from nicswitch_agent.hooks import GuardRefused

    def guard(order: SwitchOrder) -> None:
        raise GuardRefused("free space in /ckpt is 512 bytes, below min_free_bytes=1024: not checkpointing step 8")

    caplog.set_level(logging.DEBUG)
    order = SwitchOrder(seq=4, job_id="j", ranks=(1,), ops=(True,))
    execution = execute_order(order, runner=runner(), switch_hook=failing_switch, checkpoint_hook=guard,
                              guard_timeout_s=5, switch_timeout_s=5, dry_run=False)
    assert not execution.ok and execution.switch is None
    assert execution.reason.startswith("checkpoint hook refused: free space in /ckpt is 512 bytes"), execution.reason
    assert [r for r in caplog.records if r.levelno > logging.DEBUG or r.exc_info] == []


def test_keyboard_interrupt_goes_through_the_inline_runner_but_not_through_a_hook_thread() -> None:
    def interrupted(order: SwitchOrder) -> bool:
        raise KeyboardInterrupt

    order = SwitchOrder(seq=1, job_id="j", ranks=(1,), ops=(True,))
    with pytest.raises(KeyboardInterrupt):
        InlineRunner().run("switch", interrupted, order, 5, expect_bool=True)
    # On a hook thread of its own (mode external) it is only that thread's: a false result.
    assert HookRunner().run("switch", interrupted, order, 5, expect_bool=True).status is HookStatus.RAISED


def test_a_librarys_own_base_exception_on_the_parked_thread_is_a_failed_hook_not_a_stop() -> None:
    """Found by an outside check: torch's CheckpointException (a BaseException) from a DCP save
    into a read-only directory stopped training on every rank instead of refusing the switch."""
    class CheckpointException(BaseException):  # as torch.distributed.checkpoint.api's
        pass

    def failing_save(order: SwitchOrder) -> None:
        raise CheckpointException("ranks:dict_keys([1])")

    order = SwitchOrder(seq=2, job_id="j", ranks=(1,), ops=(True,))
    result = InlineRunner().run("checkpoint", failing_save, order, 5, expect_bool=False)
    assert result.status is HookStatus.RAISED, result
    assert result.detail == "checkpoint hook raised CheckpointException: ranks:dict_keys([1])"
    for stop in (KeyboardInterrupt, SystemExit, GeneratorExit):
        def stopping(order: SwitchOrder, stop: type[BaseException] = stop) -> None:
            raise stop()

        with pytest.raises(stop):
            InlineRunner().run("checkpoint", stopping, order, 5, expect_bool=False)


# -- a stop while the executor's reply is on its way ------------------------------------------------


def test_a_stop_while_the_executor_sends_its_reply_ends_the_streams_only_after_it(sim: Simulator) -> None:
    """The Ctrl-C race: the leader's executor has claimed the reply and is sending it when a stop
    (the signal's stop thread, interpreter exit) begins. The stop must not end the process-manage
    stream before that reply is on the wire: ClusterD resets the job when the stream ends, and a
    reply arriving after that is kept and taken as the next switch's result.

    The executor's send is held until the simulator saw the process-manage stream end (or 1 s,
    well within the stop's 20 s bound): a stop that does not wait ends it within that second, and
    the reply then arrives late."""
    agent = SwitchAgent(server=sim.address, job_id=MR_JOB, pause="agent", switch_hook=lambda order: False,
                        reconnect_initial_s=0.02, reconnect_max_s=0.1, stop_timeout_s=20.0)
    trainer = Trainer(agent, threading.Barrier(1, timeout=30))
    sending = threading.Event()

    def stream_ended(s: Simulator) -> bool:
        return any(reason == "SubscribeProcessManageSignal stream ended" for reason in s.job_view(MR_JOB).resets)

    try:
        agent.start()
        trainer.thread.start()
        assert sim.wait_until(mr_streams_ready, 10)
        replier = agent._session.replier  # no public seam holds a reply mid-send
        assert replier is not None
        send = replier.send

        def held_send(*args: Any, **kwargs: Any) -> Any:
            sending.set()
            sim.wait_until(stream_ended, 1.0)
            return send(*args, **kwargs)

        replier.send = held_send  # type: ignore[method-assign]
        _switch(sim, ("0",))
        assert sending.wait(20), "the executor never replied"
        stopper = threading.Thread(target=agent.stop, args=("SIGINT received",))
        stopper.start()
        stopper.join(30)
        assert not stopper.is_alive()
        view = sim.job_view(MR_JOB)
        assert view.replies == [False]
        assert view.violations == [], view.violations
    finally:
        trainer.stop.set()
        agent.stop()
