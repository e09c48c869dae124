"""Helpers the tests share: a free port, polling with a bound, JSON lines, a child's output read
line by line, an event collector, a training loop, the simulator predicates that say an agent is
connected, a watch on its open streams, and an operator's switch request.

Imported as ``support`` (tests/conftest.py puts tests/ on sys.path, as for ``scripted``). It imports
neither grpc nor torch when imported, so any test may use it.
"""

from __future__ import annotations

import datetime
import json
import queue
import re
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nicswitch_agent import SwitchAgent
    from nicswitch_agent.observability.events import AgentEvent
    from nicswitch_agent.sim import Simulator

PROCESS_MANAGE = "SubscribeProcessManageSignal"
NOTIFY = "SubscribeNotifySwitch"


def free_port() -> int:
    """A loopback port nothing listens on (the OS's pick; free when this returns)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def poll(condition: Callable[[], Any], timeout: float, interval: float = 0.02) -> Any:
    """``condition()``'s first truthy value, or None once ``timeout`` has passed.

    For what has nothing to wait on (a file, another process, ``status()``); an event or a
    condition variable is better where there is one.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            return None
        time.sleep(interval)


def wait_until(predicate: Callable[[], Any], timeout: float, interval: float = 0.02) -> bool:
    """True once ``predicate()`` is true, False if ``timeout`` passes first."""
    return poll(predicate, timeout, interval) is not None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The complete lines of a JSON-lines file (a writer may be half way through the last one)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]


class Lines:
    """A child's output stream read line by line on a thread, so that a test waits for a line with a
    bound, not a sleep."""

    def __init__(self, stream: IO[str] | None) -> None:
        assert stream is not None
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, needle: str | re.Pattern[str], timeout: float = 30) -> str | None:
        """The first line from now on that holds ``needle`` (a pattern: matches it whole); None at
        the end of the stream or the deadline."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return None
            if line is None:
                return None
            self.lines.append(line)
            if needle.fullmatch(line) if isinstance(needle, re.Pattern) else needle in line:
                return line

    def rest(self, timeout: float = 10) -> list[str]:
        """Every line read, once the child has closed the stream (waited for up to ``timeout``)."""
        self._thread.join(timeout)
        while True:
            try:
                line = self._queue.get_nowait()
            except queue.Empty:
                return self.lines
            if line is not None:
                self.lines.append(line)


def streams_ready(sim: Simulator, job: str) -> bool:
    """The simulator has exactly one agent-mode agent connected for ``job``: one process-manage
    and one notify stream open."""
    view = sim.job_view(job)
    return view.open_streams.get(PROCESS_MANAGE, 0) == 1 and view.open_streams.get(NOTIFY, 0) == 1


def idle(sim: Simulator, job: str) -> bool:
    """``job`` is back in INIT with its agent connected: ready for the next switch."""
    return sim.job_view(job).state == "INIT" and streams_ready(sim, job)


class Events:
    """An agent's events (pass as ``on_event=``), waited on with a condition rather than sleeps."""

    def __init__(self) -> None:
        self.events: list[AgentEvent] = []
        self._cond = threading.Condition()

    def __call__(self, event: AgentEvent) -> None:
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()

    @property
    def kinds(self) -> list[str]:
        with self._cond:
            return [e.kind for e in self.events]

    def of(self, kind: str) -> list[AgentEvent]:
        with self._cond:
            return [e for e in self.events if e.kind == kind]

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
        """True once ``predicate()`` (called with the events locked) holds; False after ``timeout``."""
        with self._cond:
            return self._cond.wait_for(predicate, timeout)

    def wait(self, kind: str, count: int = 1, timeout: float = 10.0) -> list[AgentEvent]:
        """The events of ``kind`` once there are ``count``; fails the test, naming what was seen, if
        they do not come within ``timeout``."""
        assert self.wait_for(lambda: len(self.of(kind)) >= count, timeout), (
            f"waited {timeout} s for {count} {kind}; saw {self.kinds}")
        return self.of(kind)

    def first(self, kind: str, timeout: float = 10.0) -> AgentEvent:
        """The first event of ``kind``, waited for as :meth:`wait` does."""
        return self.wait(kind, 1, timeout)[0]

    def wait_all(self, *kinds: str, timeout: float = 10.0) -> bool:
        """True once an event of each of ``kinds`` has been seen; False after ``timeout``."""
        return self.wait_for(lambda: all(self.of(kind) for kind in kinds), timeout)


