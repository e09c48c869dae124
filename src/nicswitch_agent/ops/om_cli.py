"""``nicswitch-agent switch`` and ``nicswitch-agent watch``: the operator's commands.

``switch`` calls SwitchNicTrack, then follows SubscribeSwitchNicSignal and says what happened
(a few plain lines, or one JSON object with ``--json``). ``watch`` only follows, every switch of
the job, printing each result as it arrives (one line, or one JSON object per line with
``--json``) until ``--count`` results, ``--timeout`` or Ctrl-C; start it before the switches.

Exit codes (also in ``--help``):

===  ==========================================================================================
0    the switch finished ("switch nic finish"); ``switch --no-wait``: accepted
1    the switch failed: ClusterD sent a failure message (it now recovers or restarts the job)
2    usage error
3    busy (411): another switch or a fault recovery is running for the job
4    invalid request (413): ClusterD's reason is printed
5    ClusterD answered another non-zero code
6    ClusterD unreachable (also: for ``--max-unreachable`` while waiting), or another gRPC error
7    timed out waiting for the result
8    no result: the result stream ended without a message, or ClusterD is not switching the job
130  interrupted (Ctrl-C); an accepted switch goes on inside ClusterD
===  ==========================================================================================

``watch`` exits 0 when every result it printed was "switch nic finish", else with the code of the
first one that was not (1 or 8); 7 when ``--timeout`` passed before ``--count`` results (without
``--count``: before any result); 6 and 130 as above.

The lead wires these into ``cli.py``::

    p = sub.add_parser("switch", help=SWITCH_HELP); add_switch_arguments(p); ... run_switch(args)
"""

from __future__ import annotations

import argparse
import datetime
import enum
import json
import os
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from nicswitch_agent.config import parse_server, server_from_mindcluster, tls_from_env
from nicswitch_agent.ops.ctrl_c import call_beside_ctrl_c
from nicswitch_agent.ops.durations import format_seconds, seconds
from nicswitch_agent.ops.om import (
    DEFAULT_FOLLOW_TIMEOUT_S,
    DEFAULT_MAX_UNREACHABLE_S,
    DEFAULT_RPC_TIMEOUT_S,
    DEFAULT_WATCH_POLL_S,
    NicOps,
    OmClient,
    OmRpcError,
    Outcome,
    OutcomeKind,
    SwitchBusy,
    SwitchInvalid,
    SwitchRejected,
    WatchedSwitch,
    describe_nic_ops,
    op_name,
    parse_nic_groups,
)


class ExitCode(enum.IntEnum):
    """Process exit codes of ``switch`` and ``watch`` (see the module docstring)."""

    OK = 0
    SWITCH_FAILED = 1
    USAGE = 2
    BUSY = 3
    INVALID = 4
    REJECTED = 5
    RPC_ERROR = 6
    TIMED_OUT = 7
    NO_RESULT = 8
    INTERRUPTED = 130


_OUTCOME_EXIT: dict[OutcomeKind, ExitCode] = {
    OutcomeKind.FINISHED: ExitCode.OK,
    OutcomeKind.FAILED: ExitCode.SWITCH_FAILED,
    OutcomeKind.NO_RESULT: ExitCode.NO_RESULT,
    OutcomeKind.NOT_SWITCHING: ExitCode.NO_RESULT,
    OutcomeKind.NOT_REGISTERED: ExitCode.NO_RESULT,
    OutcomeKind.TIMED_OUT: ExitCode.TIMED_OUT,
    OutcomeKind.RPC_ERROR: ExitCode.RPC_ERROR,
    OutcomeKind.UNREACHABLE: ExitCode.RPC_ERROR,
    OutcomeKind.CANCELLED: ExitCode.INTERRUPTED,
}


def exit_code_for(outcome: Outcome) -> ExitCode:
    """The exit code for a followed switch."""
    return _OUTCOME_EXIT[outcome.kind]


SWITCH_HELP = "request a link switch (SwitchNicTrack) and wait for ClusterD's result"
WATCH_HELP = "print the result of each link switch of a job as it arrives (SubscribeSwitchNicSignal)"

