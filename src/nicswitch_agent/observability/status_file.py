"""The agent's status file: its writer, and the reader behind ``nicswitch-agent status``
(ops/status_cli.py).

A running agent can keep a small JSON file with its :meth:`SwitchAgent.status` snapshot, so an
operator can ask "is the agent alive, connected, and how did the last switch go?" from a shell in
the pod, without a network endpoint. The file is written only when ``NICSWITCH_STATUS_FILE`` is
set (``AgentConfig.status_file``):

- by :class:`StatusFileWriter`, an event listener plus one daemon thread (``nicswitch-status``):
  every agent event wakes the thread, which rewrites the file; with no event it is rewritten every
  ``interval_s`` so its age shows the agent is alive. Nothing is written per training step: an
  event costs the agent one ``Event.set()``.
- atomically: a temporary file in the same directory, then ``os.replace``; a reader never sees a
  half-written file.
- by the leader only, unless the path names the process (``{rank}`` or ``{pid}``): every rank of
  a job sees the same environment, and ranks sharing one file would overwrite each other (see
  :func:`expand_path`).

Exit codes of ``nicswitch-agent status`` (:class:`ExitCode`, decided by :func:`read_status`):

===  ========================================================================================
0    the file is fresh and the agent in it is running (and, a leader, connected to ClusterD)
1    the agent is not running (created, stopping, stopped or failed)
2    usage error (no file given and NICSWITCH_STATUS_FILE unset)
3    the file is stale: not rewritten for longer than ``--max-age`` (the process is gone or hung)
4    no status file, or it cannot be read or parsed
5    a running leader that does not take part: its notify stream has not been established for
     longer than ``--max-disconnected``, or (pause mode ``agent``) another process-manage
     client fights it for the job's stream
6    a running agent that cannot switch: training was told to stop (ClusterD's recovery chose
     dump or exit, or killMaster), its coordination is lost (its Store or its relay's is gone),
     a hook still runs past its timeout (every order reaching the rank is answered false until
     it returns), or training has been parked for longer than ``--max-parked`` (30 min: far
     past any switch's budget)
===  ========================================================================================

A leader is briefly not connected after every switch (ClusterD ends the stream; it is reopened
at once and counts as established half a second later), hence the grace of ``--max-disconnected``.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nicswitch_agent.observability.events import AgentEvent
from nicswitch_agent.observability.links import format_links

logger = logging.getLogger("nicswitch_agent.status")

STATUS_FILE_ENV = "NICSWITCH_STATUS_FILE"
FORMAT = "nicswitch-agent-status/1"
DEFAULT_INTERVAL_S = 10.0
RUNNING_STATES = frozenset({"starting", "running", "switching"})
ENDED_STATES = frozenset({"stopped", "failed"})  # the agent wrote its last file: its age tells nothing
DEFAULT_MAX_DISCONNECTED_S = 3.0
#: Parked longer than this is no switch any more: ClusterD waits 15 min per phase, and the agent's
#: own budgets for one switch (pause, guard, switch, verify, reply) add up to 13.5 min by default.
DEFAULT_MAX_PARKED_S = 1800.0
PER_PROCESS_FIELDS = ("{rank}", "{pid}")


class ExitCode(enum.IntEnum):
    """Exit codes of ``nicswitch-agent status`` (see the module docstring)."""

    OK = 0
    NOT_RUNNING = 1
    USAGE = 2
    STALE = 3
    NO_FILE = 4
    NOT_CONNECTED = 5
    STUCK = 6


LEADER_FILE_RANK = "leader"  # what {rank} becomes in the file of a leader-only agent (the launcher's)


def own_rank(rank: int, leader_only: bool) -> int | str:
    """A process's rank in its files, events and status: ``leader`` for a leader-only agent (the
    launcher's), which is rank 0 to the coordination only: training rank 0 writes its own."""
    return LEADER_FILE_RANK if leader_only else rank


