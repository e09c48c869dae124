"""``nicswitch-agent sim``: argument parsing and a served switch (run() embedded with a stop event)."""

from __future__ import annotations

import argparse
import io
import re
import threading

import pytest

from nicswitch_agent.sim import cli

from .conftest import WAIT, Client

pytestmark = pytest.mark.timeout(20)


class _Lines(io.StringIO):
    """An ``out`` stream that signals each written line."""

    def __init__(self) -> None:
        super().__init__()
        self.changed = threading.Condition()

    def write(self, text: str) -> int:
        with self.changed:
            written = super().write(text)
            self.changed.notify_all()
        return written

    def wait_for(self, pattern: str) -> re.Match[str]:
        with self.changed:
            found: list[re.Match[str]] = []

            def seen() -> bool:
                match = re.search(pattern, self.getvalue())
                if match:
                    found.append(match)
                return bool(match)

            assert self.changed.wait_for(seen, WAIT), f"{pattern!r} not in {self.getvalue()!r}"
            return found[0]


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_parse_nodes() -> None:
    assert cli.parse_nodes(["node-0:0,1", "node-1: 2 , 3"]) == {"node-0": ["0", "1"], "node-1": ["2", "3"]}
    for bad in (["node-0"], ["node-0:"], [":0"], ["n:0", "n:1"]):
        with pytest.raises(ValueError):
            cli.parse_nodes(bad)


def test_bad_arguments_return_2() -> None:
    assert cli.run(_parse("--nodes", "broken"), stop_event=threading.Event(), out=io.StringIO()) == 2


def test_run_serves_until_stopped() -> None:
    args = _parse("--port", "0", "--job", "job-1", "--nodes", "node-0:0,1", "--nodes", "node-1:0,1", "--standin", "-v")
    out, stop = _Lines(), threading.Event()
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(cli.run(args, stop_event=stop, out=out)))
    thread.start()
    try:
        address = out.wait_for(r"listening on (\S+)").group(1)
        out.wait_for(r"node node-1: device->rank 0->2 1->3")
        worker, om = Client(address, job_id="job-1", role="worker"), Client(address, job_id="job-1", role="om")
        stream = worker.subscribe_notify()
        out.wait_for(r"SubscribeNotifySwitch opened")
        assert om.track({"node-1": (["1"], [True])}).code == 0
        assert list(stream.get().rankID) == ["3"]
        worker.reply(True)
        out.wait_for(r"WaitContinueTrainState\(switchNicRecvContinue\)-->INIT")
        worker.close()
        om.close()
    finally:
        stop.set()
        thread.join(WAIT)
    assert result == [0]


def test_module_entry_point_stops_on_sigint() -> None:
    """``python -m nicswitch_agent.sim`` serves, then exits 0 on SIGINT (the operator's Ctrl-C)."""
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "nicswitch_agent.sim", "--port", "0", "--job", "job-9"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        address = None
        for line in proc.stdout:  # log lines first, then the address line
            address = re.search(r"listening on (\S+)", line)
            if address:
                break
        assert address
        assert Client(address.group(1), job_id="job-9").init().info == "job(uid=job-9) init success"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(WAIT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
