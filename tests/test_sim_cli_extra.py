"""``nicswitch-agent sim`` on an address it cannot listen on: one line naming host and port, exit 2.

The tester's case: ``sim --host 1.2.3.4`` exited 1 after gRPC core's raw ``add_port.cc`` line. A
busy port was already one clear line with exit 2 (tests/sim/test_cli.py); a host this machine does
not have, or cannot resolve, now gets the same treatment. Real processes, as an operator runs them.
"""

from __future__ import annotations

import errno
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

# TEST-NET-3 (RFC 5737): documentation only, so no machine running the tests has it.
FOREIGN = "203.0.113.7"
UNKNOWN = "nosuch-host.invalid"  # .invalid never resolves (RFC 6761)


def sim(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nicswitch_agent", "sim", *args], capture_output=True, text=True,
                          timeout=45, check=False)


def test_a_host_this_machine_does_not_have_is_one_line_naming_host_and_port_and_exit_2() -> None:
    with socket.socket() as probe:
        try:
            probe.bind((FOREIGN, 0))
        except OSError as exc:
            assert exc.errno == errno.EADDRNOTAVAIL, exc
        else:
            pytest.skip(f"this machine can bind {FOREIGN} (non-local binds allowed)")
    done = sim("--host", FOREIGN, "--port", "8899")
    assert done.returncode == 2, done
    assert done.stdout == "", done.stdout  # nothing started, nothing stopped
    (line,) = done.stderr.splitlines()  # no gRPC core line before it
    assert line.startswith(f"nicswitch-agent sim: error: cannot listen on {FOREIGN}:8899: "), line
    assert f"{FOREIGN} is not an address of this machine" in line and "--host" in line, line


def test_a_host_that_does_not_resolve_is_one_line_and_exit_2() -> None:
    try:
        socket.getaddrinfo(UNKNOWN, 0)
    except OSError:
        pass
    else:
        pytest.skip(f"the resolver here answers for {UNKNOWN}")
    done = sim("--host", UNKNOWN, "--port", "0")
    assert done.returncode == 2, done
    assert done.stdout == "", done.stdout
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"nicswitch-agent sim: error: cannot listen on {UNKNOWN}:0: unknown host ("), line


def test_help_says_an_unusable_host_is_a_usage_error() -> None:
    done = sim("--help")
    assert done.returncode == 0
    flat = " ".join(done.stdout.split())
    assert "2 usage error (the port in use, a --host this machine does not have, a --tls-* file" in flat, flat[-300:]


def test_a_burst_of_sigterms_stops_the_simulator_every_time() -> None:
    """An outside check: six SIGTERMs at once hung ``sim`` for good (1 in 12 bursts there, 7 in 20
    here): the handler set a threading.Event, and a signal landing inside the first handler's
    ``set``, or inside ``stop.wait()``'s own hold of the Event's lock, waited for a lock the main
    thread held. Fifteen bursts: each must end the simulator."""
    import os
    import signal
    import time

    from support import Lines

    for _ in range(15):
        process = subprocess.Popen([sys.executable, "-m", "nicswitch_agent", "sim", "--port", "0"],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            output = Lines(process.stdout)
            assert output.wait_for("Ctrl-C to stop.", 30), output.lines
            for _ in range(6):  # spaced (not synchronisation): signals sent at once arrive as one
                os.kill(process.pid, signal.SIGTERM)
                time.sleep(0.002)
            code = process.wait(20)  # raises TimeoutExpired when hung
            # 0; or killed by a SIGTERM that came after the simulator stopped and gave the signal back
            assert code in (0, -signal.SIGTERM), (code, output.lines)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(10)


def test_stand_ins_with_taskds_own_registration_delay_start() -> None:
    """An outside check: ``sim --standin --standin-register-delay 10`` (TaskD's real delay, which
    operations.md tells to rehearse) refused to start: the simulator gave its stand-ins a fixed 10 s
    to subscribe, delay included."""
    from support import Lines

    process = subprocess.Popen([sys.executable, "-m", "nicswitch_agent", "sim", "--port", "0", "--standin",
                                "--standin-register-delay", "10.1"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        output = Lines(process.stdout)
        assert output.wait_for("MindIO stand-in subscribed", 40), (process.poll(), output.lines)
    finally:
        process.terminate()
        process.wait(20)
