"""A configured world_size or rank that torch.distributed contradicts is refused at start.

Found by a stranger: ``NICSWITCH_WORLD_SIZE=3`` in a 2-process torchrun job started as the leader
of 3 ranks; the first switch then waited for a rank 2 that does not exist until
``pause_timeout_s``, and ClusterD killed the job. The cases run in one process of their own with a
real gloo group (world 1: what matters is that torch.distributed is initialised).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch.distributed", reason="needs the torch extra")

CASES = [  # (environment, keywords)
    ({"NICSWITCH_WORLD_SIZE": "3"}, {}),
    ({}, {"rank": 0, "world_size": 2}),
    ({}, {"rank": 0, "world_size": 1}),
    ({}, {}),
]

SCRIPT = textwrap.dedent("""
    import datetime, json, os, sys, tempfile
    import torch.distributed as dist
    from nicswitch_agent import SwitchAgent
    from nicswitch_agent.errors import ConfigError

    store = dist.FileStore(tempfile.mktemp(), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    said = []
    for env, keywords in json.loads(sys.argv[1]):
        os.environ.update(env)
        agent = SwitchAgent(server="127.0.0.1:1", job_id="job-w", pause="external", dry_run=True,
                            rpc_timeout_s=0.5, **keywords)
        try:
            agent.start()
        except ConfigError as exc:
            said.append(f"REFUSED {exc}")
        else:
            said.append(f"STARTED {agent.rank} {agent.world_size}")
            agent.stop("done")
        for name in env:
            del os.environ[name]
    print(json.dumps(said))
""")


@pytest.fixture(scope="module")
def said() -> list[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("NICSWITCH_")}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(CASES)], env=environment, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    answers = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(answers) == len(CASES), answers
    return list(answers)


def test_a_world_size_from_the_environment_larger_than_torchs_is_refused_naming_the_variable(said: list[str]) -> None:
    assert said[0].startswith("REFUSED"), said[0]
    assert "NICSWITCH_WORLD_SIZE='3': world_size=3 disagrees with torch.distributed's world_size 1" in said[0]


def test_a_world_size_given_as_a_keyword_that_torch_contradicts_is_refused(said: list[str]) -> None:
    assert said[1].startswith("REFUSED") and "world_size=2 disagrees" in said[1], said[1]


def test_values_that_agree_with_torch_start(said: list[str]) -> None:
    assert said[2:] == ["STARTED 0 1", "STARTED 0 1"]
