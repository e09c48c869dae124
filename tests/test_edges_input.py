"""Bad input is refused where it is given: at construction or config load, naming the argument,
the type and the value, instead of at the first switch (where it costs the job a recovery)."""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path
from typing import Any

import pytest

from nicswitch_agent import AgentConfig, ConfigError, DryRunSwitcher, SwitchAgent
from nicswitch_agent import config as config_module
from nicswitch_agent.orders import SwitchOrder

ROOT = Path(__file__).resolve().parent.parent
BASE = {"server": "10.0.0.1:8899", "job_id": "job-1"}
# The words of a refused host name: the grammar it failed (config/addresses.py _HOST_LABEL).
HOST_GRAMMAR = "(dot-separated labels of 1-63 letters, digits, '-' or '_', not starting or ending with '-')"


def refused(**kwargs: Any) -> str:
    before = set(threading.enumerate())
    with pytest.raises(ConfigError) as info:
        SwitchAgent(**{**BASE, **kwargs})
    assert set(threading.enumerate()) <= before, "a refused agent must start nothing"
    return str(info.value)


# -- hooks and callbacks ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argument", "value", "expected"),
    [
        ("switch_hook", "x", "switch_hook must be callable, got str 'x'"),
        ("checkpoint_hook", 42, "checkpoint_hook must be callable, got int 42"),
        ("on_event", 3, "on_event must be callable, got int 3"),
        ("on_stop", "x", "on_stop must be callable, got str 'x'"),
        ("on_stop", b"", "on_stop must be callable, got bytes b''"),
    ],
)
def test_non_callable_hooks_are_refused_at_construction(argument: str, value: Any, expected: str) -> None:
    assert refused(**{argument: value}) == expected


def test_the_issue_example_names_the_first_bad_argument() -> None:
    message = refused(switch_hook="x", checkpoint_hook=42, on_event=3, on_stop="x")
    assert message == "switch_hook must be callable, got str 'x'"


@pytest.mark.parametrize("argument", ["switch_hook", "checkpoint_hook", "on_event", "on_stop"])
def test_a_callable_that_takes_no_argument_is_refused(argument: str) -> None:
    message = refused(**{argument: lambda: None})
    assert message.startswith(f"{argument}=<function") and "must be callable with one argument" in message


def test_a_class_instead_of_an_instance_is_refused_with_the_fix() -> None:
    message = refused(switch_hook=DryRunSwitcher)
    assert message == ("switch_hook must be callable with one argument (the order), got the class "
                       "DryRunSwitcher: pass an instance, e.g. DryRunSwitcher()")


def test_every_kind_of_one_argument_callable_is_accepted() -> None:
    class Hook:
        def __call__(self, order: SwitchOrder) -> bool:
            return True

        def method(self, order: SwitchOrder) -> None:
            return None

    def with_defaults(order: SwitchOrder, extra: int = 1, *rest: Any, **kw: Any) -> None:
        return None

    agent = SwitchAgent(**BASE, switch_hook=Hook(), checkpoint_hook=Hook().method, on_event=print,
                        on_stop=with_defaults)
    assert agent.status()["state"] == "created"
    SwitchAgent(**BASE, switch_hook=DryRunSwitcher(), on_event=lambda *events: None)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"leader_only": "yes"}, "leader_only must be a bool, got str 'yes'"),
        ({"config": {"server": "h:1"}}, "config must be an AgentConfig, got dict {'server': 'h:1'}"),
    ],
)
def test_other_constructor_arguments_name_their_type(kwargs: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        SwitchAgent(**kwargs)
    assert str(info.value) == expected


# -- types of settings --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"job_id": 123}, "job_id must be a string, got int 123"),
        ({"job_id": b"job"}, "job_id must be a string, got bytes b'job'"),
        ({"server": 8899}, "server must be a string 'host:port', got int 8899"),
        ({"store_address": 29500}, "store_address must be a string 'host:port', got int 29500"),
        ({"role": 7}, "role must be a string, got int 7"),
    ],
)
def test_a_setting_of_the_wrong_type_names_the_type(kwargs: dict[str, Any], expected: str) -> None:
    assert refused(**kwargs) == expected