_EXIT_LINES = {
    ExitCode.OK: '0    the switch finished ("switch nic finish")',
    ExitCode.SWITCH_FAILED: "1    the switch failed (ClusterD's message is printed; the job goes to recovery)",
    ExitCode.USAGE: "2    usage error",
    ExitCode.BUSY: "3    busy (411): another switch or a fault recovery is running for the job",
    ExitCode.INVALID: "4    invalid request (413): ClusterD's reason is printed",
    ExitCode.REJECTED: "5    ClusterD answered another non-zero code",
    ExitCode.RPC_ERROR: "6    ClusterD unreachable (while waiting: for --max-unreachable), or another gRPC error",
    ExitCode.TIMED_OUT: "7    timed out waiting for the result",
    ExitCode.NO_RESULT: "8    no result: the stream ended without a message, or the job is not switching",
    ExitCode.INTERRUPTED: "130  interrupted (Ctrl-C); an accepted switch goes on inside ClusterD",
}

# --server and --job of every command that dials ClusterD for a job (switch, watch, doctor, launch):
# the sources in the order they apply (config.py: an explicit value, NICSWITCH_SERVER, the local
# proxy, MINDX_SERVER_IP).
SERVER_HELP = (
    "ClusterD address host:port (default: $NICSWITCH_SERVER, else 127.0.0.1:8899 if "
    "LOCAL_PROXY_ENABLE=on, else $MINDX_SERVER_IP:8899)"
)
JOB_HELP = "job id, ClusterD's job key (default: $NICSWITCH_JOB_ID, else $MINDX_TASK_ID)"

SWITCH_EPILOG = (
    "example:\n"
    "  nicswitch-agent switch --job J --node node-1 --dev 0,1 --op standby \\\n"
    "                         --node node-2 --dev 3 --op primary\n\n"
    "ops: standby|backup|true = standby NIC, primary|false = primary NIC; one op applies to all\n"
    "devices of its --node, or give one per device.\n\n"
    "exit codes:\n  " + "\n  ".join(_EXIT_LINES.values()) + "\n  with --no-wait, 0 means accepted."
)
WATCH_EPILOG = (
    "Start watch before the switches: ClusterD keeps no result, and accepts a follower only while a switch\n"
    "runs, so watch asks every --poll seconds while none runs and holds the result stream while one does.\n"
    "Each result is printed as it arrives, with how long the switch ran: from when watch last saw no switch\n"
    "running (or 'at least', from when it first saw this one running, if it was running when watch began).\n"
    "ClusterD gives the result to one follower only: do not watch a job whose `switch` is waiting.\n\n"
    "exit codes (after --count results, --timeout or Ctrl-C):\n"
    "  0    every result printed was \"switch nic finish\"\n"
    "  1    the first result that was not: a failure (the job goes to recovery)\n"
    "  6    ClusterD unreachable: at start, or for --max-unreachable once it answered; or another gRPC error\n"
    "  7    --timeout passed before --count results (without --count: before any result)\n"
    "  8    the first result that was not a success: a switch ended without a result message\n"
    "  2    usage error; 130 interrupted (Ctrl-C)"
)


# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------