class Trainer:
    """A training loop on its own thread: a 2 ms "step" (``step_s``), then ``agent.step(step)``.

    ``stall``: while set, the step never ends (a long step, a hang). What ``agent.step`` raises
    (``TrainingStopped``, for one) ends the loop and is kept in :attr:`error`; leaving the
    ``with`` block re-raises it, so a context-managed loop cannot fail unnoticed.
    """

    def __init__(self, agent: SwitchAgent, *, stall: threading.Event | None = None, step_s: float = 0.002) -> None:
        self.agent = agent
        self.step_s = step_s
        self.step = 0
        self.stall = stall
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._stop = threading.Event()
        self._cond = threading.Condition()  # notified at every step
        self.thread = threading.Thread(target=self._run, name="trainer", daemon=True)

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.step_s):
                while self.stall is not None and self.stall.is_set() and not self._stop.is_set():
                    self._stop.wait(0.01)
                with self._cond:
                    self.step += 1
                    self._cond.notify_all()
                self.agent.step(self.step)
        except BaseException as exc:
            self.error = exc
        finally:
            self.done.set()

    def wait_step(self, step: int, timeout: float = 10.0) -> bool:
        """True once the loop has reached ``step``; False after ``timeout``."""
        with self._cond:
            return self._cond.wait_for(lambda: self.step >= step, timeout)

    def start(self) -> Trainer:
        self.thread.start()
        return self

    def stop(self) -> None:
        """End the loop and join it. Idempotent."""
        self._stop.set()
        if self.thread.ident is not None:
            self.thread.join(10)

    def __enter__(self) -> Trainer:
        return self.start()

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.stop()
        if exc_type is None and self.error is not None:
            raise self.error


def operator_switch(address: str, job: str, devs: list[str], ops: list[bool], *, node: str = "node-0") -> str:
    """What ``nicswitch-agent switch`` does: SwitchNicTrack for ``devs`` of ``node``, then the first
    SubscribeSwitchNicSignal message (``switch nic finish`` once the switch is over).

    ClusterD takes the result stream only while the switch runs and keeps no result, and a test's
    switch (2 ms steps) can end within a few ms: a subscribe sent after the track's answer can
    come too late on a loaded machine (CI saw it). So the subscribe is asked from before the track
    on, again at once while ClusterD is not switching yet, until one attempt started after the
    track's answer: the result is then lost only if the switch ended before ClusterD answered the
    track. (The operator CLI cannot do this: another operator's switch could be running.)"""
    import grpc

    from nicswitch_agent._pb import recover_pb2 as pb
    from nicswitch_agent.clusterd.channel import ChannelSettings, RecoverStub, open_channel

    channel = open_channel(ChannelSettings(target=address))
    answered = threading.Event()
    result: list[str] = []

    def follow() -> None:
        while True:
            after_answer = answered.is_set()
            try:
                for response in stub.SubscribeSwitchNicSignal(pb.SwitchNicRequest(jobID=job), timeout=20):
                    result.append(str(response.msg))
                    return
                if after_answer:
                    result.append("(no message)")
                    return
            except grpc.RpcError as exc:
                if after_answer or "swtiching" not in str(exc.details()):
                    result.append(f"(no message: {exc.details()})")
                    return
            time.sleep(0.001)  # a retry, not a synchronisation: ClusterD has not taken the track yet

    try:
        stub = RecoverStub(channel)
        request = pb.SwitchNics(jobID=job)
        request.nicOps[node].dev.extend(devs)
        request.nicOps[node].op.extend(ops)
        follower = threading.Thread(target=follow, name="operator-follow", daemon=True)
        follower.start()
        try:
            assert stub.SwitchNicTrack(request, timeout=5).code == 0
        finally:
            answered.set()
        follower.join(25)
        return result[0] if result else "(no message: no result within 25 s)"
    finally:
        channel.close()


class StreamWatch:
    """The most streams of each kind the simulator ever had open at once for ``job``: sampled on
    every state change of the simulator, from a thread of its own until :meth:`stop`."""

    def __init__(self, sim: Simulator, job: str) -> None:
        self.sim, self.job = sim, job
        self.max_open: dict[str, int] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stream-watch", daemon=True)
        self._thread.start()

    def _sample(self, sim: Simulator) -> bool:
        self.samples += 1
        for method, count in sim.job_view(self.job).open_streams.items():
            self.max_open[method] = max(self.max_open.get(method, 0), count)
        return self._stop.is_set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sim.wait_until(self._sample, 1.0)  # re-evaluated on every state change of the simulator

    def stop(self) -> dict[str, int]:
        """Stop sampling; the maxima seen."""
        self._stop.set()
        self._thread.join(5)
        return dict(self.max_open)


_STORE_SERVER = """\
import datetime, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
print(store.port, flush=True)
time.sleep(3600)
"""


def store_server_process() -> tuple[subprocess.Popen[str], int]:
    """A torch TCPStore server in a process of its own on 127.0.0.1 (a job Store whose host can be
    SIGKILLed): the process and its port. The caller kills it."""
    import sys

    server = subprocess.Popen([sys.executable, "-c", _STORE_SERVER], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    line = server.stdout.readline()
    if not line:
        server.kill()
        raise RuntimeError("the TCPStore server process did not start")
    return server, int(line)


def tcp_store(timeout_s: float = 10.0) -> Any:
    """A torch TCPStore server (libuv) on an ephemeral port of 127.0.0.1; skips the test without torch."""
    import pytest

    torch_distributed = pytest.importorskip("torch.distributed")
    return torch_distributed.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=timeout_s),
                                      wait_for_workers=False)
