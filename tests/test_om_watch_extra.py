"""``nicswitch-agent watch`` and an unreachable ClusterD: the same flag, words and exit code as ``switch``.

The tester's cases: ``watch`` had no ``--max-unreachable`` (once it had reached ClusterD it retried
forever when ClusterD went away), and said ``gRPC error: UNAVAILABLE`` where ``switch`` says
``cannot reach ClusterD at ...``. Real processes of the CLI against the simulator's on 127.0.0.1:0.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from support import Lines, wait_until

from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.ops.om import DEFAULT_MAX_UNREACHABLE_S, SWITCH_FINISH, OmClient, OutcomeKind, WatchEnd
from nicswitch_agent.ops.om_cli import ExitCode, add_switch_arguments, add_watch_arguments, run_watch

pytestmark = pytest.mark.timeout(90)

JOB = "job-watch"
NOT_REGISTERED_NOTE = f"ClusterD does not know job {JOB}"
LOST = re.compile(r"ClusterD unreachable since \d\d:\d\d:\d\d: (UNAVAILABLE|CANCELLED): .*; still watching, "
                  r"Ctrl-C to stop")


def child_env() -> dict[str, str]:
    """This interpreter's environment without the agent's settings (the tests give their own)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NICSWITCH_", "PYTEST_"))}
    return {**env, "PYTHONUNBUFFERED": "1"}


def nicswitch(*args: str) -> subprocess.Popen[str]:
    """The CLI as the operator runs it, still running."""
    return subprocess.Popen([sys.executable, "-m", "nicswitch_agent", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env())


def nicswitch_run(*args: str) -> subprocess.CompletedProcess[str]:
    """The CLI as the operator runs it, to its end."""
    return subprocess.run([sys.executable, "-m", "nicswitch_agent", *args], capture_output=True, text=True,
                          timeout=45, check=False, env=child_env())


class ClusterD:
    """``nicswitch-agent sim`` in its own process, whose job never registers (a watch is answered
    "not registed" at once, and says so), killed with SIGKILL as the tester killed ClusterD: its
    connections just drop. An in-process Simulator's stop() sends GOAWAY instead, which is not what
    these test (a call racing it could hang in gRPC's transparent retry, which the operator client
    now turns off: ChannelSettings.transparent_retries)."""

    def __init__(self, port: int = 0, options: tuple[str, ...] = ()) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "nicswitch_agent", "sim", "--port", str(port), "--job", JOB, "--nodes", "node-0:0",
             *options],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env())
        self.output = Lines(self.process.stdout)
        line = self.output.wait_for("listening on", 60)
        assert line is not None, "the simulator did not start"
        self.address = line.rsplit(" ", 1)[1]

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)


@pytest.fixture
def clusterd() -> Iterator[ClusterD]:
    server = ClusterD()
    yield server
    server.kill()


def ended(process: subprocess.Popen[str], timeout: float = 30) -> int:
    """The exit code; a child still running after ``timeout`` is killed and fails the test."""
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)
        pytest.fail(f"still running after {timeout} s")


def test_watch_has_switchs_max_unreachable_default_and_check() -> None:
    watch, switch = argparse.ArgumentParser(), argparse.ArgumentParser()
    add_watch_arguments(watch)
    add_switch_arguments(switch)
    assert watch.parse_args([]).max_unreachable == switch.parse_args([]).max_unreachable == DEFAULT_MAX_UNREACHABLE_S
    assert watch.parse_args(["--max-unreachable", "2.5"]).max_unreachable == 2.5
    refused = nicswitch_run("watch", "--job", JOB, "--max-unreachable", "0")
    assert refused.returncode == ExitCode.USAGE, refused
    assert ("nicswitch-agent watch: error: argument --max-unreachable: '0' must be a positive number of seconds"
            in refused.stderr)


