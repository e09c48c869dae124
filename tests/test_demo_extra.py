"""``nicswitch-agent demo`` as a stranger runs it, following the README literally.

Real processes of the real command line (``python -m nicswitch_agent demo ...``), the real embedded
simulator or one on a free port: settings and options the demo would otherwise silently ignore
(NICSWITCH_PAUSE, the join options without ``--server``), gRPC core's raw log lines on the terminal,
and what Ctrl-C leaves on it.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest
from support import free_port, poll

from nicswitch_agent.sim import SimJob, Simulator

JOB = "job-demo-extra"
# gRPC core's own log line (absl's format): I1206 06:03:29.254735   26270 chttp2_transport.cc:1403] ...
RAW_GRPC_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+\.cc:\d+\]", re.MULTILINE)
ERROR_PREFIX = "nicswitch-agent demo: error: "


def demo(*args: str) -> list[str]:
    return [sys.executable, "-m", "nicswitch_agent", "demo", *args]


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without the agent's or gRPC's settings (the shell running the tests may have
    some), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NICSWITCH_", "GRPC_"))}
    env.update(extra)
    return env


def default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # as in a terminal, even under a runner that ignores it


class Lines:
    """A child's stream, read on a thread into lines, so the test can wait for one."""

    def __init__(self, stream: IO[str] | None) -> None:
        assert stream is not None
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._ended = False
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def wait_for(self, text: str, timeout: float = 60) -> bool:
        """True once a line holding ``text`` was read; False when the stream ended (or the time ran out) first."""
        with self._cond:
            self._cond.wait_for(lambda: self._ended or any(text in line for line in self.lines), timeout)
            return any(text in line for line in self.lines)

    def text(self) -> str:
        self._thread.join(30)
        return "".join(self.lines)


@contextlib.contextmanager
def started(command: list[str], env: dict[str, str]) -> Iterator[tuple[subprocess.Popen[str], Lines, Lines]]:
    """The command running, with its stdout and stderr read into lines; killed if the test left it running."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=default_sigint)
    try:
        yield proc, Lines(proc.stdout), Lines(proc.stderr)
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(30)


def run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(demo(*args), capture_output=True, text=True, timeout=60, env=env, check=False)


@pytest.fixture
def sim() -> Iterator[Simulator]:
    simulator = Simulator(jobs=[SimJob(job_id=JOB, nodes={"node-0": ["0", "1"]})])
    simulator.start()
    yield simulator
    simulator.stop()


# -- 1. NICSWITCH_PAUSE -----------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args", [[], ["--server", "127.0.0.1:1", "--timeout", "2"]], ids=["embedded", "server"])
def test_nicswitch_pause_external_is_refused_in_one_line_that_says_what_to_do(args: list[str]) -> None:
    """The demo's job parks its ranks itself (pause mode agent): a shell left with NICSWITCH_PAUSE=external
    (quickstart section 3) used to get an agent-mode demo, silently."""
    result = run(*args, env=clean_env(NICSWITCH_PAUSE="External"))
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"{ERROR_PREFIX}NICSWITCH_PAUSE=External asks for pause mode external, but the "
                               "demo's job runs in pause mode agent only"), lines
    assert "unset NICSWITCH_PAUSE (or set it to agent)" in lines[0]
    assert result.stdout == ""


@pytest.mark.timeout(60)
def test_a_misspelt_nicswitch_pause_is_refused_as_the_agent_refuses_it() -> None:
    result = run(env=clean_env(NICSWITCH_PAUSE="extrnal"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip() == (f"{ERROR_PREFIX}NICSWITCH_PAUSE='extrnal': pause='extrnal' is not supported; "
                                     "choose one of auto, agent, external; did you mean 'external'?")
    assert result.stdout == ""


# -- 2. options the chosen demo would ignore ------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("args", "message"), [
    (["--switches", "3"], "--switches needs --server (it is for the job joining a running ClusterD; "
                          "without --server the demo runs its own simulator and operator)"),
    (["--background"], "--background needs --server (it is for the job joining a running ClusterD; "
                       "without --server the demo runs its own simulator and operator)"),
    (["--job", "j", "--timeout", "5"], "--job and --timeout need --server (they are for the job joining a running "
                                       "ClusterD; without --server the demo runs its own simulator and operator)"),
    (["--server", "127.0.0.1:1", "--timeout", "1", "--processes"],
     "--processes cannot be used with --server (the joining job runs its ranks as threads and writes no "
     "timeline page)"),
])
def test_an_option_the_chosen_demo_would_ignore_is_a_usage_error(args: list[str], message: str) -> None:
    result = run(*args, env=clean_env())
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip() == ERROR_PREFIX + message
    assert result.stdout == ""


# -- 3. gRPC core's own log lines -------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_grpc_core_lines_stay_off_the_terminal_unless_the_user_sets_grpc_verbosity(sim: Simulator) -> None:
    """TLS against the plaintext simulator makes gRPC core log every failed handshake at INFO, before the
    agent's own WARNING for the same attempt: a sure trigger for a raw ``I1206 ... .cc:NNNN]`` line.
    Quiet by default; a GRPC_VERBOSITY the user set is theirs."""
    for verbosity, raw_lines in ((None, False), ("INFO", True)):
        env = clean_env(NICSWITCH_TLS="true", **({"GRPC_VERBOSITY": verbosity} if verbosity else {}))
        with started(demo("--server", sim.address, "--job", JOB), env) as (proc, _, err):
            assert err.wait_for("cannot connect to ClusterD, waiting for it"), err.text()
            proc.send_signal(signal.SIGINT)
            assert proc.wait(60) == 130, err.text()
            said = err.text()
        assert bool(RAW_GRPC_LINE.search(said)) is raw_lines, (verbosity, said)
        assert ("Handshake failed" in said) is raw_lines, said


@pytest.mark.timeout(90)
def test_the_operator_commands_keep_grpc_core_lines_off_too(sim: Simulator) -> None:
    """`switch` with TLS against the plaintext simulator says "Is the server plaintext?" itself; the
    raw handshake line gRPC core logs at INFO is noise beside it, unless the user asked for it."""
    switch = [sys.executable, "-m", "nicswitch_agent", "switch", "--server", sim.address, "--job", JOB,
              "--node", "node-0", "--dev", "0", "--op", "standby"]
    for verbosity, raw_lines in ((None, False), ("INFO", True)):
        env = clean_env(NICSWITCH_TLS="true", **({"GRPC_VERBOSITY": verbosity} if verbosity else {}))
        done = subprocess.run(switch, capture_output=True, text=True, timeout=60, env=env, check=False)
        assert done.returncode == 6, done.stdout + done.stderr
        assert "Is the server plaintext?" in done.stderr, done.stderr
        assert bool(RAW_GRPC_LINE.search(done.stderr)) is raw_lines, (verbosity, done.stderr)


def rank_environ(parent: int) -> dict[str, str] | None:
    """The environment a rank process of ``parent`` was started with, once one has exec'd (None: none yet)."""
    for children in glob.glob(f"/proc/{parent}/task/*/children"):
        with contextlib.suppress(OSError):
            for pid in Path(children).read_text().split():
                if b"nicswitch_agent.demo.processes" in Path(f"/proc/{pid}/cmdline").read_bytes():  # exec'd
                    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                    return dict(e.decode(errors="replace").partition("=")[::2] for e in entries if e)
    return None


