"""``nicswitch-agent``: the command line.

Subcommands:
  demo    failover + switchback against the embedded simulator, with a timeline (no arguments)
  sim     run the ClusterD-compatible simulator (for rehearsals and tests)
  switch  O&M: ask ClusterD to switch NICs and wait for the outcome
  watch   O&M: follow a job's switch result stream
  doctor  check that this pod is ready for link switches (exit code 0: ready)
  status  show the running agent's state from its status file (NICSWITCH_STATUS_FILE)
  launch  run a training command (e.g. torchrun) with the job's leader in this process
  version print the version

The demo (and its simulator run) is imported only when it runs.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nicswitch-agent",
        description="Training-side client for MindCluster ClusterD's link failover and switchback.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    demo = sub.add_parser("demo", help="run a failover and a switchback against the embedded simulator")
    demo.set_defaults(run=_run_demo)

    sim = sub.add_parser("sim", help="run the ClusterD-compatible simulator")
    import nicswitch_agent.sim.cli as sim_cli

    sim_cli.add_arguments(sim)
    sim.set_defaults(run=sim_cli.run)

    from nicswitch_agent import om_cli

    switch = sub.add_parser("switch", help="O&M: switch NICs of a job and wait for the outcome",
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    om_cli.add_switch_arguments(switch)
    switch.set_defaults(run=om_cli.run_switch)

    watch = sub.add_parser("watch", help="O&M: follow a job's switch result stream",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    om_cli.add_watch_arguments(watch)
    watch.set_defaults(run=om_cli.run_watch)

    from nicswitch_agent import doctor, status_file

    check = sub.add_parser("doctor", help="check that this pod is ready for link switches (exit 0: ready)",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    doctor.add_arguments(check)
    check.set_defaults(run=doctor.run)

    status = sub.add_parser("status", help="show the running agent's state from its status file",
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    status_file.add_arguments(status)
    status.set_defaults(run=status_file.run)

    from nicswitch_agent import launcher

    launch = sub.add_parser("launch", help="run a training command with the job's leader in this process",
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    launcher.add_arguments(launch)
    launch.set_defaults(run=launcher.run)

    version = sub.add_parser("version", help="print the version")
    version.set_defaults(run=_run_version)
    return parser


def _run_demo(args: argparse.Namespace) -> int:
    from nicswitch_agent.demo import run_demo

    return run_demo(sys.stdout, verbose=bool(args.verbose))


def _run_version(args: argparse.Namespace) -> int:
    from nicswitch_agent import __version__

    print(f"nicswitch-agent {__version__}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.run(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
