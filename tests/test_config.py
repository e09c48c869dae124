"""AgentConfig: env precedence, MindCluster discovery and validation (no os.environ involved)."""

from __future__ import annotations

import dataclasses
import math
import re
import threading
import typing
from typing import Any, Optional

import pytest

from nicswitch_agent import AgentConfig, ConfigError
from nicswitch_agent import config as config_module
from nicswitch_agent.config import CLUSTERD_PORT, LOCAL_PROXY_ADDRESS
from nicswitch_agent.config.limits import MAX_DURATION_S

BASE = {"server": "10.0.0.1:8899", "job_id": "job-1"}
FLOAT_FIELDS = [f.name for f in dataclasses.fields(AgentConfig) if f.name.endswith("_s")]


def make(**overrides: Any) -> AgentConfig:
    return AgentConfig(**{**BASE, **overrides})


def from_env(env: dict[str, str], **explicit: Any) -> AgentConfig:
    return AgentConfig.from_env(env, **explicit)


def refused(match: str, **overrides: Any) -> str:
    with pytest.raises(ConfigError, match=match) as info:
        make(**overrides)
    return str(info.value)


# -- precedence ---------------------------------------------------------------------------------


def test_float_fields_are_the_expected_ones() -> None:
    # Guards the parametrisations below: a new *_s field must be covered by them.
    assert sorted(FLOAT_FIELDS) == sorted([
        "keepalive_time_s", "keepalive_timeout_s", "reconnect_initial_s", "reconnect_max_s", "connect_timeout_s",
        "resubscribe_after_eof_s", "pause_timeout_s", "max_parked_s", "guard_timeout_s", "switch_timeout_s",
        "verify_timeout_s", "reply_timeout_s",
        "reply_attempt_timeout_s", "rpc_timeout_s", "stop_timeout_s", "exit_timeout_s",
        "status_interval_s", "conflict_window_s", "conflict_backoff_s", "conflict_backoff_max_s",
        "node_store_timeout_s",
        "store_connect_timeout_s", "notify_reopen_wait_s", "join_timeout_s", "mindspore_poll_s",
    ])


def test_defaults_with_mindcluster_env_only() -> None:
    cfg = from_env({"MINDX_SERVER_IP": "10.1.2.3", "MINDX_TASK_ID": "uid-42"})
    assert cfg.server == f"10.1.2.3:{CLUSTERD_PORT}"
    assert cfg.job_id == "uid-42"
    assert cfg == AgentConfig(server="10.1.2.3:8899", job_id="uid-42")  # everything else default
    assert cfg.pause == "auto"
    assert cfg.dry_run is False
    assert cfg.world_size is None