def expand_path(template: str, *, rank: int | str, job_id: str, role: str | None = "leader") -> str | None:
    """The file this process writes for ``template``, or None when it writes none.

    ``{rank}``, ``{pid}`` and ``{job}`` are replaced (e.g. ``/run/nicswitch/{job}-{rank}.json``).
    A leader-only agent (the launcher's) gives ``rank="leader"``: training rank 0 writes its own
    file next to it, so the two must not share ``{rank}`` = 0.
    A template without ``{rank}`` or ``{pid}`` names one file for the whole job, which only the
    leader writes (``role == "leader"``): the ranks of a job share its environment, and ranks
    sharing a file would overwrite each other's state.

    Raises:
        ValueError: the template has another ``{field}`` or an unbalanced brace.
    """
    if not any(field in template for field in PER_PROCESS_FIELDS) and role != "leader":
        return None
    try:
        return template.format(rank=rank, pid=os.getpid(), job=job_id)
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(template_problem(exc)) from None


def template_problem(exc: Exception) -> str:
    """What is wrong with a path template that ``str.format`` refused (the caller names the value)."""
    if isinstance(exc, KeyError):
        return f"{{{exc.args[0]}}} is not replaced: only {{rank}}, {{pid}} and {{job}} may appear in braces"
    return f"only {{rank}}, {{pid}} and {{job}} may appear in braces, each closed ({exc})"


# --------------------------------------------------------------------------------------------
# Writer (inside the agent)
# --------------------------------------------------------------------------------------------


