"""The plain loop: ``enumerate_steps`` and the DDP example (``examples/ddp_train.py``).

The example runs as a user would run it, under ``torchrun --standalone --nproc-per-node 2`` (CPU,
gloo), against the simulator in this process: an operator switch arrives mid-run, both ranks park
at the same step, checkpoint together (TorchCheckpointGuard over torch.distributed.checkpoint),
run the switch hook with the same arguments, and training finishes with exit code 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support import poll, streams_ready

from nicswitch_agent import TrainingStopped
from nicswitch_agent.integrations import enumerate_steps

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "ddp_train.py"
JOB = "job-example"


class Agent:
    def __init__(self, stop_at: int | None = None) -> None:
        self.log: list[Any] = []
        self.stop_at = stop_at

    def step(self, step: int | None = None) -> None:
        self.log.append(("boundary", step))
        if step == self.stop_at:
            raise TrainingStopped("ClusterD chose exit after a failed switch")


def test_enumerate_steps_marks_the_boundary_after_each_step_body() -> None:
    agent = Agent()
    for step, item in enumerate_steps(agent, "abc", start=1):
        agent.log.append(("body", step, item))
    assert agent.log == [("body", 1, "a"), ("boundary", 1), ("body", 2, "b"), ("boundary", 2),
                         ("body", 3, "c"), ("boundary", 3)]


def test_enumerate_steps_counts_from_zero_like_enumerate_and_break_leaves_the_step_unmarked() -> None:
    agent = Agent()
    for step, _ in enumerate_steps(agent, range(10)):
        if step == 2:
            break
    assert agent.log == [("boundary", 0), ("boundary", 1)]


def test_training_stopped_comes_out_of_the_for_statement() -> None:
    agent = Agent(stop_at=2)
    seen = []
    with pytest.raises(TrainingStopped):
        for step, _ in enumerate_steps(agent, range(10), start=1):
            seen.append(step)
    assert seen == [1, 2]


def test_importing_the_integrations_imports_no_framework() -> None:
    code = ("import sys, nicswitch_agent.integrations as i; "
            "loaded = [m for m in ('torch', 'lightning', 'pytorch_lightning', 'transformers') if m in sys.modules]; "
            "assert not loaded, loaded; assert 'NicSwitchCallback' in dir(i) and i.__all__ == ['enumerate_steps']")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


# -- the DDP example under torchrun ------------------------------------------------------------


@pytest.fixture
def torchrun(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []

    def run(server: str, *args: str) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("NICSWITCH_", "PYTEST_"))}
        env.update({"NICSWITCH_SERVER": server, "NICSWITCH_JOB_ID": JOB, "NICSWITCH_PAUSE": "agent",
                    "NICSWITCH_RECONNECT_INITIAL_S": "0.02", "NICSWITCH_RECONNECT_MAX_S": "0.1",
                    "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR", "PYTHONUNBUFFERED": "1"})
        out = open(tmp_path / "torchrun.out", "wb")  # noqa: SIM115 - the child owns it
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(EXAMPLE),
             *args], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)
        out.close()
        procs.append(proc)
        return proc

    yield run
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    output = tmp_path / "torchrun.out"
    if output.exists():  # shown by pytest when the test failed
        print(output.read_text(errors="replace")[-6000:])


@pytest.mark.timeout(90)
def test_ddp_example_two_ranks_switch_mid_run_and_exit_0(torchrun: Any, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("numpy")  # torch.distributed.checkpoint
    from nicswitch_agent._pb import recover_pb2 as pb
    from nicswitch_agent.clusterd.channel import ChannelSettings, RecoverStub, open_channel
    from nicswitch_agent.sim import SimJob, SimSettings, Simulator

    settings = SimSettings(report_timeout_s=30.0, keepalive_interval_s=0.5, fault_flush_s=0.01,
                           force_release_s=0.01, schedule_wait_s=0.01, restart_wait_s=0.01, shuffle_nodes=False)
    with Simulator(jobs=[SimJob(job_id=JOB, nodes={"node-0": ["0", "1"]})], settings=settings) as sim:
        proc = torchrun(sim.address, "--wait-for-switch", "--steps", "20", "--checkpoint-dir", str(tmp_path / "ckpt"))
        output = tmp_path / "torchrun.out"

        assert poll(lambda: streams_ready(sim, JOB) or proc.poll() is not None, 60) and proc.poll() is None, (
            "the example did not start")
        channel = open_channel(ChannelSettings(target=sim.address))
        try:
            request = pb.SwitchNics(jobID=JOB)
            request.nicOps["node-0"].dev.extend(["1", "0"])
            request.nicOps["node-0"].op.extend([True, False])
            stub = RecoverStub(channel)
            assert stub.SwitchNicTrack(request, timeout=5).code == 0
            messages = [r.msg for r in stub.SubscribeSwitchNicSignal(pb.SwitchNicRequest(jobID=JOB), timeout=40)]
        finally:
            channel.close()
        assert messages[:1] == ["switch nic finish"]
        assert poll(lambda: proc.poll() is not None, 40), "the example did not finish after the switch"
        assert proc.returncode == 0
        view = sim.job_view(JOB)
        assert view.replies == [True] and view.violations == []

    text = output.read_text(errors="replace")
    hooks = re.findall(r"rank (\d): switch #1 at step (\d+): ranks \[(.*?)\] -> \[(.*?)\]", text)
    assert sorted(h[0] for h in hooks) == ["0", "1"], text[-3000:]
    assert len({h[1:] for h in hooks}) == 1, f"ranks disagree: {hooks}"  # same step, same full list
    step = int(hooks[0][1])
    assert hooks[0][2:] == ("1, 0", "'standby', 'primary'")
    done = re.findall(r"rank (\d): done after (\d+) steps, loss \S+, switches at steps \[(\d+)\]", text)
    assert sorted(r for r, _, _ in done) == ["0", "1"], text[-3000:]
    assert {(int(last), int(at)) for _, last, at in done} == {(step + 21, step)}  # the same last step on both
    saved = tmp_path / "ckpt" / f"step-{step}"
    assert (saved / ".metadata").is_file()
    assert json.loads((saved / "nicswitch.json").read_text())["world_size"] == 2
