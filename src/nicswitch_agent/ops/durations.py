"""The command line's durations: one argparse type for every ``S`` flag, and how they are printed
(:func:`format_seconds`, the status file's own format, for any float).

``float()`` takes ``inf``, ``nan`` and ``1e308``; a timeout of ``inf`` then passed the parser and
broke the command later (a deadline that expired at once, an OverflowError in the output after the
work was done). Every duration flag is checked here instead, while parsing: a usage error (exit 2)
naming the flag and the value, before anything is sent or started. The limit is the agent's own for
its settings (``NICSWITCH_*_S``, config/), so a flag that feeds a setting cannot pass what the
setting refuses. ``sim/`` keeps a copy of its own (it imports nothing of the client's; docs/architecture.md).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from nicswitch_agent.config.limits import MAX_DURATION_S, MAX_DURATION_TEXT
from nicswitch_agent.observability.status_file import format_duration as format_seconds

__all__ = ["MAX_DURATION_S", "MAX_DURATION_TEXT", "format_seconds", "seconds"]


def seconds(*, positive: bool = True) -> Callable[[str], float]:
    """argparse type: a finite number of seconds, at most :data:`MAX_DURATION_S`, above 0 (or, with
    ``positive=False``, 0 allowed). argparse prefixes the message with the flag (``argument --timeout:``)."""
    kind = "positive" if positive else "non-negative"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number of seconds")
        if value < 0 or (positive and value == 0):
            raise argparse.ArgumentTypeError(f"{text!r} must be a {kind} number of seconds")
        if value > MAX_DURATION_S:
            raise argparse.ArgumentTypeError(f"{text!r} is above the limit of {MAX_DURATION_TEXT}")
        return value

    parse.__name__ = "seconds"  # argparse names the type in "invalid seconds value" messages
    return parse