class StatusFileWriter:
    """Keeps ``path`` holding the latest ``agent_status()`` as JSON.

    Register it as an event listener (``agent.add_listener(writer)`` or ``on_event=writer``) and
    call :meth:`start`; :meth:`stop` writes the final state once more and joins the thread.

    Args:
        path: The file. Its directory must exist; a missing directory or a failed write is
            logged (once per distinct error) and retried at the next event or interval, never
            raised into the agent.
        agent_status: Returns the snapshot to write (``agent.status``); called on the writer's
            thread (and by :meth:`start`/:meth:`stop` on their caller's), never by the listener,
            so an event costs the emitting thread one ``Event.set()``.
        interval_s: Rewrite at least this often with no event, so the file's age tells a reader
            whether the agent is alive (``nicswitch-agent status`` calls it stale after 3 intervals).
        clock: Wall clock for ``written_at`` (seconds since the epoch).

    Raises:
        ValueError: ``interval_s`` is not a positive number, or ``path`` is empty.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        agent_status: Callable[[], Mapping[str, Any]],
        interval_s: float = DEFAULT_INTERVAL_S,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not os.fspath(path):
            raise ValueError("status file path is empty")
        if isinstance(interval_s, bool) or not isinstance(interval_s, (int, float)) or not interval_s > 0:
            raise ValueError(f"interval_s={interval_s!r} must be a positive number of seconds")
        self.path = Path(path)
        self.interval_s = float(interval_s)
        self._status = agent_status
        self._clock = clock
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = False
        self._stopped = False
        self._lifecycle = threading.Lock()  # guards _started, _stopped, _thread
        self._cond = threading.Condition()  # guards _writes, _last, _last_error; one write at a time
        self._writes = 0
        self._last: dict[str, Any] | None = None
        self._last_error = ""
        self._host = socket.gethostname()
        self._pid_ns = pid_namespace()
        self._parked_since: float | None = None  # when a write first saw training parked (our clock)

    # -- listener ------------------------------------------------------------------------------

    def __call__(self, event: AgentEvent) -> None:
        """Event listener: wake the writer thread (every agent event is a change of state)."""
        self._wake.set()

    def refresh(self) -> None:
        """Rewrite the file soon: the agent's state changed without an event (``connected``)."""
        self._wake.set()

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> StatusFileWriter:
        """Write the file once, then start the writer thread.

        Raises:
            RuntimeError: started twice, or after :meth:`stop`.
        """
        with self._lifecycle:
            if self._started or self._stopped:
                raise RuntimeError("a StatusFileWriter starts once")
            self._started = True
            self._thread = threading.Thread(target=self._run, name="nicswitch-status", daemon=True)
        self.write_now()
        self._thread.start()
        return self

    def stop(self, timeout: float = 1.0) -> None:
        """Stop the thread and write the final state (e.g. ``stopped``). Idempotent."""
        with self._lifecycle:
            if self._stopped:
                return
            self._stopped = True
            thread = self._thread
        self._stop.set()
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                logger.warning("status writer thread still busy after %.1f s; leaving it as a daemon", timeout)
        self.write_now()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            if self._stop.is_set():
                return
            # Clear before the snapshot: an event after this point sets it again and is written next.
            self._wake.clear()
            self.write_now()

    # -- writing -------------------------------------------------------------------------------

    @property
    def writes(self) -> int:
        """How many times the file was written."""
        with self._cond:
            return self._writes

    @property
    def last_document(self) -> dict[str, Any] | None:
        """The last document written, or None."""
        with self._cond:
            return self._last

    def write_now(self) -> bool:
        """Snapshot the status and replace the file now; False (logged) if that failed."""
        with self._cond:
            try:
                status = dict(self._status())
            except Exception as exc:  # the agent's status() must not kill the writer
                self._log_error(f"agent status failed: {exc!r}")
                return False
            now = self._clock()
            # status() says whether training is parked, not since when; the PARKED event wakes us.
            parked = bool(status.get("parked"))
            self._parked_since = (now if self._parked_since is None else self._parked_since) if parked else None
            document = {
                "format": FORMAT,
                "written_at": now,
                "parked_since": self._parked_since,
                "pid": os.getpid(),
                "host": self._host,
                "pid_ns": self._pid_ns,
                "interval_s": self.interval_s,
                "writes": self._writes + 1,
                "status": status,
            }
            try:
                text = json.dumps(document, sort_keys=True, default=str)
                _replace_atomically(self.path, text + "\n")
            except (OSError, TypeError, ValueError) as exc:
                self._log_error(f"cannot write {self.path}: {exc}")
                return False
            if self._last_error:
                logger.info("status file %s written again", self.path)
                self._last_error = ""
            self._writes += 1
            self._last = json.loads(text)
            self._cond.notify_all()
            return True

    def wait_written(self, predicate: Callable[[dict[str, Any]], bool], timeout: float) -> bool:
        """Block until a written document satisfies ``predicate`` (checked after every write)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._last is not None and predicate(self._last), timeout)

    def _log_error(self, text: str) -> None:
        if text != self._last_error:  # once per distinct error, not every interval
            logger.warning("status file: %s", text)
            self._last_error = text


def _replace_atomically(path: Path, text: str) -> None:
    # A directory that does not exist yet (/var/run/nicswitch/ on a fresh pod) is made, as the
    # events file's is: otherwise the agent runs and `status` says it does not.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


# --------------------------------------------------------------------------------------------
# Reader (``nicswitch-agent status``)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StatusReport:
    """What a status file says, judged.

    Attributes:
        path: The file read.
        exit_code: See :class:`ExitCode`.
        problem: Why the exit code is not 0, in plain words ("" when it is).
        document: The parsed file, or None when it could not be read.
        age_s: Seconds since the file was written (by the writer's clock), or None.
        max_age_s: Age past which the file counts as stale.
    """

    path: str
    exit_code: ExitCode
    problem: str
    document: dict[str, Any] | None = None
    age_s: float | None = None
    max_age_s: float | None = None

    @property
    def status(self) -> dict[str, Any]:
        """The agent's ``status()`` snapshot from the file (empty when unreadable)."""
        inner = (self.document or {}).get("status")
        return inner if isinstance(inner, dict) else {}

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.path,
            "exit_code": int(self.exit_code),
            "result": self.exit_code.name.lower(),
            "problem": self.problem or None,
            "age_s": None if self.age_s is None else round(self.age_s, 3),
            "max_age_s": self.max_age_s,
            "pid": (self.document or {}).get("pid"),
            "host": (self.document or {}).get("host"),
            "status": self.status or None,
        }