@pytest.mark.parametrize(
    ("env", "explicit", "expected"),
    [
        # server: explicit > NICSWITCH_SERVER > LOCAL_PROXY_ENABLE/MINDX_SERVER_IP
        ({"NICSWITCH_SERVER": "a:1", "MINDX_SERVER_IP": "10.0.0.2", "LOCAL_PROXY_ENABLE": "on"},
         {"server": "b:2"}, ("server", "b:2")),
        ({"NICSWITCH_SERVER": "a:1", "MINDX_SERVER_IP": "10.0.0.2", "LOCAL_PROXY_ENABLE": "on"},
         {}, ("server", "a:1")),
        ({"MINDX_SERVER_IP": "10.0.0.2"}, {}, ("server", "10.0.0.2:8899")),
        # job_id: explicit > NICSWITCH_JOB_ID > MINDX_TASK_ID
        ({"NICSWITCH_JOB_ID": "nic", "MINDX_TASK_ID": "mindx"}, {"job_id": "arg"}, ("job_id", "arg")),
        ({"NICSWITCH_JOB_ID": "nic", "MINDX_TASK_ID": "mindx"}, {}, ("job_id", "nic")),
        ({"MINDX_TASK_ID": "mindx"}, {}, ("job_id", "mindx")),
        # world_size: explicit > NICSWITCH_WORLD_SIZE > WORLD_SIZE > None
        ({"NICSWITCH_WORLD_SIZE": "16", "WORLD_SIZE": "8"}, {"world_size": 4}, ("world_size", 4)),
        ({"NICSWITCH_WORLD_SIZE": "16", "WORLD_SIZE": "8"}, {}, ("world_size", 16)),
        ({"WORLD_SIZE": "8"}, {}, ("world_size", 8)),
        ({}, {}, ("world_size", None)),
        # plain fields: explicit > NICSWITCH_* > default
        ({"NICSWITCH_SWITCH_TIMEOUT_S": "30"}, {"switch_timeout_s": 45.0}, ("switch_timeout_s", 45.0)),
        ({"NICSWITCH_SWITCH_TIMEOUT_S": "30"}, {}, ("switch_timeout_s", 30.0)),
        ({}, {}, ("switch_timeout_s", 120.0)),
        ({"NICSWITCH_ROLE": "leader"}, {}, ("role", "leader")),
        ({"NICSWITCH_DRY_RUN": "1"}, {"dry_run": False}, ("dry_run", False)),
        ({"NICSWITCH_MAX_RANKS": "64"}, {}, ("max_ranks", 64)),
        ({"NICSWITCH_HANDLE_SIGNALS": "off"}, {}, ("handle_signals", False)),
        ({}, {}, ("handle_signals", True)),
        # None counts as "not given"; an empty env value counts as unset
        ({"NICSWITCH_JOB_ID": "nic"}, {"job_id": None}, ("job_id", "nic")),
        ({"NICSWITCH_JOB_ID": "  ", "MINDX_TASK_ID": "mindx"}, {}, ("job_id", "mindx")),
        ({"NICSWITCH_SERVER": "", "MINDX_SERVER_IP": "10.0.0.3"}, {}, ("server", "10.0.0.3:8899")),
        # surrounding spaces of env values are dropped
        ({"NICSWITCH_JOB_ID": " nic \n"}, {}, ("job_id", "nic")),
        ({"MINDX_TASK_ID": " mindx "}, {}, ("job_id", "mindx")),
    ],
)
def test_precedence(env: dict[str, str], explicit: dict[str, Any], expected: tuple[str, Any]) -> None:
    full_env = {"MINDX_SERVER_IP": "10.9.9.9", "MINDX_TASK_ID": "fallback", **env}
    name, value = expected
    got = getattr(from_env(full_env, **explicit), name)
    assert got == value
    assert type(got) is type(value)


def test_explicit_server_skips_mindcluster_discovery() -> None:
    # An unusable MINDX_SERVER_IP does not matter when the server is given some other way.
    env = {"MINDX_SERVER_IP": "not-an-ip", "MINDX_TASK_ID": "j"}
    assert from_env(env, server="h:1").server == "h:1"
    assert from_env({**env, "NICSWITCH_SERVER": "h:2"}).server == "h:2"


def test_from_env_does_not_read_os_environ_when_given_a_mapping(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NICSWITCH_JOB_ID", "from-process-env")
    assert from_env({}, server="h:1", job_id="explicit").job_id == "explicit"
    with pytest.raises(ConfigError, match="job_id is not set"):
        from_env({}, server="h:1")


# -- MindCluster discovery ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ip", "server"),
    [
        ("10.96.0.12", "10.96.0.12:8899"),
        (" 10.96.0.12 ", "10.96.0.12:8899"),
        ("::1", "[::1]:8899"),
        ("fd00::a:12", "[fd00::a:12]:8899"),
        ("0:0:0:0:0:0:0:1", "[::1]:8899"),
        ("::ffff:10.0.0.1", "[::ffff:a00:1]:8899"),
    ],
)
def test_mindx_server_ip(ip: str, server: str) -> None:
    assert from_env({"MINDX_SERVER_IP": ip, "MINDX_TASK_ID": "j"}).server == server


@pytest.mark.parametrize("ip", ["clusterd-grpc-svc", "10.0.0.1:8899", "[::1]", "300.1.1.1", "10.0.0"])
def test_invalid_mindx_server_ip(ip: str) -> None:
    with pytest.raises(ConfigError) as info:
        from_env({"MINDX_SERVER_IP": ip, "MINDX_TASK_ID": "j"})
    assert "MINDX_SERVER_IP" in str(info.value)
    assert repr(ip) in str(info.value)


def test_local_proxy_enable_on() -> None:
    assert LOCAL_PROXY_ADDRESS == "127.0.0.1:8899"
    assert from_env({"LOCAL_PROXY_ENABLE": "on", "MINDX_TASK_ID": "j"}).server == "127.0.0.1:8899"


@pytest.mark.parametrize("ip", ["10.0.0.1", "not-an-ip"])
def test_local_proxy_wins_over_mindx_server_ip(ip: str) -> None:
    # As upstream taskd utils.GetClusterdAddr: the proxy check comes first, the IP is not looked at.
    env = {"LOCAL_PROXY_ENABLE": "on", "MINDX_SERVER_IP": ip, "MINDX_TASK_ID": "j"}
    assert from_env(env).server == "127.0.0.1:8899"