class _NicFlag(argparse.Action):
    """Records ``--node/--dev/--op`` in command-line order, so each group is exactly the flags
    that follow its ``--node`` (argparse's ``append`` would lose that pairing)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        flags = list(getattr(namespace, self.dest, None) or [])
        flags.append((self.option_strings[0], str(values)))
        setattr(namespace, self.dest, flags)


def _adopt_help(parser: argparse.ArgumentParser, epilog: str) -> None:
    """Add our epilog unless the caller set one; keep its line breaks."""
    if parser.epilog is None:
        parser.epilog = epilog
        if parser.formatter_class is argparse.HelpFormatter:
            parser.formatter_class = argparse.RawDescriptionHelpFormatter


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return value


def _add_common(parser: argparse.ArgumentParser, *, watch: bool = False) -> None:
    parser.add_argument("--server", metavar="HOST:PORT", help=SERVER_HELP)
    parser.add_argument("--job", metavar="JOB_ID", help=JOB_HELP)
    parser.add_argument("--job-id", dest="job", help=argparse.SUPPRESS)  # launch's first name for it
    if watch:
        parser.add_argument("--timeout", type=seconds(), default=None, metavar="S",
                            help="stop watching after S seconds (default: no limit; Ctrl-C stops it)")
        parser.add_argument("--json", action="store_true",
                            help="print one JSON object per line: one per result, then one summary")
    else:
        parser.add_argument(
            "--timeout",
            type=seconds(),
            default=DEFAULT_FOLLOW_TIMEOUT_S,
            metavar="S",
            help="how long to wait for the result, seconds (default: %(default)g, "
            "a minute past ClusterD's own 15-min waits)",
        )
        parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_tls_arguments(parser)


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """``--tls`` and ``--tls-*``: TLS to ClusterD (also for ``doctor``); see :func:`tls_overrides`."""
    group = parser.add_argument_group(
        "TLS (ClusterD itself serves plaintext, and so does a LOCAL_PROXY_ENABLE sidecar; "
        "each option defaults to its NICSWITCH_TLS* variable)"
    )
    group.add_argument("--tls", action="store_true", default=None,
                       help="dial over TLS, trusting gRPC's default roots unless --tls-ca is given "
                            "(implied by any --tls-* option)")
    group.add_argument("--tls-ca", metavar="PEM", help="CA certificate(s) that signed the server's certificate")
    group.add_argument("--tls-cert", metavar="PEM", help="client certificate, for a server that requires one (mTLS)")
    group.add_argument("--tls-key", metavar="PEM", help="unencrypted private key of --tls-cert")
    group.add_argument("--tls-server-name", metavar="NAME",
                       help="the name the server's certificate must hold, when it is not the --server host")


def tls_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--tls*`` flags as AgentConfig settings (None: not given, so NICSWITCH_TLS* applies)."""
    return {
        "tls": getattr(args, "tls", None),
        "tls_ca_file": getattr(args, "tls_ca", None),
        "tls_cert_file": getattr(args, "tls_cert", None),
        "tls_key_file": getattr(args, "tls_key", None),
        "tls_server_name": getattr(args, "tls_server_name", None),
    }


# The subcommands' parsers keep line breaks (RawDescriptionHelpFormatter, for the epilogs' tables).
SWITCH_DESCRIPTION = """\
Ask ClusterD to move devices of a job to their standby or primary NICs (SwitchNicTrack), then
follow the switch (SubscribeSwitchNicSignal) and say how it ended: "switch nic finish", a failure
(the job goes to recovery) or no result. ClusterD refuses a job that has not registered at once
(413): the job's agent (or its MindIO) must be running."""
WATCH_DESCRIPTION = """\
Follow a job's link switches, whoever asks for them, and print the result of each one as it
arrives (SubscribeSwitchNicSignal), until --count results, --timeout or Ctrl-C."""


