"""What start() checks about the hooks of a verified switch, and where collectives may run.

A hook that runs collectives (``runs_collectives = True``: TorchCheckpointGuard over a process
group, TorchLinkProbe) must run on the training thread, between two of its steps: there every rank
enters the hook's collective at the same point of its collective sequence. In pause mode
``external`` MindIO/TaskD pause training and the agent runs hooks on threads of its own while the
training thread may still be inside its own all_reduce; the two collectives meet on one
communicator and wait for each other for ever (issue 18 item 2 saw exactly that). So such a hook is
refused at start, not found at the first switch.

A verify hook's own wait (TorchLinkProbe's ``timeout_s``) must end before the agent's
``verify_timeout_s``: on the parked training thread the agent cannot abandon a hook, so a probe
that waited longer would keep training parked after the reply went out.

With a verify hook a switch may take up to ``2 x verify_timeout_s`` more than the config's budget
rule counts (the hook's warm-up before the switch hook, its verification after it), so the budget
is checked again here, with both, against ClusterD's 900 s wait for the result.
"""

from __future__ import annotations

from typing import Any

from nicswitch_agent.config import CLUSTERD_REPORT_TIMEOUT_S, AgentConfig, resolve_pause_mode
from nicswitch_agent.errors import ConfigError


def runs_collectives(hook: Any) -> bool:
    """Whether ``hook`` declares that it runs collectives (plain functions declare nothing)."""
    return getattr(hook, "runs_collectives", False) is True


def check_hooks_at_start(config: AgentConfig, pause_mode: str, hooks: dict[str, Any]) -> None:
    """Refuse combinations that deadlock or cannot be bounded (called by start() on every rank
    that runs hooks; not in a dry run, which runs none).

    Args:
        hooks: the agent's hooks by argument name (``checkpoint_hook``, ``verify_hook``, ...).

    Raises:
        ConfigError: naming the hook, the mode and the fix.
    """
    if pause_mode == "external":
        for name, hook in hooks.items():
            if hook is not None and runs_collectives(hook):
                raise ConfigError(_external_refusal(name, hook, chosen=_why_external(config)))
    verify_hook = hooks.get("verify_hook")
    own = getattr(verify_hook, "timeout_s", None)
    if isinstance(own, (int, float)) and not isinstance(own, bool) and own >= config.verify_timeout_s:
        raise ConfigError(
            f"verify_hook {type(verify_hook).__name__}(timeout_s={own:g}) must give up before verify_timeout_s="
            f"{config.verify_timeout_s:g} (NICSWITCH_VERIFY_TIMEOUT_S): on the parked training thread a hook "
            "cannot be abandoned, so training would stay parked after the reply; lower timeout_s or raise "
            "verify_timeout_s")
    if verify_hook is not None:
        _check_verified_budget(config)


def _check_verified_budget(config: AgentConfig) -> None:
    """The budget rule of AgentConfig, with the verify phase: it can run twice per switch."""
    budget = config.guard_timeout_s + config.switch_timeout_s + 2 * config.verify_timeout_s + config.reply_timeout_s
    if budget >= CLUSTERD_REPORT_TIMEOUT_S:
        room = (CLUSTERD_REPORT_TIMEOUT_S - (budget - 2 * config.verify_timeout_s)) / 2
        fix = (f"lower verify_timeout_s to below {room:g} s, or lower the others" if room > 0 else
               "lower guard_timeout_s or switch_timeout_s: they alone leave verification no time")
        raise ConfigError(
            f"with a verify hook, guard_timeout_s ({config.guard_timeout_s:g}) + switch_timeout_s "
            f"({config.switch_timeout_s:g}) + 2 x verify_timeout_s ({config.verify_timeout_s:g}) + reply_timeout_s "
            f"({config.reply_timeout_s:g}) = {budget:g} s must stay below ClusterD's {CLUSTERD_REPORT_TIMEOUT_S:g} s "
            "wait for the result (the hook's warm-up before the switch and its verification after it may each take "
            f"verify_timeout_s), or ClusterD gives up first: {fix}",
            settings=("guard_timeout_s", "switch_timeout_s", "verify_timeout_s", "reply_timeout_s"))


def _why_external(config: AgentConfig) -> str:
    """Why the pause mode is external, when the user did not say so (pause auto saw MindIO/TaskD)."""
    if config.pause != "auto":
        return ""
    return f" (pause mode external because pause='auto' and {resolve_pause_mode('auto')[1]})"


def _external_refusal(name: str, hook: Any, *, chosen: str = "") -> str:
    kind = type(hook).__name__
    fixes = ["pause='agent' (NICSWITCH_PAUSE=agent: the agent parks training and runs the hook on the "
             "training thread)"]
    if hasattr(hook, "use_dcp"):  # TorchCheckpointGuard and its subclasses
        fixes.append(f"{kind}(..., use_dcp=False) (each rank saves its own state with torch.save, no collective)")
    else:
        fixes.append(f"leave {name} out in pause mode external")
    return (f"{name}={kind}(...) runs collectives, and in pause mode external{chosen} the agent runs hooks on a "
            "thread of its own while the training thread may be inside its own collective: the two meet on "
            "one communicator and wait for each other for ever. Fix: " + ", or ".join(fixes))


def warm_up_budget(config: AgentConfig, verify_hook: Any, *, leader_only: bool) -> float:
    """How much longer the leader waits for a switch order: a verify hook's warm-up (``prepare``)
    runs before the switch hook. A launcher's leader does not know the members' hooks."""
    if config.dry_run:
        return 0.0
    if leader_only or callable(getattr(verify_hook, "prepare", None)):
        return config.verify_timeout_s
    return 0.0


def coordinator_settings(config: AgentConfig, verify_hook: Any, *, leader_only: bool) -> dict[str, Any]:
    """The leader's verification settings: the warm-up's budget, and whether switch orders ask the
    ranks to wait on a go key for a verify round (where one is likely: this rank's agent has a
    verify hook, or a launcher's leader, which cannot know; never in a dry run, which verifies
    nothing). A rank with a verify hook under a leader without one still gets the round, as a
    queue event."""
    expected = not config.dry_run and (leader_only or verify_hook is not None)
    return {"warm_up_s": warm_up_budget(config, verify_hook, leader_only=leader_only), "verify_expected": expected}


__all__ = ["check_hooks_at_start", "coordinator_settings", "runs_collectives", "warm_up_budget"]
