"""Fake ``torch_npu.npu``: ``_comm_switch_nic`` records every call, exactly as received.

Each call appends one JSON line to the file named by ``FAKE_TORCH_NPU_LOG``: the arguments as
received (``repr`` and JSON), their Python types, the pid, the thread and this process's RANK, so
a test can check what every rank really passed to torch_npu. ``FAKE_TORCH_NPU_RESULT`` (default
``true``) is what the call returns.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any


def _comm_switch_nic(ranks: Any, useBackup: Any) -> bool:
    record = {
        "ranks": list(ranks),
        "ops": list(useBackup),
        "ranks_repr": repr(ranks),
        "ops_repr": repr(useBackup),
        "ranks_type": type(ranks).__name__,
        "ops_type": type(useBackup).__name__,
        "item_types": sorted({type(r).__name__ for r in ranks} | {type(o).__name__ for o in useBackup}),
        "pid": os.getpid(),
        "rank": os.environ.get("RANK"),
        "thread": threading.current_thread().name,
        "t": time.time(),
    }
    path = os.environ.get("FAKE_TORCH_NPU_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    return os.environ.get("FAKE_TORCH_NPU_RESULT", "true").lower() == "true"


__all__ = ["_comm_switch_nic"]
