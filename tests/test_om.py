"""O&M client and CLI against real gRPC servers on 127.0.0.1:0 (scripted, and the simulator)."""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.clusterd.channel import ChannelSettings, RecoverStub, settings_of
from nicswitch_agent.ops.om import (
    FAILURE_MESSAGES,
    SWITCH_FINISH,
    OmClient,
    OmError,
    OmRpcError,
    OutcomeKind,
    StreamError,
    SwitchBusy,
    SwitchInvalid,
    SwitchRejected,
    backoff_delays,
    build_switch_request,
    classify_stream_error,
    describe_nic_ops,
    parse_nic_groups,
    parse_nic_ops,
    parse_op,
)
from nicswitch_agent.ops.om_cli import (
    ExitCode,
    add_switch_arguments,
    add_watch_arguments,
    exit_code_for,
    format_seconds,
    nic_groups_from_flags,
    normalize_server,
    resolve_job,
    resolve_server,
    run_switch,
    run_watch,
)

pytestmark = pytest.mark.timeout(10)

JOB = "job-1"
NOT_SWITCHING = f"jobId={JOB} is not swtiching nic"
NOT_REGISTERED = f"jobId={JOB} not registed"
ACCEPTED_INFO = "switching operation was successfully distributed"
BUSY_INFO = f"jobId={JOB} nic is swtiching, or job recovering"


# --------------------------------------------------------------------------------------------
# Scripted server
# --------------------------------------------------------------------------------------------

Step = tuple[Any, ...]


class StreamScript:
    """SubscribeSwitchNicSignal behaviour: one step per call, the last step repeats.

    Steps: ("msg", text), ("eof",), ("abort", StatusCode, details), ("block",) until the call ends.
    """

    def __init__(self, *steps: Step, log: list[str] | None = None) -> None:
        self.steps = list(steps)
        self.calls = 0
        self.opened = threading.Event()
        self.log = log if log is not None else []
        self._lock = threading.Lock()

    def __call__(self, request: Any, context: Any) -> Iterator[Any]:
        with self._lock:
            self.calls += 1
            step = self.steps.pop(0) if len(self.steps) > 1 else self.steps[0]
        self.log.append("subscribe")
        self.opened.set()
        if step[0] == "msg":
            yield pb.SwitchNicResponse(jobID=request.jobID, msg=step[1])
        elif step[0] == "abort":
            context.abort(step[1], step[2])
        elif step[0] == "block":
            ended = threading.Event()
            context.add_callback(ended.set)
            ended.wait(8)


class TrackScript:
    """SwitchNicTrack behaviour: answer ``Status(code, info)``, or block (``code=None``)."""

    def __init__(self, code: int | None = 0, info: str = ACCEPTED_INFO, log: list[str] | None = None) -> None:
        self.code = code
        self.info = info
        self.requests: list[Any] = []
        self.log = log if log is not None else []

    def __call__(self, request: Any, context: Any) -> Any:
        self.requests.append(request)
        self.log.append("track")
        if self.code is None:
            ended = threading.Event()
            context.add_callback(ended.set)
            ended.wait(8)
        return pb.Status(code=self.code or 0, info=self.info)


Serve = Callable[..., str]


# serve: the fixture in conftest.py (a real gRPC server with the given Recover behaviours).


