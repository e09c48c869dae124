"""``nicswitch-agent``: the command line.

Subcommands:
  demo    failover + switchback against the embedded simulator, with a timeline (ranks as threads, or
          with --processes as real torch processes)
  sim     run the ClusterD-compatible simulator (for rehearsals and tests)
  switch  O&M: ask ClusterD to switch NICs and wait for the outcome
  watch   O&M: follow a job's switch result stream
  doctor  check that this pod is ready for link switches (exit code 0: ready)
  status  show the running agent's state from its status file (NICSWITCH_STATUS_FILE)
  launch  run a training command (e.g. torchrun) with the job's leader in this process
  timeline draw a job's switches from its events files (one HTML page, no network needed)
  version print the version (also ``--version``)

Every command ends with 130 on Ctrl-C and with 141 (128 + SIGPIPE) when the reader of its output
goes away (``| head``), without a traceback, once :func:`console` runs (a Ctrl-C in the
interpreter's own start-up or the package's first imports, before it, is Python's: a traceback
and death by SIGINT).

``-v/--verbose`` (DEBUG logging) is accepted before and after the command. The demo (and its
simulator run) is imported only when it runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

Runner = Callable[..., Any]
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: an argument it does not know is its own usage error.

    argparse hands a subcommand's leftovers back to the top-level parser, which then prints the
    top-level usage (``nicswitch-agent [-h] [-v] [--version] COMMAND ...``) for a mistyped
    ``switch`` option; the user needs ``switch``'s usage.
    """

    _json = False  # --json among this command's arguments: a usage error is one JSON object too

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self._json = "--json" in (sys.argv[1:] if args is None else args)
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras

    def error(self, message: str) -> NoReturn:
        """As argparse's (usage and message on stderr, exit 2); with ``--json`` also the object a
        script reads (``switch``: every key it always has, docs/operations.md)."""
        if self._json:
            import json

            from nicswitch_agent.ops.om_cli import SWITCH_JSON_KEYS

            command = self.prog.rsplit(" ", 1)[-1]
            keys = SWITCH_JSON_KEYS if command == "switch" else ()
            print(json.dumps({**dict.fromkeys(keys), "command": command, "error": message, "exit_code": 2,
                              "result": "usage"}), flush=True)
        super().error(message)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nicswitch-agent",
        description="Training-side client for MindCluster ClusterD's link failover and switchback.",
    )
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log at DEBUG level (the demo's rank processes at INFO)")
    parser.add_argument("--version", action="version", version=f"nicswitch-agent {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_CommandParser)
    sub.required = True

    import nicswitch_agent.sim.cli as sim_cli
    from nicswitch_agent.ops import doctor, launcher, om_cli, status_cli, timeline_cli

    # (name, help, add_arguments, run): each command module owns its flags and its behaviour.
    commands: list[tuple[str, str, Callable[[argparse.ArgumentParser], None] | None, Runner]] = [
        ("demo", "run a failover and a switchback against the embedded simulator", _add_demo_arguments,
         _run_demo),
        ("sim", "run the ClusterD-compatible simulator", sim_cli.add_arguments, sim_cli.run),
        ("switch", "O&M: switch NICs of a job and wait for the outcome", om_cli.add_switch_arguments,
         om_cli.run_switch),
        ("watch", "O&M: follow a job's switch result stream", om_cli.add_watch_arguments, om_cli.run_watch),
        ("doctor", "check that this pod is ready for link switches (exit 0: ready)", doctor.add_arguments,
         doctor.run),
        ("status", "show the running agent's state from its status file", status_cli.add_arguments,
         status_cli.run),
        ("launch", "run a training command with the job's leader in this process", launcher.add_arguments,
         launcher.run),
        ("timeline", "draw a job's switches from its events files (one HTML page)", timeline_cli.add_arguments,
         timeline_cli.run),
        ("version", "print the version", None, _run_version),
    ]
    for name, help_text, add_arguments, run in commands:
        command = sub.add_parser(name, help=help_text, formatter_class=argparse.RawDescriptionHelpFormatter)
        if add_arguments is not None:
            add_arguments(command)
        if command.description is None:  # a command module may say more; this line at least
            command.description = help_text[0].upper() + help_text[1:] + "."
        _accept_verbose(command)
        command.set_defaults(run=run)
    # The launcher's log is the leader's log: its INFO lines ("registered job", "switch #N ...
    # received", "replied true") are what docs/operations.md tells operators to look for.
    sub.choices["launch"].set_defaults(configure_logging=launcher.configure_logging)
    return parser


def _accept_verbose(command: argparse.ArgumentParser) -> None:
    """``-v`` after the command too (``nicswitch-agent switch -v ...``), without clobbering one given before it.

    argparse copies every default of a subparser over the main parser's values, so the command's
    ``verbose`` must have no default at all (SUPPRESS): then only a ``-v`` given after the command
    sets it, and the main parser's value stands otherwise. A command with its own ``-v`` (sim) keeps
    its flag and help, with the same SUPPRESS default.
    """
    own = [action for action in command._actions if action.dest == "verbose"]
    if own:
        for action in own:
            action.default = argparse.SUPPRESS
        return
    command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                         help="log at DEBUG level (the demo's rank processes at INFO; also accepted before "
                              "the command)")


def _version() -> str:
    from nicswitch_agent import __version__

    return __version__


def _add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    from nicswitch_agent.ops.durations import seconds

    # Here, not in demo/run.py: building the parser must not import the demo (and its simulator).
    parser.description = (
        "Run a ClusterD simulator and a small training job with the agent on this machine, ask for a failover "
        "and a switchback, and print a timeline: every rank parking at the same step, the checkpoint guard, "
        "the switch on every rank, the reply, the resume."
    )
    parser.epilog = (
        "The demo's job always runs in pause mode agent (its ranks park at a step boundary; there is no\n"
        "MindIO here): NICSWITCH_PAUSE=external is refused (unset it, or set it to agent). gRPC core's own\n"
        "log lines are off (GRPC_VERBOSITY=ERROR) unless GRPC_VERBOSITY or GRPC_TRACE is set. Ctrl-C\n"
        "prints what the demo did so far (the timeline, or how many switches the joined job saw).\n"
        "\n"
        "exit codes: 0 both switches finished on every rank (with --server: --switches switches were\n"
        "replied to, or SIGINT/SIGTERM with --switches 0), 1 the demo failed, 2 usage error (--processes\n"
        "without torch, --ranks out of range, a join option without --server, a bad NICSWITCH_* setting,\n"
        "NICSWITCH_PAUSE=external), 130 interrupted by SIGINT (Ctrl-C), and with --server 143 by SIGTERM"
    )
    parser.add_argument("--ranks", type=int, default=4, metavar="N",
                        help="training ranks (default: %(default)s; 1-64 as threads, 1-16 with --processes)")
    parser.add_argument("--processes", action="store_true",
                        help="run every rank as a real torch process (torch.distributed, gloo on CPU, the job's "
                             "TCPStore hosted by rank 0) instead of a thread; needs torch, takes a few seconds; "
                             "not with --server")
    parser.add_argument("--output-dir", metavar="DIR",
                        help="where to write the ranks' events files and the timeline page "
                             "(default: a new temporary directory, kept); not with --server")
    join = parser.add_argument_group("join a running ClusterD or simulator (no embedded simulator, no operator: "
                                     "you run `nicswitch-agent switch`; --job, --switches, --timeout and "
                                     "--background only with --server)")
    join.add_argument("--server", metavar="HOST:PORT", help="run only the job (threads, pause mode agent) against this "
                                                            "ClusterD, until --switches switches were replied to")
    # None: not given. Their defaults (_JOIN_DEFAULTS) apply with --server; without it they are an error.
    join.add_argument("--job", metavar="JOB_ID", help=f"job id to register (default: {_JOIN_DEFAULTS['job']})")
    join.add_argument("--switches", type=int, metavar="N",
                      help=f"stop after N switches (default: {_JOIN_DEFAULTS['switches']}; 0: until SIGINT/SIGTERM)")
    join.add_argument("--timeout", type=seconds(), metavar="S",
                      help=f"stop after S seconds at most (default: {_JOIN_DEFAULTS['timeout']:g}; with --switches 0 "
                           "it bounds only the wait for the job to register)")
    join.add_argument("--background", action="store_true", default=None,
                      help="run the job in a child process and return once it is registered (for scripts); "
                           "the job logs to a file it names, not to this command's stdout/stderr")


# The join options, which only a job joining a running ClusterD (--server) uses, and their defaults.
_JOIN_DEFAULTS: dict[str, Any] = {"job": "job-1", "switches": 2, "timeout": 300.0, "background": False}
# The embedded demo's options, which the joining job has no use for.
_EMBEDDED_ONLY = {"processes": False, "output_dir": None}


def _demo_misuse(args: argparse.Namespace) -> str | None:
    """An option that the chosen kind of demo would silently ignore, as a usage error (or None)."""
    def flags(names: list[str]) -> str:
        return " and ".join("--" + name.replace("_", "-") for name in names)

    if args.server is None:
        given = [name for name in _JOIN_DEFAULTS if getattr(args, name) is not None]
        if given:
            one = len(given) == 1
            return (f"{flags(given)} {'needs' if one else 'need'} --server ({'it is' if one else 'they are'} for the "
                    "job joining a running ClusterD; without --server the demo runs its own simulator and operator)")
        return None
    given = [name for name, unset in _EMBEDDED_ONLY.items() if getattr(args, name) != unset]
    if given:
        return (f"{flags(given)} cannot be used with --server (the joining job runs its ranks as threads and "
                "writes no timeline page)")
    return None


def _quiet_grpc(argv: Sequence[str]) -> None:
    """No raw gRPC core lines in the output of the demo (the first a user sees) and the operator
    commands, which say the same in their own words (demo/quiet.py has which and why).

    Here, before the parser is built, because building it imports grpc, which reads
    GRPC_VERBOSITY only then; the demo's child processes inherit the value.
    """
    from nicswitch_agent.demo.quiet import is_quiet_command, quiet_grpc

    if is_quiet_command(argv):
        quiet_grpc()


def _run_demo(args: argparse.Namespace) -> int:
    problem = _demo_misuse(args)
    if problem is not None:
        print(f"nicswitch-agent demo: error: {problem}", file=sys.stderr)
        return 2
    if args.server is not None:
        from nicswitch_agent.demo import run_job

        join = {name: _JOIN_DEFAULTS[name] if getattr(args, name) is None else getattr(args, name)
                for name in _JOIN_DEFAULTS}
        return run_job(sys.stdout, server=str(args.server), job_id=str(join["job"]), ranks=int(args.ranks),
                       switches=int(join["switches"]), timeout_s=float(join["timeout"]),
                       background=bool(join["background"]))
    from nicswitch_agent.demo import run_demo

    return run_demo(sys.stdout, verbose=bool(args.verbose), ranks=int(args.ranks), processes=bool(args.processes),
                    output_dir=args.output_dir)


def _run_version(args: argparse.Namespace) -> int:
    print(f"nicswitch-agent {_version()}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns its exit code (for programs and tests: the process lives on)."""
    return _run(argv, exiting=False)


def console() -> int:
    """The ``nicswitch-agent`` command and ``python -m nicswitch_agent``: :func:`main`, and once the
    command has its result, Ctrl-C is ignored for the rest of the process's life. The interpreter's
    teardown takes tens of ms (half a second after torch was imported, as ``doctor`` does); a
    SIGINT landing there made CPython die of the signal and the command's own code (1, 6, ...) was
    lost, or printed a KeyboardInterrupt traceback from an exit handler."""
    _exit_quietly_on_ctrl_c()
    return _run(None, exiting=True)


def _exit_quietly_on_ctrl_c() -> None:
    """Until the command runs (its imports, its parser: hundreds of ms), Ctrl-C ends the process
    with 130 at once. A ``KeyboardInterrupt`` raised there does not always reach :func:`_run`: an
    outside check saw it wrapped in a RuntimeError (a dataclass field's ``__set_name__``) and
    printed as a traceback, and once swallowed by the import system (the demo then ran to its end).
    Nothing is set up yet that an exit could leave behind. A SIGINT someone else handles, or
    ignores (a background job), is left alone."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _exit_130)


def _exit_130(signum: int, frame: object) -> None:
    os._exit(130)


def _ctrl_c_raises_again() -> None:
    """The command runs: from here Ctrl-C is Python's ``KeyboardInterrupt``, which each command
    handles (and :func:`_run` ends with 130)."""
    if signal.getsignal(signal.SIGINT) is _exit_130:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _run(argv: Sequence[str] | None, *, exiting: bool) -> int:
    # Ctrl-C at any moment, the imports that building the parser and running a command take
    # included (hundreds of ms: grpc, the agent), ends the command with 130 and no traceback.
    # (Importing this module costs only the package's first lines: nicswitch_agent/__init__.py.)
    code: int | None = None
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, not at exit: a closed pipe is then ours to handle, below
        if exiting:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # the result is decided: only the exit is left
        return code
    except KeyboardInterrupt:
        if exiting:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        return 130 if code is None else code  # a Ctrl-C after the result does not change it
    except BrokenPipeError:
        if exiting:  # decided too: a Ctrl-C now must not turn 141 into death by SIGINT
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        return _reader_gone()


def _reader_gone() -> int:
    """Our reader went away (``nicswitch-agent status | head -4``): stop quietly with 141, as a
    shell tool killed by SIGPIPE does (128 + 13), instead of a traceback. What is still buffered
    for stdout goes to /dev/null, or Python's own flush at exit would complain again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real stdout (a test's capture): nothing more to flush there
        pass
    return 128 + 13


def _main(argv: Sequence[str] | None) -> int:
    _quiet_grpc(sys.argv[1:] if argv is None else argv)  # before _build_parser imports grpc
    parser = _build_parser()
    args = parser.parse_args(argv)
    configure_logging = getattr(args, "configure_logging", None)
    if configure_logging is not None:  # launch: the leader's INFO lines by default
        configure_logging(verbose=bool(args.verbose), quiet=bool(getattr(args, "quiet", False)))
    else:
        logging.basicConfig(
            level=logging.DEBUG if args.verbose else logging.WARNING,
            format=LOG_FORMAT,
        )
    from nicswitch_agent.errors import ConfigError

    _ctrl_c_raises_again()
    try:
        return int(args.run(args))
    except ConfigError as exc:  # a bad setting (a NICSWITCH_* variable, a flag): its message says which and why
        print(f"nicswitch-agent {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
