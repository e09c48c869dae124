"""A Store host out of file descriptors: clients give up within ``store_connect_timeout_s`` and say
why, the launcher raises its soft limit or refuses to start, and ``doctor`` reports the limit.

Every Store is a real torch TCPStore, hosted by a child process (or the real launcher) whose
RLIMIT_NOFILE its own code lowers before torch is imported; real Store clients fill it up.
Synchronisation is by the child's output and by polling its /proc fd table with a deadline.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import free_port, poll

torch = pytest.importorskip("torch")

from nicswitch_agent import AgentConfig, SwitchAgent  # noqa: E402
from nicswitch_agent.coordination import fd_budget  # noqa: E402
from nicswitch_agent.errors import ConfigError  # noqa: E402
from nicswitch_agent.sim import SimJob, Simulator  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
JOB = "job-fd"
SOFT = 64  # small enough to fill in well under a second
# Runs `argv` (a Python module or script and its arguments) with RLIMIT_NOFILE = (soft, hard).
WITH_LIMIT = ("import resource, runpy, sys; soft, hard = int(sys.argv[1]), int(sys.argv[2]); "
              "resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)); mod, sys.argv = sys.argv[3], sys.argv[3:]; "
              "runpy.run_module(mod, run_name='__main__', alter_sys=True) if not mod.endswith('.py') "
              "else runpy.run_path(mod, run_name='__main__')")
HOST = r"""
import datetime, sys
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
print(store.port, flush=True)
sys.stdin.read()  # until the test closes our stdin
"""


def with_limit(soft: int, hard: int, target: str, *args: str) -> list[str]:
    return [sys.executable, "-c", WITH_LIMIT, str(soft), str(hard), target, *args]


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture(scope="module")
def full_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, list[Any]]]:
    """A TCPStore hosted by a child whose soft limit is SOFT, with every descriptor taken by a client.

    Yields (port, the clients): the first client keeps a 30-minute timeout, like the job's default
    Store (the process group's timeout).
    """
    script = tmp_path_factory.mktemp("fd") / "host_store.py"
    script.write_text(HOST)
    _, hard = fd_budget.nofile_limits()
    host = subprocess.Popen(with_limit(SOFT, hard, str(script)), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"})
    clients: list[Any] = []
    try:
        assert host.stdout is not None
        port = int(host.stdout.readline())
        for minutes in (30.0, 1.0):  # the "default store" client, then the one the others are cloned from
            clients.append(torch.distributed.TCPStore("127.0.0.1", port, None, False,
                                                      datetime.timedelta(minutes=minutes), wait_for_workers=False))
        # A client returns once the host has answered it, so the host has accepted it by then.
        for _ in range(SOFT - open_fds(host.pid)):  # exactly the descriptors it has left
            clients.append(clients[1].clone())
        assert poll(lambda: open_fds(host.pid) == SOFT, 10), open_fds(host.pid)
        yield port, clients
    finally:
        clients.clear()
        host.kill()
        host.wait(10)


def member_config(**settings: Any) -> AgentConfig:
    return AgentConfig(server="127.0.0.1:1", job_id=JOB, handle_signals=False, dry_run=True, **settings)


# -- clients ----------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_member_of_a_full_launcher_store_gives_up_within_the_bound_and_names_the_limit(
        full_store: tuple[int, list[Any]]) -> None:
    """Before: a bare "Broken pipe"/"Connection reset by peer" after at least 30 s, whatever was set."""
    port = full_store[0]
    agent = SwitchAgent(config=member_config(leader="launcher", store_address=f"127.0.0.1:{port}", rank=1,
                                             world_size=500, store_connect_timeout_s=1.0))
    with pytest.raises(ConfigError) as caught:
        agent.start()
    message = str(caught.value)
    assert f"the Store at store_address (127.0.0.1:{port}) within store_connect_timeout_s=1 " in message
    assert "out of file descriptors (RLIMIT_NOFILE)" in message
    assert "For 500 ranks it needs about 1,128" in message  # 2 per rank + 128
    assert "`ulimit -n 1128`" in message
    assert agent.status()["state"] == "created"  # nothing left running; start() may be retried


@pytest.mark.timeout(60)
def test_a_member_on_the_jobs_full_default_store_gives_up_within_the_bound_not_the_pg_timeout(
        full_store: tuple[int, list[Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's clone() of the default store retries for the process group's timeout (30 min here)."""
    dist = torch.distributed
    clients = full_store[1]
    dist.init_process_group("gloo", store=clients[0], rank=0, world_size=1, timeout=datetime.timedelta(minutes=30))
    # Rank 1 of 300 as torch.distributed says it too (a real group of 300 cannot run here): the
    # agent refuses a configured rank or world size that torch.distributed contradicts.
    monkeypatch.setattr(dist, "get_world_size", lambda *args, **kwargs: 300)
    monkeypatch.setattr(dist, "get_rank", lambda *args, **kwargs: 1)
    try:
        agent = SwitchAgent(config=member_config(rank=1, world_size=300, store_connect_timeout_s=1.0))
        with pytest.raises(ConfigError) as caught:
            agent.start()
    finally:
        dist.destroy_process_group()
    message = str(caught.value)
    assert "cannot connect to the job's torch Store (127.0.0.1:" in message
    assert "out of file descriptors" in message and "For 300 ranks it needs about 1,028" in message  # 3 per rank


def test_a_store_nobody_serves_is_named_as_such() -> None:
    with pytest.raises(ConfigError, match=r"within store_connect_timeout_s=0.5 .*: nothing answered there") as caught:
        fd_budget.StoreClient("127.0.0.1", free_port(), 0.5, 2, connect=True)
    assert "file descriptors" not in str(caught.value)


def test_a_connect_that_timed_out_against_a_listening_host_names_the_descriptor_limit() -> None:
    """Under load, a full host's resets land inside torch's connect loop, which retries them and then
    says "timed out ... while trying to connect", the words it also uses when nothing listens (seen in
    CI). A plain TCP connect tells the two apart: here torch's real words, and a host that listens."""
    with pytest.raises(RuntimeError, match="while trying to connect") as refused:
        torch.distributed.TCPStore("127.0.0.1", free_port(), None, False, datetime.timedelta(seconds=0.3),
                                   wait_for_workers=False)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        message = fd_budget.explain_store_connect_failure(refused.value, "127.0.0.1", port, 0.3, 500,
                                                          torch_store=False)
    assert "Something listens there but the Store did not answer" in message
    assert "out of file descriptors (RLIMIT_NOFILE)" in message and "For 500 ranks it needs about 1,128" in message


def test_a_host_that_accepts_and_never_answers_is_given_up_on_within_the_bound() -> None:
    """torch bounds the connect, not the exchange after it: without the bounded dial, start() hangs."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)  # the kernel completes the handshake; nobody accepts, nobody answers
        with pytest.raises(ConfigError, match=r"within store_connect_timeout_s=0.2 \(no answer from torch's connect "
                                              r"within 3.2 s\)\. Something listens there but the Store did not "
                                              r"answer: .* \(or it is frozen or stopped"):
            fd_budget.StoreClient("127.0.0.1", listener.getsockname()[1], 0.2, 2, connect=True)
    # Closing the listener resets the abandoned dial, whose thread then ends (not at interpreter exit).
    assert poll(lambda: not any(t.name == "nicswitch-store-dial" for t in threading.enumerate()), 30)


# -- the launcher -----------------------------------------------------------------------------

CONNECT = r"""
import datetime, os, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)  # our own side
from torch.distributed import TCPStore
host, _, port = os.environ["NICSWITCH_STORE_ADDRESS"].rpartition(":")
clients = []
for i in range(int(sys.argv[1])):  # as many connections as the ranks would hold
    # 30 s: the Store's host does a reverse-DNS lookup per connection, which can stall it for 5 s
    clients.append(TCPStore(host, int(port), None, False, datetime.timedelta(seconds=30), wait_for_workers=False))
    clients[-1].set(f"probe/{i}", "x")
