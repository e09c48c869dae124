"""fork() beside a live leader: DataLoader workers forked, epoch after epoch, while the agent switches.

The simulator runs in this (pytest) process and the training process is a separate subprocess,
as in a real job (an in-process gRPC server plus fork is a different, unsupported layout:
docs/torch-store.md#grpc-and-fork). The
training process gets grpcio's default environment (GRPC_ENABLE_FORK_SUPPORT unset): the library
itself must make the forks safe (docs/operations.md, Fork and DataLoader workers). Without that, a
worker died ("DataLoader worker ... exited unexpectedly", a SIGSEGV) within a few epochs in every
run: the forks only break while the leader's gRPC threads are busy, which is why switches are
driven throughout and why it takes many forks, not one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")

from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.clusterd.channel import ChannelSettings, RecoverStub, open_channel
from nicswitch_agent.sim import SimJob, SimSettings, Simulator

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parent.parent
JOB = "job-fork"
EPOCHS = 40  # 80 forks; without the fix a worker died by epoch 5 in every run
MIN_REPLIES = 30  # switches answered while forking, so the forks meet a busy leader


@pytest.fixture
def sim() -> Iterator[Simulator]:
    simulator = Simulator(jobs=[SimJob(job_id=JOB, nodes={"node-0": ["0", "1"]})],
                          settings=SimSettings(report_timeout_s=30, keepalive_interval_s=0.5), standin=True)
    simulator.start()
    yield simulator
    simulator.stop()


class SwitchDriver(threading.Thread):
    """Plays the operator: one switch after another (alternating switch and switchback) until stopped."""

    def __init__(self, sim: Simulator) -> None:
        super().__init__(name="test-switch-driver", daemon=True)
        self.sim = sim
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        channel = open_channel(ChannelSettings(target=self.sim.address))
        try:
            stub = RecoverStub(channel)
            on = True
            while not self.stopping.is_set():
                if not self.sim.wait_idle(JOB, 0.5):
                    continue
                flows = len(self.sim.job_view(JOB).path_history)
                request = pb.SwitchNics(jobID=JOB)
                request.nicOps["node-0"].dev.append("0")  # rank 0: the job is this one process
                request.nicOps["node-0"].op.append(on)
                status = stub.SwitchNicTrack(request, timeout=10)
                assert status.code == 0, status
                on = not on
                # Wait for the flow to end: the reply taken and training continued (or, rarely, the
                # simulator's MindIO stand-in resubscribing late and resetting it before the list).
                deadline = time.monotonic() + 30
                while not self.sim.wait_until(lambda s, n=flows: len(s.job_view(JOB).path_history) > n, 0.5):
                    if self.stopping.is_set():
                        return  # the job is gone: the test reports why
                    assert time.monotonic() < deadline, self.sim.job_view(JOB)
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            channel.close()


def test_dataloader_workers_forked_beside_a_switching_leader_survive_with_grpcs_default_env(sim: Simulator) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NICSWITCH_", "GRPC_"))}
    env.update(NICSWITCH_SERVER=sim.address, NICSWITCH_JOB_ID=JOB, PYTHONPATH=os.pathsep.join([str(ROOT / "src"),
               str(ROOT)]), TORCH_CPP_LOG_LEVEL="ERROR")
    proc = subprocess.Popen([sys.executable, "-m", "tests.fork_job.dataloader", str(EPOCHS), str(MIN_REPLIES)],
                            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    driver = SwitchDriver(sim)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert sim.wait_until(lambda s: s.job_view(JOB).open_streams.get("SubscribeNotifySwitch", 0) == 1, 30)
        driver.start()
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.strip() == "READY":
                break
        driver.stopping.set()
        driver.join(60)
        if lines and lines[-1].strip() == "READY":  # the job lives: let the switch under way finish
            assert sim.wait_until(lambda s: s.job_view(JOB).state == "INIT", 30), sim.job_view(JOB)
        lists = len(sim.job_view(JOB).lists_sent)
        out, err = proc.communicate(f"done {lists}\n", timeout=60)
        report = "".join(lines) + out + "\n" + err[-3000:]
        assert proc.returncode == 0, report  # a worker that died: "DataLoader worker (pid(s) ...) exited unexpectedly"
        assert "exited unexpectedly" not in err and "Segmentation fault" not in err and "Traceback" not in err, report
        assert not driver.is_alive() and driver.error is None, driver.error
        epochs, _, replies_while_forking, state = (part.split("=")[1] for part in lines[-2].split())
        assert int(epochs) >= EPOCHS and int(replies_while_forking) >= MIN_REPLIES, report
        assert state in ("running", "switching"), report
        # Every list ClusterD sent was answered, true, and counted by the agent.
        assert sim.job_view(JOB).replies == [True] * lists, sim.job_view(JOB)
        assert f"replies={lists} driven={lists}" in out, report
    finally:
        driver.stopping.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