@pytest.fixture
def closed_port() -> str:
    """A local address nobody listens on (connection refused at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"127.0.0.1:{port}"


NODE1 = {"node-1": (["0", "1"], [True, False])}


# --------------------------------------------------------------------------------------------
# Parsing and validation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("word", "expected"),
    [("standby", True), ("BACKUP", True), (" True ", True), ("primary", False), ("False", False)],
)
def test_parse_op_words(word: str, expected: bool) -> None:
    assert parse_op(word) is expected


def test_parse_nic_ops_single_op_applies_to_all() -> None:
    assert parse_nic_ops("node-1", "0, 1,2", "standby") == {"node-1": (["0", "1", "2"], [True] * 3)}
    assert parse_nic_ops("node-1", "0,1", "backup,PRIMARY") == {"node-1": (["0", "1"], [True, False])}


@pytest.mark.parametrize(
    ("node", "devs", "ops", "flag", "bad"),
    [
        ("node-1", "0,1", "standby,sideways", "--op", "'sideways'"),
        ("node-1", "0,1", "standby,primary,standby", "--op", "'standby,primary,standby'"),
        ("node-1", "0,,1", "standby", "--dev", "'0,,1'"),
        ("node-1", "", "standby", "--dev", "empty"),
        ("node-1", "0,0", "standby", "--dev", "'0'"),
        ("node-1", "0", "", "--op", "empty"),
        ("", "0", "standby", "--node", "empty"),
        ("node 1", "0", "standby", "--node", "'node 1'"),
    ],
)
def test_parse_nic_ops_errors_name_flag_and_value(node: str, devs: str, ops: str, flag: str, bad: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_nic_ops(node, devs, ops)
    assert str(info.value).startswith(flag + ":")
    assert bad in str(info.value)


def test_parse_nic_groups_merges_nodes_and_rejects_repeats() -> None:
    merged = parse_nic_groups([("n1", "0", "standby"), ("n2", "3", "primary"), ("n1", "1", "primary")])
    assert merged == {"n1": (["0", "1"], [True, False]), "n2": (["3"], [False])}
    with pytest.raises(ValueError, match="--dev: device '0' repeated for node 'n1'"):
        parse_nic_groups([("n1", "0", "standby"), ("n1", "0", "primary")])
    with pytest.raises(ValueError, match="--node"):
        parse_nic_groups([])


@pytest.mark.timeout(60)  # regex strategies: generating 40 examples took over 10 s on a loaded 2-core box
@settings(max_examples=40, deadline=None)
@given(
    st.dictionaries(
        st.from_regex(r"[a-z][a-z0-9-]{0,8}", fullmatch=True),
        st.lists(st.tuples(st.from_regex(r"[0-9]{1,2}", fullmatch=True), st.booleans()), min_size=1).map(
            lambda pairs: list(dict(pairs).items())
        ),
        min_size=1,
        max_size=4,
    )
)
def test_parse_round_trips_to_the_wire(spec: dict[str, list[tuple[str, bool]]]) -> None:
    groups = [
        (node, ",".join(d for d, _ in pairs), ",".join("standby" if o else "primary" for _, o in pairs))
        for node, pairs in spec.items()
    ]
    nic_ops = parse_nic_groups(groups)
    request = pb.SwitchNics.FromString(build_switch_request(JOB, nic_ops).SerializeToString())
    assert request.jobID == JOB
    for node, pairs in spec.items():
        assert list(request.nicOps[node].dev) == [d for d, _ in pairs]
        assert list(request.nicOps[node].op) == [o for _, o in pairs]


@pytest.mark.parametrize(
    ("nic_ops", "needle"),
    [
        ({}, "no node"),
        ({"n1": ([], [])}, "empty"),
        ({"n1": (["0", "1"], [True])}, "2 devices but 1 ops"),
        ({"n1": (["0", "0"], [True, True])}, "repeated"),
        ({"n1": (["0"], ["standby"])}, "bools"),
        ({"": (["0"], [True])}, "empty node"),
    ],
)
def test_build_switch_request_rejects_what_clusterd_mishandles(nic_ops: Any, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        build_switch_request(JOB, nic_ops)


def test_describe_nic_ops() -> None:
    assert describe_nic_ops(NODE1) == "node-1: dev 0 -> standby, dev 1 -> primary"


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize(
    ("code", "details", "expected"),
    [
        (grpc.StatusCode.UNKNOWN, NOT_SWITCHING, StreamError.NOT_SWITCHING),
        (grpc.StatusCode.UNKNOWN, NOT_REGISTERED, StreamError.NOT_REGISTERED),
        (grpc.StatusCode.UNKNOWN, "qps exceeded, method=x", StreamError.FATAL),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", StreamError.DEADLINE),
        (grpc.StatusCode.UNAVAILABLE, "Socket closed", StreamError.TRANSIENT),
        (grpc.StatusCode.INTERNAL, "RST_STREAM", StreamError.TRANSIENT),
        (grpc.StatusCode.UNIMPLEMENTED, "", StreamError.FATAL),
        (grpc.StatusCode.PERMISSION_DENIED, "", StreamError.FATAL),
    ],
)
def test_classify_stream_error(code: grpc.StatusCode, details: str, expected: StreamError) -> None:
    assert classify_stream_error(FakeRpcError(code, details)) is expected


def test_backoff_is_capped() -> None:
    delays = backoff_delays(0.1, 1.0)
    values = [next(delays) for _ in range(20)]
    assert all(0 < v <= 1.0 for v in values)
    assert values[0] <= 0.1


# --------------------------------------------------------------------------------------------
# OmClient.switch
# --------------------------------------------------------------------------------------------


def test_switch_accepted_sends_exact_request(serve: Serve) -> None:
    track = TrackScript()
    with OmClient(serve(SwitchNicTrack=track)) as client:
        accepted = client.switch(JOB, {"node-1": (["0", "1"], [True, False]), "node-0": (["1"], [False])})
    assert accepted.info == ACCEPTED_INFO and accepted.job_id == JOB
    (request,) = track.requests
    assert request.jobID == JOB
    assert list(request.nicOps["node-1"].dev) == ["0", "1"]
    assert list(request.nicOps["node-1"].op) == [True, False]
    assert list(request.nicOps["node-0"].op) == [False]


@pytest.mark.parametrize(
    ("code", "info", "error"),
    [
        (411, BUSY_INFO, SwitchBusy),
        (413, "node:node-9 not exist in job:job-1", SwitchInvalid),
        (502, "operate podgroup error", SwitchRejected),
    ],
)
def test_switch_maps_status_codes(serve: Serve, code: int, info: str, error: type[SwitchRejected]) -> None:
    with OmClient(serve(SwitchNicTrack=TrackScript(code, info))) as client, pytest.raises(error) as raised:
        client.switch(JOB, NODE1)
    assert type(raised.value) is error
    assert (raised.value.code, raised.value.info) == (code, info)


def test_switch_bad_input_sends_nothing(serve: Serve) -> None:
    track = TrackScript()
    with OmClient(serve(SwitchNicTrack=track)) as client, pytest.raises(ValueError):
        client.switch(JOB, {})
    assert track.requests == []


def test_switch_unreachable_server(closed_port: str) -> None:
    started = time.monotonic()
    with OmClient(closed_port, rpc_timeout_s=8) as client, pytest.raises(OmRpcError) as raised:
        client.switch(JOB, NODE1)
    assert raised.value.code == "UNAVAILABLE" and not raised.value.maybe_delivered
    assert isinstance(raised.value, OmError)
    assert time.monotonic() - started < 5  # not the RPC's timeout: a bound, not a timing


def test_switch_deadline_is_maybe_delivered(serve: Serve) -> None:
    client = OmClient(serve(SwitchNicTrack=TrackScript(None)), rpc_timeout_s=0.2)
    with client, pytest.raises(OmRpcError) as raised:
        client.switch(JOB, NODE1)
    assert raised.value.code == "DEADLINE_EXCEEDED" and raised.value.maybe_delivered


# --------------------------------------------------------------------------------------------
# OmClient.follow
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("message", [SWITCH_FINISH, *sorted(FAILURE_MESSAGES)])
def test_follow_classifies_every_message(serve: Serve, message: str) -> None:
    with OmClient(serve(SubscribeSwitchNicSignal=StreamScript(("msg", message)))) as client:
        outcome = client.follow(JOB, 5)
    assert outcome.message == message and outcome.documented
    assert outcome.kind is (OutcomeKind.FINISHED if message == SWITCH_FINISH else OutcomeKind.FAILED)
    assert outcome.ok is (message == SWITCH_FINISH)


def test_follow_undocumented_message_is_a_failure(serve: Serve) -> None:
    with OmClient(serve(SubscribeSwitchNicSignal=StreamScript(("msg", "something new")))) as client:
        outcome = client.follow(JOB, 5)
    assert outcome.kind is OutcomeKind.FAILED and not outcome.documented


def test_follow_stream_ended_without_message_then_not_switching(serve: Serve) -> None:
    script = StreamScript(("eof",), ("abort", grpc.StatusCode.UNKNOWN, NOT_SWITCHING))
    with OmClient(serve(SubscribeSwitchNicSignal=script)) as client:
        outcome = client.follow(JOB, 5, server_seen=True)
    assert outcome.kind is OutcomeKind.NO_RESULT
    assert "without a message" in outcome.detail and outcome.attempts == 2


def test_follow_resubscribes_after_empty_end_while_still_switching(serve: Serve) -> None:
    script = StreamScript(("eof",), ("msg", SWITCH_FINISH))
    with OmClient(serve(SubscribeSwitchNicSignal=script)) as client:
        outcome = client.follow(JOB, 5)
    assert outcome.kind is OutcomeKind.FINISHED and script.calls == 2


@pytest.mark.parametrize(
    ("details", "kind"),
    [(NOT_SWITCHING, OutcomeKind.NOT_SWITCHING), (NOT_REGISTERED, OutcomeKind.NOT_REGISTERED)],
)
def test_follow_not_switching_ends_at_once(serve: Serve, details: str, kind: OutcomeKind) -> None:
    script = StreamScript(("abort", grpc.StatusCode.UNKNOWN, details))
    with OmClient(serve(SubscribeSwitchNicSignal=script)) as client:
        outcome = client.follow(JOB, 5)
    assert outcome.kind is kind and outcome.detail == details and script.calls == 1


def test_follow_wait_for_start_retries_until_the_switch_runs(serve: Serve) -> None:
    script = StreamScript(
        ("abort", grpc.StatusCode.UNKNOWN, NOT_REGISTERED),
        ("abort", grpc.StatusCode.UNKNOWN, NOT_SWITCHING),
        ("msg", SWITCH_FINISH),
    )
    with OmClient(serve(SubscribeSwitchNicSignal=script)) as client:
        outcome = client.follow(JOB, 5, wait_for_start=True)
    assert outcome.kind is OutcomeKind.FINISHED and outcome.attempts == 3


def test_follow_wait_for_start_times_out_naming_the_last_answer(serve: Serve) -> None:
    script = StreamScript(("abort", grpc.StatusCode.UNKNOWN, NOT_SWITCHING))
    with OmClient(serve(SubscribeSwitchNicSignal=script)) as client:
        outcome = client.follow(JOB, 0.4, wait_for_start=True)
    assert outcome.kind is OutcomeKind.TIMED_OUT and NOT_SWITCHING in outcome.detail
    assert script.calls >= 2


def test_follow_slow_stream_times_out(serve: Serve) -> None:
    with OmClient(serve(SubscribeSwitchNicSignal=StreamScript(("block",)))) as client:
        outcome = client.follow(JOB, 0.3)
    assert outcome.kind is OutcomeKind.TIMED_OUT
    assert 0.25 <= outcome.elapsed_s < 5  # the stream never ends: a bound, not a timing


def test_follow_retries_lost_connection_once_server_was_seen(serve: Serve) -> None:
    script = StreamScript(("abort", grpc.StatusCode.UNAVAILABLE, "connection reset"), ("msg", SWITCH_FINISH))
    with OmClient(serve(SubscribeSwitchNicSignal=script)) as client:
        outcome = client.follow(JOB, 5, server_seen=True)
    assert outcome.kind is OutcomeKind.FINISHED and script.calls == 2


def test_follow_unreachable_fails_fast_unless_server_was_seen(closed_port: str) -> None:
    with OmClient(closed_port) as client:
        outcome = client.follow(JOB, 5)
    assert outcome.kind is OutcomeKind.RPC_ERROR and outcome.rpc_code == "UNAVAILABLE"
    with OmClient(closed_port) as client:
        outcome = client.follow(JOB, 0.4, server_seen=True)
    assert outcome.kind is OutcomeKind.TIMED_OUT and "UNAVAILABLE" in outcome.detail


def test_follow_other_rpc_error(serve: Serve) -> None:
    with OmClient(serve(SwitchNicTrack=TrackScript())) as client:  # no stream handler
        outcome = client.follow(JOB, 5)
    assert outcome.kind is OutcomeKind.RPC_ERROR and outcome.rpc_code == "UNIMPLEMENTED"


def test_close_cancels_a_running_follow(serve: Serve) -> None:
    script = StreamScript(("block",))
    client = OmClient(serve(SubscribeSwitchNicSignal=script))
    result: list[Any] = []
    worker = threading.Thread(target=lambda: result.append(client.follow(JOB, 8)), name="follow")
    worker.start()
    assert script.opened.wait(5)
    client.close()
    client.close()  # idempotent
    worker.join(5)
    assert not worker.is_alive()
    assert result[0].kind is OutcomeKind.CANCELLED


def test_switch_and_wait_subscribes_right_after_acceptance(serve: Serve) -> None:
    log: list[str] = []
    target = serve(
        SwitchNicTrack=TrackScript(log=log),
        SubscribeSwitchNicSignal=StreamScript(("msg", SWITCH_FINISH), log=log),
    )
    with OmClient(target) as client:
        outcome = client.switch_and_wait(JOB, NODE1, timeout_s=5)
    assert log == ["track", "subscribe"]
    assert outcome.ok and outcome.accepted is not None and outcome.accepted.info == ACCEPTED_INFO
    assert outcome.elapsed_s >= outcome.accepted.rpc_s


def test_switch_and_wait_raises_on_rejection_without_subscribing(serve: Serve) -> None:
    script = StreamScript(("msg", SWITCH_FINISH))
    target = serve(SwitchNicTrack=TrackScript(411, BUSY_INFO), SubscribeSwitchNicSignal=script)
    with OmClient(target) as client, pytest.raises(SwitchBusy):
        client.switch_and_wait(JOB, NODE1, timeout_s=5)
    assert script.calls == 0


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def switch_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="nicswitch-agent switch")
    add_switch_arguments(parser)
    return parser.parse_args(list(argv))


def watch_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="nicswitch-agent watch")
    add_watch_arguments(parser)
    return parser.parse_args(list(argv))


GROUP = ("--node", "node-1", "--dev", "0,1", "--op", "standby,primary")


def test_cli_switch_finished(serve: Serve, capsys: pytest.CaptureFixture[str]) -> None:
    target = serve(SwitchNicTrack=TrackScript(), SubscribeSwitchNicSignal=StreamScript(("msg", SWITCH_FINISH)))
    code = run_switch(switch_args("--server", target, "--job", JOB, *GROUP), env={})
    out = capsys.readouterr().out
    assert code == ExitCode.OK == 0
    assert f"switch job {JOB} on {target}: node-1: dev 0 -> standby, dev 1 -> primary" in out
    assert "accepted" in out and ACCEPTED_INFO in out
    assert "switch finished after" in out and SWITCH_FINISH in out


def test_cli_switch_json(serve: Serve, capsys: pytest.CaptureFixture[str]) -> None:
    target = serve(
        SwitchNicTrack=TrackScript(),
        SubscribeSwitchNicSignal=StreamScript(("msg", "switch nic failed, switch nic failed")),
    )
    argv = ("--server", target, "--job", JOB, *GROUP, "--node", "node-0", "--dev", "1", "--op", "false", "--json")
    code = run_switch(switch_args(*argv), env={})
    out = capsys.readouterr().out
    data = json.loads(out)  # exactly one object, nothing else on stdout
    assert code == data["exit_code"] == ExitCode.SWITCH_FAILED
    assert data["request"] == {
        "node-1": {"dev": ["0", "1"], "op": ["standby", "primary"]},
        "node-0": {"dev": ["1"], "op": ["primary"]},
    }
    assert data["accepted"] is True and data["status"] == {"code": 0, "info": ACCEPTED_INFO}
    assert data["outcome"] == "failed" and data["message"] == "switch nic failed, switch nic failed"
    assert data["result"] == "switch_failed" and data["elapsed_s"] >= 0


def test_cli_switch_json_has_the_same_keys_in_every_outcome(serve: Serve, closed_port: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A script reads ``outcome``, ``message``, ``elapsed_s`` ... whatever the ending: null where unknown."""
    import grpc

    from nicswitch_agent.ops.om_cli import SWITCH_JSON_KEYS

    endings = {
        "failed": serve(SwitchNicTrack=TrackScript(),
                        SubscribeSwitchNicSignal=StreamScript(("msg", "switch nic failed, switch nic failed"))),
        "rejected": serve(SwitchNicTrack=TrackScript(code=411, info="busy")),
        "no_result": serve(SwitchNicTrack=TrackScript(), SubscribeSwitchNicSignal=StreamScript(
            ("eof",), ("abort", grpc.StatusCode.UNKNOWN, f"jobId={JOB} is not swtiching nic"))),
        "rpc_error": closed_port,
    }
    seen = {}
    for expected, target in endings.items():
        run_switch(switch_args("--server", target, "--job", JOB, *GROUP, "--timeout", "5", "--rpc-timeout", "2",
                               "--json"), env={})
        seen[expected] = json.loads(capsys.readouterr().out)
    run_switch(switch_args("--server", "h:1", "--job", JOB, "--json"), env={})  # a usage error: no --node
    seen["usage"] = json.loads(capsys.readouterr().out)
    for ending, data in seen.items():
        assert tuple(data) == SWITCH_JSON_KEYS, (ending, data)
    assert {ending: data["outcome"] for ending, data in seen.items()} == {
        "failed": "failed", "rejected": "rejected", "no_result": "no_result", "rpc_error": "rpc_error", "usage": None}
    assert all(data["elapsed_s"] >= 0 for ending, data in seen.items() if ending != "usage")
    assert seen["failed"]["message"] == "switch nic failed, switch nic failed" and seen["rejected"]["message"] is None
    assert seen["rejected"]["detail"] == "busy" and seen["usage"]["error"] is not None


