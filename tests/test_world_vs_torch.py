"""A configured world_size or rank that torch.distributed contradicts is refused at start.

Found by a stranger: ``NICSWITCH_WORLD_SIZE=3`` in a 2-process torchrun job started as the leader
of 3 ranks; the first switch then waited for a rank 2 that does not exist until
``pause_timeout_s``, and ClusterD killed the job. Each case runs in a process of its own with a
real gloo group (world 1: what matters is that torch.distributed is initialised).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch.distributed", reason="needs the torch extra")

SCRIPT = textwrap.dedent("""
    import datetime, sys, tempfile
    import torch.distributed as dist
    from nicswitch_agent import SwitchAgent
    from nicswitch_agent.errors import ConfigError

    store = dist.FileStore(tempfile.mktemp(), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    agent = SwitchAgent(server="127.0.0.1:1", job_id="job-w", pause="external", dry_run=True,
                        rpc_timeout_s=0.5, **eval(sys.argv[1]))
    try:
        agent.start()
    except ConfigError as exc:
        print("REFUSED", exc)
    else:
        print("STARTED", agent.rank, agent.world_size)
        agent.stop("done")
""")


def run(settings: str, **env: str) -> str:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("NICSWITCH_")}
    environment.update(env)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, settings], env=environment, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_a_world_size_from_the_environment_larger_than_torchs_is_refused_naming_the_variable() -> None:
    said = run("{}", NICSWITCH_WORLD_SIZE="3")
    assert said.startswith("REFUSED"), said
    assert "NICSWITCH_WORLD_SIZE" in said and "world_size=3 disagrees with torch.distributed's world_size 1" in said


def test_a_rank_given_as_a_keyword_that_torch_contradicts_is_refused() -> None:
    said = run("{'rank': 0, 'world_size': 2}")
    assert said.startswith("REFUSED") and "world_size=2 disagrees" in said, said


def test_values_that_agree_with_torch_start() -> None:
    assert run("{'rank': 0, 'world_size': 1}") == "STARTED 0 1"
    assert run("{}") == "STARTED 0 1"
