"""A fake ``torch_npu`` for the multi-process tests (put ``tests/torch_job/fake_torch_npu`` on PYTHONPATH).

Only what :class:`nicswitch_agent.TorchNpuSwitcher` touches exists: ``torch_npu.npu._comm_switch_nic``.
"""

from torch_npu import npu

__all__ = ["npu"]
