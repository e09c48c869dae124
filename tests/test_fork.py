"""fork() with a live agent: DataLoader workers forked while the agent's streams are open.

The simulator runs in this (pytest) process and the training process is a separate subprocess,
as in a real job (an in-process gRPC server plus fork is unsafe whatever the agent does:
docs/torch-store.md#grpc-and-fork). GRPC_ENABLE_FORK_SUPPORT=false is what docs/operations.md
recommends; the default (unset) is exercised too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")

from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.sim import SimJob, SimSettings, Simulator
from nicswitch_agent.transport import ChannelSettings, RecoverStub, open_channel

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def sim() -> Iterator[Simulator]:
    simulator = Simulator(jobs=[SimJob(job_id="job-fork", nodes={"node-0": ["0", "1"]})],
                          settings=SimSettings(report_timeout_s=30, keepalive_interval_s=0.5), standin=True)
    simulator.start()
    yield simulator
    simulator.stop()


@pytest.mark.parametrize("fork_support", ["false", None], ids=["fork-support-false", "default"])
def test_dataloader_workers_fork_cleanly_and_the_agent_still_switches(sim: Simulator, fork_support: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NICSWITCH_")}
    env.update(NICSWITCH_SERVER=sim.address, NICSWITCH_JOB_ID="job-fork", PYTHONPATH=str(ROOT),
               TORCH_CPP_LOG_LEVEL="ERROR")
    env.pop("GRPC_ENABLE_FORK_SUPPORT", None)
    if fork_support is not None:
        env["GRPC_ENABLE_FORK_SUPPORT"] = fork_support
    proc = subprocess.Popen([sys.executable, "-m", "tests.fork_job.dataloader", "1"], cwd=ROOT, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.strip() == "READY":
                break
        assert lines and lines[-1].strip() == "READY", "".join(lines) + (proc.stderr.read() if proc.stderr else "")
        assert "state=running" in lines[-2]
        assert sim.wait_until(lambda s: s.job_view("job-fork").open_streams.get("SubscribeNotifySwitch", 0) == 1, 10)
        channel = open_channel(ChannelSettings(target=sim.address))
        try:
            stub = RecoverStub(channel)
            request = pb.SwitchNics(jobID="job-fork")
            request.nicOps["node-0"].dev.append("1")
            request.nicOps["node-0"].op.append(True)
            assert stub.SwitchNicTrack(request, timeout=5).code == 0
            messages = [r.msg for r in stub.SubscribeSwitchNicSignal(pb.SwitchNicRequest(jobID="job-fork"),
                                                                      timeout=30)]
        finally:
            channel.close()
        assert messages == ["switch nic finish"]
        out, err = proc.communicate("done\n", timeout=60)
        assert proc.returncode == 0, err
        assert "replies=1 after=done" in out
        assert "Segmentation fault" not in err and "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