def default_max_age(interval_s: float) -> float:
    """Stale after three missed rewrites, and never sooner than 5 s past one interval."""
    return max(3 * interval_s, interval_s + 5.0)


def read_status(path: str | os.PathLike[str], *, now: float | None = None,
                max_age_s: float | None = None,
                max_disconnected_s: float = DEFAULT_MAX_DISCONNECTED_S,
                max_parked_s: float = DEFAULT_MAX_PARKED_S) -> StatusReport:
    """Read and judge a status file.

    Args:
        path: The file.
        now: The current wall clock (default ``time.time()``).
        max_age_s: Stale threshold; default :func:`default_max_age` of the interval in the file.
        max_disconnected_s: A running leader whose notify stream has not been established for
            longer than this (counted up to now, not to the write) is judged NOT_CONNECTED.
        max_parked_s: A running agent whose training has been parked longer than this (counted up
            to now) is judged STUCK, as is one with a hook stuck past its timeout or its
            coordination lost.
    """
    name = os.fspath(path)
    try:
        text = Path(name).read_text(encoding="utf-8")
    except FileNotFoundError:
        return StatusReport(name, ExitCode.NO_FILE, f"no status file at {name}: the agent is not running, or "
                                                    f"{STATUS_FILE_ENV} was not set for it")
    except OSError as exc:
        return StatusReport(name, ExitCode.NO_FILE, f"cannot read {name}: {exc}")
    except UnicodeDecodeError as exc:  # a ValueError, not an OSError: the agent writes UTF-8 JSON only
        return StatusReport(name, ExitCode.NO_FILE, f"{name} is not UTF-8 text, so not a status file: {exc}")
    try:
        document = json.loads(text)
    except ValueError as exc:
        return StatusReport(name, ExitCode.NO_FILE, f"{name} is not JSON: {exc}")
    if not isinstance(document, dict) or document.get("format") != FORMAT or not isinstance(
        document.get("status"), dict
    ):
        return StatusReport(name, ExitCode.NO_FILE, f"{name} is not a nicswitch-agent status file ({FORMAT})")
    written_at = _number(document.get("written_at"))
    interval = _number(document.get("interval_s")) or DEFAULT_INTERVAL_S
    limit = default_max_age(interval) if max_age_s is None else max_age_s
    now = time.time() if now is None else now
    age = None if written_at is None else now - written_at
    state = str(document["status"].get("state"))
    if state in ENDED_STATES:
        # A stopped or failed agent writes its file one last time and never again: that old write is
        # its verdict (exit 1), not a sign of a gone or hung process (exit 3).
        return _not_running(name, state, document, age, limit)
    gone = _process_gone(document)
    if gone:
        return StatusReport(name, ExitCode.STALE, f"{gone}: it ended without stopping its agent (killed?), "
                            f"last state: {state}", document, age, limit)
    if age is None or age > limit:
        shown = "unknown" if age is None else format_duration(age)
        return StatusReport(name, ExitCode.STALE,
                            f"stale: written {shown} ago, more than {format_duration(limit)} (the agent rewrites it "
                            f"every {format_duration(interval)}): its process is gone or hung (last state: {state})",
                            document, age, limit)
    if state not in RUNNING_STATES:
        return _not_running(name, state, document, age, limit)
    problem = _not_taking_part(document["status"], age, max_disconnected_s)
    if problem:
        return StatusReport(name, ExitCode.NOT_CONNECTED, problem, document, age, limit)
    problem = _cannot_switch(document, now, max_parked_s)
    if problem:
        return StatusReport(name, ExitCode.STUCK, problem, document, age, limit)
    return StatusReport(name, ExitCode.OK, "", document, age, limit)