def add_switch_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``nicswitch-agent switch``."""
    if parser.description is None:
        parser.description = SWITCH_DESCRIPTION
    _add_common(parser)
    group = parser.add_argument_group("devices (repeat --node/--dev/--op for more nodes)")
    group.add_argument("--node", dest="nic_flags", action=_NicFlag, metavar="NODE", help="k8s node name of the devices")
    group.add_argument(
        "--dev", dest="nic_flags", action=_NicFlag, metavar="IDS", help="device ids on the node, e.g. 0,1"
    )
    group.add_argument(
        "--op",
        dest="nic_flags",
        action=_NicFlag,
        metavar="OPS",
        help="standby|primary (aliases backup|true, false), one or one per device",
    )
    parser.add_argument(
        "--rpc-timeout",
        type=seconds(),
        default=DEFAULT_RPC_TIMEOUT_S,
        metavar="S",
        help="deadline of the SwitchNicTrack call, seconds (default: %(default)g)",
    )
    add_max_unreachable_argument(parser, "while waiting for the result", "the switch may still run there")
    parser.add_argument("--no-wait", action="store_true", help="exit once ClusterD accepts the request (exit code 0)")
    _adopt_help(parser, SWITCH_EPILOG)


def add_max_unreachable_argument(parser: argparse.ArgumentParser, when: str, caveat: str) -> None:
    """``--max-unreachable S`` (exit 6), one flag for ``switch`` and ``watch`` with one meaning and
    default: ``client.follow``/``watch``'s ``max_unreachable_s``. ``when``/``caveat`` fit the help
    to the command."""
    parser.add_argument(
        "--max-unreachable",
        type=seconds(),
        default=DEFAULT_MAX_UNREACHABLE_S,
        metavar="S",
        help=f"{when}, give up (exit 6) when ClusterD has not answered for S seconds "
        f"(default: %(default)g, for switch and watch alike); {caveat}",
    )


def add_watch_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``nicswitch-agent watch``."""
    if parser.description is None:
        parser.description = WATCH_DESCRIPTION
    _add_common(parser, watch=True)
    parser.add_argument("--count", type=positive_int, default=None, metavar="N",
                        help="stop after N results (default: no limit)")
    parser.add_argument("--poll", type=seconds(), default=DEFAULT_WATCH_POLL_S, metavar="S",
                        help="while no switch runs, ask ClusterD every S seconds (default: %(default)g); a "
                             "switch shorter than this can be missed")
    add_max_unreachable_argument(parser, "once ClusterD has answered",
                                 "switches that end meanwhile go unseen; unreachable at start: exit 6 at once")
    _adopt_help(parser, WATCH_EPILOG)


def nic_groups_from_flags(flags: Sequence[tuple[str, str]]) -> list[tuple[str, str, str]]:
    """Split the ordered ``--node/--dev/--op`` flags into ``(node, devs, ops)`` groups.

    Raises:
        ValueError: a ``--dev``/``--op`` before any ``--node``, given twice, or missing.
    """
    groups: list[dict[str, str]] = []
    for flag, value in flags:
        if flag == "--node":
            groups.append({"--node": value})
            continue
        if not groups:
            raise ValueError(f"{flag} {value!r} comes before any --node")
        current = groups[-1]
        if flag in current:
            raise ValueError(
                f"{flag}: given twice for --node {current['--node']!r} ({current[flag]!r}, {value!r}); "
                "each --node takes one --dev and one --op"
            )
        current[flag] = value
    if not groups:
        raise ValueError("--node: at least one --node/--dev/--op group is required")
    for group in groups:
        for flag in ("--dev", "--op"):
            if flag not in group:
                raise ValueError(f"--node {group['--node']!r} has no {flag} (give it after that --node)")
    return [(g["--node"], g["--dev"], g["--op"]) for g in groups]


def normalize_server(text: str, source: str = "--server") -> str:
    """``--server`` (or ``source``) in the agent's one grammar (:func:`~nicswitch_agent.config.parse_server`):
    ``host:port``, a bare host or IP getting ``:8899``, IPv6 in brackets.

    Raises:
        ValueError: naming ``source`` and the value, in the agent's words (a ConfigError).
    """
    return parse_server(text, source)


def resolve_server(given: str | None, env: Mapping[str, str]) -> str:
    """``--server``, else the agent's discovery: NICSWITCH_SERVER, the local mTLS proxy when
    LOCAL_PROXY_ENABLE=on (it wins over MINDX_SERVER_IP, as in taskd's GetClusterdAddr), else
    MINDX_SERVER_IP:8899. Every value is read by the agent's own parser, so the decisions and
    the messages are the library's.

    Raises:
        ValueError: nothing set, or a malformed value (named with where it came from).
    """
    if given is not None:
        return normalize_server(given)
    explicit = env.get("NICSWITCH_SERVER", "").strip()
    if explicit:
        return normalize_server(explicit, "NICSWITCH_SERVER")
    discovered = server_from_mindcluster(env)  # the agent's own rule, so both always agree
    if discovered:
        return discovered
    raise ValueError("--server: not given, and none of NICSWITCH_SERVER, MINDX_SERVER_IP, LOCAL_PROXY_ENABLE=on")


