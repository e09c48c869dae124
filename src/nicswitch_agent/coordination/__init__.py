"""Leader <-> member coordination over a key-value Store (torch.distributed's, or in-process).

One process per job is the leader (it holds the ClusterD streams); every training rank is a
member. See protocol.py for the keys and messages, member.py and leader.py for each side.
"""

from nicswitch_agent.coordination.kv import KV, InProcessStore, StoreLike
from nicswitch_agent.coordination.leader import Coordinator, PauseOutcome, RunOutcome
from nicswitch_agent.coordination.member import Member, MemberHooks
from nicswitch_agent.coordination.protocol import KIND_CHECKPOINT, KIND_ROLLBACK, KIND_SWITCH, key_prefix

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