def pid_namespace() -> int | None:
    """This process's PID namespace (Linux), so that a reader knows whether a pid in a file is one
    it can look up: a sidecar container shares the pod's host name, not its pids."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _process_gone(document: dict[str, Any]) -> str:
    """Why the writer is known to be gone ("" if not known): its pid no longer exists, on this
    host and in this PID namespace, so nothing has to wait for the file to go stale."""
    pid, ns = document.get("pid"), document.get("pid_ns")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 or ns is None or ns != pid_namespace() \
            or document.get("host") != socket.gethostname():
        return ""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"its process (pid {pid} on {document.get('host')}) is gone"
    except OSError:  # exists, as another user's: alive
        return ""
    return ""


def _not_running(name: str, state: str, document: dict[str, Any], age: float | None,
                 limit: float) -> StatusReport:
    """The verdict on an agent that is not running; a failed leader says why (what ClusterD refused,
    and the fix) in "reason"."""
    error = document["status"].get("reason") or document["status"].get("last_error") or ""
    why = f" ({error})" if state == "failed" and error else ""
    return StatusReport(name, ExitCode.NOT_RUNNING, f"the agent is {state}{why}", document, age, limit)


def _not_taking_part(status: dict[str, Any], age: float, max_disconnected_s: float) -> str:
    """Why a running leader does not take part in switches ("" when it does, or is no leader)."""
    if status.get("role") != "leader":
        return ""
    conflict = status.get("conflict")
    if isinstance(conflict, dict) and status.get("pause") == "agent":
        return f"another process-manage client fights for the job's stream: {conflict.get('detail')}"
    if status.get("connected"):
        return ""
    since = _number(status.get("disconnected_s"))
    if since is None or "connected" not in status:
        return ""  # a file from an agent that did not say (an older version)
    total = since + max(0.0, age)
    if total <= max_disconnected_s:
        return ""
    error = status.get("last_error") or "no error seen: the stream waits for a connection or for ClusterD"
    return (f"not connected to ClusterD for {format_duration(total)} (more than "
            f"{format_duration(max_disconnected_s)}): {error}")


def _cannot_switch(document: dict[str, Any], now: float, max_parked_s: float) -> str:
    """Why a running agent cannot take part in a switch now ("" when it can)."""
    status = document["status"]
    if status.get("training_stopped"):
        return (f"training was told to stop ({status.get('training_stopped')}): step() raises TrainingStopped on "
                "this rank; the job is ending, or its script goes on without switches")
    if status.get("coordination_lost"):
        return (f"coordination lost ({status.get('coordination_lost')}): switches cannot run on this rank until "
                "its process restarts")
    if status.get("stuck_hook"):
        return (f"{status.get('stuck_hook')} is still running past its timeout: every order reaching this rank is "
                "answered false until it returns (the rank's log names the hook and its timeout)")
    since = _number(document.get("parked_since"))
    if status.get("parked") and since is not None and now - since > max_parked_s:
        return (f"training parked at step {status.get('parked_step')} for {format_duration(now - since)}, more than "
                f"{format_duration(max_parked_s)}: far past any switch's budget (see the leader's log)")
    return ""


def format_summary(report: StatusReport) -> str:
    """A few readable lines: state, role, connection, last switch, counters, file age."""
    doc = report.document
    if doc is None:
        return f"status: {report.problem}"
    s = report.status
    lines: list[str] = []
    age = "unknown" if report.age_s is None else format_duration(report.age_s)
    lines.append(f"file        {report.path} (written {age} ago by pid {doc.get('pid')} on {doc.get('host')})")
    role = s.get("role") or "no role yet"
    # The launcher's leader is no training rank: it leads world_size of them (its {rank} is "leader").
    rank = (f" of {s.get('world_size')} rank(s), hosted by nicswitch-agent launch" if s.get("rank") == LEADER_FILE_RANK
            else f", rank {s.get('rank')} of {s.get('world_size')}")
    lines.append(f"state       {s.get('state')} ({role}{rank}, "
                 f"pause {s.get('pause')}{', dry run' if s.get('dry_run') else ''})")
    lines.append(f"job         {s.get('job_id')} on ClusterD {s.get('server')}")
    if s.get("reason"):
        lines.append(f"reason      {s.get('reason')}")
    if s.get("training_stopped"):
        lines.append(f"training    told to stop: {s.get('training_stopped')}")
    if s.get("coordination_lost"):
        lines.append(f"coordination lost: {s.get('coordination_lost')}; switches cannot run on this rank")
    if s.get("stuck_hook"):
        lines.append(f"stuck hook  {s.get('stuck_hook')} is still running past its timeout: every order "
                     "reaching this rank is answered false until it returns")
    if s.get("role") == "leader":
        stream = s.get("stream") or {}
        connected = "yes" if s.get("connected") else "NO"
        since = _number(s.get("disconnected_s"))
        if not s.get("connected") and since is not None:
            connected += f", for {format_duration(since)} before the write"
        msg_age = _number(s.get("last_message_age_s"))
        extra = "" if msg_age is None else f", last message {format_duration(msg_age)} before the write"
        lines.append(f"connected   {connected} (stream {'open' if s.get('stream_open') else 'closed'}; "
                     f"subscriptions {stream.get('opens', 0)}, errors {stream.get('errors', 0)}{extra})")
        if s.get("last_error"):
            lines.append(f"last error  {s.get('last_error')}")
        seen = _error_seen(s, _number(doc.get("written_at")))
        if seen:
            lines.append(f"error seen  {seen}")
        conflict = s.get("conflict")
        if isinstance(conflict, dict):
            lines.append(f"conflict    {conflict.get('action')}: {conflict.get('detail')}")
    if s.get("parked"):
        since = _number(doc.get("parked_since"))
        written = _number(doc.get("written_at"))
        held = "" if since is None or written is None else f" for {format_duration(max(0.0, written - since))}"
        lines.append(f"training    PARKED at step {s.get('parked_step')}{held}")
    elif s.get("last_step") is not None:
        lines.append(f"training    last step {s.get('last_step')}")
    lines.append(f"last switch {_last_switch(s.get('last_switch'), _number(doc.get('written_at')))}")
    lines.append(f"last verify {_last_verify(s.get('last_verify'), _number(doc.get('written_at')))}")
    links = format_links(s.get("links"), _number(doc.get("written_at")), format_duration)
    if links:
        lines.append(f"links       {links}")
    c = s.get("counters") or {}
    if c:
        lines.append(
            f"counters    lists {c.get('lists_received', 0)} received ({c.get('lists_rejected', 0)} rejected, "
            f"{c.get('lists_ignored', 0)} for other jobs); switches {c.get('switches_ok', 0)} ok, "
            f"{c.get('switches_failed', 0)} failed; replies {c.get('replies_delivered', 0)} delivered, "
            f"{c.get('replies_failed', 0)} failed"
        )
    timings = _timings(s.get("timings"))
    if timings:
        lines.append(f"timings     {timings}")
    verdict = "OK: the agent is running and the file is fresh" if report.exit_code is ExitCode.OK else (
        f"NOT OK: {report.problem}"
    )
    lines.append(f"verdict     {verdict}")
    return "\n".join(lines)


def _last_switch(last: Any, written_at: float | None) -> str:
    if not isinstance(last, dict):
        return "none yet"
    result = "true" if last.get("result") else "false"
    reason = last.get("reason") or "no reason"
    if last.get("reply") == "delivered":
        parts = [f"#{last.get('seq')}: replied {result} ({reason})",
                 f"reply delivered after {last.get('reply_attempts')} attempt(s)"]
    else:  # the switch ran (or was refused), but ClusterD did not get its answer: say so, and why
        tries = f" after {last.get('reply_attempts')} attempt(s)" if last.get("reply_attempts") else ""
        why = f": {last.get('error')}" if last.get("error") else ""
        parts = [f"#{last.get('seq')}: {'ok' if last.get('result') else 'failed'} ({reason})",
                 f"reply {result} NOT delivered ({last.get('reply')}{tries}{why})"]
    total = _number(last.get("total_s"))
    if total is not None:
        parts.append(f"{format_duration(total)} from list to reply")
    at = _number(last.get("at"))
    if at is not None and written_at is not None:
        parts.append(f"{format_duration(max(0.0, written_at - at))} before the write")
    return ", ".join(parts)


def _last_verify(last: Any, written_at: float | None) -> str:
    """This rank's last verification (``status()["last_verify"]``, see coordination/member.py)."""
    if not isinstance(last, dict):
        return "none yet"
    name = str(last.get("order", ""))
    seq = name.split(".")[1] if name.count(".") == 2 else "?"  # "<epoch>.<seq>.verify"
    # "on this rank": the leader's line beside a switch that failed verification on another rank
    verdict = "passed on this rank" if last.get("ok") else f"FAILED on this rank ({last.get('reason') or 'no reason'})"
    parts = [f"#{seq}: {verdict}"]
    took = _number(last.get("duration_s"))
    if took is not None:
        parts[0] += f" in {format_duration(took)}"
    report = last.get("report")
    groups = report.get("groups") if isinstance(report, dict) else None
    if isinstance(groups, list):
        parts.append(f"{sum(1 for g in groups if isinstance(g, dict) and g.get('ok'))} of {len(groups)} group(s) ok")
    at = _number(last.get("at"))
    if at is not None and written_at is not None:
        parts.append(f"{format_duration(max(0.0, written_at - at))} before the write")
    return ", ".join(parts)


