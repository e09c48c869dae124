"""``nicswitch-agent doctor``: is this pod ready to take part in link switches?

One line per check, in plain words, each passed (``ok``), failed (``FAIL``) or only worth a look
(``warn``: a warning, or a check skipped because its input is missing or a check before it
failed). The exit code is 0 when nothing failed ("ready"), 1 otherwise, 2 for a usage error.

Checks, in order: where ClusterD is (``--server`` or the agent's own discovery), the job id, the other
``NICSWITCH_*`` settings, the keepalive (ClusterD refuses pings more often than every 3 s), TLS (``--tls*`` or
``NICSWITCH_TLS*``: files readable, the key matching its certificate), ClusterD answering ``HealthCheck``
(within ``--rpc-timeout``, over TLS when it is on; a plaintext/TLS mismatch is named as such), the pause mode
and who pauses training, torch, torch_npu and ``torch_npu.npu._comm_switch_nic`` (or, with ``--switch-hook``,
that hook), ``HCCL_OP_RETRY_ENABLE`` enabling L2 (without it HCCL accepts a switch and does nothing),
``P2P_HCCL_BUFFSIZE`` (send/recv communicators a switch does not visit), HCCL's worst-case switch time, a way to
map ClusterD's global ranks (torchrun's ``RANK``/``WORLD_SIZE``, msrun's ``RANK_ID``/``MS_WORKER_NUM``,
or a rank table ``RANK_TABLE_FILE``: ops/doctor_ranks.py), the
file-descriptor limit the Store's host needs for the job's ranks (``--world-size``, else ``WORLD_SIZE``), and
the checkpoint directory (``--checkpoint-dir``: exists, writable, free space).

The doctor only reads: its one call to ClusterD is ``HealthCheck``, which changes nothing there
(``Init`` or a subscription would reset the job's controller), and the checkpoint directory gets
one temporary file, removed at once.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.clusterd.channel import (
    ChannelSettings,
    RecoverStub,
    TlsSettings,
    explain_connect_failure,
    open_channel,
)
from nicswitch_agent.clusterd.rpc_policy import Kind, RpcFailure, classify
from nicswitch_agent.config import (
    CLUSTERD_MIN_PING_INTERVAL_S,
    ENV_PREFIX,
    EXTERNAL_PAUSE_MARKERS,
    TLS_FIELDS,
    AgentConfig,
    parse_server,
    resolve_pause_mode,
    tls_from_env,
    unknown_env_names,
)
from nicswitch_agent.config.frameworks import in_msrun, world_names
from nicswitch_agent.errors import ConfigError
from nicswitch_agent.hooks.hccl_env import blocking_finding, p2p_finding, retry_finding
from nicswitch_agent.hooks.ms_switch import MODULE as MS_SWITCH_MODULE
from nicswitch_agent.hooks.torch_npu import FUNCTION as SWITCH_FUNCTION
from nicswitch_agent.hooks.torch_npu import MODULE as SWITCH_MODULE
from nicswitch_agent.ops import doctor_ranks, hook_spec
from nicswitch_agent.ops.durations import seconds
from nicswitch_agent.ops.om_cli import (
    JOB_HELP,
    SERVER_HELP,
    add_tls_arguments,
    positive_int,
    tls_overrides,
)

DEFAULT_TIMEOUT_S = 3.0
DEFAULT_MIN_FREE_BYTES = 1 << 30  # TorchCheckpointGuard's default floor
ROLE = "nicswitch-doctor"  # ClusterD logs ClientInfo.role: the doctor's call is easy to tell apart

_SERVER_ENV = ("NICSWITCH_SERVER", "LOCAL_PROXY_ENABLE", "MINDX_SERVER_IP")
_JOB_ENV = ("NICSWITCH_JOB_ID", "MINDX_TASK_ID")
_KEEPALIVE_ENV = ("NICSWITCH_KEEPALIVE_TIME_S", "NICSWITCH_KEEPALIVE_TIMEOUT_S")
_TOPOLOGY_ENV = ("NICSWITCH_WORLD_SIZE", "WORLD_SIZE", "NICSWITCH_RANK", "RANK", "MS_WORKER_NUM", "RANK_ID", "MS_ROLE")
_TLS_ENV = tuple(ENV_PREFIX + name.upper() for name in TLS_FIELDS)
_PLACEHOLDER_SERVER = "127.0.0.1:8899"
_PLACEHOLDER_JOB = "doctor-placeholder"


@dataclass(frozen=True)
class Check:
    """The outcome of one check.

    Attributes:
        name: Short name, e.g. ``"ClusterD"``.
        ok: True passed, False failed (not ready), None a warning or a skipped check.
        detail: What was found, and for a failure what to do about it.
    """

    name: str
    ok: bool | None
    detail: str

    @property
    def label(self) -> str:
        return {True: "ok", False: "FAIL", None: "warn"}[self.ok]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "status": self.label, "detail": self.detail}


@dataclass(frozen=True)
class Inputs:
    """What the checks look at; built once by :func:`gather_inputs`."""

    env: Mapping[str, str]
    server: str | None
    server_source: str
    server_error: str
    job_id: str | None
    job_source: str
    job_error: str
    config: AgentConfig | None
    config_error: str
    checkpoint_dir: str | None = None
    min_free_bytes: int = DEFAULT_MIN_FREE_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    tls: TlsSettings | None = None
    tls_error: str = ""
    tls_from_flags: bool = False
    world_size: int | None = None  # --world-size; None: NICSWITCH_WORLD_SIZE, else WORLD_SIZE
    switch_hook: str | None = None  # --switch-hook module:callable; None: torch_npu's

    @property
    def dry_run(self) -> bool:
        if self.config is not None:
            return self.config.dry_run
        return self.env.get("NICSWITCH_DRY_RUN", "").strip().lower() in ("1", "true", "yes", "on")


def _subset(env: Mapping[str, str], names: tuple[str, ...]) -> dict[str, str]:
    return {name: env[name] for name in names if name in env}


def gather_inputs(
    *,
    server: str | None = None,
    job_id: str | None = None,
    env: Mapping[str, str] | None = None,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    min_free_bytes: int = DEFAULT_MIN_FREE_BYTES,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    tls_options: Mapping[str, Any] | None = None,
    world_size: int | None = None,
    switch_hook: str | None = None,
) -> Inputs:
    """Resolve server, job and settings as the agent would (explicit > NICSWITCH_* > MindCluster env).

    ``tls_options`` are explicit TLS settings (AgentConfig names, e.g. ``tls_ca_file``; None values
    count as not given), as from the ``--tls*`` flags.
    """
    env = dict(os.environ if env is None else env)
    # A misspelt NICSWITCH_* variable has its own line (check_settings); the config's WARNING for
    # it would land in the middle of the table.
    config_logger = logging.getLogger("nicswitch_agent.config")
    muted, config_logger.disabled = config_logger.disabled, True
    try:
        return _gather(env, server, job_id, checkpoint_dir, min_free_bytes, timeout_s, tls_options, world_size,
                       switch_hook)
    finally:
        config_logger.disabled = muted


def _gather(env: dict[str, str], server: str | None, job_id: str | None,
            checkpoint_dir: str | os.PathLike[str] | None, min_free_bytes: int, timeout_s: float,
            tls_options: Mapping[str, Any] | None, world_size: int | None, switch_hook: str | None) -> Inputs:
    server_source = _server_source(server, env)
    try:
        resolved_server: str | None = AgentConfig.from_env(  # --server named as such, in the agent's grammar
            _subset(env, _SERVER_ENV), server=None if server is None else parse_server(server, "--server"),
            job_id=_PLACEHOLDER_JOB).server
        server_error = ""
    except ConfigError as exc:
        resolved_server, server_error = None, str(exc)
    job_source = "--job" if job_id is not None else next(
        (name for name in _JOB_ENV if env.get(name, "").strip()), "")
    try:
        resolved_job: str | None = AgentConfig.from_env(
            _subset(env, _JOB_ENV), server=_PLACEHOLDER_SERVER, job_id=job_id).job_id
        job_error = ""
    except ConfigError as exc:
        resolved_job, job_error = None, str(exc)
    tls_given = {k: v for k, v in (tls_options or {}).items() if v is not None}
    try:
        tls, tls_error = tls_from_env(_subset(env, _TLS_ENV), **tls_given), ""
    except ConfigError as exc:
        tls, tls_error = None, str(exc)
    # Every other setting, each problem once: server, job, keepalive, TLS and ranks have checks of their own.
    others = {k: v for k, v in env.items() if k not in _KEEPALIVE_ENV + _TOPOLOGY_ENV + _TLS_ENV}
    try:
        config: AgentConfig | None = AgentConfig.from_env(
            others, server=resolved_server or _PLACEHOLDER_SERVER, job_id=resolved_job or _PLACEHOLDER_JOB)
        config_error = ""
    except ConfigError as exc:
        config, config_error = None, str(exc)
    return Inputs(
        env=env, server=resolved_server, server_source=server_source, server_error=server_error,
        job_id=resolved_job, job_source=job_source, job_error=job_error, config=config, config_error=config_error,
        checkpoint_dir=None if checkpoint_dir is None else os.fspath(checkpoint_dir),
        min_free_bytes=min_free_bytes, timeout_s=timeout_s, tls=tls, tls_error=tls_error,
        tls_from_flags=bool(tls_given), world_size=world_size, switch_hook=switch_hook,
    )


def _server_source(explicit: str | None, env: Mapping[str, str]) -> str:
    if explicit is not None:
        return "--server"
    if env.get("NICSWITCH_SERVER", "").strip():
        return "NICSWITCH_SERVER"
    if env.get("LOCAL_PROXY_ENABLE", "").strip().lower() == "on":
        return "LOCAL_PROXY_ENABLE=on, the local mTLS proxy"
    if env.get("MINDX_SERVER_IP", "").strip():
        return "MINDX_SERVER_IP"
    return ""


# --------------------------------------------------------------------------------------------
# The checks: each a small function of the inputs
# --------------------------------------------------------------------------------------------


def check_server(inp: Inputs) -> Check:
    name = "ClusterD address"
    if inp.server is None:
        if not inp.server_source:
            return Check(name, False, "not set: set MINDX_SERVER_IP (ascend-operator injects it), "
                                      "NICSWITCH_SERVER=host:port, or LOCAL_PROXY_ENABLE=on; or pass --server")
        return Check(name, False, f"{inp.server_error} (from {inp.server_source})")
    proxy = inp.env.get("LOCAL_PROXY_ENABLE", "").strip()
    if inp.server_source != "--server" and proxy and proxy.lower() not in ("on", "off"):
        # taskd takes "on" only; "true" or "1" look like yes and silently bypass the mTLS sidecar
        return Check(name, None, f"{inp.server} (from {inp.server_source}); LOCAL_PROXY_ENABLE={proxy!r} is not "
                                 "'on' (the only value MindCluster takes), so it does not dial the local mTLS "
                                 "proxy: set LOCAL_PROXY_ENABLE=on to use it, or unset it")
    return Check(name, True, f"{inp.server} (from {inp.server_source})")


def check_job(inp: Inputs) -> Check:
    name = "job id"
    if inp.job_id is None:
        if not inp.job_source:
            return Check(name, False, "not set: ClusterD keys every switch by job; set MINDX_TASK_ID "
                                      "(ascend-operator injects the job UID) or NICSWITCH_JOB_ID, or pass --job")
        return Check(name, False, f"{inp.job_error} (from {inp.job_source})")
    return Check(name, True, f"{inp.job_id} (from {inp.job_source})")


def check_settings(inp: Inputs) -> Check:
    name = "settings"
    if inp.config is None:
        return Check(name, False, inp.config_error)
    judged_elsewhere = _SERVER_ENV + _JOB_ENV + _KEEPALIVE_ENV + _TOPOLOGY_ENV + _TLS_ENV
    given = sorted(k for k in inp.env if k.startswith("NICSWITCH_") and inp.env[k].strip()
                   and k not in judged_elsewhere)
    unknown = unknown_env_names(inp.env)
    if unknown:  # a typo is otherwise silently ignored: the setting it meant keeps its default
        typos = "; ".join(f"{var} is not a setting and is ignored ({hint})" for var, hint in unknown)
        return Check(name, None, typos)
    listed = ", ".join(given) if given else "none"
    # "besides ...": keepalive, TLS and the others below are judged on lines of their own (an
    # outside check read "set: none" above a failing keepalive line as a contradiction).
    return Check(name, True, f"timeouts and modes valid (NICSWITCH_* set besides server, job, keepalive, TLS and "
                             f"ranks, which have lines of their own: {listed})")


def check_keepalive(inp: Inputs) -> Check:
    name = "keepalive"
    try:
        cfg = AgentConfig.from_env(_subset(inp.env, _KEEPALIVE_ENV), server=_PLACEHOLDER_SERVER,
                                   job_id=_PLACEHOLDER_JOB)
    except ConfigError as exc:
        return Check(name, False, str(exc))
    detail = (f"pings every {cfg.keepalive_time_s:g} s (ClusterD allows one per {CLUSTERD_MIN_PING_INTERVAL_S:g} s), "
              f"connection declared dead after {cfg.keepalive_timeout_s:g} s without an answer")
    return Check(name, True, detail)


def check_tls(inp: Inputs) -> Check:
    """The TLS settings the agent would dial with: files readable, PEM, the key matching its certificate."""
    name = "TLS"
    from_env = any(inp.env.get(name, "").strip() for name in _TLS_ENV)
    source = ("--tls* flags and NICSWITCH_TLS*" if from_env else "--tls* flags") if inp.tls_from_flags \
        else "NICSWITCH_TLS*"
    if inp.tls_error:
        return Check(name, False, f"{inp.tls_error} (from {source})")
    if inp.tls is None:
        return Check(name, True, "off: plaintext, as ClusterD serves it (with LOCAL_PROXY_ENABLE=on the local "
                                 "sidecar does the TLS)")
    if inp.server_source.startswith("LOCAL_PROXY_ENABLE=on"):
        return Check(name, None, f"on ({inp.tls.describe()}; from {source}), but the agent dials the local mTLS "
                                 "sidecar (LOCAL_PROXY_ENABLE=on), which takes plaintext and does the TLS itself: "
                                 "turn TLS off")
    return Check(name, True, f"on ({inp.tls.describe()}; from {source})")


def check_clusterd(inp: Inputs) -> Check:
    """One ``HealthCheck`` within ``timeout_s``: reachable, speaks ``/Recover``, answers code 0."""
    name = "ClusterD"
    if inp.server is None:
        return Check(name, None, "skipped: no ClusterD address")
    if inp.tls_error:
        return Check(name, None, "skipped: the TLS settings are not valid")
    settings = ChannelSettings(target=inp.server, tls=inp.tls)
    try:
        channel = open_channel(settings)
    except ConfigError as exc:
        return Check(name, False, str(exc))
    over = " over TLS" if inp.tls is not None else ""
    started = time.monotonic()
    try:
        status = RecoverStub(channel).HealthCheck(pb.ClientInfo(jobId=inp.job_id or "", role=ROLE),
                                                  timeout=inp.timeout_s)
    except grpc.RpcError as exc:
        plain = explain_connect_failure(exc, settings)
        if plain:
            return Check(name, False, f"cannot reach ClusterD at {inp.server}: {plain}")
        return Check(name, False, _rpc_problem(inp.server, inp.timeout_s, classify(exc)))
    finally:
        channel.close()
    took = (time.monotonic() - started) * 1000
    if int(status.code) != 0:
        return Check(name, False, f"{inp.server} answered HealthCheck with code {status.code}: {status.info!r}")
    return Check(name, True, f"{inp.server} answered HealthCheck{over} in {took:.0f} ms")


def _rpc_problem(server: str, timeout_s: float, failure: RpcFailure) -> str:
    text = failure.details
    if failure.code is grpc.StatusCode.UNAVAILABLE:
        return (f"cannot reach ClusterD at {server}: {text} (is ClusterD running, and is its port open "
                "from this pod?)")
    if failure.kind is Kind.DEADLINE:
        return (f"no answer from {server} within {timeout_s:g} s (a wrong address, or a firewall "
                "dropping packets)")
    if failure.code is grpc.StatusCode.UNIMPLEMENTED:
        return f"{server} speaks gRPC but has no /Recover/HealthCheck: it is not ClusterD ({text})"
    return f"HealthCheck to {server} failed: {failure.code_name}: {text}"


def check_pause_mode(inp: Inputs) -> Check:
    name = "pause mode"
    configured = inp.config.pause if inp.config is not None else "auto"
    mode, reason = resolve_pause_mode(configured, inp.env)
    markers = [m for m in EXTERNAL_PAUSE_MARKERS if inp.env.get(m, "").strip()]
    if configured == "agent" and markers:
        return Check(name, None, f"agent, but {', '.join(markers)} is set: if MindIO/TaskD runs, the agent's "
                                 "process-manage stream resets ClusterD's job controller and takes their "
                                 "pause signals; use pause=external (or auto)")
    if configured == "external" and not markers:
        return Check(name, None, "external, but no MindIO/TaskD marker (TTP_PORT, TASKD_PROCESS_ENABLE) is "
                                 "set: unless MindIO/TaskD pause training, ClusterD waits 15 min and kills "
                                 "the job; use pause=agent (or auto)")
    return Check(name, True, f"{mode}: {reason}")


def _import(module: str) -> tuple[Any, str]:
    try:
        return importlib.import_module(module), ""
    except Exception as exc:  # torch_npu raises more than ImportError when CANN is broken
        return None, f"{type(exc).__name__}: {exc}"


def _needs_torch(env: Mapping[str, str]) -> str:
    """Why this process needs torch, or "" when it does not.

    The agent needs torch only for a Store: ranks coordinate through one when the world has more
    than one rank, and a launcher's members reach the launcher's Store with a torch client. A
    single process (world size 1, no launcher) coordinates in-process.
    """
    if env.get("NICSWITCH_STORE_ADDRESS", "").strip() or env.get("NICSWITCH_LEADER", "").strip() == "launcher":
        return "a member of a launcher's leader reaches its Store with torch"
    world = doctor_ranks.env_int(env, *world_names(env))
    if world == 1 or in_msrun(env):
        return ""
    if isinstance(world, int):
        return f"{world} ranks coordinate through a torch Store"
    return "the world size is not known (no WORLD_SIZE), so ranks may coordinate through a torch Store"


def check_torch(inp: Inputs) -> Check:
    name = "torch"
    module, error = _import("torch")
    if module is None:
        why = _needs_torch(inp.env)
        if not why:
            return Check(name, None, f"skipped: not importable ({error}); not needed by {_torchless(inp.env)}")
        return Check(name, False, f"cannot import torch ({error}): {why}; python3 -m pip install '.[torch]' in "
                                  "the nicswitch-agent checkout")
    dist = getattr(module, "distributed", None)
    if dist is None or not dist.is_available():
        why = _needs_torch(inp.env)
        if not why:
            return Check(name, None, f"torch {module.__version__} has no torch.distributed; not needed by "
                                     f"{_torchless(inp.env)}")
        return Check(name, False, f"torch {module.__version__} has no torch.distributed: {why}")
    return Check(name, True, f"torch {module.__version__} with torch.distributed")


def _torchless(env: Mapping[str, str]) -> str:
    """The job that needs no torch (:func:`_needs_torch` said so), in words."""
    if in_msrun(env):
        return "a MindSpore job (msrun's MS_ROLE=MS_WORKER, or NICSWITCH_FRAMEWORK=mindspore): it coordinates " \
               "through MindSpore's TCPStore and switches with MindSpore's own call"
    return "a single-process job (WORLD_SIZE=1: no Store to coordinate through)"


def check_torch_npu(inp: Inputs) -> Check:
    """The framework's module that switches links: torch_npu, or for a MindSpore job mindspore."""
    if in_msrun(inp.env):
        return _check_mindspore(inp)
    name = "torch_npu"
    if inp.switch_hook is not None:
        return Check(name, None, f"not checked: the switch hook is {inp.switch_hook} ({hook_spec.FLAG})")
    module, error = _import("torch_npu")
    if module is None:
        if inp.dry_run:
            return Check(name, None, f"not importable ({error}); not needed in a dry run")
        return Check(name, False, f"cannot import torch_npu ({error}): install the torch_npu that matches "
                                  "your torch and CANN")
    return Check(name, True, f"torch_npu {getattr(module, '__version__', '(no version)')}")


