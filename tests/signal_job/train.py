"""A training process with a live agent, for tests/test_signals.py (run as a subprocess).

``python train.py SERVER JOB SCENARIO``; every agent event is printed as ``EVENT <kind>``, so the
test can wait for a state before it sends a signal. Scenarios:

- ``idle``: step every 10 ms until killed;
- ``switching``: the switch hook prints HOOK and then runs (Python code, sleeping in slices)
  until the process ends;
- ``user-handler``: a SIGTERM handler installed before the agent prints USER-HANDLER and exits 42;
- ``user-handler-switching``: both: the handler's ``sys.exit(42)`` raises inside the hook;
- ``no-handlers``: ``handle_signals=False``;
- ``return``: main returns while the agent runs (interpreter exit must stop it, bounded).

Once the hook has started, a ``step()`` that returns prints STEPPED-AFTER-HOOK (training resumed).
"""

from __future__ import annotations

import signal
import sys
import time
from types import FrameType

from nicswitch_agent import SwitchAgent
from nicswitch_agent.observability.events import AgentEvent
from nicswitch_agent.orders import SwitchOrder


def say(text: str) -> None:
    sys.stdout.write(text + "\n")  # one write per line: lines come from several threads
    sys.stdout.flush()


def on_event(event: AgentEvent) -> None:
    say(f"EVENT {event.kind}")


HOOK_STARTED = False


def hook_that_runs_on(order: SwitchOrder) -> bool:
    global HOOK_STARTED
    HOOK_STARTED = True
    say("HOOK")
    while True:  # a long switch; Python code, so a signal handler gets to run
        time.sleep(0.05)


def user_handler(signum: int, frame: FrameType | None) -> None:
    say("USER-HANDLER")
    sys.exit(42)


def main() -> int:
    global HOOK_STARTED
    server, job, scenario = sys.argv[1:4]
    if scenario.startswith("user-handler"):
        signal.signal(signal.SIGTERM, user_handler)
    hook = hook_that_runs_on if scenario.endswith("switching") else (lambda order: True)
    agent = SwitchAgent(server=server, job_id=job, pause="agent", switch_hook=hook, on_event=on_event,
                        handle_signals=scenario != "no-handlers", reconnect_initial_s=0.05, reconnect_max_s=0.2,
                        stop_timeout_s=2.0)
    agent.start()
    say("STARTED")
    if scenario == "return":
        deadline = time.monotonic() + 20
        while not agent.status()["stream_open"] and time.monotonic() < deadline:
            time.sleep(0.01)
        say("RETURNING")
        return 0
    step = 0
    while True:
        step += 1
        agent.step(step)
        if HOOK_STARTED:
            say("STEPPED-AFTER-HOOK")
            HOOK_STARTED = False
        time.sleep(0.01)


if __name__ == "__main__":
    sys.exit(main())