def resolve_job(given: str | None, env: Mapping[str, str]) -> str:
    """``--job``, else NICSWITCH_JOB_ID, else MINDX_TASK_ID.

    Raises:
        ValueError: none set.
    """
    for name, value in (("--job", given), ("NICSWITCH_JOB_ID", env.get("NICSWITCH_JOB_ID")),
                        ("MINDX_TASK_ID", env.get("MINDX_TASK_ID"))):
        if value is not None and value.strip():
            if any(ord(c) < 32 or ord(c) == 127 for c in value.strip()):  # as the agent refuses it
                raise ValueError(f"{name}={value!r} has control characters: a job id never does")
            return value.strip()
    if given is not None:
        raise ValueError("--job: empty value")
    raise ValueError("--job: not given, and neither NICSWITCH_JOB_ID nor MINDX_TASK_ID is set")


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


# Every key of ``switch --json``, in every outcome (None where it is not known): a script reads
# them without checking which ones a given ending left out (docs/operations.md, What the operator sees).
SWITCH_JSON_KEYS = ("command", "server", "job", "tls", "request", "accepted", "status", "outcome", "message",
                    "detail", "elapsed_s", "attempts", "rpc_code", "error", "exit_code", "result")


class _Report:
    """Prints human lines as they happen, or collects one JSON object printed at the end.

    ``keys``: the keys the object always has (None until set), in this order.
    """

    def __init__(self, command: str, as_json: bool, keys: tuple[str, ...] = ()) -> None:
        self.as_json = as_json
        self.data: dict[str, Any] = {**dict.fromkeys(keys), "command": command}

    def say(self, text: str, *, error: bool = False) -> None:
        if not self.as_json:
            print(text, file=sys.stderr if error else sys.stdout, flush=True)

    def done(self, code: ExitCode, **fields: Any) -> int:
        self.data.update(fields)
        self.data["exit_code"] = int(code)
        self.data["result"] = code.name.lower()
        if self.as_json:
            print(json.dumps(self.data), flush=True)
        return int(code)

    def usage(self, prog: str, message: str) -> int:
        print(f"nicswitch-agent {prog}: error: {message}", file=sys.stderr, flush=True)
        return self.done(ExitCode.USAGE, error=message)


def watch_command(server: str, job_id: str, args: argparse.Namespace) -> str:
    """The ``watch`` command that follows this switch, ready to paste: the same server, job and
    ``--tls*`` flags (NICSWITCH_TLS* apply in the same shell anyway), and ``--count 1``."""
    argv = ["nicswitch-agent", "watch", "--server", server, "--job", job_id]
    if getattr(args, "tls", None):
        argv.append("--tls")
    for flag in ("tls_ca", "tls_cert", "tls_key", "tls_server_name"):
        value = getattr(args, flag, None)
        if value is not None:
            argv += ["--" + flag.replace("_", "-"), str(value)]
    return shlex.join([*argv, "--count", "1"])


def _request_json(nic_ops: NicOps) -> dict[str, Any]:
    return {node: {"dev": list(devs), "op": [op_name(op) for op in ops]} for node, (devs, ops) in nic_ops.items()}


def _outcome_json(outcome: Outcome) -> dict[str, Any]:
    return {
        "outcome": outcome.kind.value,
        "message": outcome.message,
        "detail": outcome.detail or None,
        "elapsed_s": round(outcome.elapsed_s, 3),
        "attempts": outcome.attempts,
    }


