"""Every error about a setting names where it came from (issue 18, item 5).

A value read from the environment is named by its variable and its value as written there
(``NICSWITCH_SWITCH_TIMEOUT_S='-5': switch_timeout_s=-5.0 must not be negative``); a keyword
by its field. A near miss of a choice gets a suggestion (``did you mean 'external'?``). The
tests iterate ``dataclasses.fields(AgentConfig)``, so a new field cannot escape them: a new
field of a type without a generic bad value needs an entry in ``BAD_TEXT``.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import pytest

from nicswitch_agent import AgentConfig, ConfigError
from nicswitch_agent.config import _non_optional, tls_from_env

FIELDS = [f.name for f in dataclasses.fields(AgentConfig)]
TYPES = {name: _non_optional(kind) for name, kind in typing.get_type_hints(AgentConfig).items() if name in FIELDS}
BASE_ENV = {"NICSWITCH_SERVER": "clusterd:8899", "NICSWITCH_JOB_ID": "job-env"}

# Values of the field's type that are always refused: every number and duration of the agent
# is refused below 0, every duration (the float fields) above 7 days, and no word is a bool.
GENERIC_BAD = {int: ["-5", "x1"], float: ["-5", "x1", "1e20"], bool: ["maybe"]}
# Strings have no generic bad value: one per field.
BAD_TEXT = {
    "server": "http://clusterd:8899",
    "job_id": "job\x01id",
    "role": "role\x01",
    "pause": "extrnal",
    "leader": "rank",
    "fan_out": "nod",
    "node_transport": "unix",
    "framework": "mindsp0re",
    "store_address": "storehost",
    "status_file": "/tmp/{oops}.json",
    "events_file": "/tmp/{oops}.jsonl",
    "tls_ca_file": "/nonexistent/ca.pem",
    "tls_cert_file": "/nonexistent/client.pem",
    "tls_key_file": "/nonexistent/client.key",
    "tls_server_name": "clusterd svc",
}


def variable(name: str) -> str:
    return f"NICSWITCH_{name.upper()}"


def bad_values(name: str) -> list[str]:
    kind = TYPES[name]
    if kind is str:
        assert name in BAD_TEXT, f"new text field {name}: add a value it refuses to BAD_TEXT"
        return [BAD_TEXT[name]]
    assert kind in GENERIC_BAD, f"new field {name} of type {kind}: add bad values for its type"
    return GENERIC_BAD[kind]


CASES = [(name, raw) for name in FIELDS for raw in bad_values(name)]


@pytest.mark.parametrize(("name", "raw"), CASES)
def test_every_setting_from_the_environment_names_its_variable_and_value(name: str, raw: str) -> None:
    env = {**BASE_ENV, variable(name): raw}
    with pytest.raises(ConfigError) as info:
        AgentConfig.from_env(env)
    message = str(info.value)
    assert message.startswith(f"{variable(name)}={raw!r}"), message


@pytest.mark.parametrize("name", FIELDS)
def test_every_keyword_names_its_field(name: str) -> None:
    """A value of no usable type, given as a keyword: the message leads with the field."""
    given: dict[str, Any] = {"server": "clusterd:8899", "job_id": "job-kw", name: object()}
    with pytest.raises(ConfigError) as info:
        AgentConfig(**given)
    assert str(info.value).startswith(name), str(info.value)
    assert name in info.value.settings


@pytest.mark.parametrize(
    ("name", "given", "suggestion"),
    [("pause", "extrnal", "external"), ("pause", "agnet", "agent"), ("leader", "rank", "rank0"),
     ("leader", "launch", "launcher"), ("fan_out", "nod", "node"), ("fan_out", "groups", "group")],
)
def test_a_near_miss_of_a_choice_gets_a_suggestion(name: str, given: str, suggestion: str) -> None:
    hint = f"did you mean {suggestion!r}?"
    with pytest.raises(ConfigError) as info:
        AgentConfig.from_env({**BASE_ENV, variable(name): given})
    assert str(info.value).startswith(f"{variable(name)}={given!r}: {name}={given!r} is not supported")
    assert str(info.value).endswith(hint), str(info.value)
    with pytest.raises(ConfigError) as info:
        AgentConfig(server="clusterd:8899", job_id="job-kw", **{name: given})
    assert str(info.value).startswith(f"{name}={given!r} is not supported") and str(info.value).endswith(hint)


@pytest.mark.parametrize(("raw_env", "expected"), [
    ({"NICSWITCH_MAX_MESSAGE_BYTES": "3000000000"},
     "NICSWITCH_MAX_MESSAGE_BYTES='3000000000': max_message_bytes=3000000000 must be at most 2147483647"),
    ({"NICSWITCH_RECONNECT_MAX_S": "2200000"},
     "NICSWITCH_RECONNECT_MAX_S='2200000': reconnect_max_s=2200000.0 must be at most 604800 s (7 days)"),
    ({"NICSWITCH_KEEPALIVE_TIME_S": "1e20"},
     "NICSWITCH_KEEPALIVE_TIME_S='1e20': keepalive_time_s=1e+20 must be at most 604800 s (7 days)"),
    ({"NICSWITCH_KEEPALIVE_TIMEOUT_S": "1e20"},
     "NICSWITCH_KEEPALIVE_TIMEOUT_S='1e20': keepalive_timeout_s=1e+20 must be at most 604800 s (7 days)"),
    ({"NICSWITCH_CONNECT_TIMEOUT_S": "1e20"},
     "NICSWITCH_CONNECT_TIMEOUT_S='1e20': connect_timeout_s=1e+20 must be at most 604800 s (7 days)"),
])
def test_values_too_large_for_grpc_are_refused_when_the_config_is_built(raw_env: dict[str, str],
                                                                         expected: str) -> None:
    """The tester's repro: each passed from_env() and crashed start() with gRPC's OverflowError."""
    with pytest.raises(ConfigError) as info:
        AgentConfig.from_env({**BASE_ENV, **raw_env})
    assert str(info.value).startswith(expected), str(info.value)


def test_the_issues_example() -> None:
    with pytest.raises(ConfigError) as info:
        AgentConfig.from_env({**BASE_ENV, "NICSWITCH_SWITCH_TIMEOUT_S": "-5"})
    assert str(info.value) == "NICSWITCH_SWITCH_TIMEOUT_S='-5': switch_timeout_s=-5.0 must not be negative"


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"NICSWITCH_RECONNECT_INITIAL_S": "9"}, ["NICSWITCH_RECONNECT_INITIAL_S='9'"]),
        ({"NICSWITCH_RECONNECT_INITIAL_S": "9", "NICSWITCH_RECONNECT_MAX_S": "8"},
         ["NICSWITCH_RECONNECT_INITIAL_S='9'", "NICSWITCH_RECONNECT_MAX_S='8'"]),
        ({"RANK": "3", "WORLD_SIZE": "2"}, ["RANK='3'", "WORLD_SIZE='2'"]),
        ({"WORLD_SIZE": "0"}, ["WORLD_SIZE='0'"]),
        ({"LOCAL_WORLD_SIZE": "-1"}, ["LOCAL_WORLD_SIZE='-1'"]),
        ({"NICSWITCH_JOB_ID": "", "MINDX_TASK_ID": "a\x02b"}, ["MINDX_TASK_ID='a\\x02b'"]),
        ({"NICSWITCH_SWITCH_TIMEOUT_S": "800"}, ["NICSWITCH_SWITCH_TIMEOUT_S='800'"]),
    ],
)
def test_errors_about_several_settings_name_each_one_from_the_environment(env: dict[str, str],
                                                                          named: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        AgentConfig.from_env({**BASE_ENV, **env})
    assert str(info.value).startswith(", ".join(named) + ": "), str(info.value)


def test_a_keyword_beside_a_variable_names_only_the_variable() -> None:
    with pytest.raises(ConfigError) as info:
        AgentConfig.from_env({**BASE_ENV, "NICSWITCH_RECONNECT_MAX_S": "1"}, reconnect_initial_s=2.0)
    assert str(info.value) == ("NICSWITCH_RECONNECT_MAX_S='1': reconnect_initial_s=2.0 exceeds "
                               "reconnect_max_s=1.0")


def test_tls_settings_read_alone_name_their_variable() -> None:
    with pytest.raises(ConfigError) as info:
        tls_from_env({"NICSWITCH_TLS_CA_FILE": "/nonexistent/ca.pem"})
    assert str(info.value).startswith("NICSWITCH_TLS_CA_FILE='/nonexistent/ca.pem': tls_ca_file=")


def test_an_unknown_keyword_gets_a_suggestion() -> None:
    with pytest.raises(ConfigError, match=r"unknown setting\(s\): swtich_timeout_s \(did you mean switch_timeout_s"):
        AgentConfig.from_env(BASE_ENV, swtich_timeout_s=5)


def test_msrun_rank_and_world_size_are_read_in_an_msrun_worker() -> None:
    """msrun exports MS_WORKER_NUM and RANK_ID (and MS_ROLE=MS_WORKER) to each worker; torchrun's
    names win when both are there; outside msrun (no MS_ROLE, framework not mindspore) they are ignored."""
    msrun = {"NICSWITCH_SERVER": "127.0.0.1:8899", "MINDX_TASK_ID": "job",
             "MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "4", "RANK_ID": "3"}
    cfg = AgentConfig.from_env(msrun)
    assert (cfg.rank, cfg.world_size) == (3, 4)
    cfg = AgentConfig.from_env({**msrun, "RANK": "1", "WORLD_SIZE": "2"})
    assert (cfg.rank, cfg.world_size) == (1, 2)
    assert AgentConfig.from_env({**msrun, "MS_ROLE": ""}).rank is None
    cfg = AgentConfig.from_env({**msrun, "MS_ROLE": "", "NICSWITCH_FRAMEWORK": "MindSpore", "RANK_ID": "2"})
    assert (cfg.framework, cfg.rank, cfg.world_size) == ("mindspore", 2, 4)
    with pytest.raises(ConfigError, match="RANK_ID"):
        AgentConfig.from_env({**msrun, "RANK_ID": "9"})