def _check_mindspore(inp: Inputs) -> Check:
    name = "mindspore"
    module, error = _import("mindspore")
    if module is None:
        return Check(name, False, f"cannot import mindspore ({error}), and this is a MindSpore job (msrun's "
                                  "MS_ROLE=MS_WORKER, or NICSWITCH_FRAMEWORK=mindspore): python3 -m pip install "
                                  "'.[mindspore]' in the nicswitch-agent checkout")
    return Check(name, True, f"mindspore {getattr(module, '__version__', '(no version)')}")


def check_switch_function(inp: Inputs) -> Check:
    if inp.switch_hook is not None:
        return Check("switch hook", *hook_spec.check_switch_hook(inp.switch_hook))
    name = SWITCH_FUNCTION
    mindspore = in_msrun(inp.env)
    framework, switch_module = ("mindspore", MS_SWITCH_MODULE) if mindspore else ("torch_npu", SWITCH_MODULE)
    where = f"{switch_module}.{SWITCH_FUNCTION}"
    if sys.modules.get(framework) is None:  # check_torch_npu could not import it
        return Check(name, None, f"skipped: {framework} is not importable")
    module, error = _import(switch_module)
    fn = None if module is None else getattr(module, SWITCH_FUNCTION, None)
    if callable(fn):
        return Check(name, True, f"{where} found")
    why = f"cannot import {SWITCH_MODULE} ({error})" if module is None else f"{where} is missing"
    if inp.dry_run:
        return Check(name, None, f"{why}; not needed in a dry run")
    return Check(name, False, f"{why}: this {framework} predates link switching; upgrade {framework}")


