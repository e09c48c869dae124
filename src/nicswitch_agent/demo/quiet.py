"""Keep gRPC core's own log lines (``I0000 ... chttp2_transport.cc ... Got goaway``) off the terminal of
the demo and the operator commands.

With ``GRPC_VERBOSITY`` unset, grpcio leaves absl's defaults alone, and absl writes INFO and up to
stderr (everything before ``absl::InitializeLog()``, which nothing calls): a goaway or a failed TLS
handshake then prints a raw core line between the demo's own. grpc reads the variable once, when it
is imported (``grpc_init``), so the command line calls :func:`quiet_grpc` before it imports grpc,
and the demo's child processes inherit the value. This module imports nothing of grpc's.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping, Sequence

VERBOSITY_ENV = "GRPC_VERBOSITY"
TRACE_ENV = "GRPC_TRACE"
QUIET = "ERROR"  # gRPC core's errors still show; its INFO chatter does not


def quiet_grpc(env: MutableMapping[str, str] | None = None) -> bool:
    """Set ``GRPC_VERBOSITY=ERROR`` in ``env`` (default: this process's) unless the user chose a
    verbosity or asked for ``GRPC_TRACE`` tracers (which log at INFO). True when it set it."""
    env = os.environ if env is None else env
    if env.get(VERBOSITY_ENV, "").strip() or env.get(TRACE_ENV, "").strip():
        return False
    env[VERBOSITY_ENV] = QUIET
    return True


# The commands whose terminal output is ours alone: each says in its own words what gRPC core would
# log (a failed TLS handshake: "Is the server plaintext?"). Not `launch`: its child, the training
# job, inherits the environment, and its gRPC logging is the job's own business.
QUIET_COMMANDS = ("demo", "switch", "watch", "doctor", "sim")


def is_quiet_command(argv: Sequence[str]) -> bool:
    """Whether ``argv`` (without the program name) runs one of :data:`QUIET_COMMANDS`: the first
    word that is not an option is the command (the top-level options, -v, --version and -h, take
    no value)."""
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    return command in QUIET_COMMANDS
