"""A ClusterD-compatible ``Recover`` server in pure Python: tests, the demo, operators' rehearsals.

Same method paths, codes, strings and state machine as the real server (``docs/clusterd.md``),
with every wait configurable so failure paths run in milliseconds. Protocol misuse that would hurt the real
server is recorded in :attr:`JobView.violations`.
"""

from __future__ import annotations

from nicswitch_agent.sim.event_controller import JobView
from nicswitch_agent.sim.server import ServerTls, Simulator
from nicswitch_agent.sim.settings import SimJob, SimSettings
from nicswitch_agent.sim.standin import MindIOStandIn

__all__ = ["JobView", "MindIOStandIn", "ServerTls", "SimJob", "SimSettings", "Simulator"]
