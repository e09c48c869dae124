"""Leader <-> member coordination over a key-value Store (torch.distributed's, or in-process).

One process per job is the leader (it holds the ClusterD streams); every training rank is a
member. messages.py: the keys and messages; leader.py and member.py: each side; parking.py: where
the training thread waits at a step boundary; hook_runner.py: how a hook runs under its timeout;
topology.py: the rank, the world size and the Store. Nothing here imports gRPC.
"""

from nicswitch_agent.coordination.kv import KV, InProcessStore, StoreLike
from nicswitch_agent.coordination.leader import Coordinator, PauseOutcome, RunOutcome
from nicswitch_agent.coordination.member import Member, MemberHooks
from nicswitch_agent.coordination.messages import KIND_CHECKPOINT, KIND_ROLLBACK, KIND_SWITCH, key_prefix

__all__ = [
    "KIND_CHECKPOINT",
    "KIND_ROLLBACK",
    "KIND_SWITCH",
    "KV",
    "Coordinator",
    "InProcessStore",
    "Member",
    "MemberHooks",
    "PauseOutcome",
    "RunOutcome",
    "StoreLike",
    "key_prefix",
]