def _say_outcome(report: _Report, outcome: Outcome, job_id: str, elapsed_s: float, *, hint: str = "") -> None:
    took = format_seconds(elapsed_s)
    kind = outcome.kind
    if kind is OutcomeKind.FINISHED:
        report.say(f"switch finished after {took}: {outcome.message}")
    elif kind is OutcomeKind.FAILED:
        report.say(f"switch FAILED after {took}: {outcome.message}")
        report.say("ClusterD now recovers or restarts the job (often with a checkpoint); check it before retrying.")
    elif kind is OutcomeKind.TIMED_OUT:
        report.say(f"timed out after {took}: {outcome.detail}", error=True)
        if hint:
            report.say(f"the switch may still be running: {hint}", error=True)
    elif kind is OutcomeKind.RPC_ERROR:
        report.say(f"gRPC error after {took}: {outcome.detail}", error=True)
    elif kind is OutcomeKind.UNREACHABLE:
        report.say(f"gave up after {took}: {outcome.detail}", error=True)
        report.say("the switch may still be running on ClusterD's side (ClusterD keeps no result). Once ClusterD "
                   f"is back, `{hint}` prints its result if it still runs (it waits for one: Ctrl-C); the job's leader "
                   "log ('switch #N: replied true|false ...') or `nicswitch-agent status` on the leader's pod says "
                   "how it ended", error=True)
    elif kind is OutcomeKind.CANCELLED:
        report.say(f"stopped waiting after {took}", error=True)
    elif kind is OutcomeKind.NOT_REGISTERED:
        report.say(f"no result: ClusterD does not know job {job_id} ({outcome.detail})", error=True)
    elif kind is OutcomeKind.NOT_SWITCHING:
        report.say(f"no result: ClusterD is not switching job {job_id} ({outcome.detail})", error=True)
    else:
        report.say(f"no result after {took}: {outcome.detail}; check the job", error=True)
    if kind in (OutcomeKind.NO_RESULT, OutcomeKind.NOT_SWITCHING):
        report.say("ClusterD keeps no result: the job's leader log says how the switch ended "
                   "('switch #N: replied true|false ...'); without a 'switch #N ... received' line there, "
                   "the list never reached the job (ClusterD restarted, or the job went away first) and "
                   "nothing was switched", error=True)


# --------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------


def run_switch(args: argparse.Namespace, *, env: Mapping[str, str] | None = None) -> int:
    """``nicswitch-agent switch``: request, follow, report; returns the exit code."""
    env = os.environ if env is None else env
    report = _Report("switch", args.json, SWITCH_JSON_KEYS)
    started = time.monotonic()
    try:
        server = resolve_server(args.server, env)
        job_id = resolve_job(args.job, env)
        nic_ops = parse_nic_groups(nic_groups_from_flags(args.nic_flags or []))
        tls = tls_from_env(env, **tls_overrides(args))
        client = OmClient(server, rpc_timeout_s=args.rpc_timeout, tls=tls)
    except ValueError as exc:  # ConfigError (a TLS setting) is a ValueError too
        return report.usage("switch", str(exc))
    report.data.update(server=server, job=job_id, tls=tls is not None, request=_request_json(nic_ops))
    report.say(f"switch job {job_id} on {server}{' (TLS)' if tls else ''}: {describe_nic_ops(nic_ops)}")

    with client:
        try:
            accepted = call_beside_ctrl_c(lambda: client.switch(job_id, nic_ops), client.close)
        except ValueError as exc:  # what parsing let through but the request check refuses
            return report.usage("switch", str(exc))
        except SwitchRejected as exc:
            code, label = _rejection(exc)
            report.say(f"rejected ({exc.code}, {label}): {exc.info}", error=True)
            if code is ExitCode.BUSY:
                report.say("another switch or a fault recovery is running for this job; retry later", error=True)
            return report.done(code, accepted=False, status={"code": exc.code, "info": exc.info}, outcome="rejected",
                               detail=exc.info, elapsed_s=round(time.monotonic() - started, 3))
        except OmRpcError as exc:
            if exc.maybe_delivered:
                report.say(
                    f"no answer from ClusterD at {server} within {args.rpc_timeout:g} s; the switch may have "
                    f"been accepted: {watch_command(server, job_id, args)}",
                    error=True,
                )
            else:
                report.say(f"cannot reach ClusterD at {server}: {exc.code}: {exc.details}", error=True)
            return report.done(ExitCode.RPC_ERROR, accepted=None, rpc_code=exc.code, detail=exc.details,
                               outcome=OutcomeKind.RPC_ERROR.value, elapsed_s=round(time.monotonic() - started, 3))
        except KeyboardInterrupt:
            report.say("interrupted before ClusterD answered; the switch may have been accepted", error=True)
            return report.done(ExitCode.INTERRUPTED, accepted=None, outcome=OutcomeKind.CANCELLED.value,
                               detail="interrupted before ClusterD answered",
                               elapsed_s=round(time.monotonic() - started, 3))

        report.data.update(accepted=True, status={"code": 0, "info": accepted.info})
        report.say(f"accepted ({format_seconds(accepted.rpc_s)}): {accepted.info}")
        if args.no_wait:
            report.say(f"not waiting for the result; follow it with: {watch_command(server, job_id, args)}")
            return report.done(ExitCode.OK, outcome="accepted", elapsed_s=round(accepted.rpc_s, 3))
        report.say(f"waiting for the result (up to {format_seconds(args.timeout)})...")
        try:
            outcome = call_beside_ctrl_c(
                lambda: client.follow(job_id, args.timeout, server_seen=True, max_unreachable_s=args.max_unreachable,
                                      on_note=lambda text: report.say(text, error=True)),
                client.close)
        except KeyboardInterrupt:
            report.say(f"interrupted; the switch goes on inside ClusterD; follow it with: "
                       f"{watch_command(server, job_id, args)}", error=True)
            return report.done(ExitCode.INTERRUPTED, outcome=OutcomeKind.CANCELLED.value,
                               detail="interrupted while waiting for the result; the switch goes on inside ClusterD; "
                                      f"follow it with: {watch_command(server, job_id, args)}",
                               elapsed_s=round(time.monotonic() - started, 3))
    elapsed = accepted.rpc_s + outcome.elapsed_s
    _say_outcome(report, outcome, job_id, elapsed, hint=watch_command(server, job_id, args))
    return report.done(exit_code_for(outcome), **{**_outcome_json(outcome), "elapsed_s": round(elapsed, 3)})