def test_an_unset_job_id_still_says_so() -> None:
    assert refused(job_id="").startswith("job_id is not set")


# -- enumerations -------------------------------------------------------------------------------


@pytest.mark.parametrize(("raw", "expected"), [("External", "external"), ("AGENT", "agent"), ("Auto", "auto")])
def test_pause_accepts_any_case(raw: str, expected: str) -> None:
    assert AgentConfig.from_env({"NICSWITCH_PAUSE": raw}, **BASE).pause == expected
    assert AgentConfig(**BASE, pause=raw).pause == expected


def test_leader_accepts_any_case() -> None:
    assert AgentConfig.from_env({"NICSWITCH_LEADER": "Launcher"}, **BASE).leader == "launcher"
    assert AgentConfig(**BASE, leader="RANK0").leader == "rank0"


def test_an_unknown_enumeration_value_is_named_as_given() -> None:
    with pytest.raises(ConfigError, match=r"pause='Internal' is not supported; choose one of auto, agent, external"):
        AgentConfig(**BASE, pause="Internal")


# -- unknown NICSWITCH_* variables --------------------------------------------------------------


@pytest.fixture
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_module, "_warned_env", set())


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name.startswith("nicswitch")]


@pytest.mark.usefixtures("fresh_warnings")
def test_a_misspelt_variable_is_warned_about_naming_the_closest_setting(caplog: pytest.LogCaptureFixture) -> None:
    config = AgentConfig.from_env({"NICSWITCH_SWICH_TIMEOUT_S": "30", **{"NICSWITCH_" + k.upper(): v
                                                                          for k, v in BASE.items()}})
    assert config.switch_timeout_s == 120.0  # still ignored: a typo must not change a setting
    assert warnings_of(caplog) == [
        "NICSWITCH_SWICH_TIMEOUT_S is not a nicswitch-agent setting and is ignored: "
        "did you mean NICSWITCH_SWITCH_TIMEOUT_S?"
    ]


@pytest.mark.usefixtures("fresh_warnings")
def test_each_unknown_variable_is_warned_about_once_per_process(caplog: pytest.LogCaptureFixture) -> None:
    env = {"NICSWITCH_PASUE": "agent", "nicswitch_leader": "launcher", "NICSWITCH_FROBNICATE": "1"}
    for _ in range(3):
        AgentConfig.from_env(env, **BASE)
    assert warnings_of(caplog) == [
        "NICSWITCH_FROBNICATE is not a nicswitch-agent setting and is ignored: "
        "docs/configuration.md lists the settings",
        "NICSWITCH_PASUE is not a nicswitch-agent setting and is ignored: did you mean NICSWITCH_PAUSE?",
        "nicswitch_leader is not a nicswitch-agent setting and is ignored: did you mean NICSWITCH_LEADER?",
    ]