assert clients[0].get(f"probe/{len(clients) - 1}") == b"x"
print("connected", len(clients), flush=True)
"""


@pytest.fixture
def sim() -> Iterator[Simulator]:
    simulator = Simulator(jobs=[SimJob(job_id=JOB, nodes={"node-0": ["0", "1"]})])
    simulator.start()
    yield simulator
    simulator.stop()


def launch(sim: Simulator, soft: int, hard: int, world: int, *command: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NICSWITCH_", "PET_", "TORCHELASTIC_"))}
    env.update({"NICSWITCH_SERVER": sim.address, "NICSWITCH_JOB_ID": JOB, "NICSWITCH_PAUSE": "external",
                "TORCH_CPP_LOG_LEVEL": "ERROR", "PYTHONUNBUFFERED": "1"})
    argv = with_limit(soft, hard, "nicswitch_agent.ops.launcher", "--world-size", str(world), "--", *command)
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=100,
                          start_new_session=True)


@pytest.mark.timeout(120)
def test_the_launcher_raises_its_soft_limit_for_the_ranks_it_hosts(sim: Simulator, tmp_path: Path) -> None:
    """At soft 40 the launcher (about 21 descriptors of its own) drops about the 20th connection;
    20 ranks need 168 descriptors."""
    script = tmp_path / "connect.py"
    script.write_text(CONNECT)
    done = launch(sim, 40, 4096, 20, sys.executable, str(script), "40")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "connected 40" in done.stdout
    assert ("raised the soft file-descriptor limit (RLIMIT_NOFILE) from 40 to 168 (hard 4,096): the Store of 20 "
            "ranks needs 2 per rank + 128") in done.stderr
    assert done.stderr.count("raised the soft file-descriptor limit") == 1


@pytest.mark.timeout(120)
def test_the_launcher_refuses_to_start_when_even_the_hard_limit_is_too_low(sim: Simulator, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    done = launch(sim, SOFT, 128, 100, sys.executable, "-c", f"open({str(marker)!r}, 'w')")
    assert done.returncode == 2, done.stdout + done.stderr
    assert not marker.exists(), "the training command ran"
    assert ("the Store for world_size=100 needs 328 file descriptors (2 per rank + 128), but this process's limit "
            "(RLIMIT_NOFILE) is soft 64, hard 128") in done.stderr
    assert "raise the container's nofile limit to at least 328" in done.stderr
    assert sum(sim.job_view(JOB).stream_opens.values()) == 0  # no ClusterD client was started


# -- doctor -----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("hard", "env", "ok", "fragments"), [
    (4096, {}, False, ["soft 64, hard 4,096: the job's Store for 100 ranks needs 428 (3 per rank + 128)",
                       "after about 0 ranks", "`ulimit -n 428`"]),
    (4096, {"NICSWITCH_LEADER": "launcher"}, True,
     ["the launcher's Store for 100 ranks needs 328: the launcher raises its soft limit"]),
    (128, {"NICSWITCH_LEADER": "launcher"}, False,
     ["needs 328 (2 per rank + 128), more than the launcher may open", "nofile limit to at least 328"]),
], ids=["torchrun-soft-too-low", "launcher-raises", "launcher-hard-too-low"])
def test_doctor_reports_the_limit_and_what_the_job_needs(hard: int, env: dict[str, str], ok: bool,
                                                         fragments: list[str]) -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("NICSWITCH_", "WORLD_SIZE"))}
    argv = with_limit(SOFT, hard, "nicswitch_agent.ops.cli", "doctor", "--world-size", "100", "--json")
    done = subprocess.run(argv, cwd=ROOT, env={**base, **env}, capture_output=True, text=True, timeout=50)
    checks = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
    check = checks["file descriptors"]
    assert check["ok"] is ok, check
    for fragment in fragments:
        assert fragment in check["detail"]


def test_the_budget_arithmetic() -> None:
    assert fd_budget.descriptors_needed(16_384) == 16_384 * fd_budget.STORE_SOCKETS_PER_RANK + fd_budget.HOST_MARGIN
    assert fd_budget.descriptors_needed(1000, torch_store=True) == 3128
    assert fd_budget.ranks_within(1024, torch_store=True) == 298  # measured: ~340 with torch's own connection
    assert fd_budget.ranks_within(fd_budget.descriptors_needed(777)) == 777