def test_cli_switch_failure_message(serve: Serve, capsys: pytest.CaptureFixture[str]) -> None:
    message = "switch nic failed, report error when switching nic"
    target = serve(SwitchNicTrack=TrackScript(), SubscribeSwitchNicSignal=StreamScript(("msg", message)))
    assert run_switch(switch_args("--server", target, "--job", JOB, *GROUP), env={}) == 1
    out = capsys.readouterr().out
    assert "switch FAILED after" in out and message in out


@pytest.mark.parametrize(
    ("status", "info", "expected"),
    [
        (411, BUSY_INFO, ExitCode.BUSY),
        (413, "device:7 not exist in node:node-1", ExitCode.INVALID),
        (403, "process recover enable off", ExitCode.REJECTED),
    ],
)
def test_cli_switch_rejected(
    serve: Serve, capsys: pytest.CaptureFixture[str], status: int, info: str, expected: ExitCode
) -> None:
    script = StreamScript(("msg", SWITCH_FINISH))
    target = serve(SwitchNicTrack=TrackScript(status, info), SubscribeSwitchNicSignal=script)
    assert run_switch(switch_args("--server", target, "--job", JOB, *GROUP), env={}) == expected
    err = capsys.readouterr().err
    assert f"rejected ({status}" in err and info in err
    assert script.calls == 0