@pytest.mark.timeout(90)
def test_the_rank_processes_start_with_the_quiet_default() -> None:
    """``run_demo(processes=True)`` from a program (no command line to set it first): its ranks, which
    import grpc themselves, still get GRPC_VERBOSITY=ERROR. Ctrl-C once a rank runs ends the demo with 130."""
    pytest.importorskip("torch")
    code = ("import sys; from nicswitch_agent.demo import run_demo; "
            "sys.exit(run_demo(sys.stdout, ranks=1, processes=True))")
    with started([sys.executable, "-c", code], clean_env()) as (proc, out, err):
        assert out.wait_for("starting the rank processes"), out.text() + err.text()
        environ = poll(lambda: rank_environ(proc.pid), 60)
        assert environ is not None, out.text() + err.text()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130, out.text() + err.text()
    assert environ.get("GRPC_VERBOSITY") == "ERROR", sorted(environ)
    assert "demo interrupted after 0 of 2 switches" in out.text()


# -- 4. Ctrl-C ---------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_ctrl_c_soon_after_the_start_prints_the_timeline_so_far_and_exits_130() -> None:
    """Before: the banner alone, then 130. Now the timeline lines so far and how many switches were done."""
    with started(demo(), clean_env()) as (proc, out, err):
        assert out.wait_for("nicswitch-agent demo: ClusterD simulator"), out.text() + err.text()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130, out.text() + err.text()
        text = out.text()
    assert re.search(r"^ +\d+\.\d ms  demo +interrupted \(Ctrl-C\): the job and the simulator stopped$", text,
                     re.MULTILINE), text
    assert re.search(r"^demo interrupted after [0-2] of 2 switches", text, re.MULTILINE), text
    assert "demo succeeded" not in text and "Traceback" not in err.text()


