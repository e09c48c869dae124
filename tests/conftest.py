from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings

import nicswitch_agent  # noqa: F401  (before grpc, as in a user's process: it sets up grpc for forks)

sys.path.insert(0, str(Path(__file__).parent))

from scripted import ScriptedClusterD

# Property tests are derandomized and keep no example database by default (the README's test
# command is CI's), so a red run is red again on any machine; every failure found is pinned with
# @example. HYPOTHESIS_PROFILE=explore searches new random examples. No timing checks (hypothesis'
# deadline and too_slow health check): a loaded machine is not a failure of the property.
_UNTIMED = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
hypothesis_settings.register_profile("ci", derandomize=True, database=None, print_blob=True, **_UNTIMED)
hypothesis_settings.register_profile("explore", derandomize=False, database=None, print_blob=True, **_UNTIMED)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Scrub MindCluster/agent env so tests never pick up the machine's settings by accident.
for name in list(os.environ):
    if name.startswith("NICSWITCH_") or name in (
        "MINDX_SERVER_IP", "MINDX_TASK_ID", "LOCAL_PROXY_ENABLE", "TTP_PORT", "TASKD_PROCESS_ENABLE", "WORLD_SIZE"
    ):
        del os.environ[name]


@pytest.fixture
def clusterd() -> Iterator[ScriptedClusterD]:
    server = ScriptedClusterD().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def _agent_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="nicswitch_agent")


@pytest.fixture
def serve() -> Iterator[Callable[..., str]]:
    """Start a real gRPC server with the given Recover behaviours; returns its target."""
    import grpc  # here, not at the top: nicswitch_agent must be imported before grpc (fork safety)

    from nicswitch_agent.clusterd.channel import generic_handler

    servers: list[grpc.Server] = []

    def start(**handlers: Callable[..., Any]) -> str:
        server = grpc.server(ThreadPoolExecutor(max_workers=8))
        server.add_generic_rpc_handlers((generic_handler(handlers),))
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(0).wait(2)
