"""One grammar for a ClusterD address (issue 18, item 4).

The same inputs go through every entry point: the library (``AgentConfig(server=...)``), the
environment (``NICSWITCH_SERVER``), and the subcommands that take ``--server`` (switch, watch,
doctor, launch, demo; ``status`` reads a file and takes no address, ``sim --port`` is a port to
listen on). Each must make the same decision (the same normalised address, or a refusal) and say
the same words, led by where the value came from: ``server='x': ...``, ``NICSWITCH_SERVER='x':
...``, ``--server='x': ...``.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable

import pytest

from nicswitch_agent import AgentConfig, ConfigError
from nicswitch_agent.config import parse_server
from nicswitch_agent.ops import cli, doctor
from nicswitch_agent.ops.om_cli import resolve_server

JOB = "job-addr"
ADDRESS_ENV = ("NICSWITCH_SERVER", "MINDX_SERVER_IP", "LOCAL_PROXY_ENABLE", "NICSWITCH_JOB_ID", "MINDX_TASK_ID")

# (input, the address it becomes) for what every entry point accepts.
ACCEPTED = [
    ("127.0.0.1", "127.0.0.1:8899"),  # a bare host gets ClusterD's port, as MindCluster dials MINDX_SERVER_IP
    ("clusterd-grpc-svc.mindx-dl", "clusterd-grpc-svc.mindx-dl:8899"),
    ("clusterd_grpc.mindx-dl:9000", "clusterd_grpc.mindx-dl:9000"),  # '_', as the refusal's words say
    ("10.0.0.1:9000", "10.0.0.1:9000"),
    ("[fd00::5]", "[fd00::5]:8899"),
    ("[fd00::5]:9000", "[fd00::5]:9000"),
    (" 10.0.0.1:9000 ", "10.0.0.1:9000"),
]
# (input, the problem) for what every entry point refuses, in these words.
REFUSED = [
    ("http://127.0.0.1:8899", "give host:port without a scheme (gRPC dials it directly), e.g. '127.0.0.1:8899'"),
    ("localhost:99999", "the port 99999 is outside 1-65535"),
    ("localhost:0", "the port 0 is outside 1-65535"),
    ("clusterd:grpc", "the port 'grpc' is not a number"),
    ("fd00::5:8899", "put an IPv6 address in brackets, e.g. [fd00::5]:8899"),
    ("::1", "put an IPv6 address in brackets, e.g. [::1]:8899"),
    ("[fd00::5", "an IPv6 address in brackets needs its closing ']', e.g. [::1]:8899"),
    ("300.1.1.1:8899", "'300.1.1.1' is not an IPv4 address"),
    ("my host:8899", "'my host' is not a host name or IP address "
                     "(dot-separated labels of 1-63 letters, digits, '-' or '_', not starting or ending with '-')"),
]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ADDRESS_ENV:
        monkeypatch.delenv(name, raising=False)


def run_cli(*argv: str) -> tuple[int, str]:
    """``nicswitch-agent ARGV`` through the real parser; (exit code, stdout + stderr)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = cli.main(list(argv))
    return code, out.getvalue()


def library(text: str) -> str:
    return AgentConfig(server=text, job_id=JOB).server


def environment(text: str) -> str:
    return AgentConfig.from_env({"NICSWITCH_SERVER": text, "MINDX_TASK_ID": JOB}).server


def launch_plan(text: str) -> str:
    from nicswitch_agent.ops.launcher import add_arguments, make_plan

    parser = cli.argparse.ArgumentParser()
    add_arguments(parser)
    plan = make_plan(parser.parse_args(["--server", text, "--job", JOB, "--world-size", "1", "--", "true"]), {})
    return plan.env["NICSWITCH_SERVER"]