@pytest.mark.timeout(90)
def test_ctrl_c_while_the_background_job_waits_for_clusterd_stops_it_and_says_so(tmp_path: Path) -> None:
    """``demo --background`` waits for its child to register; nothing listens at --server. Ctrl-C used to
    end the command without a word and leave the child waiting (up to --timeout) unseen."""
    env = clean_env(TMPDIR=str(tmp_path))  # where the child's log goes (mkstemp), so the test can read it

    def child_waits() -> bool:
        return any("waiting for it" in log.read_text() for log in tmp_path.glob("nicswitch-demo-*.log"))

    with started(demo("--server", f"127.0.0.1:{free_port()}", "--job", JOB, "--background", "--timeout", "30"),
                 env) as (proc, out, err):
        assert poll(child_waits, 60), err.text()
        proc.send_signal(signal.SIGINT)  # to this process alone, as `kill -INT`: the child must be stopped by it
        assert proc.wait(60) == 130, out.text() + err.text()
        said = err.text()
    found = re.search(rf"^nicswitch-agent demo: interrupted \(Ctrl-C\) before the background job {JOB} was ready; "
                      r"stopped it \(pid (\d+), exit 130; log: \S+\)$", said, re.MULTILINE)
    assert found, said
    assert f"nicswitch-agent demo: SIGINT before job {JOB} registered" in said  # the child's log, copied
    assert not Path(f"/proc/{found.group(1)}").exists()  # stopped, and reaped by the command


def background_job(parent: int) -> int | None:
    """The pid of ``parent``'s background job (``python -m nicswitch_agent demo ...``) once it has exec'd."""
    for children in glob.glob(f"/proc/{parent}/task/*/children"):
        with contextlib.suppress(OSError):
            for pid in Path(children).read_text().split():
                if b"nicswitch_agent\0demo\0" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return int(pid)
    return None


def running(pid: int) -> bool:
    """Whether ``pid`` still runs: a zombie (ended, its new parent has not reaped it yet) does not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("phase", ["started", "waiting"])
def test_sigterm_while_the_background_job_is_not_ready_stops_it_and_exits_143(phase: str, tmp_path: Path) -> None:
    """``kill <pid>`` of ``demo --background`` while its job starts (``started``: the child exists) or
    waits for ClusterD (``waiting``): the command used to die of SIGTERM without a word (143), leaving
    its job running unseen for --timeout, to register with a ClusterD that came up later. While it
    waits, the job's first warning (a wrong --server) shows on stderr, as in the foreground."""
    with started(demo("--server", f"127.0.0.1:{free_port()}", "--job", JOB, "--background", "--timeout", "30"),
                 clean_env(TMPDIR=str(tmp_path))) as (proc, out, err):
        child = poll(lambda: background_job(proc.pid), 60)
        assert child is not None, err.text()
        if phase == "waiting":
            assert err.wait_for("still waiting for it to be ready"), err.text()
            assert "cannot connect to ClusterD, waiting for it" in "".join(err.lines), err.text()
        proc.send_signal(signal.SIGTERM)  # to this process alone, as `kill`
        assert proc.wait(60) == 143, out.text() + err.text()
        said = err.text()
    assert re.search(rf"^nicswitch-agent demo: SIGTERM before the background job {JOB} was ready; stopped it "
                     rf"\(pid {child}, exit (143|-15); log: \S+\)$", said, re.MULTILINE), said
    assert not running(child)  # stopped, and reaped by the command
    assert "Traceback" not in said and out.text() == "", said


@pytest.mark.timeout(90)
def test_a_background_job_whose_command_was_killed_before_it_was_ready_stops_itself(tmp_path: Path) -> None:
    """SIGKILL (which no handler sees) to ``demo --background`` while its job waits for ClusterD: the job
    sees the command's end of the ready pipe close and stops, instead of running on unseen."""
    with started(demo("--server", f"127.0.0.1:{free_port()}", "--job", JOB, "--background", "--timeout", "120"),
                 clean_env(TMPDIR=str(tmp_path))) as (proc, _, err):  # a --timeout well past the bound below
        assert err.wait_for("still waiting for it to be ready"), err.text()
        child = background_job(proc.pid)
        assert child is not None, err.text()
        proc.kill()
        assert proc.wait(60) == -signal.SIGKILL
        stopped = poll(lambda: not running(child), 30)
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)  # not to leave it running if the test failed
    logs = list(tmp_path.glob("nicswitch-demo-*.log"))
    assert stopped, [log.read_text() for log in logs]
    assert any(f"the command that started job {JOB} in the background ended before the job was ready; stopped"
               in log.read_text() for log in logs), [log.read_text() for log in logs]