def test_watch_gives_up_with_6_once_clusterd_stays_away_for_max_unreachable(clusterd: ClusterD) -> None:
    watch = nicswitch("watch", "--server", clusterd.address, "--job", JOB, "--max-unreachable", "0.5")
    err, out = Lines(watch.stderr), Lines(watch.stdout)
    try:
        assert err.wait_for(NOT_REGISTERED_NOTE), err.lines  # ClusterD answered the watch
        clusterd.kill()
        assert err.wait_for(LOST), err.lines
        assert ended(watch) == ExitCode.RPC_ERROR
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait(10)
    lines = err.rest()
    assert sum(bool(LOST.fullmatch(line)) for line in lines) == 1, lines  # once, not once per retry
    gave_up = [line for line in lines if line.startswith("gave up after ")]
    assert len(gave_up) == 1 and ": ClusterD unreachable for " in gave_up[0] and "(limit 0.5 s): " in gave_up[0], lines
    assert not any("gRPC error" in line for line in lines), lines
    assert out.rest()[0].startswith(f"watching job {JOB} on {clusterd.address}")


def test_watch_says_when_clusterd_is_back_as_switch_does(clusterd: ClusterD) -> None:
    """Lost and back, one line each, in switch's words; the watch goes on (default limit: 60 s).
    Killed at the end, not Ctrl-C'd: a Ctrl-C while watch polls can leave a lock held (not this test's case)."""
    watch = nicswitch("watch", "--server", clusterd.address, "--job", JOB)
    err = Lines(watch.stderr)
    again: ClusterD | None = None
    try:
        assert err.wait_for(NOT_REGISTERED_NOTE), err.lines
        clusterd.kill()
        assert err.wait_for(LOST), err.lines
        again = ClusterD(port=int(clusterd.address.rsplit(":", 1)[1]))  # ClusterD restarted
        back = err.wait_for("ClusterD answers again")
        assert back is not None and re.fullmatch(r"ClusterD answers again, after \d+\.\d s unreachable", back), back
        assert watch.poll() is None  # still watching
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait(10)
        if again is not None:
            again.kill()
    assert not any("lost ClusterD" in line or "gRPC error" in line for line in err.rest()), err.lines


def test_watch_at_start_says_cannot_reach_clusterd_in_switchs_words() -> None:
    with socket.socket() as closed:  # bound, never listening: every connection is refused
        closed.bind(("127.0.0.1", 0))
        server = f"127.0.0.1:{closed.getsockname()[1]}"
        watch = nicswitch_run("watch", "--server", server, "--job", JOB)
        switch = nicswitch_run("switch", "--server", server, "--job", JOB, "--node", "node-0", "--dev", "0",
                               "--op", "standby")
    assert watch.returncode == switch.returncode == ExitCode.RPC_ERROR, (watch, switch)
    said = watch.stderr.splitlines()
    assert len(said) == 1 and said[0].startswith(f"cannot reach ClusterD at {server}: UNAVAILABLE: "), said
    assert said == switch.stderr.splitlines()  # the same line, explanation included


Serve = Callable[..., str]


def test_watch_rides_out_a_call_the_server_cancels(serve: Serve, capsys: pytest.CaptureFixture[str]) -> None:
    """A Python gRPC server that stops (the simulator's Ctrl-C) cancels the calls it has not answered:
    the watch got CANCELLED and ended with ``gRPC error: CANCELLED`` about 2 times in 3. A CANCELLED
    it did not ask for is the server going away, said and retried as UNAVAILABLE is. A real gRPC
    server here, cancelling its second call itself, so that the case is certain."""
    calls: list[int] = []
    lock = threading.Lock()

    def stream(request: Any, context: grpc.ServicerContext) -> Iterator[pb.SwitchNicResponse]:
        with lock:
            calls.append(len(calls) + 1)
            n = len(calls)
        if n == 1:
            context.abort(grpc.StatusCode.UNKNOWN, f"jobId={JOB} is not swtiching nic")
        elif n == 2:
            context.cancel()
        else:
            yield pb.SwitchNicResponse(jobID=JOB, msg=SWITCH_FINISH)

    watch = argparse.ArgumentParser()
    add_watch_arguments(watch)
    args = watch.parse_args(["--server", serve(SubscribeSwitchNicSignal=stream), "--job", JOB, "--count", "1",
                             "--poll", "0.001", "--timeout", "60"])
    assert run_watch(args, env={}) == ExitCode.OK
    out, err = capsys.readouterr()
    assert "switch 1 finished" in out, out
    lost, back = err.splitlines()
    assert LOST.fullmatch(lost) and lost.split(": ", 1)[1].startswith("CANCELLED"), err
    assert back.startswith("ClusterD answers again, after "), err


