"""Issue 11 §6: ``examples/ddp_train.py --wait-for-switch`` ends under ``nicswitch-agent launch``.

There the leader is the launcher process, so no training rank sees the leader's ``switch_done``;
each rank's member hears the leader's decision instead (``switch_outcome``), and the example waits
for that. Real processes: the launcher, torchrun, two ranks (gloo, CPU), against the simulator.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import poll
from test_launcher import FAST, FINISH, JOB, ROOT, STARTUP_S, Launch, Operator, base_env

from nicswitch_agent.sim import SimJob, Simulator

EXAMPLE = ROOT / "examples" / "ddp_train.py"


@pytest.fixture
def sim() -> Iterator[Simulator]:
    simulator = Simulator(jobs=[SimJob(job_id=JOB, nodes={"node-0": ["0", "1"]})], settings=FAST)
    simulator.start()
    yield simulator
    simulator.stop()


@pytest.mark.timeout(300)
def test_the_ddp_example_waiting_for_a_switch_finishes_under_the_launcher(sim: Simulator, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("numpy")  # torch.distributed.checkpoint
    launch = Launch(tmp_path / "launch", [
        "--", "torchrun", "--standalone", "--nproc-per-node", "2", str(EXAMPLE),
        "--wait-for-switch", "--steps", "20", "--hook", "log", "--checkpoint-dir", str(tmp_path / "ckpt")],
        base_env(sim))
    operator = Operator(sim)
    try:
        # Both members must be up before the pause, or they cannot answer it.
        assert poll(lambda: launch.proc.poll() is not None or all(
            f"started as member: rank {r} of 2" in launch.log() for r in (0, 1)), STARTUP_S)
        assert launch.proc.poll() is None, "the launcher ended before training started"
        launch.remember_tree()
        assert operator.switch(["1", "0"], [True, False]) == FINISH
        code = launch.wait(120)
        assert code == 0, f"the example did not finish after the switch (exit {code})"
    finally:
        operator.close()
        launch.close()
    text = launch.log()
    assert sim.job_view(JOB).replies == [True]
    hooks = re.findall(r"rank (\d): switch #1 at step (\d+)", text)
    assert sorted(r for r, _ in hooks) == ["0", "1"], text[-3000:]
    step = int(hooks[0][1])
    done = re.findall(r"rank (\d): done after (\d+) steps, loss \S+, switches at steps \[(\d+)\]", text)
    assert sorted(r for r, _, _ in done) == ["0", "1"], text[-3000:]
    assert {(int(last), int(at)) for _, last, at in done} == {(step + 21, step)}
