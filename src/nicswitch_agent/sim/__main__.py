"""``python -m nicswitch_agent.sim``: the simulator CLI on its own."""

from __future__ import annotations

import sys

from nicswitch_agent.sim.cli import main

if __name__ == "__main__":
    sys.exit(main())