def test_watch_that_joined_a_running_switch_says_clusterd_lost_when_it_dies() -> None:
    """The tester's case: ``switch --no-wait``, then ``watch`` while that switch runs, then ClusterD
    killed. ClusterD accepts the stream and says nothing until the result, so the watch had never
    heard it answer and took the broken stream for ClusterD unreachable at start ("cannot reach",
    exit 6 at once). A connection made is ClusterD reached: the loss is said and retried, as by
    ``switch``. The job registers (``--standin``) and no agent answers, so the switch stays running;
    ``-v`` logs the stream's opening, so the kill comes once ClusterD holds it."""
    clusterd = ClusterD(options=("--standin", "-v"))
    notes: list[str] = []
    ends: list[WatchEnd] = []
    try:
        with OmClient(clusterd.address) as operator:
            operator.switch(JOB, {"node-0": (["0"], [False])})
        with OmClient(clusterd.address) as client:  # the watch's own connection, as its own process has
            watching = threading.Thread(
                target=lambda: ends.append(client.watch(JOB, max_unreachable_s=0.5, on_note=notes.append)))
            watching.start()
            try:
                assert clusterd.output.wait_for("SubscribeSwitchNicSignal opened"), clusterd.output.lines
                clusterd.kill()
                watching.join(30)
            finally:
                client.close()
                watching.join(10)
    finally:
        clusterd.kill()
    (watch_end,) = ends
    assert watch_end.stopped is OutcomeKind.UNREACHABLE, watch_end  # was RPC_ERROR, at once
    assert len(notes) == 1 and LOST.fullmatch(notes[0]), notes  # said once, then retried up to the limit
    assert watch_end.detail.startswith("ClusterD unreachable for ") and "(limit 0.5 s): " in watch_end.detail


def poller_running(channel: grpc.Channel) -> bool:
    """gRPC's connectivity polling thread runs (grpcio's own flag; private, so checked to exist)."""
    state = getattr(channel, "_connectivity_state", None)
    assert state is not None and hasattr(state, "polling"), "grpcio moved the flag these tests read"
    return bool(state.polling)


def test_a_watch_that_ends_leaves_no_connectivity_poller_on_the_channel() -> None:
    """CI's case: ``watch`` stopped by Ctrl-C, and its channel closed at once, printed gRPC's
    ``ValueError: Cannot monitor channel state: Channel closed!`` traceback: the watch had
    unsubscribed from the channel's connectivity, but gRPC's polling thread runs up to 0.2 s longer
    and dies if the channel closes meanwhile. A watch that returns has waited for that thread: a
    nothing-listens port ends it at once (never reached), with the subscription just taken."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"  # bound, never listening: refused
        with grpc.insecure_channel(address) as channel, OmClient(address, channel=channel) as client:
            end = client.watch(JOB, timeout_s=30)
            assert end.stopped is OutcomeKind.RPC_ERROR, end
            assert not poller_running(channel), "the watch returned with gRPC's poller still on the channel"


def test_closing_the_client_under_a_watch_lets_go_of_the_poller_before_the_channel_closes() -> None:
    """The same from the other side: ``close()`` from another thread while a watch waits for a
    connection (a server that accepts TCP and never speaks HTTP/2 keeps the channel CONNECTING, so
    the subscription stays held). close() ends the watch's connectivity wait before it returns (and
    before it closes a channel of its own), not when the watch's thread gets round to it."""
    errors: list[BaseException | None] = []
    hook = threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value)
    try:
        with socket.socket() as silent:
            silent.bind(("127.0.0.1", 0))
            silent.listen()
            address = f"127.0.0.1:{silent.getsockname()[1]}"
            with grpc.insecure_channel(address) as channel:
                client = OmClient(address, channel=channel)
                ends: list[WatchEnd] = []
                watching = threading.Thread(target=lambda: ends.append(client.watch(JOB, timeout_s=60)))
                watching.start()
                try:
                    assert wait_until(lambda: poller_running(channel), 20), "the watch never subscribed"
                finally:
                    client.close()
                    assert not poller_running(channel), "close() returned with gRPC's poller still on the channel"
                    watching.join(30)
        (end,) = ends
        assert end.stopped is OutcomeKind.CANCELLED, end
    finally:
        threading.excepthook = hook
    assert errors == []
