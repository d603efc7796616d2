"""The agent's Reserve decision (pure): grant a lease, or the reason to refuse.

One function for the agent (replica_agent/agent.py ``Agent.reserve``) and the fleet simulation's
simulated agents (loadgen/fleet/sim.py), so the simulation decides as the product does. Order of
the checks (the first that fails is the reason): the replica is unhealthy (``unhealthy``); the
prompt is longer than the engine's max model length (``prompt-too-long``); the prompt does not fit
the class's PAB by the exact rule :func:`~replica_agent.policy.pab.admits` over the class horizon
minus the request's age ``waited_ms`` (``kv-full`` when the prompt exceeds the KV-limited tokens,
else ``no-budget``). The lease table's own bound (``too-many-leases``) is the caller's.
"""

from __future__ import annotations

from replica_agent.policy.pab import ClassBudget, ReplicaState, SloClass, admits


def reserve_decision(
    prompt_tokens: int, state: ReplicaState, slo: SloClass, waited_ms: float = 0.0, healthy: bool = True,
    max_prompt_tokens: int = 0, on_time_only: bool = False,
) -> tuple[str, ClassBudget | None]:
    """``("", budget)`` when a lease may be granted, else ``(reason, budget or None)`` (module docstring).

    Args:
        prompt_tokens: P (tokens), >= 0.
        state: the replica now (PAB inputs, leases included).
        slo: the request's class.
        waited_ms: ms since the request's arrival at the router (>= 0).
        healthy: whether the replica may take work.
        max_prompt_tokens: engine max model length (0 = unknown: not checked).
        on_time_only: grant only a start that meets the request's TTFT (:func:`admits`); a prompt
            that the work-conserving rule would take late is refused ``not-on-time``.

    Returns:
        (reason, the budget over the aged horizon that :func:`admits` computed; None when the
        decision was made before the fit).

    Raises:
        ValueError: if ``prompt_tokens`` or ``waited_ms`` is negative (or ``waited_ms`` NaN).
    """
    if not healthy:
        return "unhealthy", None
    if max_prompt_tokens and prompt_tokens > max_prompt_tokens:
        return "prompt-too-long", None
    ok, budget = admits(prompt_tokens, state, slo, waited_ms, on_time_only)
    if ok:
        return "", budget
    if prompt_tokens > budget.kv_limited_tokens:
        return "kv-full", budget
    if on_time_only and admits(prompt_tokens, state, slo, waited_ms)[0]:
        return "not-on-time", budget
    return "no-budget", budget