def _rejection(exc: SwitchRejected) -> tuple[ExitCode, str]:
    if isinstance(exc, SwitchBusy):
        return ExitCode.BUSY, "busy"
    if isinstance(exc, SwitchInvalid):
        return ExitCode.INVALID, "invalid request"
    return ExitCode.REJECTED, "refused"


def _duration(result: WatchedSwitch) -> str:
    """How long the switch ran, as far as the watch can know (see WATCH_EPILOG)."""
    least = format_seconds(result.at_least_s)
    if result.at_most_s is None:
        return f"at least {least} (it was running when watch began)"
    most = format_seconds(result.at_most_s)
    return least if most == least else f"{least} to {most}"


def _say_result(report: _Report, result: WatchedSwitch) -> None:
    outcome = result.outcome
    clock = time.strftime("%H:%M:%S", time.localtime(result.wall_time))
    ran = _duration(result)
    if outcome.kind is OutcomeKind.FINISHED:
        report.say(f"{clock} switch {result.seq} finished, ran {ran}: {outcome.message}")
    elif outcome.kind is OutcomeKind.FAILED:
        report.say(f"{clock} switch {result.seq} FAILED, ran {ran}: {outcome.message} (ClusterD now recovers or "
                   "restarts the job)")
    else:
        report.say(f"{clock} switch {result.seq}: no result, ran {ran}: {outcome.detail}")
    if report.as_json:
        print(json.dumps({
            "command": "watch", "event": "result", "job": report.data.get("job"), "seq": result.seq,
            "outcome": outcome.kind.value, "message": outcome.message, "detail": outcome.detail or None,
            "exit_code": int(exit_code_for(outcome)),
            "at": datetime.datetime.fromtimestamp(result.wall_time).astimezone().isoformat(timespec="milliseconds"),
            "ran_at_least_s": round(result.at_least_s, 3),
            "ran_at_most_s": None if result.at_most_s is None else round(result.at_most_s, 3),
        }), flush=True)