def check_hccl_retry(inp: Inputs) -> Check:
    found = retry_finding(inp.env)  # without L2 HCCL accepts a switch, says it succeeded and does nothing
    return Check("HCCL_OP_RETRY_ENABLE", True if found.ok else None if inp.dry_run else False, found.text)


def check_p2p_links(inp: Inputs) -> Check:
    found = p2p_finding(inp.env)
    return Check("P2P communicators", True if found.ok else None, found.text)


def check_switch_time(inp: Inputs) -> Check:
    found = blocking_finding(inp.env, None, inp.config.switch_timeout_s if inp.config is not None else None)
    return Check("HCCL switch time", True if found.ok else None, found.text)


def check_rank_map(inp: Inputs) -> Check:
    """torchrun's RANK/WORLD_SIZE (msrun's RANK_ID/MS_WORKER_NUM), or a rank table (doctor_ranks.py)."""
    return Check("rank mapping", *doctor_ranks.rank_map(inp.env))


def check_file_descriptors(inp: Inputs) -> Check:
    return Check("file descriptors", *doctor_ranks.file_descriptors(inp.env, inp.world_size))


def check_checkpoint_dir(inp: Inputs) -> Check:
    name = "checkpoint dir"
    if inp.checkpoint_dir is None:
        return Check(name, None, "skipped: pass --checkpoint-dir DIR to check where the checkpoint guard writes")
    directory = Path(inp.checkpoint_dir).expanduser()
    if not directory.exists():
        return Check(name, False, f"{directory} does not exist: create it on a filesystem every rank can reach")
    if not directory.is_dir():
        return Check(name, False, f"{directory} is not a directory")
    try:  # a real write: os.access() says yes to root on a read-only mount
        fd, probe = tempfile.mkstemp(prefix=".nicswitch-doctor-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return Check(name, False, f"{directory} is not writable: {exc}")
    free = shutil.disk_usage(directory).free
    newest, newest_size = _newest_checkpoint(directory)
    need = inp.min_free_bytes + newest_size
    if free < need:
        next_one = f" plus about {_bytes(newest_size)} for the next checkpoint (as big as {newest})" if newest else ""
        return Check(name, False, f"{directory}: {_bytes(free)} free, less than the {_bytes(inp.min_free_bytes)} "
                                  f"floor{next_one}: the checkpoint guard would refuse switches")
    newest_text = f"; newest checkpoint {newest} is {_bytes(newest_size)}" if newest else ""
    return Check(name, True, f"{directory} writable, {_bytes(free)} free{newest_text}")


_STEP_DIR = re.compile(r"^step-(\d+)$")


def _newest_checkpoint(directory: Path) -> tuple[str, int]:
    """Name and size of the highest ``step-<N>`` directory (the guard's layout), or ("", 0)."""
    best: tuple[int, Path] | None = None
    for entry in directory.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir() and (best is None or int(match.group(1)) > best[0]):
            best = (int(match.group(1)), entry)
    if best is None:
        return "", 0
    size = 0
    for root, _dirs, files in os.walk(best[1]):
        for file in files:
            try:
                size += os.lstat(os.path.join(root, file)).st_size
            except OSError:
                continue
    return best[1].name, size


def _bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover - the loop always returns


CHECKS: tuple[Callable[[Inputs], Check], ...] = (
    check_server,
    check_job,
    check_settings,
    check_keepalive,
    check_tls,
    check_clusterd,
    check_pause_mode,
    check_torch,
    check_torch_npu,
    check_switch_function,
    check_hccl_retry,
    check_p2p_links,
    check_switch_time,
    check_rank_map,
    check_file_descriptors,
    check_checkpoint_dir,
)


def run_checks(
    *,
    server: str | None = None,
    job_id: str | None = None,
    env: Mapping[str, str] | None = None,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    min_free_bytes: int = DEFAULT_MIN_FREE_BYTES,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    on_check: Callable[[Check], None] | None = None,
    tls_options: Mapping[str, Any] | None = None,
    world_size: int | None = None,
    switch_hook: str | None = None,
) -> list[Check]:
    """Run every check in order; ``on_check`` sees each result as soon as it is known.

    Args:
        server: ``host:port`` of ClusterD; None: the agent's discovery from ``env``.
        job_id: The job; None: NICSWITCH_JOB_ID, else MINDX_TASK_ID.
        env: The environment to judge (default ``os.environ``).
        checkpoint_dir: Where the checkpoint guard writes; None skips that check.
        min_free_bytes: Free space the checkpoint directory must keep beyond the next checkpoint.
        timeout_s: Deadline of the HealthCheck call.
        tls_options: Explicit TLS settings (``tls``, ``tls_ca_file``, ...) over NICSWITCH_TLS*.
        world_size: Ranks of the job, for the file-descriptor check; None: NICSWITCH_WORLD_SIZE, else WORLD_SIZE.
        switch_hook: ``module:callable`` of the job's own switch hook, checked instead of torch_npu's.

    A check that raises is reported as failed, never raised.
    """
    inputs = gather_inputs(server=server, job_id=job_id, env=env, checkpoint_dir=checkpoint_dir,
                           min_free_bytes=min_free_bytes, timeout_s=timeout_s, tls_options=tls_options,
                           world_size=world_size, switch_hook=switch_hook)
    results: list[Check] = []
    for check in CHECKS:
        try:
            result = check(inputs)
        except Exception as exc:
            result = Check(check.__name__.removeprefix("check_").replace("_", " "), False,
                           f"the check itself failed: {type(exc).__name__}: {exc}")
        results.append(result)
        if on_check is not None:
            on_check(result)
    return results


def ready(checks: list[Check]) -> bool:
    """True when no check failed (warnings do not count)."""
    return all(c.ok is not False for c in checks)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``1073741824``, ``512M``, ``1G``, ``1.5GiB`` -> bytes (binary units)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512M, 1G, 2GiB)")
    power = " kmgt".index(match.group(2).lower() or " ")
    return int(float(match.group(1)) * 1024**power)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``nicswitch-agent doctor``."""
    parser.add_argument("--server", metavar="HOST:PORT", help=SERVER_HELP)
    parser.add_argument("--job", metavar="JOB_ID", help=JOB_HELP)
    parser.add_argument("--job-id", dest="job", help=argparse.SUPPRESS)  # launch's first name for it
    parser.add_argument("--checkpoint-dir", metavar="DIR",
                        help="check that the checkpoint guard's directory is writable and has room")
    parser.add_argument("--min-free", type=parse_size, default=DEFAULT_MIN_FREE_BYTES, metavar="SIZE",
                        help="free space the checkpoint directory must keep beyond the next checkpoint "
                             "(default: 1G, the guard's default)")
    parser.add_argument("--rpc-timeout", type=seconds(), default=DEFAULT_TIMEOUT_S, metavar="S",
                        help="deadline of the HealthCheck call, seconds (default: %(default)g)")
    parser.add_argument("--timeout", type=seconds(), dest="rpc_timeout", help=argparse.SUPPRESS)  # first name
    parser.add_argument("--world-size", type=positive_int, metavar="N",
                        help="ranks of the job, to check the file-descriptor limit the Store's host needs "
                             "(default: NICSWITCH_WORLD_SIZE, else WORLD_SIZE)")
    hook_spec.add_argument(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_tls_arguments(parser)
    if parser.epilog is None:
        parser.epilog = "exit codes: 0 ready (no check failed), 1 not ready, 2 usage error"


def run(args: argparse.Namespace, *, env: Mapping[str, str] | None = None) -> int:
    """``nicswitch-agent doctor``: print one line per check; 0 when ready, 1 when not."""
    width = 22

    def say(check: Check) -> None:
        print(f"  {check.label:<5} {check.name:<{width}} {check.detail}", flush=True)

    if not args.json:
        print("nicswitch-agent doctor: is this pod ready for link switches?", flush=True)
    checks = run_checks(server=args.server, job_id=args.job, env=env, checkpoint_dir=args.checkpoint_dir,
                        min_free_bytes=args.min_free, timeout_s=args.rpc_timeout, on_check=None if args.json else say,
                        tls_options=tls_overrides(args), world_size=getattr(args, "world_size", None),
                        switch_hook=getattr(args, "switch_hook", None))
    is_ready = ready(checks)
    failed = [c.name for c in checks if c.ok is False]
    warned = [c.name for c in checks if c.ok is None]
    if args.json:
        print(json.dumps({"ready": is_ready, "exit_code": 0 if is_ready else 1,
                          "failed": failed, "warnings": warned,
                          "checks": [c.to_json() for c in checks]}, sort_keys=True))
    elif is_ready:
        note = f" ({len(warned)} warning(s): {', '.join(warned)})" if warned else ""
        print(f"ready{note}")
    else:
        print(f"NOT READY: {len(failed)} check(s) failed: {', '.join(failed)}")
    return 0 if is_ready else 1


__all__ = ["CHECKS", "DEFAULT_MIN_FREE_BYTES", "DEFAULT_TIMEOUT_S", "Check", "Inputs", "add_arguments",
           "gather_inputs", "parse_size", "ready", "run", "run_checks"]
