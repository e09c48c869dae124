"""The command line's manners (issue 18 §7), read from the parser the CLI really builds.

A usage error prints the usage of the subcommand it was made in; every subcommand says what it
is for; an option has one name and one metavar wherever it appears (the old names still parse,
hidden); and the help lists ClusterD's address sources in the order they apply.
"""

from __future__ import annotations

import argparse

import pytest

from nicswitch_agent.config import AgentConfig
from nicswitch_agent.ops import cli


def commands() -> dict[str, argparse.ArgumentParser]:
    parser = cli._build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


NAMES = sorted(commands())


@pytest.mark.parametrize("name", NAMES)
def test_an_unknown_option_prints_the_usage_of_its_subcommand(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    required = {"launch": ["--", "true"], "timeline": ["events.jsonl"]}  # so that only the option is wrong
    argv = [name, "--no-such-option", *required.get(name, [])]
    with pytest.raises(SystemExit) as stopped:
        cli.main(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: nicswitch-agent {name} "), err
    assert err.rstrip().endswith(f"nicswitch-agent {name}: error: unrecognized arguments: --no-such-option"), err


def test_a_bad_value_still_names_its_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["watch", "--count", "zero"])
    err = capsys.readouterr().err
    assert err.startswith("usage: nicswitch-agent watch ") and "nicswitch-agent watch: error: argument --count" in err


@pytest.mark.parametrize("bad", [["--timeout", "-1"], ["--no-such-option"], ["--count", "1"]])
def test_a_usage_error_of_switch_json_is_its_object_with_every_key(bad: list[str],
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """--json gives the same keys in every outcome; argparse's errors gave none (found by an outside check)."""
    import json

    from nicswitch_agent.ops.om_cli import SWITCH_JSON_KEYS

    with pytest.raises(SystemExit) as ended:
        cli.main(["switch", "--json", "--server", "127.0.0.1:1", "--job", "j", "--node", "n", "--dev", "0",
                  "--op", "standby", *bad])
    assert ended.value.code == 2
    out, err = capsys.readouterr()
    document = json.loads(out)
    assert list(document) == list(SWITCH_JSON_KEYS)
    assert document["exit_code"] == 2 and document["result"] == "usage" and document["outcome"] is None
    assert document["error"] and f"nicswitch-agent switch: error: {document['error']}" in err


def test_a_usage_error_without_json_prints_no_object(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["switch", "--server", "127.0.0.1:1", "--job", "j", "--timeout", "-1"])
    assert capsys.readouterr().out == ""


def test_an_unknown_option_before_the_subcommand_is_the_top_levels(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--no-such-option", "version"])
    err = capsys.readouterr().err
    assert err.startswith("usage: nicswitch-agent [-h]") and "unrecognized arguments: --no-such-option" in err


@pytest.mark.parametrize("name", NAMES)
def test_every_subcommand_describes_itself(name: str) -> None:
    parser = commands()[name]
    assert parser.description and parser.description.strip(), name
    assert parser.description.split()[0] in parser.format_help()


def visible_options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.help is not argparse.SUPPRESS]


def test_an_option_has_one_metavar_everywhere() -> None:
    """``--job JOB_ID`` in one command and ``--job JOB`` in another reads as two different things."""
    seen: dict[str, dict[str, str]] = {}
    for name, parser in commands().items():
        for action in visible_options(parser):
            if action.nargs == 0:  # a switch: no value, no metavar
                continue
            metavar = str(action.metavar or action.dest.upper())  # argparse's default for an option
            for option in action.option_strings:
                seen.setdefault(option, {})[name] = metavar
    mixed = {option: by for option, by in seen.items() if len(set(by.values())) > 1}
    assert not mixed, mixed


def test_every_command_with_a_job_calls_it_job_and_the_old_name_still_parses() -> None:
    parsers = commands()
    for name in ("switch", "watch", "doctor", "launch", "sim", "demo"):
        options = {o for a in visible_options(parsers[name]) for o in a.option_strings}
        assert "--job" in options and "--job-id" not in options, name
    parser = cli._build_parser()
    assert parser.parse_args(["launch", "--job-id", "old", "--", "x"]).job_id == "old"
    for name in ("switch", "watch", "doctor"):  # launch's first name works wherever a job is dialled
        assert parser.parse_args([name, "--job-id", "old"]).job == "old", name
        assert parser.parse_args([name]).job is None, name


def test_the_deadline_of_one_call_to_clusterd_is_rpc_timeout_in_doctor_as_in_switch() -> None:
    parsers = commands()
    for name in ("switch", "doctor"):
        options = {o for a in visible_options(parsers[name]) for o in a.option_strings}
        assert "--rpc-timeout" in options, name
    doctor_options = {o for a in visible_options(parsers["doctor"]) for o in a.option_strings}
    assert "--timeout" not in doctor_options  # switch's --timeout is how long it waits for the result
    parser = cli._build_parser()
    assert parser.parse_args(["doctor", "--rpc-timeout", "4"]).rpc_timeout == 4
    assert parser.parse_args(["doctor", "--timeout", "5"]).rpc_timeout == 5  # its first name, hidden
    assert parser.parse_args(["doctor"]).rpc_timeout == 3


SOURCES = ("NICSWITCH_SERVER", "LOCAL_PROXY_ENABLE", "MINDX_SERVER_IP")  # first wins


def test_the_address_sources_apply_in_this_order() -> None:
    env = {"NICSWITCH_SERVER": "10.0.0.1:1234", "LOCAL_PROXY_ENABLE": "on", "MINDX_SERVER_IP": "10.0.0.2"}
    assert AgentConfig.from_env(env, job_id="j").server == "10.0.0.1:1234"
    del env["NICSWITCH_SERVER"]
    assert AgentConfig.from_env(env, job_id="j").server == "127.0.0.1:8899"  # the local proxy
    del env["LOCAL_PROXY_ENABLE"]
    assert AgentConfig.from_env(env, job_id="j").server == "10.0.0.2:8899"


@pytest.mark.parametrize("name", ["switch", "watch", "doctor", "launch"])
def test_help_lists_the_address_sources_in_the_order_they_apply(name: str) -> None:
    server = next(a for a in commands()[name]._actions if "--server" in a.option_strings)
    text = str(server.help)
    positions = [text.find(source) for source in SOURCES]
    assert -1 not in positions and positions == sorted(positions), (name, text)


# -- durations (B2: `--timeout inf` passed the parser, then broke the command) -------------------

REQUIRED = {"launch": ["--", "true"], "timeline": ["events.jsonl"]}  # so that only the flag under test is wrong


def is_duration(action: argparse.Action) -> bool:
    return getattr(action.type, "__name__", None) == "seconds"


DURATIONS = sorted((name, action.option_strings[0], action) for name, parser in commands().items()
                   for action in parser._actions if action.option_strings and is_duration(action))
DURATION_IDS = [f"{name} {flag}" for name, flag, _ in DURATIONS]


def test_every_duration_flag_of_every_command_is_parsed_as_one() -> None:
    """One type for every flag that takes seconds: the client's (ops/durations.py) everywhere but in
    ``sim``, which imports nothing of the client's (docs/architecture.md) and keeps a copy of it."""
    assert {name for name, _, _ in DURATIONS} >= {"switch", "watch", "doctor", "status", "launch", "sim", "demo"}
    for name, parser in commands().items():
        for action in parser._actions:
            if not action.option_strings or action.type is None:
                continue
            seconds_like = action.metavar in ("S", "SECONDS") or action.type is float or action.dest == "rpc_timeout"
            assert is_duration(action) or not seconds_like, (name, action.option_strings)
            if is_duration(action):
                module = "nicswitch_agent.sim.cli" if name == "sim" else "nicswitch_agent.ops.durations"
                assert action.type.__module__ == module, (name, action.option_strings)  # type: ignore[union-attr]
    from nicswitch_agent.config.limits import MAX_DURATION_S
    from nicswitch_agent.sim import cli as sim_cli

    assert sim_cli.MAX_SECONDS == MAX_DURATION_S


@pytest.mark.parametrize(("value", "complaint"), [
    ("inf", "'inf' is not a finite number of seconds"),
    ("-inf", "'-inf' is not a finite number of seconds"),
    ("nan", "'nan' is not a finite number of seconds"),
    ("1e308", "'1e308' is above the limit of 604800 s (7 days)"),
    ("604800.5", "'604800.5' is above the limit of 604800 s (7 days)"),
    ("-1", "'-1' must be a "),
    ("soon", "'soon' is not a number of seconds"),
])
@pytest.mark.parametrize(("name", "flag", "action"), DURATIONS, ids=DURATION_IDS)
def test_a_duration_flag_refuses_what_no_wait_can_take(name: str, flag: str, action: argparse.Action, value: str,
                                                       complaint: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A usage error (exit 2) naming the flag and the value, while parsing: nothing is sent or started.
    (Parsed only: were the value taken, running the command would wait for it, sim forever.)"""
    with pytest.raises(SystemExit) as stopped:
        cli._build_parser().parse_args([name, f"{flag}={value}", *REQUIRED.get(name, [])])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert f"nicswitch-agent {name}: error: argument {flag}: {complaint}" in err, err


# A delay or a grace, where 0 is none; every other duration is a timeout or a period, and 0 means nothing.
ZERO_ALLOWED = {("sim", "--standin-register-delay"), ("sim", "--fault-flush"), ("sim", "--force-release"),
                ("sim", "--schedule-wait"), ("sim", "--restart-wait"), ("sim", "--list-delay"),
                ("status", "--max-disconnected")}


@pytest.mark.parametrize(("name", "flag", "action"), DURATIONS, ids=DURATION_IDS)
def test_a_duration_flag_takes_up_to_seven_days_and_zero_only_where_it_means_something(
        name: str, flag: str, action: argparse.Action, capsys: pytest.CaptureFixture[str]) -> None:
    parser = commands()[name]
    assert getattr(parser.parse_args([flag, "604800", *REQUIRED.get(name, [])]), action.dest) == 604800.0
    assert getattr(parser.parse_args([flag, "0.25", *REQUIRED.get(name, [])]), action.dest) == 0.25
    if (name, flag) in ZERO_ALLOWED:
        assert getattr(parser.parse_args([flag, "0", *REQUIRED.get(name, [])]), action.dest) == 0.0
        return
    with pytest.raises(SystemExit):
        parser.parse_args([flag, "0", *REQUIRED.get(name, [])])
    assert f"argument {flag}: '0' must be a positive number of seconds" in capsys.readouterr().err
