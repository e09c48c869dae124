"""The ranges of the settings that end up in C: every duration, and the gRPC message size.

gRPC takes its channel arguments (keepalive, backoff, connect timeout, message sizes) as C ints,
durations in milliseconds; ``poll()`` takes a C int of milliseconds too, and a thread's wait at most
:data:`threading.TIMEOUT_MAX`. A setting past these passed the checks and made ``start()`` fail with
an ``OverflowError``. So every duration is bounded here, with room for a few of them added up.
"""

from __future__ import annotations

import math
from typing import Any

from nicswitch_agent.errors import ConfigError

MAX_DURATION_S = 7 * 24 * 3600.0
"""The longest any duration may be: far past any useful wait (ClusterD gives up after 15 minutes),
and three of them added up still fit a C int of milliseconds (2**31 - 1 ms: 24.8 days)."""
MAX_DURATION_TEXT = f"{MAX_DURATION_S:.0f} s ({MAX_DURATION_S / 86400:g} days)"
MAX_MESSAGE_BYTES = 2**31 - 1
"""gRPC's largest message size (``grpc.max_receive_message_length`` is a C int)."""


def check_seconds(name: str, value: Any) -> None:
    """``value`` of setting ``name`` is a finite number of seconds, from 0 to :data:`MAX_DURATION_S`.

    Raises:
        ConfigError: naming the setting and the value (and the limit).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{name}={value!r} must be a finite number of seconds", settings=(name,))
    if value < 0:
        raise ConfigError(f"{name}={value!r} must not be negative", settings=(name,))
    if value > MAX_DURATION_S:
        raise ConfigError(f"{name}={value!r} must be at most {MAX_DURATION_TEXT}", settings=(name,))