# How each entry point resolves an address it accepts.
RESOLVERS: dict[str, Callable[[str], str | None]] = {
    "library": library,
    "NICSWITCH_SERVER": environment,
    "switch/watch --server": lambda text: resolve_server(text, {}),
    "switch/watch NICSWITCH_SERVER": lambda text: resolve_server(None, {"NICSWITCH_SERVER": text}),
    "doctor --server": lambda text: doctor.gather_inputs(server=text, env={}).server,
    "doctor NICSWITCH_SERVER": lambda text: doctor.gather_inputs(env={"NICSWITCH_SERVER": text}).server,
    "launch --server": launch_plan,
}


@pytest.mark.parametrize(("text", "address"), ACCEPTED)
@pytest.mark.parametrize("entry", sorted(RESOLVERS))
def test_every_entry_point_accepts_alike(entry: str, text: str, address: str) -> None:
    assert RESOLVERS[entry](text) == address


@pytest.mark.parametrize(("text", "problem"), REFUSED)
def test_the_library_and_the_environment_refuse_alike(text: str, problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        library(text)
    assert str(info.value) == f"server={text!r}: {problem}"
    with pytest.raises(ConfigError) as info:
        environment(text.strip())
    assert str(info.value) == f"NICSWITCH_SERVER={text.strip()!r}: {problem}"
    assert doctor.gather_inputs(env={"NICSWITCH_SERVER": text}).server_error == (
        f"NICSWITCH_SERVER={text.strip()!r}: {problem}")
    with pytest.raises(ValueError) as cli_info:  # switch and watch, with the variable set
        resolve_server(None, {"NICSWITCH_SERVER": text})
    assert str(cli_info.value) == f"NICSWITCH_SERVER={text.strip()!r}: {problem}"


SUBCOMMANDS = {
    "switch": ("switch", "--job", JOB, "--node", "node-0", "--dev", "0", "--op", "standby"),
    "watch": ("watch", "--job", JOB),
    "doctor": ("doctor", "--job", JOB),
    "launch": ("launch", "--job", JOB, "--world-size", "1", "--", "true"),
    "demo": ("demo", "--job", JOB, "--switches", "1", "--timeout", "5"),
}
USAGE = {"switch": 2, "watch": 2, "doctor": 1, "launch": 2, "demo": 2}  # doctor: "not ready", the others: usage


@pytest.mark.parametrize(("text", "problem"), REFUSED)
@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_every_subcommand_refuses_alike(command: str, text: str, problem: str) -> None:
    name, *rest = SUBCOMMANDS[command]
    code, output = run_cli(name, "--server", text, *rest)
    assert code == USAGE[command], output
    assert f"--server={text!r}: {problem}" in output, output


def test_the_parser_is_idempotent_on_what_it_accepts() -> None:
    for text, address in ACCEPTED:
        assert parse_server(address) == address == parse_server(text)


@pytest.mark.parametrize(("ip", "address"), [("10.0.0.7", "10.0.0.7:8899"), ("fd00::7", "[fd00::7]:8899")])
def test_mindx_server_ip_is_a_bare_ip_everywhere(ip: str, address: str) -> None:
    """MindCluster sets MINDX_SERVER_IP to ClusterD's IP alone and dials port 8899."""
    env = {"MINDX_SERVER_IP": ip, "MINDX_TASK_ID": JOB}
    assert AgentConfig.from_env(env).server == address
    assert resolve_server(None, env) == address
    assert doctor.gather_inputs(env=env).server == address


@pytest.mark.parametrize("ip", ["clusterd", "10.0.0.7:9000", "[fd00::7]"])
def test_mindx_server_ip_that_is_not_an_ip_is_refused_alike(ip: str) -> None:
    env = {"MINDX_SERVER_IP": ip, "MINDX_TASK_ID": JOB}
    with pytest.raises(ConfigError) as info:
        AgentConfig.from_env(env)
    message = str(info.value)
    assert message.startswith(f"MINDX_SERVER_IP={ip!r} is not an IP address") and "NICSWITCH_SERVER" in message
    with pytest.raises(ValueError) as cli_info:
        resolve_server(None, env)
    assert str(cli_info.value) == message
    assert doctor.gather_inputs(env=env).server_error == message