def run_watch(args: argparse.Namespace, *, env: Mapping[str, str] | None = None) -> int:
    """``nicswitch-agent watch``: print each switch's result as it arrives; returns the exit code."""
    env = os.environ if env is None else env
    report = _Report("watch", args.json)
    started = time.monotonic()
    try:
        server = resolve_server(args.server, env)
        job_id = resolve_job(args.job, env)
        tls = tls_from_env(env, **tls_overrides(args))
        client = OmClient(server, tls=tls)
    except ValueError as exc:  # ConfigError (a TLS setting) is a ValueError too
        return report.usage("watch", str(exc))
    report.data.update(server=server, job=job_id, tls=tls is not None)
    limits = [f"{args.count} result(s)" if args.count else "", format_seconds(args.timeout) if args.timeout else ""]
    until = " or ".join(x for x in limits if x) or "Ctrl-C"
    report.say(f"watching job {job_id} on {server}{' (TLS)' if tls else ''}, until {until}...")
    results: list[WatchedSwitch] = []

    def on_result(result: WatchedSwitch) -> None:
        results.append(result)
        _say_result(report, result)

    def on_note(text: str) -> None:
        report.say(text, error=True)

    with client:
        try:
            end = call_beside_ctrl_c(
                lambda: client.watch(job_id, on_result, count=args.count, timeout_s=args.timeout, poll_s=args.poll,
                                     max_unreachable_s=args.max_unreachable, on_note=on_note),
                client.close)
        except KeyboardInterrupt:
            report.say(f"stopped after {len(results)} result(s)", error=True)
            return report.done(ExitCode.INTERRUPTED, results=len(results))
    failures = [exit_code_for(r.outcome) for r in results if r.outcome.kind is not OutcomeKind.FINISHED]
    code = failures[0] if failures else ExitCode.OK
    if end.stopped is OutcomeKind.RPC_ERROR:
        # UNAVAILABLE ends a watch only before ClusterD answered (later it is retried): say it as switch does.
        unreachable = end.rpc_code == "UNAVAILABLE"
        report.say(f"cannot reach ClusterD at {server}: {end.detail}" if unreachable else f"gRPC error: {end.detail}",
                   error=True)
        return report.done(ExitCode.RPC_ERROR, results=len(results), rpc_code=end.rpc_code, detail=end.detail)
    if end.stopped is OutcomeKind.UNREACHABLE:
        report.say(f"gave up after {format_seconds(time.monotonic() - started)}: {end.detail}", error=True)
        report.say("a switch that ended meanwhile was not seen (ClusterD keeps no result): the job's leader log "
                   "('switch #N: replied true|false ...') or `nicswitch-agent status` on the leader's pod says how "
                   "it ended", error=True)
        return report.done(ExitCode.RPC_ERROR, results=len(results), rpc_code=end.rpc_code, detail=end.detail)
    if end.stopped is OutcomeKind.TIMED_OUT:
        if args.count or not results:  # fewer results than asked for
            report.say(f"timed out: {end.detail}", error=True)
            return report.done(ExitCode.TIMED_OUT, results=len(results), detail=end.detail)
        report.say(f"stopped after {format_seconds(args.timeout)}: {len(results)} result(s)")
    if end.stopped is OutcomeKind.CANCELLED:
        return report.done(ExitCode.INTERRUPTED, results=len(results))
    return report.done(code, results=len(results))


__all__ = [
    "JOB_HELP",
    "SERVER_HELP",
    "SWITCH_DESCRIPTION",
    "SWITCH_EPILOG",
    "SWITCH_HELP",
    "WATCH_DESCRIPTION",
    "WATCH_EPILOG",
    "WATCH_HELP",
    "ExitCode",
    "add_max_unreachable_argument",
    "add_switch_arguments",
    "add_tls_arguments",
    "add_watch_arguments",
    "exit_code_for",
    "format_seconds",
    "nic_groups_from_flags",
    "normalize_server",
    "resolve_job",
    "resolve_server",
    "run_switch",
    "run_watch",
    "tls_overrides",
    "watch_command",
]