@pytest.mark.parametrize("value", ["off", "", "1", "true"])
def test_local_proxy_other_values_fall_back_to_mindx_server_ip(value: str) -> None:
    env = {"LOCAL_PROXY_ENABLE": value, "MINDX_SERVER_IP": "10.0.0.1", "MINDX_TASK_ID": "j"}
    assert from_env(env).server == "10.0.0.1:8899"


def test_mindx_task_id_and_world_size() -> None:
    cfg = from_env({"MINDX_SERVER_IP": "10.0.0.1", "MINDX_TASK_ID": "3f2a-uid", "WORLD_SIZE": "32"})
    assert cfg.job_id == "3f2a-uid"
    assert cfg.world_size == 32


@pytest.mark.parametrize("raw", ["abc", "8.0", "1e3"])
def test_bad_world_size_names_the_env_var(raw: str) -> None:
    with pytest.raises(ConfigError) as info:
        from_env({"MINDX_SERVER_IP": "10.0.0.1", "MINDX_TASK_ID": "j", "WORLD_SIZE": raw})
    assert f"WORLD_SIZE={raw!r}" in str(info.value)
    assert "world_size" in str(info.value)


@pytest.mark.parametrize("raw", ["0", "-4"])
def test_non_positive_world_size_from_env(raw: str) -> None:
    with pytest.raises(ConfigError, match=rf"world_size={raw} must be a positive integer"):
        from_env({"MINDX_SERVER_IP": "10.0.0.1", "MINDX_TASK_ID": "j", "WORLD_SIZE": raw})


# -- env parsing --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("1", True), ("true", True), ("TRUE", True), ("on", True), ("yes", True), (" On ", True),
     ("0", False), ("false", False), ("False", False), ("off", False), ("no", False)],
)
def test_dry_run_from_env(raw: str, expected: bool) -> None:
    cfg = from_env({"NICSWITCH_DRY_RUN": raw}, **BASE)
    assert cfg.dry_run is expected


@pytest.mark.parametrize("raw", ["2", "maybe", "enabled", "y"])
def test_bad_dry_run_from_env(raw: str) -> None:
    with pytest.raises(ConfigError) as info:
        from_env({"NICSWITCH_DRY_RUN": raw}, **BASE)
    assert f"NICSWITCH_DRY_RUN={raw!r}" in str(info.value)
    assert "dry_run" in str(info.value)


@pytest.mark.parametrize("name", FLOAT_FIELDS)
def test_every_float_field_from_env(name: str) -> None:
    value = {"keepalive_time_s": "7.5", "reconnect_initial_s": "0.5", "reconnect_max_s": "7.5",
             "reply_attempt_timeout_s": "7.5", "reply_timeout_s": "12.5",
             "conflict_backoff_max_s": "42.5"}.get(name, "2.5")
    cfg = from_env({f"NICSWITCH_{name.upper()}": value}, **BASE)
    assert getattr(cfg, name) == float(value)
    assert isinstance(getattr(cfg, name), float)


@pytest.mark.parametrize("name", FLOAT_FIELDS)
def test_unparsable_float_from_env(name: str) -> None:
    env_name = f"NICSWITCH_{name.upper()}"
    with pytest.raises(ConfigError) as info:
        from_env({env_name: "ten"}, **BASE)
    assert f"{env_name}='ten'" in str(info.value)
    assert name in str(info.value)


@pytest.mark.parametrize("raw", ["nan", "inf", "-inf"])
def test_non_finite_float_from_env(raw: str) -> None:
    with pytest.raises(ConfigError, match=r"switch_timeout_s=.* must be a finite number of seconds"):
        from_env({"NICSWITCH_SWITCH_TIMEOUT_S": raw}, **BASE)


def test_int_fields_from_env() -> None:
    cfg = from_env({"NICSWITCH_MAX_RANKS": "128", "NICSWITCH_MAX_MESSAGE_BYTES": "4096"}, **BASE)
    assert (cfg.max_ranks, cfg.max_message_bytes) == (128, 4096)
    with pytest.raises(ConfigError, match=r"NICSWITCH_MAX_RANKS='1e3' is not valid for max_ranks"):
        from_env({"NICSWITCH_MAX_RANKS": "1e3"}, **BASE)