def _error_seen(status: dict[str, Any], written_at: float | None) -> str:
    """The last error the leader met, when, and whether it still holds ("" if none was met)."""
    seen = status.get("last_error_seen")
    if not isinstance(seen, dict) or not seen.get("error"):
        return ""
    at = _number(seen.get("at"))
    when = ("" if at is None or written_at is None
            else f"{format_duration(max(0.0, written_at - at))} before the write, ")
    holds = "still holds" if status.get("last_error") == seen.get("error") else "over"
    return f"{seen.get('error')} ({when}{seen.get('stream', '?')} stream; {holds})"


_TIMING_LABELS = (("switch_s", "switch"), ("reply_latency_s", "list to reply"), ("pause_s", "parked"))


def _timings(timings: Any) -> str:
    """``switch 2 ms (max 5 ms, 3 times), ...`` from ``status()["timings"]`` (metrics.EventStats)."""
    if not isinstance(timings, dict):
        return ""
    parts = []
    for key, label in _TIMING_LABELS:
        entry = timings.get(key)
        if isinstance(entry, dict) and _number(entry.get("last")) is not None:
            peak = _number(entry.get("max")) or 0.0
            parts.append(f"{label} {format_duration(float(entry['last']))} (max {format_duration(peak)}, "
                         f"{entry.get('count')} time(s))")
    losses = timings.get("stream_losses")
    if isinstance(losses, int) and losses:
        parts.append(f"stream lost {losses} time(s)")
    return "; ".join(parts)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def format_duration(seconds: float) -> str:
    """``12 ms``, ``1.7 s``, ``2 min 5 s``, ``16 min``, ``2.5 h``, ``3.2 days``: short and unambiguous
    for any float, also one read from a file or given by a program (``inf s``, never an OverflowError
    or a number of 300 digits)."""
    if not math.isfinite(seconds):
        return f"{seconds} s"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(round(seconds), 60)
    if minutes < 120:
        return f"{minutes} min {rest} s" if rest else f"{minutes} min"
    if minutes < 48 * 60:
        return f"{minutes / 60:.1f} h"
    return f"{seconds / 86400:.3g} days"



__all__ = [
    "DEFAULT_INTERVAL_S",
    "DEFAULT_MAX_DISCONNECTED_S",
    "DEFAULT_MAX_PARKED_S",
    "LEADER_FILE_RANK",
    "STATUS_FILE_ENV",
    "ExitCode",
    "StatusFileWriter",
    "StatusReport",
    "default_max_age",
    "expand_path",
    "format_duration",
    "format_summary",
    "read_status",
    "template_problem",
]
