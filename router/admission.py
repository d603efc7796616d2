"""The router's admission rules that are neither placement nor shedding (pure: state in, decision out).

One module for the decisions :mod:`router.server` used to make inline, so each can be tested by hand
without HTTP, gRPC or a clock (issue 16, "router core without I/O"); the server only gathers the
state and acts on the answer.

- :func:`prompt_decision`: the prompt cap. An exact prompt (token ids) longer than every replica's
  context is refused (400 ``context_length_exceeded``); an estimated one (text at
  ``bytes_per_token``) only when even ``estimate / refuse_factor`` is, because an estimate may
  overcount; an estimate that is kept is placed as at most the largest context (the engine's
  tokenizer has the last word).
- :func:`contention_excluded` and :class:`ContentionCap`: the contention cap (docs/architecture.md
  "Start window"): while requests of two tenants or more wait in the fair queue, a replica already
  running ``max(cap, what it ran when the contention began)`` of this router's requests takes no
  more, so the rest waits where the weights decide.
- :func:`hold_replica`: the replica held for a starving queue head (:class:`router.admission_queue.
  Dispatcher`, "Holds"): the usable one it may use where it will fit soonest.
- :func:`offer_replicas` and :func:`lease_tokens`: where a placement is carried out, and with what
  lease parameters. ``reserve`` mode: a Reserve on the first ``max_reserve`` candidates in order
  until one grants; ``inline`` mode: the first candidate only (no round trip, the agent decides on
  arrival). Either covers the prompt's tokens that the replica is estimated not to hold in its
  prefix cache (the prefill left to compute). :func:`use_inline`: ``inline`` mode applies only
  where the first candidate's agent is on the HTTP path (its snapshot's ``inline_admission``);
  elsewhere (``--no-proxy``, where the router sends to vLLM directly and nothing would check the
  header, or an agent that does not say) the placement takes Reserve leases as in ``reserve`` mode.
- :func:`after_relay`: what a relay attempt's outcome means for the charge, the lease and the next
  step (answer, place again, try another replica, give up); :class:`RelayAttempts` keeps one
  request's count of tries and refusals and the replicas it left out, and bounds both.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from router.placement import ReplicaView, largest_max_prompt, prompt_exceeds_every_replica


@dataclass(frozen=True, slots=True)
class PromptDecision:
    """What the prompt cap decided.

    Attributes:
        tokens: prompt tokens to place with (the estimate, capped at the largest context).
        refusal: None, or the message of a 400 ``context_length_exceeded``.
    """

    tokens: int
    refusal: str | None = None


def prompt_decision(
    prompt_tokens: int, exact: bool, views: Iterable[ReplicaView], bytes_per_token: float, refuse_factor: float
) -> PromptDecision:
    """The prompt cap of the module docstring.

    Args:
        prompt_tokens: the prompt's tokens (counted when ``exact``, else estimated).
        exact: the prompt came as token ids.
        views: the replicas now (their ``max_prompt_tokens``; 0 = unknown, never refuses).
        bytes_per_token: the estimate's rate (for the message).
        refuse_factor: an estimate is refused only when ``ceil(estimate / refuse_factor)`` exceeds
            every replica (>= 1).
    """
    views = list(views)
    largest = largest_max_prompt(views)
    if exact:
        if prompt_exceeds_every_replica(prompt_tokens, views):
            return PromptDecision(prompt_tokens, f"The prompt ({prompt_tokens} tokens) is longer than every "
                                                 f"replica's maximum context ({largest} tokens).")
        return PromptDecision(prompt_tokens)
    if prompt_exceeds_every_replica(math.ceil(prompt_tokens / refuse_factor), views):
        return PromptDecision(prompt_tokens, (
            f"The prompt (about {prompt_tokens} tokens, estimated at {bytes_per_token:g} bytes per token) is "
            f"longer than every replica's maximum context ({largest} tokens) by more than {refuse_factor:g}x."))
    return PromptDecision(min(prompt_tokens, largest) if largest > 0 else prompt_tokens)


def contention_excluded(cap: int, backlogged_tenants: int, replica_load: Mapping[str, int],
                        onset_load: Mapping[str, int] | None = None) -> frozenset[str]:
    """Replicas at the contention cap (module docstring); empty with the cap off (``cap <= 0``) or
    fewer than two tenants waiting.

    A replica's cap is ``max(cap, onset_load[replica])``: with ``onset_load`` (the requests each
    replica ran for this router when the contention began, :class:`ContentionCap`), a replica
    keeps the batch it had and takes a new request only as one of its own ends, so the fair queue
    decides who gets each freed slot without the batch shrinking to ``cap`` (``admission.
    contention_keep_running``). Without it (None) every replica's cap is ``cap``.

    Args:
        cap: ``admission.contention_max_inflight``.
        backlogged_tenants: tenants with requests in the fair queue.
        replica_load: requests this router holds a lease for, per replica.
        onset_load: the same, read when the current contention began, or None.
    """
    if cap <= 0 or backlogged_tenants < 2:
        return frozenset()
    if onset_load is None:
        return frozenset(rid for rid, n in replica_load.items() if n >= cap)
    return frozenset(rid for rid, n in replica_load.items() if n >= max(cap, onset_load.get(rid, 0)))


@dataclass(slots=True)
class ContentionCap:
    """The contention cap with its memory of the contention's onset (:func:`contention_excluded`).

    ``cap`` and ``keep_running`` are ``admission.contention_max_inflight`` and ``admission.
    contention_keep_running``. :meth:`excluded` is called with the state now; the first call that
    sees two tenants or more waiting records ``replica_load`` as the onset, and the first that sees
    fewer forgets it, so a contention that ends and starts again records afresh.
    """

    cap: int
    keep_running: bool = True
    onset: dict[str, int] | None = None

    def excluded(self, backlogged_tenants: int, replica_load: Mapping[str, int]) -> frozenset[str]:
        """Replicas that take no new request now (:func:`contention_excluded`)."""
        if self.cap <= 0 or backlogged_tenants < 2:
            self.onset = None
            return frozenset()
        if not self.keep_running:
            return contention_excluded(self.cap, backlogged_tenants, replica_load)
        if self.onset is None:
            self.onset = dict(replica_load)
        return contention_excluded(self.cap, backlogged_tenants, replica_load, self.onset)


def hold_replica(
    slo_class: str, prompt_tokens: int, exclude: frozenset[str], views: Iterable[ReplicaView]
) -> str | None:
    """The replica to hold for a starving head: among the usable replicas it may use (healthy,
    fresh, not excluded, the prompt within its max length, its class budgeted), the one with the
    least reserved for its class (largest ``horizon - slot wait - decode - in-flight reservation``: an
    engine at its ``max_num_seqs`` frees nothing before a running request ends), then the most
    ``kv_limited_tokens``, then the first in ``views`` order; None when there is none."""
    best: tuple[float, int, str] | None = None
    for v in views:
        cb = v.classes.get(slo_class)
        if not (v.healthy and v.fresh and cb is not None) or v.replica_id in exclude:
            continue
        if v.max_prompt_tokens > 0 and prompt_tokens > v.max_prompt_tokens:
            continue
        key = (cb.horizon_ms - cb.slot_wait_ms - cb.decode_reservation_ms - cb.inflight_reservation_ms,
               cb.kv_limited_tokens, v.replica_id)
        if best is None or key[:2] > best[:2]:
            best = key
    return None if best is None else best[2]


MAX_RELAY_TRIES = 2
"""Replicas tried per request when one fails before its first byte."""

MAX_ADMIT_REFUSALS = 8
"""Inline admissions agents may refuse for one request before it is answered 503 ``no-budget``."""


def use_inline(lease_mode: str, agent_inline: bool) -> bool:
    """Whether a placement is admitted inline (module docstring): ``lease_mode`` is ``inline`` and the
    first candidate's agent decides ``x-fairbatch-admit`` on arrival (``agent_inline``, the
    snapshot's ``inline_admission``). Otherwise a Reserve lease: an inline header sent past an
    agent that is not on the path would admit the request without any check of its budget."""
    return lease_mode == "inline" and agent_inline


def offer_replicas(candidates: Sequence[str], inline: bool, max_reserve: int) -> Sequence[str]:
    """The candidates a placement is offered to, in order (module docstring): the first only when
    ``inline``, else the first ``max_reserve``."""
    return candidates[:1] if inline else candidates[:max_reserve]


def lease_tokens(prompt_tokens: int, cached: Mapping[str, int], replica_id: str) -> int:
    """Prompt tokens the lease (or inline admission) on ``replica_id`` covers: ``prompt_tokens``
    less the tokens ``cached`` estimates the replica holds (router/prefix_index.py
    ``cached_tokens``, at most ``prompt_tokens - 1``), never below 0."""
    n = cached.get(replica_id) if cached else None
    return prompt_tokens if n is None else max(0, prompt_tokens - n)


@dataclass(frozen=True, slots=True)
class RelayAction:
    """What the router does after one relay attempt (:func:`after_relay`).

    Attributes:
        refund: give the tenant back the dispatch charge (nothing was generated).
        release: why the lease is released (``upstream-refused``, ``upstream-error``,
            ``client-disconnect``), or None when the request is done with it another way (``ok``:
            the agent consumed it; ``lease_refused``: no lease exists).
        next: ``answer`` (the attempt's outcome is the answer), ``replace`` (place again, the
            attempt not counted: an inline admission the agent refused), ``retry`` (place again on
            another replica, the attempt counted: it failed before its first byte) or ``give_up``
            (``replace`` once too often: answer 503 ``no-budget``).
        outcome: the request's outcome label for ``answer``.
    """

    refund: bool
    release: str | None
    next: str
    outcome: str = ""


def after_relay(kind: str, refusals: int, max_refusals: int) -> RelayAction:
    """The rule after a relay attempt whose outcome is ``kind`` (:class:`router.relay.RelayOutcome`):

    ==============  ======  =================  ==========================================
    kind            refund  release            next
    ==============  ======  =================  ==========================================
    ok              no      (consumed)         answer ``ok``
    lease_refused   yes     (none held)        replace, or give_up at ``max_refusals``
    refused         yes     upstream-refused   answer ``upstream_refused`` (engine's 4xx)
    retryable       yes     upstream-error     retry on another replica
    client_gone     no      client-disconnect  answer ``client_disconnect``
    upstream_error  no      upstream-error     answer ``upstream_error`` (tokens went out)
    ==============  ======  =================  ==========================================

    Args:
        kind: the attempt's outcome kind.
        refusals: inline refusals of this request so far, this one included.
        max_refusals: refusals after which the request is given up.

    Raises:
        ValueError: an unknown ``kind``.
    """
    if kind == "ok":
        return RelayAction(False, None, "answer", "ok")
    if kind == "lease_refused":
        return RelayAction(True, None, "give_up" if refusals >= max_refusals else "replace")
    if kind == "refused":
        return RelayAction(True, "upstream-refused", "answer", "upstream_refused")
    if kind == "retryable":
        return RelayAction(True, "upstream-error", "retry")
    if kind == "client_gone":
        return RelayAction(False, "client-disconnect", "answer", "client_disconnect")
    if kind == "upstream_error":
        return RelayAction(False, "upstream-error", "answer", "upstream_error")
    raise ValueError(f"unknown relay outcome {kind!r}")


class RelayAttempts:
    """One request's relay attempts (:func:`after_relay` applied in turn), bounded.

    ``max_tries`` attempts may fail before the first byte (each leaves its replica out of the
    request's later placements: ``exclude``); an inline admission refused on arrival is not a
    failure of the replica and does not count as an attempt, but leaves the refusing replica out of
    the next immediate placement (``refused_on``), and the ``max_refusals``-th refusal since the
    request last waited in the router's queue gives up (:meth:`waited`). So between two queue waits a
    request makes at most ``max_tries + max_refusals - 1`` relay attempts, and every wait is bounded by
    the request's queue deadline (from its arrival): the refusal bound stops a request bouncing between
    agents on a view that does not change, not one that waits for budget to free and is refused again
    because the router's view lagged the agents (a 200-request backlog on a loaded machine: 2 requests of
    a non-sheddable class answered 503 ``no-budget`` while the queue still drained).

    Args:
        max_tries: attempts that may fail before the first byte (>= 1).
        max_refusals: inline refusals that give up (>= 1).
    """

    __slots__ = ("max_tries", "max_refusals", "tries", "refusals", "exclude", "refused_on")

    def __init__(self, max_tries: int = MAX_RELAY_TRIES, max_refusals: int = MAX_ADMIT_REFUSALS) -> None:
        self.max_tries = max_tries
        self.max_refusals = max_refusals
        self.tries = 0
        self.refusals = 0
        self.exclude: frozenset[str] = frozenset()  # failed before the first byte: never again
        self.refused_on: frozenset[str] = frozenset()  # refused an inline admission: not at once

    def next_try(self) -> bool:
        """Start an attempt; False (nothing started) when ``max_tries`` have been made."""
        if self.tries >= self.max_tries:
            return False
        self.tries += 1
        return True

    def waited(self) -> None:
        """The request waits in the router's queue (for a budget change): its refusals so far stop
        counting towards ``max_refusals``."""
        self.refusals = 0

    def after(self, kind: str, replica_id: str) -> RelayAction:
        """The attempt on ``replica_id`` ended with ``kind``: :func:`after_relay`'s action, with this
        request's state updated (``replace``: the attempt given back and the replica added to
        ``refused_on``; ``retry``: the replica added to ``exclude``).

        Raises:
            ValueError: an unknown ``kind``.
        """
        if kind == "lease_refused":
            self.refusals += 1
        action = after_relay(kind, self.refusals, self.max_refusals)
        if action.next == "replace":
            self.refused_on = self.refused_on | {replica_id}
            self.tries -= 1
        elif action.next == "retry":
            self.exclude = self.exclude | {replica_id}
        return action