def test_pause_from_env() -> None:
    assert from_env({"NICSWITCH_PAUSE": "external"}, **BASE).pause == "external"
    assert from_env({"NICSWITCH_PAUSE": "agent"}, **BASE).pause == "agent"
    with pytest.raises(ConfigError, match=r"pause='internal' is not supported; choose one of auto, agent, external"):
        from_env({"NICSWITCH_PAUSE": "internal"}, **BASE)


# -- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0.0, 1.0, 2.999])
def test_keepalive_below_three_seconds_refused(value: float) -> None:
    message = refused("keepalive_time_s", keepalive_time_s=value)
    assert f"keepalive_time_s={value!r}" in message
    assert "3 s" in message
    assert "too_many_pings" in message


def test_keepalive_of_three_seconds_accepted() -> None:
    assert make(keepalive_time_s=3).keepalive_time_s == 3


@pytest.mark.parametrize("name", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [-1.0, -0.001])
def test_negative_times_refused(name: str, value: float) -> None:
    message = refused(rf"{name}=", **{name: value})
    assert f"{name}={value!r}" in message


@pytest.mark.parametrize("name", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_times_refused(name: str, value: float) -> None:
    message = refused("must be a finite number of seconds", **{name: value})
    assert f"{name}={value!r}" in message


@pytest.mark.parametrize("name", FLOAT_FIELDS)
@pytest.mark.parametrize("value", ["10", None, True])
def test_non_numeric_times_refused(name: str, value: Any) -> None:
    message = refused("must be a finite number of seconds", **{name: value})
    assert f"{name}={value!r}" in message


@pytest.mark.parametrize(
    "name",
    ["keepalive_timeout_s", "pause_timeout_s", "reconnect_initial_s", "reconnect_max_s", "connect_timeout_s",
     "guard_timeout_s", "switch_timeout_s",
     "reply_timeout_s", "reply_attempt_timeout_s", "rpc_timeout_s", "stop_timeout_s", "store_connect_timeout_s",
     "join_timeout_s", "mindspore_poll_s"],
)
def test_zero_refused_where_a_positive_time_is_needed(name: str) -> None:
    message = refused(rf"{name}=0 must be positive", **{name: 0})
    assert name in message


@pytest.mark.parametrize("name", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [MAX_DURATION_S + 0.5, 2_200_000.0, 1e20, 1e308])
def test_times_above_seven_days_refused(name: str, value: float) -> None:
    """A duration gRPC (or poll(), or a thread's wait) cannot take used to pass, and crashed start()
    with an OverflowError: it is a ConfigError naming the setting, the value and the limit."""
    message = refused(r"must be at most 604800 s \(7 days\)", **{name: value})
    assert message.startswith(f"{name}={value!r} must be at most 604800 s (7 days)"), message


def test_the_longest_times_fit_grpcs_c_ints_and_open_a_channel() -> None:
    """At the limit every channel setting still opens a channel (grpc's options are C ints of ms),
    with room for a few durations added up; and a thread may wait that long several times over."""
    import grpc

    from nicswitch_agent.clusterd.channel import ChannelSettings

    longest = MAX_DURATION_S
    assert 3 * longest * 1000 <= 2**31 - 1 and 4 * longest < threading.TIMEOUT_MAX
    cfg = make(keepalive_time_s=longest, keepalive_timeout_s=longest, reconnect_initial_s=longest,
               reconnect_max_s=longest, connect_timeout_s=longest, max_message_bytes=2**31 - 1)
    settings = ChannelSettings(target=cfg.server, keepalive_time_s=cfg.keepalive_time_s,
                               keepalive_timeout_s=cfg.keepalive_timeout_s, reconnect_initial_s=cfg.reconnect_initial_s,
                               reconnect_max_s=cfg.reconnect_max_s, connect_timeout_s=cfg.connect_timeout_s,
                               max_receive_bytes=cfg.max_message_bytes)
    grpc.insecure_channel(settings.target, options=settings.options()).close()  # no OverflowError


@pytest.mark.parametrize("value", [2**31, 3_000_000_000, 2**63])
def test_max_message_bytes_above_grpcs_limit_refused(value: int) -> None:
    message = refused("max_message_bytes", max_message_bytes=value)
    assert message == f"max_message_bytes={value} must be at most 2147483647 (gRPC's limit: 2 GiB - 1)"


def test_resubscribe_after_eof_may_be_zero_but_at_most_60() -> None:
    assert make(resubscribe_after_eof_s=0).resubscribe_after_eof_s == 0
    assert make(resubscribe_after_eof_s=60).resubscribe_after_eof_s == 60
    refused(r"resubscribe_after_eof_s=60.5 must be at most 60 s", resubscribe_after_eof_s=60.5)


def test_reconnect_initial_above_max_refused() -> None:
    message = refused("exceeds", reconnect_initial_s=6.0, reconnect_max_s=5.0)
    assert "reconnect_initial_s=6.0" in message
    assert "reconnect_max_s=5.0" in message
    assert make(reconnect_initial_s=5.0, reconnect_max_s=5.0).reconnect_initial_s == 5.0


def test_reply_attempt_above_total_refused() -> None:
    message = refused("exceeds", reply_attempt_timeout_s=61.0, reply_timeout_s=60.0)
    assert "reply_attempt_timeout_s=61.0" in message
    assert "reply_timeout_s=60.0" in message
    assert make(reply_attempt_timeout_s=60.0, reply_timeout_s=60.0).reply_attempt_timeout_s == 60.0


@pytest.mark.parametrize(
    ("guard", "switch", "reply", "ok"),
    [
        (300.0, 120.0, 60.0, True),
        (719.0, 120.0, 60.0, True),
        (720.0, 120.0, 60.0, False),  # exactly 900 s: ClusterD's limit, refused
        (100.0, 700.0, 100.0, False),
        (1.0, 1.0, 1000.0, False),
    ],
)
def test_total_budget_below_clusterd_limit(guard: float, switch: float, reply: float, ok: bool) -> None:
    kwargs = {"guard_timeout_s": guard, "switch_timeout_s": switch, "reply_timeout_s": reply}
    if ok:
        assert make(**kwargs).guard_timeout_s == guard
        return
    message = refused("900 s", **kwargs)
    assert "guard_timeout_s + switch_timeout_s + reply_timeout_s" in message
    assert f"{guard + switch + reply:g} s" in message


@pytest.mark.parametrize(
    "server",
    ["10.0.0.1:8899", "clusterd-grpc-svc.mindx-dl.svc.cluster.local:8899", "[::1]:8899",
     "[fd00::1]:1", "localhost:65535", "unix:/tmp/clusterd.sock"],
)
def test_good_server_targets(server: str) -> None:
    assert make(server=server).server == server


@pytest.mark.parametrize(
    ("server", "normalised"),
    [("10.0.0.1", "10.0.0.1:8899"), ("clusterd", "clusterd:8899"), ("[::1]", "[::1]:8899"),
     (" 10.0.0.1:9000 ", "10.0.0.1:9000"), ("host:080", "host:80"), ("dns:///svc.ns", "dns:///svc.ns:8899")],
)
def test_a_bare_host_gets_clusterds_port(server: str, normalised: str) -> None:
    assert make(server=server).server == normalised


@pytest.mark.parametrize(
    ("server", "problem"),
    [
        ("10.0.0.1:", "the port after ':' is missing"),
        (":8899", "the host is missing (give host:port)"),
        ("host:port", "the port 'port' is not a number"),
        ("host:0", "the port 0 is outside 1-65535"),
        ("host:65536", "the port 65536 is outside 1-65535"),
        ("host:-1", "the port '-1' is not a number"),
        ("host:+80", "the port '+80' is not a number"),
        ("host: 80", "the port ' 80' is not a number"),
        ("::1:8899", "put an IPv6 address in brackets, e.g. [::1]:8899"),
        ("fd00::1:8899", "put an IPv6 address in brackets, e.g. [fd00::1]:8899"),
        ("fd00::1", "put an IPv6 address in brackets, e.g. [fd00::1]:8899"),
        ("[::1:8899", "an IPv6 address in brackets needs its closing ']'"),
        ("[::1]x", "expected ':port' after the address in brackets, not 'x'"),
        ("[zz]:1", "'zz' is not an IPv6 address"),
    ],
)
def test_bad_server_targets(server: str, problem: str) -> None:
    message = refused(re.escape(problem), server=server)
    assert message.startswith(f"server={server!r}: "), message


def test_non_ascii_digit_port_is_a_config_error() -> None:
    try:
        make(server="clusterd:\u00b2")  # superscript two
    except ConfigError as exc:
        assert "server='clusterd:\u00b2'" in str(exc)
    except ValueError as exc:  # int('²') would fail after isdigit() said yes
        raise AssertionError(f"ValueError, not ConfigError: {exc}") from exc
    else:
        raise AssertionError("accepted")


def test_fullwidth_digit_port_refused() -> None:
    with pytest.raises(ConfigError, match="server="):
        make(server="clusterd:\uff18\uff18\uff19\uff19")  # fullwidth 8899


def test_server_from_env_is_validated_too() -> None:
    with pytest.raises(ConfigError, match=r"NICSWITCH_SERVER='::1:8899': put an IPv6 address in brackets"):
        from_env({"NICSWITCH_SERVER": "::1:8899", "MINDX_TASK_ID": "j"})


@pytest.mark.parametrize("server", ["", "   "])
def test_missing_server_message(server: str) -> None:
    message = refused("server is not set", server=server)
    for hint in ("server=", "NICSWITCH_SERVER", "MINDX_SERVER_IP", "LOCAL_PROXY_ENABLE=on"):
        assert hint in message


def test_missing_server_from_empty_env() -> None:
    with pytest.raises(ConfigError, match="server is not set") as info:
        from_env({"MINDX_TASK_ID": "j"})
    assert "MINDX_SERVER_IP" in str(info.value)


@pytest.mark.parametrize("job_id", ["", "   "])
def test_missing_job_id_message(job_id: str) -> None:
    message = refused("job_id is not set", job_id=job_id)
    for hint in ("job_id=", "NICSWITCH_JOB_ID", "MINDX_TASK_ID"):
        assert hint in message


def test_missing_job_id_from_env() -> None:
    with pytest.raises(ConfigError, match=r"job_id is not set.*MINDX_TASK_ID"):
        from_env({"MINDX_SERVER_IP": "10.0.0.1"})


@pytest.mark.parametrize("job_id", [" job", "job ", "jo\x00b", "job\n", "a\tb"])
def test_job_id_with_spaces_or_control_characters_refused(job_id: str) -> None:
    message = refused("surrounding spaces or control characters", job_id=job_id)
    assert f"job_id={job_id!r}" in message


def test_unknown_setting_names() -> None:
    unknown = r"unknown setting\(s\): keepalive_s \(did you mean keepalive_time_s\?\), zzz"
    with pytest.raises(ConfigError, match=unknown):
        from_env({}, **BASE, zzz=1, keepalive_s=3)


@pytest.mark.parametrize("pause", ["internal", "mindio", "", "Externals", None])
def test_unknown_pause_modes_refused(pause: Any) -> None:
    message = refused("is not supported; choose one of auto, agent, external", pause=pause)
    assert f"pause={pause!r}" in message


@pytest.mark.parametrize("value", ["yes", 1, 0, None])
def test_dry_run_must_be_a_bool(value: Any) -> None:
    assert f"dry_run={value!r} must be a bool" in refused("dry_run", dry_run=value)


@pytest.mark.parametrize("value", [0, -1, True, 2.0, "8"])
def test_world_size_must_be_a_positive_int(value: Any) -> None:
    assert f"world_size={value!r} must be a positive integer" in refused("world_size", world_size=value)


@pytest.mark.parametrize("name", ["max_ranks", "max_message_bytes"])
@pytest.mark.parametrize("value", [0, -5, True, 1.5, "64"])
def test_limits_must_be_positive_ints(name: str, value: Any) -> None:
    assert f"{name}={value!r} must be a positive integer" in refused(name, **{name: value})


@pytest.mark.parametrize(("role", "expected"), [("", "role='' must be a non-empty string"),
                                              (None, "role must be a string, got NoneType None"),
                                              (7, "role must be a string, got int 7")])
def test_role_must_be_a_non_empty_string(role: Any, expected: str) -> None:
    assert expected in refused("role", role=role)


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        make(pause="internal")


# -- dataclass behaviour ------------------------------------------------------------------------


def test_frozen() -> None:
    cfg = make()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.server = "other:1"  # type: ignore[misc]
    assert cfg.server == BASE["server"]


def test_keyword_construction_and_equality() -> None:
    assert make() == make()
    assert make() != make(job_id="job-2")
    assert hash(make()) == hash(make())


def test_positional_construction_is_refused() -> None:
    # Forty-odd fields of like types: a positional slip would silently set the wrong one.
    with pytest.raises(TypeError, match="positional"):
        AgentConfig("10.0.0.1:8899", "job-1")  # type: ignore[misc]


def test_replace_returns_a_validated_copy() -> None:
    cfg = make()
    changed = cfg.replace(switch_timeout_s=30.0, dry_run=True)
    assert (changed.switch_timeout_s, changed.dry_run) == (30.0, True)
    assert (cfg.switch_timeout_s, cfg.dry_run) == (120.0, False)  # the original is untouched
    with pytest.raises(ConfigError, match=r"keepalive_time_s=1 is below 3 s"):
        cfg.replace(keepalive_time_s=1)
    with pytest.raises(ConfigError, match="exceeds"):
        cfg.replace(reconnect_initial_s=10.0)
    with pytest.raises(ConfigError, match="900 s"):
        cfg.replace(guard_timeout_s=800.0)


def test_describe_is_a_plain_dict_of_every_field() -> None:
    described = make(world_size=8).describe()
    assert set(described) == {f.name for f in dataclasses.fields(AgentConfig)}
    assert described["server"] == BASE["server"]
    assert described["world_size"] == 8


def test_describe_says_tls_is_on_when_another_tls_setting_turns_it_on() -> None:
    assert make().describe()["tls"] is False
    named = make(tls_server_name="clusterd.example")
    assert named.tls is False and named.describe()["tls"] is True


def test_dns_scheme_target_is_accepted() -> None:
    assert make(server="dns:///clusterd-grpc-svc.mindx-dl.svc.cluster.local:8899").server.startswith("dns:")


def test_non_string_server_names_the_value() -> None:
    assert "server must be a string 'host:port', got int 123" in refused("must be a string", server=123)


def test_replace_with_unknown_setting_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown setting"):
        make().replace(bogus=1)


def test_underscores_in_numbers_from_env_are_refused() -> None:
    with pytest.raises(ConfigError, match="NICSWITCH_GUARD_TIMEOUT_S='1_0'"):
        from_env({"NICSWITCH_SERVER": "h:1", "MINDX_TASK_ID": "j", "NICSWITCH_GUARD_TIMEOUT_S": "1_0"})


# One value of each field's type, as an environment variable spells it, and what it must become.
SAMPLES: dict[Any, tuple[str, Any]] = {bool: ("yes", True), int: ("7", 7), float: ("2.5", 2.5), str: ("a_b", "a_b")}


def test_every_field_from_env_gets_a_value_of_its_type() -> None:
    # Parsed by the field's type itself, not by how its annotation is spelled.
    hints = typing.get_type_hints(AgentConfig)
    for f in dataclasses.fields(AgentConfig):
        kind = hints[f.name]
        base = next((a for a in typing.get_args(kind) if a is not type(None)), kind)
        raw, expected = SAMPLES[base]
        assert config_module._parse(f.name, kind, raw, "X") == expected, (f.name, kind)


@pytest.mark.parametrize(("kind", "raw", "expected"), [
    (Optional[float], "2.5", 2.5),  # noqa: UP045 - the spelling is the point
    (float | None, "2.5", 2.5),
    (typing.Union[None, int], "3", 3),  # noqa: UP007
    (Optional[bool], "off", False),  # noqa: UP045
    (float, "1e3", 1000.0),
    (int | None, "-4", -4),
    (str | None, "3", "3"),
])
def test_env_values_are_parsed_by_type_however_it_is_spelled(kind: Any, raw: str, expected: Any) -> None:
    value = config_module._parse("field", kind, raw, "EXAMPLE_VARIABLE")
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize(("kind", "raw"), [(Optional[int], "1.5"), (float, "1_0"), (bool, "maybe")])  # noqa: UP045
def test_env_values_of_the_wrong_type_name_the_variable(kind: Any, raw: str) -> None:
    with pytest.raises(ConfigError, match=f"EXAMPLE_VARIABLE={raw!r} is not valid for field"):
        config_module._parse("field", kind, raw, "EXAMPLE_VARIABLE")


def test_a_field_type_without_a_parser_is_a_programming_error() -> None:
    with pytest.raises(TypeError, match="no parser"):
        config_module._parse("field", list[str], "x", "EXAMPLE_VARIABLE")


@pytest.mark.parametrize(
    ("env", "mode", "because"),
    [
        ({}, "agent", "no MindIO/TaskD markers"),
        ({"TTP_PORT": "8000"}, "external", "TTP_PORT is set"),
        ({"TASKD_PROCESS_ENABLE": "on"}, "external", "TASKD_PROCESS_ENABLE=on"),
        ({"TASKD_PROCESS_ENABLE": "off"}, "agent", "no MindIO/TaskD markers"),
        ({"TTP_PORT": "  "}, "agent", "no MindIO/TaskD markers"),
    ],
)
def test_auto_pause_mode_follows_mindio_markers(env: dict[str, str], mode: str, because: str) -> None:
    from nicswitch_agent.config import resolve_pause_mode

    resolved, reason = resolve_pause_mode("auto", env)
    assert resolved == mode and because in reason


@pytest.mark.parametrize("pause", ["agent", "external"])
def test_forced_pause_mode_ignores_markers(pause: str) -> None:
    from nicswitch_agent.config import resolve_pause_mode

    assert resolve_pause_mode(pause, {"TTP_PORT": "1"})[0] == pause


def test_pause_timeout_must_stay_inside_clusterd_wait() -> None:
    assert "pause_timeout_s=900" in refused("below ClusterD's 900 s", pause_timeout_s=900)


@pytest.mark.parametrize("leader", ["rank0", "launcher"])
def test_leader_places(leader: str) -> None:
    assert from_env({"NICSWITCH_LEADER": leader}, **BASE).leader == leader


def test_unknown_leader_place_refused() -> None:
    assert "leader='rank1'" in refused("choose one of rank0, launcher", leader="rank1")


def test_store_address_from_env_and_validated() -> None:
    assert from_env({"NICSWITCH_STORE_ADDRESS": "10.0.0.1:29600"}, **BASE).store_address == "10.0.0.1:29600"
    assert "store_address='nohost'" in refused("host:port", store_address="nohost")


def test_rank_from_env_and_inside_world() -> None:
    assert from_env({"RANK": "3", "WORLD_SIZE": "4"}, **BASE).rank == 3
    assert "rank=4 is outside world_size=4" in refused("outside", rank=4, world_size=4)


def test_handle_signals_must_be_a_bool() -> None:
    with pytest.raises(ConfigError, match="handle_signals='yes' must be a bool"):
        AgentConfig(server="h:1", job_id="j", handle_signals="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"NICSWITCH_CONFLICT_RESETS": "1"}, "conflict_resets=1 must be an integer of at least 2"),
        ({"NICSWITCH_CONFLICT_BACKOFF_S": "400"}, "conflict_backoff_s=400.0 exceeds conflict_backoff_max_s=300.0"),
        ({"NICSWITCH_CONFLICT_WINDOW_S": "0"}, "conflict_window_s=0.0 must be positive"),
    ],
)
def test_conflict_settings_are_checked(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        from_env(env, **BASE)


def test_conflict_settings_from_env() -> None:
    cfg = from_env({"NICSWITCH_CONFLICT_RESETS": "5", "NICSWITCH_CONFLICT_BACKOFF_MAX_S": "60"}, **BASE)
    assert (cfg.conflict_resets, cfg.conflict_backoff_max_s) == (5, 60.0)


# -- node-local fan-out ---------------------------------------------------------------------------


def test_local_world_size_comes_from_torchruns_env_and_nicswitch_wins() -> None:
    env = {"MINDX_SERVER_IP": "10.1.2.3", "MINDX_TASK_ID": "j", "LOCAL_WORLD_SIZE": "8"}
    assert from_env(env).local_world_size == 8
    assert from_env({**env, "NICSWITCH_LOCAL_WORLD_SIZE": "4"}).local_world_size == 4  # the launcher's export
    assert from_env(env).fan_out == "auto"


@pytest.mark.parametrize(("overrides", "match"), [
    ({"fan_out": "tree"}, "fan_out='tree' is not supported; choose one of auto, group, node, flat"),
    ({"node_transport": "tcp"}, "node_transport='tcp' is not supported; choose one of auto, socket, store"),
    ({"nodes_per_group": 1}, "nodes_per_group=1 must be an integer of at least 2"),
    ({"nodes_per_group": "8"}, "nodes_per_group='8' must be an integer of at least 2"),
    ({"local_world_size": 0}, "local_world_size=0 must be a positive integer"),
    ({"local_world_size": True}, "local_world_size=True must be a positive integer"),
    ({"node_store_timeout_s": 0}, "node_store_timeout_s=0 must be positive"),
])
def test_fan_out_settings_are_checked(overrides: dict[str, Any], match: str) -> None:
    refused(re.escape(match), **overrides)


@pytest.mark.parametrize(("template", "problem"), [
    ("/run/{x}.json", "{x} is not replaced: only {rank}, {pid} and {job} may appear in braces"),
    ("/run/{rank.json", "only {rank}, {pid} and {job} may appear in braces, each closed"),
])
def test_a_path_template_with_a_stray_brace_is_named_once_with_what_is_wrong(template: str, problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        AgentConfig(server="127.0.0.1:1", job_id="j", status_file=template)
    assert str(info.value).startswith(f"status_file={template!r}: {problem}"), str(info.value)
    assert str(info.value).count(template) == 1
