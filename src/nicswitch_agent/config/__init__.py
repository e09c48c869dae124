"""AgentConfig: every knob of the agent, validated once, with MindCluster and NICSWITCH_* env names.

Precedence, highest first: explicit arguments > ``NICSWITCH_*`` env > MindCluster env
(``MINDX_SERVER_IP``, ``LOCAL_PROXY_ENABLE``, ``MINDX_TASK_ID``) > defaults. Only
:meth:`AgentConfig.from_env` reads the environment; the dataclass itself is plain and frozen so a
config can be built in tests without touching ``os.environ``.

Every wait the agent does on ClusterD's behalf must end well inside ClusterD's own 15-minute
limits (``reportTimeoutMinutes``): a reply that arrives after ClusterD gave up is worse than a
prompt false, because ClusterD then takes it as the result of the *next* switch.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import logging
import os
import threading
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nicswitch_agent.config import pem
from nicswitch_agent.config.addresses import CLUSTERD_PORT, parse_server
from nicswitch_agent.config.frameworks import FRAMEWORKS, MSRUN_NAMES, in_msrun, job_framework
from nicswitch_agent.config.limits import MAX_MESSAGE_BYTES, check_seconds
from nicswitch_agent.errors import ConfigError
from nicswitch_agent.observability.status_file import expand_path

if TYPE_CHECKING:  # transport imports grpc, which only the leader needs (members never dial)
    from nicswitch_agent.clusterd.channel import TlsSettings

CLUSTERD_REPORT_TIMEOUT_S = 15 * 60.0
CLUSTERD_MIN_PING_INTERVAL_S = 3.0
LOCAL_PROXY_ADDRESS = f"127.0.0.1:{CLUSTERD_PORT}"
PAUSE_MODES = ("auto", "agent", "external")
LEADER_PLACES = ("rank0", "launcher")
FAN_OUTS = ("auto", "group", "node", "flat")
NODE_TRANSPORTS = ("auto", "socket", "store")
AUTO_GROUP_NODES = 128  # fan_out auto: above this many nodes, nodes answer through group relays
ENV_PREFIX = "NICSWITCH_"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}

logger = logging.getLogger("nicswitch_agent.config")


def _env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _describe(value: Any) -> str:
    """``int 123``: the type and the value, for messages about a value of the wrong type."""
    return f"{type(value).__name__} {value!r}"


def _invalid(message: str, *settings: str) -> ConfigError:
    """The error for ``settings`` (field names), which :meth:`AgentConfig.from_env` extends with the
    variable and the value of each one that came from the environment."""
    return ConfigError(message, settings=settings)


def did_you_mean(given: str, candidates: Sequence[str]) -> str:
    """``"; did you mean 'external'?"`` for a near miss among ``candidates`` (difflib), else ""."""
    close = difflib.get_close_matches(given.lower(), list(candidates), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        hint = did_you_mean(value, choices) if isinstance(value, str) else ""
        raise _invalid(f"{name}={value!r} is not supported; choose one of {', '.join(choices)}{hint}", name)


def _unknown_settings(names: Sequence[str], known: Sequence[str]) -> ConfigError:
    """``unknown setting(s): swtich_timeout_s (did you mean switch_timeout_s?)``."""
    parts = []
    for name in names:
        close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
        parts.append(f"{name} (did you mean {close[0]}?)" if close else name)
    return ConfigError(f"unknown setting(s): {', '.join(parts)}")


def _name_sources(exc: ConfigError, sources: Mapping[str, tuple[str, str]]) -> ConfigError:
    """``exc`` led by the variable and value of each of its settings that came from the environment
    (``NICSWITCH_SWITCH_TIMEOUT_S='-5': switch_timeout_s=-5.0 must not be negative``)."""
    named = [f"{sources[name][0]}={sources[name][1]!r}" for name in exc.settings if name in sources]
    if not named:
        return exc
    return ConfigError(f"{', '.join(named)}: {exc}", settings=exc.settings)


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """Validated settings of one agent. Construct with keywords; invalid values raise ConfigError.

    Times are seconds (floats). Each field ``x`` can be set by the env var ``NICSWITCH_X``.
    """

    server: str
    """ClusterD address ``host:port``. Env: NICSWITCH_SERVER, else MINDX_SERVER_IP (+ :8899),
    else 127.0.0.1:8899 when LOCAL_PROXY_ENABLE=on (the nginx mTLS sidecar)."""
    job_id: str
    """ClusterD's job key (the job UID). Env: NICSWITCH_JOB_ID, else MINDX_TASK_ID."""
    role: str = "nicswitch-agent"
    """``ClientInfo.role``: ClusterD only logs it."""
    pause: str = "auto"
    """Who pauses training around a switch. ``agent``: the agent is ClusterD's process-manage
    client and parks the training thread at a step boundary itself. ``external``: MindIO/TaskD do
    (the agent never opens the process-manage stream, which would reset ClusterD's job
    controller). ``auto``: ``external`` when MindIO/TaskD markers are present, else ``agent``."""
    dry_run: bool = False
    """Log what would be switched, run no hooks, and report success: a rehearsal."""

    keepalive_time_s: float = 10.0
    """HTTP/2 ping interval. ClusterD refuses pings more often than every 3 s (GOAWAY)."""
    keepalive_timeout_s: float = 5.0
    """How long a ping may go unanswered before the connection is declared dead."""
    reconnect_initial_s: float = 0.2
    """First delay before resubscribing after a stream error (jittered, grows x2)."""
    reconnect_max_s: float = 1.0
    """Cap of the resubscribe delay after errors, and of the channel's reconnect backoff: the
    streams reopen within 2 s of a restarted ClusterD answering again."""
    connect_timeout_s: float = 20.0
    """How long one connection attempt to ClusterD may take (TCP, TLS, HTTP/2 settings) before gRPC
    drops it and tries again after its backoff: gRPC's own default. A host that refuses at once
    still fails at once; a slow link must not fail every attempt."""
    resubscribe_after_eof_s: float = 0.0
    """Delay before resubscribing after a clean end of stream (ClusterD ends it after every
    switch); reopening is still throttled if the server keeps ending it at once."""
    notify_reopen_wait_s: float = 5.0
    """Pause mode agent: after ClusterD ends the notify stream cleanly (it reset the job, which ends
    the process-manage stream too), how long the notify stream waits for the process-manage stream
    to be reopened before it reopens anyway. Reopened earlier, the reset would end it again."""

    pause_timeout_s: float = 300.0
    """Pause mode agent: how long training may take to reach a step boundary after ClusterD's
    pause_train. Past it the pause is reported failed (499) and withdrawn, so training is never
    left parked; ClusterD answers a failed pause by killing the job (killMaster)."""
    guard_timeout_s: float = 300.0
    """Budget of the checkpoint guard for one order."""
    switch_timeout_s: float = 120.0
    """Budget of the switch hook for one order."""
    verify_timeout_s: float = 30.0
    """Budget of the verify hook for one order (it runs on every rank once the switch succeeded on
    every rank), and of a verify hook's warm-up before the switch (``TorchLinkProbe``)."""
    reply_timeout_s: float = 60.0
    """Total budget for delivering ReplySwitchNicResult, retries included."""
    reply_attempt_timeout_s: float = 10.0
    """Deadline of one ReplySwitchNicResult attempt."""
    rpc_timeout_s: float = 10.0
    """Deadline of the other unary calls: Init, Register, the process-manage reports, HealthCheck."""
    stop_timeout_s: float = 1.0
    """How long stop() waits for each agent thread."""
    exit_timeout_s: float = 10.0
    """How long interpreter exit, or a second stop() from another thread, waits for a stop that is
    already under way (its false replies being sent) before giving up on it."""
    handle_signals: bool = True
    """On SIGTERM, stop the agent first (a false reply for any list owed one, every rank
    unparked), then let the signal take its usual course. Installed only when the agent is started
    on the main thread; previous handlers are chained (a SIGINT one too), ignored signals left alone;
    Ctrl-C's own KeyboardInterrupt is left to Python (process_hooks.py)."""

    world_size: int | None = None
    """Ranks in the job (env WORLD_SIZE, or msrun's MS_WORKER_NUM; else torch.distributed's, else
    1). Lists naming a rank outside it are refused; above 1, every rank coordinates through a Store."""
    rank: int | None = None
    """This process's global rank (env RANK, or msrun's RANK_ID; else torch.distributed's, else
    MindSpore's after its init(), else 0; an msrun worker of several ranks with none is refused).
    Rank 0 leads: it alone holds ClusterD's streams (ClusterD has one queue per job, read by
    competing subscribers)."""
    leader: str = "rank0"
    """Where the job's leader runs: ``rank0`` (global rank 0's agent) or ``launcher`` (the
    ``nicswitch-agent launch`` process; every training rank is then a member only)."""
    store_address: str | None = None
    """``host:port`` of a TCPStore to coordinate through instead of the job's default store (the
    launcher hosts one and exports it as NICSWITCH_STORE_ADDRESS)."""
    framework: str = "auto"
    """``torch``, ``mindspore``, or ``auto`` (MindSpore when it is imported and torch is not): which
    Store the ranks coordinate through and the default switch hook (docs/architecture.md#mindspores-tcpstore)."""
    fan_out: str = "auto"
    """How ranks reach the job's Store: ``node`` (one rank per node relays for its node over a
    node-local Store, so the job's Store sees nodes, not ranks), ``group`` (as ``node``, and the
    node relays of each group of ``nodes_per_group`` nodes answer through a group relay with a Store
    of its own, so the job's Store sees groups), ``flat`` (every rank on the job's Store), or
    ``auto`` (``node`` when the job spans more than one node of ``local_world_size`` ranks,
    ``group`` above 128 nodes). Every rank and the leader must choose alike: leave it to ``auto``
    and torchrun's LOCAL_WORLD_SIZE (``nicswitch-agent launch`` exports its choice to the training
    command)."""
    local_world_size: int | None = None
    """Ranks per node (env LOCAL_WORLD_SIZE, as torchrun sets it). Nodes are ``rank //
    local_world_size``; every node must have the same number of ranks."""
    nodes_per_group: int | None = None
    """With fan_out ``group``: nodes per group (the last group may have fewer); by default the
    square root of the number of nodes, rounded up, so the job's Store and each group's see about
    as many answers."""
    node_transport: str = "auto"
    """With node-local fan-out, how a node's ranks reach their relay: ``socket`` (coordination/node_link.py,
    Linux), ``store`` (a TCPStore local rank 0 hosts), ``auto`` (socket on Linux). Local rank 0 decides."""
    node_store_timeout_s: float = 60.0
    """With node-local fan-out, at start: how long a rank waits for its node's local rank 0 to
    publish the node-local Store it hosts."""
    store_connect_timeout_s: float = 30.0
    """How long opening a connection to the coordination Store may take before start() fails
    (torch retries a refused one until then: a Store host out of file descriptors refuses them);
    also the deadline of the Store calls that carry none of their own."""
    mindspore_poll_s: float = 0.02
    """With MindSpore's TCPStore (whose ``get`` holds the GIL, so waits poll): the longest gap between
    an idle wait's polls, one round trip each. Longer costs an idle rank less and a pause more."""
    join_timeout_s: float = 600.0
    """A launcher-hosted leader (``nicswitch-agent launch``) makes itself known to ClusterD once every
    rank has joined, or after this long at most (then it names the ranks missing)."""
    conflict_resets: int = 3
    """Pause mode agent: this many clean ends of the process-manage stream with no signal between
    them, within ``conflict_window_s``, mean another process-manage client (MindIO/TaskD, ``sim
    --standin``) is fighting for the job: ClusterD resets the job on every subscription."""
    conflict_window_s: float = 30.0
    """The window of ``conflict_resets``; a stream that then holds this long ends the conflict."""
    conflict_backoff_s: float = 30.0
    """Once a conflict is seen, wait this long before subscribing again (doubling, jittered)."""
    conflict_backoff_max_s: float = 300.0
    """Cap of that wait."""
    max_parked_s: float = 1800.0
    """A member parked this long without a word from the leader lets training go on."""
    max_ranks: int = 1 << 18
    """Largest rank list accepted (entries); a larger one is answered false, never run. The
    default (262,144) keeps the largest accepted list well inside max_message_bytes."""
    max_message_bytes: int = 8 * 1024 * 1024
    """Largest message accepted from ClusterD (it sends up to 8 MiB)."""
    max_pending_lists: int = 16
    """Lists kept waiting while one is executed. ClusterD sends one and waits for its reply, so
    more means a misbehaving server: a list beyond the limit is not kept (only its place in the
    reply order) and is answered false in turn."""

    status_file: str | None = None
    """A JSON file the agent keeps with its ``status()`` (read by ``nicswitch-agent status``); None:
    none. ``{rank}``, ``{pid}`` and ``{job}`` are replaced; without ``{rank}`` or ``{pid}`` only the
    leader writes it."""
    status_interval_s: float = 10.0
    """The status file is rewritten on every event, and at least this often."""
    events_file: str | None = None
    """Append every event as one JSON line to this file (``{rank}``, ``{pid}``, ``{job}`` replaced)."""
    metrics_port: int | None = None
    """The leader serves Prometheus metrics on this port (needs the ``metrics`` extra); None: off."""

    tls: bool = False
    """Dial ClusterD over TLS (on as well when any other ``tls_*`` setting is given). ClusterD
    itself serves plaintext, and MindCluster's nginx mTLS sidecar (LOCAL_PROXY_ENABLE=on) is dialed
    in plaintext too: this is for a TLS endpoint put in front of ClusterD some other way."""
    tls_ca_file: str | None = None
    """PEM file of the CA(s) that signed the server's certificate; None: gRPC's default roots."""
    tls_cert_file: str | None = None
    """PEM client certificate, for a server that requires one (mutual TLS); needs tls_key_file."""
    tls_key_file: str | None = None
    """Unencrypted PEM private key of tls_cert_file. Its path may be logged; its content never is."""
    tls_server_name: str | None = None
    """The name the server's certificate must hold, instead of the host in ``server``
    (``grpc.ssl_target_name_override``), e.g. when ``server`` is an IP address."""

    def __post_init__(self) -> None:
        for name, choices in (("pause", PAUSE_MODES), ("leader", LEADER_PLACES), ("fan_out", FAN_OUTS),
                               ("framework", FRAMEWORKS), ("node_transport", NODE_TRANSPORTS)):
            value = getattr(self, name)  # enumerations: any case (NICSWITCH_PAUSE=External)
            if isinstance(value, str) and value != value.lower() and value.lower() in choices:
                object.__setattr__(self, name, value.lower())
        self._validate()

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, /, **explicit: Any) -> AgentConfig:
        """Build from explicit keywords, then ``NICSWITCH_*``, then MindCluster env, then defaults.

        Keywords whose value is ``None`` count as not given. An error about a value read from the
        environment names its variable and the value as written there.
        """
        env = os.environ if env is None else env
        names = _field_types(cls)
        unknown = sorted(set(explicit) - set(names))
        if unknown:
            raise _unknown_settings(unknown, list(names))
        warn_unknown_env(env)
        values: dict[str, Any] = {k: v for k, v in explicit.items() if v is not None}
        sources: dict[str, tuple[str, str]] = {}  # field -> (variable, value) it was read from

        def read(name: str, variable: str) -> None:
            raw = env.get(variable, "").strip()
            if name not in values and raw:
                values[name] = _parse(name, names[name], raw, variable)
                sources[name] = (variable, raw)

        for name in names:
            read(name, _env_name(name))
        for name, variable in (("job_id", "MINDX_TASK_ID"), ("world_size", "WORLD_SIZE"),
                               ("local_world_size", "LOCAL_WORLD_SIZE"), ("rank", "RANK")):
            read(name, variable)
        if in_msrun(env, values.get("framework")):  # msrun's names, after torchrun's (frameworks.py)
            for name, variable in MSRUN_NAMES:
                read(name, variable)
        for name, default_port in (("server", CLUSTERD_PORT), ("store_address", None)):
            if name in sources:  # so that its message names the variable, as every other does
                values[name] = parse_server(values[name], sources[name][0], default_port=default_port)
        if "server" not in values:
            values["server"] = server_from_mindcluster(env)
        values.setdefault("job_id", "")
        try:
            return cls(**values)
        except ConfigError as exc:
            raise _name_sources(exc, sources) from None

    def replace(self, **changes: Any) -> AgentConfig:
        """A copy with ``changes`` applied (and validated)."""
        known = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(changes) - set(known))
        if unknown:
            raise _unknown_settings(unknown, known)
        return dataclasses.replace(self, **changes)

    # -- validation ----------------------------------------------------------------------------

    def _validate(self) -> None:
        """Every check, each error naming its field(s) (``ConfigError.settings``) and the value."""
        if not isinstance(self.server, str):
            raise _invalid(f"server must be a string 'host:port', got {_describe(self.server)}", "server")
        if not self.server.strip():
            raise _invalid(
                "server is not set: pass server='host:port', or set NICSWITCH_SERVER, "
                "MINDX_SERVER_IP or LOCAL_PROXY_ENABLE=on", "server"
            )
        object.__setattr__(self, "server", parse_server(self.server))  # a bare host gets :8899
        if not isinstance(self.job_id, str):
            raise _invalid(f"job_id must be a string, got {_describe(self.job_id)}", "job_id")
        if not self.job_id.strip():
            raise _invalid("job_id is not set: pass job_id=..., or set NICSWITCH_JOB_ID or MINDX_TASK_ID", "job_id")
        if self.job_id != self.job_id.strip() or any(ord(c) < 32 for c in self.job_id):
            raise _invalid(f"job_id={self.job_id!r} has surrounding spaces or control characters", "job_id")
        _check_choice("leader", self.leader, LEADER_PLACES)
        if self.store_address is not None:
            if not isinstance(self.store_address, str):
                raise _invalid(f"store_address must be a string 'host:port', got {_describe(self.store_address)}",
                               "store_address")
            object.__setattr__(self, "store_address",
                               parse_server(self.store_address, "store_address", default_port=None))
        _check_choice("pause", self.pause, PAUSE_MODES)
        for name in ("dry_run", "handle_signals"):
            if not isinstance(getattr(self, name), bool):
                raise _invalid(f"{name}={getattr(self, name)!r} must be a bool", name)
        for f in dataclasses.fields(self):
            if f.name.endswith("_s"):
                check_seconds(f.name, getattr(self, f.name))  # finite, 0 to 7 days (limits.py)
        if self.keepalive_time_s < CLUSTERD_MIN_PING_INTERVAL_S:
            raise _invalid(
                f"keepalive_time_s={self.keepalive_time_s!r} is below 3 s: ClusterD answers faster "
                "pings with GOAWAY too_many_pings (and resets the job if this is its process-manage client)",
                "keepalive_time_s",
            )
        if self.keepalive_timeout_s <= 0:
            raise _invalid(f"keepalive_timeout_s={self.keepalive_timeout_s!r} must be positive", "keepalive_timeout_s")
        for name in ("status_file", "events_file"):
            template = getattr(self, name)
            if template is not None:
                if not isinstance(template, str) or not template.strip():
                    raise _invalid(f"{name}={template!r} must be the path of a file", name)
                try:
                    expand_path(template, rank=0, job_id="job")
                except ValueError as exc:
                    raise _invalid(f"{name}={template!r}: {exc}", name) from None
        if self.metrics_port is not None and (
            isinstance(self.metrics_port, bool) or not isinstance(self.metrics_port, int)
            or not 0 <= self.metrics_port < 65536
        ):
            raise _invalid(f"metrics_port={self.metrics_port!r} must be a port number (0-65535)", "metrics_port")
        positive = ("pause_timeout_s", "max_parked_s", "reconnect_initial_s", "reconnect_max_s", "connect_timeout_s",
                    "guard_timeout_s",
                    "switch_timeout_s", "verify_timeout_s", "status_interval_s",
                    "reply_timeout_s", "reply_attempt_timeout_s", "rpc_timeout_s", "stop_timeout_s",
                    "store_connect_timeout_s", "join_timeout_s", "mindspore_poll_s",
                    "exit_timeout_s", "conflict_window_s", "conflict_backoff_s", "conflict_backoff_max_s",
                    "node_store_timeout_s", "notify_reopen_wait_s")
        for name in positive:
            if getattr(self, name) <= 0:
                raise _invalid(f"{name}={getattr(self, name)!r} must be positive", name)
        if self.reconnect_initial_s > self.reconnect_max_s:
            raise _invalid(
                f"reconnect_initial_s={self.reconnect_initial_s!r} exceeds reconnect_max_s={self.reconnect_max_s!r}",
                "reconnect_initial_s", "reconnect_max_s",
            )
        if isinstance(self.conflict_resets, bool) or not isinstance(self.conflict_resets, int) \
                or self.conflict_resets < 2:
            raise _invalid(f"conflict_resets={self.conflict_resets!r} must be an integer of at least 2",
                           "conflict_resets")
        if self.conflict_backoff_s > self.conflict_backoff_max_s:
            raise _invalid(
                f"conflict_backoff_s={self.conflict_backoff_s!r} exceeds "
                f"conflict_backoff_max_s={self.conflict_backoff_max_s!r}",
                "conflict_backoff_s", "conflict_backoff_max_s",
            )
        if self.resubscribe_after_eof_s > 60:
            raise _invalid(f"resubscribe_after_eof_s={self.resubscribe_after_eof_s!r} must be at most 60 s",
                           "resubscribe_after_eof_s")
        if self.reply_attempt_timeout_s > self.reply_timeout_s:
            raise _invalid(
                f"reply_attempt_timeout_s={self.reply_attempt_timeout_s!r} exceeds "
                f"reply_timeout_s={self.reply_timeout_s!r}",
                "reply_attempt_timeout_s", "reply_timeout_s",
            )
        if self.pause_timeout_s >= CLUSTERD_REPORT_TIMEOUT_S:
            raise _invalid(
                f"pause_timeout_s={self.pause_timeout_s!r} must stay below ClusterD's 900 s wait for the pause report",
                "pause_timeout_s",
            )
        budget = self.guard_timeout_s + self.switch_timeout_s + self.reply_timeout_s
        if budget >= CLUSTERD_REPORT_TIMEOUT_S:
            raise _invalid(
                f"guard_timeout_s + switch_timeout_s + reply_timeout_s = {budget:g} s must stay below "
                "ClusterD's 900 s wait for the result, or ClusterD gives up first",
                "guard_timeout_s", "switch_timeout_s", "reply_timeout_s",
            )
        if self.world_size is not None and (
            isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1
        ):
            raise _invalid(f"world_size={self.world_size!r} must be a positive integer", "world_size")
        bad_rank = isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0
        if self.rank is not None and bad_rank:
            raise _invalid(f"rank={self.rank!r} must be a non-negative integer", "rank")
        if self.rank is not None and self.world_size is not None and self.rank >= self.world_size:
            raise _invalid(f"rank={self.rank!r} is outside world_size={self.world_size!r}", "rank", "world_size")
        for name, choices in (("fan_out", FAN_OUTS), ("node_transport", NODE_TRANSPORTS), ("framework", FRAMEWORKS)):
            _check_choice(name, getattr(self, name), choices)
        if self.local_world_size is not None and (
                isinstance(self.local_world_size, bool) or not isinstance(self.local_world_size, int)
                or self.local_world_size < 1):
            raise _invalid(f"local_world_size={self.local_world_size!r} must be a positive integer",
                           "local_world_size")
        if self.nodes_per_group is not None and (
                isinstance(self.nodes_per_group, bool) or not isinstance(self.nodes_per_group, int)
                or self.nodes_per_group < 2):
            raise _invalid(f"nodes_per_group={self.nodes_per_group!r} must be an integer of at least 2",
                           "nodes_per_group")
        for name in ("max_ranks", "max_message_bytes", "max_pending_lists"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise _invalid(f"{name}={value!r} must be a positive integer", name)
        if self.max_message_bytes > MAX_MESSAGE_BYTES:
            raise _invalid(f"max_message_bytes={self.max_message_bytes!r} must be at most {MAX_MESSAGE_BYTES} "
                           "(gRPC's limit: 2 GiB - 1)", "max_message_bytes")
        if not isinstance(self.role, str):
            raise _invalid(f"role must be a string, got {_describe(self.role)}", "role")
        if not self.role:
            raise _invalid(f"role={self.role!r} must be a non-empty string", "role")
        if any(ord(c) < 32 for c in self.role):
            raise _invalid(f"role={self.role!r} has control characters", "role")
        _check_tls(self.tls, self.tls_ca_file, self.tls_cert_file, self.tls_key_file, self.tls_server_name)

    @property
    def tls_enabled(self) -> bool:
        """True when the agent dials over TLS: ``tls`` is true or any other ``tls_*`` is given."""
        return _tls_on(self.tls, self.tls_ca_file, self.tls_cert_file, self.tls_key_file, self.tls_server_name)

    def tls_settings(self) -> TlsSettings | None:
        """The channel's TLS settings; None: plaintext."""
        if not self.tls_enabled:
            return None
        from nicswitch_agent.clusterd.channel import TlsSettings

        return TlsSettings(ca_file=self.tls_ca_file, cert_file=self.tls_cert_file, key_file=self.tls_key_file,
                           server_name=self.tls_server_name)

    def describe(self) -> dict[str, Any]:
        """Settings as a plain dict, for logs and ``status()`` (nothing secret lives here); ``tls``:
        whether the agent dials over TLS (:attr:`tls_enabled`), not only the flag."""
        return {**dataclasses.asdict(self), "tls": self.tls_enabled}


# Markers of a running MindIO TFT / TaskD process-manage client. Both are set by the user for
# MindCluster's own switch support (docs: MindIO needs TTP_PORT; MindSpore+TaskD needs
# TASKD_PROCESS_ENABLE=on). When either is present, opening the process-manage stream ourselves
# would reset ClusterD's controller and steal MindIO's pause/continue signals.
EXTERNAL_PAUSE_MARKERS = ("TTP_PORT", "TASKD_PROCESS_ENABLE")


def resolve_pause_mode(pause: str, env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """The effective pause mode for ``pause`` and the reason, for a one-line INFO log."""
    if pause != "auto":
        return pause, f"pause={pause!r} was configured"
    env = os.environ if env is None else env
    if env.get("TTP_PORT", "").strip():
        return "external", "TTP_PORT is set: MindIO TFT pauses training"
    if env.get("TASKD_PROCESS_ENABLE", "").strip().lower() == "on":
        return "external", "TASKD_PROCESS_ENABLE=on: TaskD/MindIO pause training"
    return "agent", "no MindIO/TaskD markers (TTP_PORT, TASKD_PROCESS_ENABLE): the agent pauses training"


def server_from_mindcluster(env: Mapping[str, str]) -> str:
    """MindCluster's own discovery (taskd ``utils.GetClusterdAddr``); "" when nothing is set.

    ``LOCAL_PROXY_ENABLE=on``: the local mTLS sidecar, ``127.0.0.1:8899``. Else ``MINDX_SERVER_IP``,
    which MindCluster sets to ClusterD's IP address alone and dials at port 8899: a host name or a
    port there is refused (MindCluster's own clients would refuse it too), with the fix.

    Raises:
        ConfigError: MINDX_SERVER_IP is not an IP address.
    """
    if env.get("LOCAL_PROXY_ENABLE", "").strip().lower() == "on":
        return LOCAL_PROXY_ADDRESS
    ip = env.get("MINDX_SERVER_IP", "").strip()
    if not ip:
        return ""
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        raise ConfigError(f"MINDX_SERVER_IP={ip!r} is not an IP address (MindCluster sets it to ClusterD's IP "
                          f"and dials port {CLUSTERD_PORT}); for a host name or another port set "
                          "NICSWITCH_SERVER=host:port instead") from None
    host = f"[{addr}]" if addr.version == 6 else str(addr)
    return parse_server(f"{host}:{CLUSTERD_PORT}", "MINDX_SERVER_IP")


TLS_FIELDS = ("tls", "tls_ca_file", "tls_cert_file", "tls_key_file", "tls_server_name")


def tls_from_env(env: Mapping[str, str] | None = None, /, **explicit: Any) -> TlsSettings | None:
    """The TLS settings alone, resolved and checked as :meth:`AgentConfig.from_env` does
    (keywords, then ``NICSWITCH_TLS*``), for the commands that dial ClusterD without a full
    config (``switch``, ``watch``). None: plaintext.

    Raises:
        ConfigError: naming the setting (or variable) and the value.
    """
    env = os.environ if env is None else env
    unknown = sorted(set(explicit) - set(TLS_FIELDS))
    if unknown:
        raise _unknown_settings(unknown, TLS_FIELDS)
    warn_unknown_env(env)
    types = _field_types(AgentConfig)
    values: dict[str, Any] = {k: v for k, v in explicit.items() if v is not None}
    sources: dict[str, tuple[str, str]] = {}
    for name in TLS_FIELDS:
        raw = env.get(_env_name(name), "").strip()
        if name not in values and raw:
            values[name] = _parse(name, types[name], raw, _env_name(name))
            sources[name] = (_env_name(name), raw)
    args = (values.get("tls", False), *(values.get(name) for name in TLS_FIELDS[1:]))
    try:
        _check_tls(*args)
    except ConfigError as exc:
        raise _name_sources(exc, sources) from None
    if not _tls_on(*args):
        return None
    from nicswitch_agent.clusterd.channel import TlsSettings

    return TlsSettings(ca_file=args[1], cert_file=args[2], key_file=args[3], server_name=args[4])


def _tls_on(tls: bool, *others: str | None) -> bool:
    return tls or any(value is not None for value in others)


def _check_tls(tls: Any, ca_file: Any, cert_file: Any, key_file: Any, server_name: Any) -> None:
    """Types, files readable and PEM, the key belonging to the certificate: every TLS mistake
    that can be found before dialing. Messages name files by path, never by content."""
    if not isinstance(tls, bool):
        raise _invalid(f"tls={tls!r} must be a bool", "tls")
    files = {"tls_ca_file": ca_file, "tls_cert_file": cert_file, "tls_key_file": key_file}
    for name, path in files.items():
        if path is None:
            continue
        if not isinstance(path, str) or not path.strip():
            raise _invalid(f"{name}={path!r} must be the path of a PEM file", name)
        problem = pem.unreadable(path)
        if problem is not None:
            raise _invalid(f"{name}={path!r} cannot be read: {problem}", name)
    if (cert_file is None) != (key_file is None):
        given, missing = ("tls_cert_file", "tls_key_file") if key_file is None else ("tls_key_file", "tls_cert_file")
        raise _invalid(f"{given}={files[given]!r} is set without {missing}: a client certificate "
                       "and its key go together (set both, or neither)", given)
    if ca_file is None and cert_file is None:
        _check_server_name(server_name)
        return
    problem = None if ca_file is None else pem.ca_problem(ca_file, server=False)
    if problem is not None:
        raise _invalid(f"tls_ca_file={ca_file!r} holds no usable PEM certificate ({problem})", "tls_ca_file")
    problem = None if cert_file is None else pem.key_pair_problem(cert_file, key_file, server=False)
    if problem is not None:
        raise _invalid(f"tls_cert_file={cert_file!r} and tls_key_file={key_file!r} cannot be used together "
                       f"({problem}): both must be PEM, the key unencrypted and belonging to the certificate",
                       "tls_cert_file", "tls_key_file")
    _check_server_name(server_name)


def _check_server_name(server_name: Any) -> None:
    if server_name is not None and (
        not isinstance(server_name, str) or not server_name or server_name != server_name.strip()
        or any(ord(c) <= 32 for c in server_name)
    ):
        raise _invalid(f"tls_server_name={server_name!r} must be a host name without spaces", "tls_server_name")


def known_env_names() -> frozenset[str]:
    """Every ``NICSWITCH_*`` variable the library reads: one per :class:`AgentConfig` field."""
    return frozenset(_env_name(f.name) for f in dataclasses.fields(AgentConfig))


_warned_env: set[str] = set()  # unknown variables already warned about in this process
_warned_lock = threading.Lock()  # guards _warned_env


def unknown_env_names(env: Mapping[str, str]) -> list[tuple[str, str]]:
    """Each ``NICSWITCH_*`` variable in ``env`` that is no setting, with a hint: the closest
    known name (``did you mean ...?``), or where the settings are listed."""
    known = known_env_names()
    found = []
    for name in sorted(k for k in env if k.upper().startswith(ENV_PREFIX) and k not in known):
        # Compared without the prefix every name shares, which would make anything look close.
        close = difflib.get_close_matches(name.upper()[len(ENV_PREFIX):], [k[len(ENV_PREFIX):] for k in sorted(known)],
                                          n=1, cutoff=0.6)
        found.append((name, f"did you mean {ENV_PREFIX}{close[0]}?" if close
                      else "docs/configuration.md lists the settings"))
    return found


def warn_unknown_env(env: Mapping[str, str]) -> list[str]:
    """Log one WARNING per ``NICSWITCH_*`` variable in ``env`` that is no setting (a typo is
    otherwise silently ignored), naming the closest known one. Each name is warned about once per
    process, however often a config is loaded. Returns the unknown names."""
    unknown = unknown_env_names(env)
    for name, hint in unknown:
        with _warned_lock:
            if name in _warned_env:
                continue
            _warned_env.add(name)
        logger.warning("%s is not a nicswitch-agent setting and is ignored: %s", name, hint)
    return [name for name, _ in unknown]


def _field_types(cls: type[AgentConfig]) -> dict[str, Any]:
    """Each field's type, evaluated (the annotations are strings under ``from __future__ import
    annotations``), in declaration order."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _parse(name: str, kind: Any, raw: str, source: str) -> Any:
    """``raw`` (an environment value) as a value of the field's type ``kind``: bool, int, float or
    str, or any of them ``| None`` (an empty variable is never parsed: it means "not set")."""
    base = _non_optional(kind)
    try:
        if "_" in raw and base in (int, float):  # paths may hold underscores; numbers may not
            raise ValueError("underscores are not accepted in numbers")
        if base is bool:
            lowered = raw.lower()
            if lowered in _TRUE:
                return True
            if lowered in _FALSE:
                return False
            raise ValueError("expected 1/0, true/false, yes/no or on/off")
        if base is int or base is float:
            return base(raw)
        if base is str:
            return raw
    except ValueError as exc:
        raise ConfigError(f"{source}={raw!r} is not valid for {name}: {exc}") from None
    raise TypeError(f"AgentConfig.{name}: no parser for {kind!r}")  # a field of a new type needs one


def _non_optional(kind: Any) -> Any:
    """``X`` for ``X | None`` or ``Optional[X]``; ``kind`` itself otherwise."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        args = [arg for arg in typing.get_args(kind) if arg is not type(None)]
        if len(args) == 1:
            return args[0]
    return kind


__all__ = ["CLUSTERD_PORT", "AgentConfig", "ConfigError", "job_framework", "parse_server"]