# The command line, with SIGINT handed to another thread than the main one once the main thread
# sleeps in the wait named by $WAIT_IN (and the background job's log in $LOG_DIR, if set, says it
# waits for ClusterD): the kernel does that to a process-directed signal when it likes, and gRPC's
# threads block no signal (seen ~1 run in 3 with TLS: the job sat out its --timeout).
REDIRECTED_SIGINT = """
import glob, os, signal, sys, threading
from nicswitch_agent.ops.cli import main

def main_thread_waits() -> bool:
    logs = glob.glob(os.path.join(os.environ.get("LOG_DIR", ""), "nicswitch-demo-*.log"))
    if "LOG_DIR" in os.environ and not any("waiting for it" in open(log).read() for log in logs):
        return False
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None and frame.f_code.co_name == "wait":
        frame = frame.f_back
    return frame is not None and frame.f_code.co_name == os.environ["WAIT_IN"]

def redirect() -> None:
    while not main_thread_waits():
        threading.Event().wait(0.01)
    print("redirecting SIGINT to a thread that is not the main one", file=sys.stderr, flush=True)
    signal.pthread_kill(threading.get_ident(), signal.SIGINT)

threading.Thread(target=redirect, daemon=True).start()
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("background", [False, True], ids=["foreground", "background"])
def test_a_sigint_that_another_thread_received_still_ends_the_wait_for_clusterd(background: bool,
                                                                               tmp_path: Path) -> None:
    """The main thread slept where only a signal delivered to it wakes it (Event.wait; the background
    job's ready pipe), and the Python handler waited for that sleep's end (--timeout). Now it sleeps in
    select on Python's wakeup fd, which the signal's C handler writes on any thread."""
    args = ["demo", "--server", f"127.0.0.1:{free_port()}", "--job", JOB]
    env = clean_env(WAIT_IN="run_job")
    if background:
        args += ["--background", "--timeout", "30"]
        env.update(WAIT_IN="_start_in_background", LOG_DIR=str(tmp_path), TMPDIR=str(tmp_path))
    with started([sys.executable, "-c", REDIRECTED_SIGINT, *args], env) as (proc, out, err):
        assert err.wait_for("redirecting SIGINT"), err.text()
        code = proc.wait(30)  # the default --timeout is 300 s, the background job's here 30 s
        assert code == 130, out.text() + err.text()
    said = err.text()
    if background:
        assert f"nicswitch-agent demo: interrupted (Ctrl-C) before the background job {JOB} was ready" in said, said
    else:
        assert f"nicswitch-agent demo: SIGINT before job {JOB} registered" in said, said


@pytest.mark.timeout(90)
def test_ctrl_c_before_the_joined_jobs_switches_says_how_many_and_exits_130(sim: Simulator) -> None:
    """The job registered and waits for its 2 switches: Ctrl-C now is an interruption (130), not "done" (0)."""
    with started(demo("--server", sim.address, "--job", JOB), clean_env()) as (proc, out, err):
        assert out.wait_for("registered with ClusterD"), out.text() + err.text()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130, out.text() + err.text()
        text = out.text()
    assert f"job {JOB}: SIGINT after 0 of 2 switch(es); stopped" in text, text


# -- 5. the thread job stopped while parked -----------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_thread_job_stopped_while_its_ranks_are_parked_ends_every_rank_without_a_traceback(tmp_path: Path) -> None:
    """Ctrl-C to `demo --server` while a switch has parked the ranks: a member whose agent stops
    while parked stops its training (TrainingStopped); the demo's rank threads end on it quietly
    instead of printing "Exception in thread demo-rank1" (a stranger saw it in 37 runs)."""
    from nicswitch_agent.demo.common import Timeline
    from nicswitch_agent.demo.run import ThreadJob
    from nicswitch_agent.ops.om import OmClient
    from nicswitch_agent.sim import SimSettings

    job_id = "job-parked"
    sim = Simulator(jobs=[SimJob(job_id=job_id, nodes={"node-0": ["0", "1"]})],
                    settings=SimSettings(list_delay_s=60.0))  # the ranks stay parked, no list comes
    sim.start()
    escaped: list[BaseException | None] = []
    previous_hook = threading.excepthook
    threading.excepthook = lambda args: escaped.append(args.exc_value)
    try:
        job = ThreadJob(2, Timeline(), str(tmp_path), job_id=job_id)
        job.start(sim.address)
        try:
            assert poll(lambda: sim.job_view(job_id).open_streams["SubscribeNotifySwitch"] >= 1, 30)
            with OmClient(sim.address) as client:
                client.switch(job_id, {"node-0": (("0",), (True,))})
            assert poll(lambda: all(rank.agent.status()["parked"] for rank in job._ranks), 30)
            job._ranks[1].agent.stop("SIGINT received")  # a member's stop first, as when every rank gets it
            assert job._ranks[1].thread is not None
            job._ranks[1].thread.join(10)
        finally:
            job.stop()
        assert all(rank.thread is not None and not rank.thread.is_alive() for rank in job._ranks)
        assert escaped == [], escaped
    finally:
        threading.excepthook = previous_hook
        sim.stop()
