"""``python -m nicswitch_agent`` is the same as the ``nicswitch-agent`` command."""

import sys

from nicswitch_agent.ops.cli import console

sys.exit(console())