def test_cli_switch_unreachable(closed_port: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = switch_args("--server", closed_port, "--job", JOB, *GROUP, "--rpc-timeout", "3")
    assert run_switch(args, env={}) == ExitCode.RPC_ERROR
    assert f"cannot reach ClusterD at {closed_port}: UNAVAILABLE" in capsys.readouterr().err


def test_cli_switch_times_out(serve: Serve, capsys: pytest.CaptureFixture[str]) -> None:
    target = serve(SwitchNicTrack=TrackScript(), SubscribeSwitchNicSignal=StreamScript(("block",)))
    args = switch_args("--server", target, "--job", JOB, *GROUP, "--timeout", "0.3")
    assert run_switch(args, env={}) == ExitCode.TIMED_OUT
    assert "timed out after" in capsys.readouterr().err


def test_cli_switch_no_result(serve: Serve, capsys: pytest.CaptureFixture[str]) -> None:
    script = StreamScript(("eof",), ("abort", grpc.StatusCode.UNKNOWN, NOT_SWITCHING))
    target = serve(SwitchNicTrack=TrackScript(), SubscribeSwitchNicSignal=script)
    assert run_switch(switch_args("--server", target, "--job", JOB, *GROUP), env={}) == ExitCode.NO_RESULT
    err = capsys.readouterr().err
    assert "no result" in err
    # What happened, and where the answer is: a reset drops the result ClusterD held (a job whose
    # client went away right after its false reply, as on Ctrl-C: nothing else reaches the operator).
    assert "a reset of the job drops the result ClusterD held" in err
    assert "the job's leader log says how the switch ended ('switch #N: replied true|false ...')" in err
    # ... and what it means when that line is not there (a stranger found no such line after a
    # ClusterD restart: the list had never reached the job)
    assert "without a 'switch #N ... received' line there, the list never reached the job" in err


def test_cli_switch_no_wait(serve: Serve, capsys: pytest.CaptureFixture[str]) -> None:
    script = StreamScript(("msg", SWITCH_FINISH))
    target = serve(SwitchNicTrack=TrackScript(), SubscribeSwitchNicSignal=script)
    assert run_switch(switch_args("--server", target, "--job", JOB, *GROUP, "--no-wait"), env={}) == 0
    assert "not waiting" in capsys.readouterr().out and script.calls == 0


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (("--server", "h:1", "--job", JOB, "--node", "n", "--dev", "0", "--op", "up"), {}, "--op: unknown value 'up'"),
        (("--server", "h:1", "--job", JOB, "--dev", "0", "--node", "n", "--op", "up"), {}, "--dev '0' comes before"),
        (("--server", "h:1", "--job", JOB, "--node", "n", "--op", "standby"), {}, "--node 'n' has no --dev"),
        (("--server", "h:1", "--job", JOB), {}, "at least one --node"),
        (("--job", JOB, *GROUP), {}, "--server: not given"),
        (("--server", "h:1", *GROUP), {}, "--job: not given"),
        (("--server", "h:x", "--job", JOB, *GROUP), {}, "--server='h:x': the port 'x' is not a number"),
        (("--job", JOB, *GROUP), {"MINDX_SERVER_IP": "clusterd"}, "MINDX_SERVER_IP='clusterd' is not an IP"),
    ],
)
def test_cli_switch_usage_errors(
    argv: tuple[str, ...], env: dict[str, str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_switch(switch_args(*argv), env=env) == ExitCode.USAGE == 2
    assert needle in capsys.readouterr().err


def test_cli_usage_errors_in_json_mode_still_print_one_object(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_switch(switch_args("--server", "h:1", "--job", JOB, "--json"), env={}) == 2
    captured = capsys.readouterr()
    assert json.loads(captured.out)["exit_code"] == 2 and "--node" in captured.err


def test_cli_argparse_rejects_bad_timeout(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        switch_args("--timeout", "-1")
    assert exited.value.code == 2
    assert "argument --timeout: '-1' must be a positive number of seconds" in capsys.readouterr().err


def test_cli_help_documents_exit_codes() -> None:
    parser = argparse.ArgumentParser()
    add_switch_arguments(parser)
    text = parser.format_help()
    for code in ExitCode:
        assert f"\n  {int(code)} " in text
    parser = argparse.ArgumentParser()
    add_watch_arguments(parser)
    assert "411" not in parser.format_help() and "\n  7 " in parser.format_help()


def test_nic_groups_from_flags_rejects_a_repeated_flag() -> None:
    flags = [("--node", "n"), ("--dev", "0"), ("--dev", "1"), ("--op", "standby")]
    with pytest.raises(ValueError, match="--dev: given twice for --node 'n'"):
        nic_groups_from_flags(flags)


@pytest.mark.parametrize(
    ("given", "env", "expected"),
    [
        ("10.0.0.1:9000", {"NICSWITCH_SERVER": "x:1"}, "10.0.0.1:9000"),
        (None, {"NICSWITCH_SERVER": "x:1", "MINDX_SERVER_IP": "10.0.0.1"}, "x:1"),
        (None, {"MINDX_SERVER_IP": "10.0.0.1"}, "10.0.0.1:8899"),
        (None, {"MINDX_SERVER_IP": "fd00::1"}, "[fd00::1]:8899"),
        (None, {"MINDX_SERVER_IP": "10.0.0.1", "LOCAL_PROXY_ENABLE": "on"}, "127.0.0.1:8899"),
        (None, {"LOCAL_PROXY_ENABLE": "ON"}, "127.0.0.1:8899"),
        ("clusterd", {}, "clusterd:8899"),
        ("[::1]", {}, "[::1]:8899"),
        ("[::1]:7000", {}, "[::1]:7000"),
    ],
)
def test_resolve_server(given: str | None, env: dict[str, str], expected: str) -> None:
    assert resolve_server(given, env) == expected


@pytest.mark.parametrize("text", ["fd00::1::x", "::1", "fd00::5:8899"])
def test_normalize_server_rejects_unbracketed_ipv6(text: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"--server={text!r}: put an IPv6 address in brackets")):
        normalize_server(text)


def test_resolve_job() -> None:
    assert resolve_job(None, {"NICSWITCH_JOB_ID": "a", "MINDX_TASK_ID": "b"}) == "a"
    assert resolve_job(None, {"MINDX_TASK_ID": "b"}) == "b"
    assert resolve_job("c", {"MINDX_TASK_ID": "b"}) == "c"
    with pytest.raises(ValueError, match="--job"):
        resolve_job(None, {})
    assert resolve_job(" c ", {}) == "c"  # spaces trimmed, as the agent trims NICSWITCH_JOB_ID and MINDX_TASK_ID
    # A control character is refused, as the agent refuses it (found by an outside check: printed raw)
    with pytest.raises(ValueError, match=r"^--job='job\\nx' has control characters: a job id never does$"):
        resolve_job("job\nx", {})
    with pytest.raises(ValueError, match=r"^MINDX_TASK_ID='b\\x01' has control characters"):
        resolve_job(None, {"MINDX_TASK_ID": "b\x01"})


def test_format_seconds() -> None:
    assert [format_seconds(s) for s in (0.0123, 1.71, 125, 960)] == ["12 ms", "1.7 s", "2 min 5 s", "16 min"]


def test_format_seconds_of_hours_days_and_what_no_flag_takes() -> None:
    """Any float: ``inf`` was an OverflowError after the switch had succeeded, ``1e308`` 300 digits."""
    assert [format_seconds(s) for s in (7200, 9000, 604800, 2_200_000)] == ["2.0 h", "2.5 h", "7 days", "25.5 days"]
    assert [format_seconds(s) for s in (math.inf, -math.inf, math.nan)] == ["inf s", "-inf s", "nan s"]
    assert format_seconds(1e308) == "1.16e+303 days"


def test_cli_watch_waits_for_the_switch(serve: Serve, capsys: pytest.CaptureFixture[str]) -> None:
    script = StreamScript(("abort", grpc.StatusCode.UNKNOWN, NOT_SWITCHING), ("msg", SWITCH_FINISH))
    target = serve(SubscribeSwitchNicSignal=script)
    assert run_watch(watch_args("--server", target, "--count", "1"), env={"MINDX_TASK_ID": JOB}) == 0
    out = capsys.readouterr().out
    assert f"watching job {JOB}" in out and "switch 1 finished, ran " in out and SWITCH_FINISH in out


def test_cli_watch_json_failure(serve: Serve, capsys: pytest.CaptureFixture[str]) -> None:
    target = serve(SubscribeSwitchNicSignal=StreamScript(("msg", "pause train timeout")))
    assert run_watch(watch_args("--server", target, "--job", JOB, "--json", "--count", "1"), env={}) == 1
    result, summary = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert result["command"] == "watch" and result["event"] == "result" and result["seq"] == 1
    assert result["message"] == "pause train timeout" and result["outcome"] == "failed" and result["exit_code"] == 1
    assert result["ran_at_most_s"] is None  # it was running when the watch began: only a lower bound
    assert summary["command"] == "watch" and summary["exit_code"] == 1 and summary["results"] == 1


def test_cli_watch_times_out_when_nothing_switches(serve: Serve, capsys: pytest.CaptureFixture[str]) -> None:
    target = serve(SubscribeSwitchNicSignal=StreamScript(("abort", grpc.StatusCode.UNKNOWN, NOT_SWITCHING)))
    assert run_watch(watch_args("--server", target, "--job", JOB, "--timeout", "0.3"), env={}) == 7
    assert NOT_SWITCHING in capsys.readouterr().err


def test_cli_watch_unreachable(closed_port: str) -> None:
    assert run_watch(watch_args("--server", closed_port, "--job", JOB), env={}) == ExitCode.RPC_ERROR


# --------------------------------------------------------------------------------------------
# End to end against the simulator
# --------------------------------------------------------------------------------------------


class Worker:
    """Plays nicswitch-agent's leader: subscribes SubscribeNotifySwitch and replies ``result``,
    once ``before_reply()`` returns (the test's own ordering, if any)."""

    def __init__(self, target: str, result: bool, before_reply: Callable[[], object] = lambda: None) -> None:
        self.channel = grpc.insecure_channel(target)
        self.stub = RecoverStub(self.channel)
        self.result = result
        self.before_reply = before_reply
        self.received: list[Any] = []
        self._stop = threading.Event()
        self._call: Any = None
        self._thread = threading.Thread(target=self._run, name="e2e-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        # Resubscribe after a clean end (controller reset) or an error (not registered yet).
        while not self._stop.is_set() and not self.received:
            self._call = self.stub.SubscribeNotifySwitch(pb.ClientInfo(jobId=JOB, role="worker"))
            try:
                for order in self._call:
                    self.received.append(order)
                    self.before_reply()
                    self.stub.ReplySwitchNicResult(pb.SwitchResult(jobId=order.jobId, result=self.result), timeout=5)
                    break
            except grpc.RpcError:
                self._stop.wait(0.05)

    def stop(self) -> None:
        self._stop.set()
        if self._call is not None:
            self._call.cancel()
        self._thread.join(2)
        self.channel.close()


@pytest.fixture
def simulator() -> Iterator[Any]:
    from nicswitch_agent.sim import SimJob, Simulator

    sim = Simulator(
        jobs=[SimJob(job_id=JOB, nodes={"node-0": ["0", "1"], "node-1": ["0", "1"]})],
        host="127.0.0.1",
        port=0,
        standin=True,
    )
    sim.start()
    try:
        assert sim.wait_idle(JOB, 5)
        yield sim
        assert sim.job_view(JOB).violations == []
    finally:
        sim.stop()


def _worker_listening(sim: Any) -> bool:
    return bool(sim.job_view(JOB).open_streams["SubscribeNotifySwitch"] >= 1)


@pytest.mark.parametrize(("result", "expected"), [(True, ExitCode.OK), (False, ExitCode.SWITCH_FAILED)])
def test_e2e_switch_against_simulator(
    simulator: Any, capsys: pytest.CaptureFixture[str], result: bool, expected: ExitCode
) -> None:
    # The reply waits for the operator's result stream: ClusterD keeps no result for a switch that
    # ended before anyone followed it (exit 8, docs/clusterd.md#the-operators-result-stream), and on
    # a loaded machine the whole switch can end before the command's subscribe (seen in CI).
    following = functools.partial(simulator.wait_until,
                                  lambda sim: sim.job_view(JOB).open_streams.get("SubscribeSwitchNicSignal", 0) >= 1, 8)
    worker = Worker(simulator.address, result, before_reply=following)
    worker.start()
    try:
        assert simulator.wait_until(_worker_listening, 5)
        args = switch_args("--server", simulator.address, "--job", JOB, *GROUP, "--timeout", "8", "--json")
        code = run_switch(args, env={})
    finally:
        worker.stop()
    data = json.loads(capsys.readouterr().out)
    assert code == expected, data
    assert data["message"] == (SWITCH_FINISH if result else "switch nic failed, switch nic failed")
    (order,) = worker.received
    assert list(order.rankID) == ["2", "3"] and list(order.op) == [True, False]
    assert simulator.job_view(JOB).om_messages == [data["message"]]


def test_e2e_busy_and_invalid_against_simulator(simulator: Any, capsys: pytest.CaptureFixture[str]) -> None:
    # No worker: the switch stays in progress (NotifySwitchNicState has no timeout), so a second
    # request is busy, and a follow has nothing to read until our own deadline.
    args = switch_args("--server", simulator.address, "--job", JOB, *GROUP, "--no-wait")
    assert run_switch(args, env={}) == ExitCode.OK
    assert run_switch(args, env={}) == ExitCode.BUSY
    assert run_watch(watch_args("--server", simulator.address, "--job", JOB, "--timeout", "0.3"), env={}) == 7
    bad = switch_args("--server", simulator.address, "--job", JOB, "--node", "node-0", "--dev", "7", "--op", "up")
    assert run_switch(bad, env={}) == ExitCode.USAGE
    bad = switch_args("--server", simulator.address, "--job", JOB, "--node", "node-0", "--dev", "7", "--op", "standby")
    assert run_switch(bad, env={}) == ExitCode.INVALID  # parameters are checked before "busy"
    err = capsys.readouterr().err
    assert BUSY_INFO in err and "device:7 not exist in node:node-0" in err


# --------------------------------------------------------------------------------------------
# ClusterD lost while the result is awaited: one line each way, then a bounded wait
# --------------------------------------------------------------------------------------------


def test_follow_says_once_when_clusterd_is_lost_and_once_when_it_is_back(serve: Serve) -> None:
    lost = ("abort", grpc.StatusCode.UNAVAILABLE, "Connection refused")
    script = StreamScript(lost, lost, lost, ("msg", SWITCH_FINISH))
    notes: list[str] = []
    with OmClient(serve(SubscribeSwitchNicSignal=script)) as client:
        outcome = client.follow(JOB, 30, server_seen=True, max_unreachable_s=30, on_note=notes.append)
    assert outcome.kind is OutcomeKind.FINISHED and script.calls == 4
    assert len(notes) == 2, notes  # not one per retry
    assert re.fullmatch(r"ClusterD unreachable since \d\d:\d\d:\d\d: UNAVAILABLE: Connection refused; still "
                        r"waiting for the result, Ctrl-C to stop", notes[0]), notes[0]
    assert re.fullmatch(r"ClusterD answers again, after \d+\.\d s unreachable", notes[1]), notes[1]


def test_follow_gives_up_on_a_clusterd_unreachable_for_max_unreachable(serve: Serve) -> None:
    script = StreamScript(("abort", grpc.StatusCode.UNAVAILABLE, "Connection refused"))
    with OmClient(serve(SubscribeSwitchNicSignal=script)) as client:
        outcome = client.follow(JOB, 60, server_seen=True, max_unreachable_s=0.3)
    assert outcome.kind is OutcomeKind.UNREACHABLE and outcome.rpc_code == "UNAVAILABLE"
    assert "ClusterD unreachable for " in outcome.detail and "(limit 0.3 s): UNAVAILABLE: Connection refused" in \
        outcome.detail
    assert exit_code_for(outcome) is ExitCode.RPC_ERROR


def test_cli_switch_clusterd_lost_while_waiting_exits_6(serve: Serve, capsys: pytest.CaptureFixture[str]) -> None:
    script = StreamScript(("abort", grpc.StatusCode.UNAVAILABLE, "Connection refused"))
    target = serve(SwitchNicTrack=TrackScript(), SubscribeSwitchNicSignal=script)
    args = switch_args("--server", target, "--job", JOB, *GROUP, "--max-unreachable", "0.3")
    assert run_switch(args, env={}) == ExitCode.RPC_ERROR
    err = capsys.readouterr().err
    assert err.count("ClusterD unreachable since ") == 1, err
    assert "gave up after " in err and "the switch may still be running on ClusterD's side" in err
    assert f"nicswitch-agent watch --server {target} --job {JOB} --count 1" in err


def test_the_operator_channel_has_no_transparent_retries_and_the_agents_has() -> None:
    """A stream opened as a simulator stopped could hang for good inside gRPC's transparent retry
    (about 1 in 130 such opens here; ChannelSettings.transparent_retries): the operator tools retry
    on their own and turn it off. The agent keeps it for its replies."""
    with OmClient("127.0.0.1:1") as client:
        settings = settings_of(client._channel)
        assert settings is not None and not settings.transparent_retries
        assert ("grpc.enable_retries", 0) in settings.options()
    assert ("grpc.enable_retries", 0) not in ChannelSettings(target="127.0.0.1:1").options()