@pytest.mark.usefixtures("fresh_warnings")
def test_the_agent_warns_about_a_typo_in_the_process_environment(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("NICSWITCH_SERVER", "127.0.0.1:8899")
    monkeypatch.setenv("NICSWITCH_JOB_ID", "job-1")
    monkeypatch.setenv("NICSWITCH_DRYRUN", "1")
    SwitchAgent()
    assert warnings_of(caplog) == [
        "NICSWITCH_DRYRUN is not a nicswitch-agent setting and is ignored: did you mean NICSWITCH_DRY_RUN?"
    ]


@pytest.mark.usefixtures("fresh_warnings")
def test_the_tls_only_loader_warns_too(caplog: pytest.LogCaptureFixture) -> None:
    assert config_module.tls_from_env({"NICSWITCH_TLS_CA_FIEL": "/x"}) is None
    assert warnings_of(caplog) == [
        "NICSWITCH_TLS_CA_FIEL is not a nicswitch-agent setting and is ignored: did you mean NICSWITCH_TLS_CA_FILE?"
    ]


@pytest.mark.usefixtures("fresh_warnings")
def test_known_variables_raise_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    env = {name: "" for name in config_module.known_env_names()}
    AgentConfig.from_env(env, **BASE)
    assert warnings_of(caplog) == []


def test_every_nicswitch_variable_the_project_mentions_is_known() -> None:
    # The launcher, demo, docs and tests set or read these; a warning about one would be a false alarm.
    mentioned: set[str] = set()
    for folder in ("src", "tests", "docs", "examples", "benchmarks", "scripts"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".md", ".sh", ".yaml", ".yml", ".txt") and path.is_file():
                mentioned |= set(re.findall(r"\bNICSWITCH_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(errors="replace")))
    mentioned -= {"NICSWITCH_X"}  # docs' placeholder for "any field"
    assert mentioned, "the scan found nothing: wrong folder?"
    typos_in_this_file = ["NICSWITCH_DRYRUN", "NICSWITCH_FROBNICATE", "NICSWITCH_PASUE", "NICSWITCH_SWICH_TIMEOUT_S",
                          "NICSWITCH_TLS_CA_FIEL"]
    assert sorted(mentioned - config_module.known_env_names()) == typos_in_this_file


# -- addresses ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("server", "expected"),
    [
        ("host:99999", "server='host:99999': the port 99999 is outside 1-65535"),
        ("host:0", "server='host:0': the port 0 is outside 1-65535"),
        ("host:http", "server='host:http': the port 'http' is not a number"),
        ("http://clusterd:8899", "server='http://clusterd:8899': give host:port without a scheme "
                                 "(gRPC dials it directly), e.g. 'clusterd:8899'"),
        ("grpc://10.0.0.1:8899/", "server='grpc://10.0.0.1:8899/': give host:port without a scheme "
                                  "(gRPC dials it directly), e.g. '10.0.0.1:8899'"),
        ("300.1.1.1:8899", "server='300.1.1.1:8899': '300.1.1.1' is not an IPv4 address"),
        ("10.0.0:8899", "server='10.0.0:8899': '10.0.0' is not an IPv4 address"),
        ("[::zz]:8899", "server='[::zz]:8899': '::zz' is not an IPv6 address"),
        ("[10.0.0.1]:8899", "server='[10.0.0.1]:8899': '10.0.0.1' is not an IPv6 address"),
        ("my host:8899", "server='my host:8899': 'my host' is not a host name or IP address "
                         + HOST_GRAMMAR),
        ("clusterd..svc:8899", "server='clusterd..svc:8899': 'clusterd..svc' is not a host name or IP address "
                               + HOST_GRAMMAR),
        ("-clusterd:8899", "server='-clusterd:8899': '-clusterd' is not a host name or IP address "
                           + HOST_GRAMMAR),
        ("user@clusterd:8899", "server='user@clusterd:8899': 'user@clusterd' is not a host name or IP address "
                               + HOST_GRAMMAR),
        ("dns:///:8899", "server='dns:///:8899': the host is missing (give host:port)"),
    ],
)
def test_bad_addresses_say_what_is_wrong(server: str, expected: str) -> None:
    assert refused(server=server) == expected


def test_store_address_is_checked_the_same_way() -> None:
    assert refused(store_address="10.0.0.2:70000") == (
        "store_address='10.0.0.2:70000': the port 70000 is outside 1-65535")


@pytest.mark.parametrize(
    "server",
    ["[::1]:8899", "[fd00::1]:1", "[fe80::1%eth0]:8899", "[::ffff:10.0.0.1]:8899", "10.0.0.1:65535",
     "clusterd-grpc-svc.mindx-dl.svc.cluster.local:8899", "clusterd-grpc-svc.mindx-dl.svc.cluster.local.:8899",
     "localhost:8899", "CLUSTERD:8899", "dns:///clusterd-grpc-svc.mindx-dl:8899", "dns://10.0.0.10/clusterd:8899",
     "dns:clusterd:8899", "unix:/tmp/clusterd.sock", "unix-abstract:clusterd"],
)
def test_good_addresses_keep_working(server: str) -> None:
    assert AgentConfig(**{**BASE, "server": server}).server == server
