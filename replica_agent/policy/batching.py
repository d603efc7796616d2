"""Batch-formation policies: which requests an engine iteration computes, and how many tokens each.

A policy is pure: it reads a :class:`SchedState` (plain data, time passed in as ``now_ms``) and
returns one :class:`Batch`. It only *proposes*; KV-cache allocation and preemption stay with the
engine, as in vLLM v1 where ``Scheduler.schedule()`` asks the KV-cache manager for slots and
preempts when it answers None. The engine may therefore run a subset of the proposal.

Token accounting (same as vLLM v1, ``num_new_tokens = num_tokens - num_computed_tokens``):
a request's known tokens are ``prompt_tokens + tokens_out``; ``computed_tokens`` of them are in
the KV cache. A prefill (or a recompute after preemption) has many tokens left, a decode exactly
one (the token sampled last step). The step that brings ``computed_tokens`` up to the known tokens
samples the next output token.

Policies live in :data:`POLICIES` (name -> class); :func:`make_policy` builds one by name from a
:class:`PolicyConfig`:

- ``vllm-default`` (:class:`VllmDefaultPolicy`): decode first (running order), then FCFS waiting
  prefills chunked to a fixed token budget (vLLM v1 chunked prefill, Sarathi-style).
- ``fairbatching`` (:class:`FairBatchingPolicy`): deadline/slack batch formation inside a
  predicted time budget (FairBatching, arXiv 2510.14392; docs/design.md section 3).
- ``fairbatching-pd`` (:class:`PrefillDeadlineFairBatchingPolicy`): FairBatching whose budget may
  grow so the most urgent waiting prefill meets its first-token deadline (our extension).
- ``fcfs`` (:class:`FcfsPolicy`): arrival order, prefill and decode alike.
- ``prefill-first`` (:class:`PrefillFirstPolicy`): every prefill (arrival order) before any decode.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import ClassVar, Protocol

from replica_agent.policy.time_model import TimeModel


@dataclass(slots=True)
class SchedRequest:
    """Scheduling view of one request.

    Attributes:
        request_id: engine-unique id.
        prompt_tokens: prompt length (tokens).
        computed_tokens: tokens already in the KV cache (tokens); 0 when new or preempted.
        tokens_out: output tokens sampled so far.
        max_tokens: output length at which the request finishes (tokens, >= 1).
        arrival_ms: arrival time (simulated ms).
        ttft_ms: TTFT target (ms), None when unknown.
        tpot_ms: TPOT target (ms), None when unknown.
        first_token_ms: time the first output token was sampled (simulated ms), None before it.
    """

    request_id: str
    prompt_tokens: int
    computed_tokens: int = 0
    tokens_out: int = 0
    max_tokens: int = 16
    arrival_ms: float = 0.0
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    first_token_ms: float | None = None

    @property
    def num_tokens(self) -> int:
        """Known tokens of the sequence: prompt + sampled outputs."""
        return self.prompt_tokens + self.tokens_out

    @property
    def remaining_tokens(self) -> int:
        """Tokens still to compute before the next output token (1 for a decode)."""
        return self.prompt_tokens + self.tokens_out - self.computed_tokens

    @property
    def is_prefill(self) -> bool:
        """True while more than the last sampled token is missing from the KV cache (prefill or recompute)."""
        return self.prompt_tokens + self.tokens_out - self.computed_tokens > 1 or self.tokens_out == 0


@dataclass(slots=True)
class SchedState:
    """Everything a policy may read for one iteration (read-only: the engine passes its live queues).

    Attributes:
        now_ms: current time (simulated ms).
        running: requests holding KV blocks, in running order (order they were first scheduled).
        waiting: requests not yet scheduled (or preempted), queue order, head first.
        max_num_batched_tokens: token cap of one iteration (tokens).
        max_num_seqs: cap on running requests (sequences).
        kv_free_blocks: free KV blocks before this iteration (blocks).
        block_size: tokens per KV block.
        time_model: batch-time model of this engine (ms), None when the policy needs none.
    """

    now_ms: float
    running: Sequence[SchedRequest]
    waiting: Sequence[SchedRequest]
    max_num_batched_tokens: int
    max_num_seqs: int
    kv_free_blocks: int = 0
    block_size: int = 16
    time_model: TimeModel | None = None


@dataclass(slots=True)
class Batch:
    """A proposed (or, from the engine, executed) iteration.

    Attributes:
        items: (request_id, num_new_tokens) in schedule order, each num_new_tokens >= 1.
        num_new_tokens: sum of num_new_tokens over items (tokens).
    """

    items: list[tuple[str, int]] = field(default_factory=list)
    num_new_tokens: int = 0

    def add(self, request_id: str, num_new_tokens: int) -> None:
        """Append one request with its token count."""
        self.items.append((request_id, num_new_tokens))
        self.num_new_tokens += num_new_tokens

    def __len__(self) -> int:
        return len(self.items)


class BatchingPolicy(Protocol):
    """Interface of a batch-formation policy (pure; see module docstring)."""

    name: ClassVar[str]

    @classmethod
    def from_config(cls, config: PolicyConfig) -> BatchingPolicy:
        """Build the policy from the shared parameters."""
        ...

    def form_batch(self, state: SchedState) -> Batch:
        """Propose the next iteration's batch."""
        ...


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """Parameters of the policies (each policy reads the ones it needs).

    Attributes:
        default_ttft_ms: TTFT target (ms) of requests without one (FairBatching).
        default_tpot_ms: TPOT target (ms) of requests without one (FairBatching).
        token_budget: vllm-default's per-step token budget (tokens; vLLM's max_num_batched_tokens
            as a fixed chunked-prefill budget); None -> the engine's max_num_batched_tokens.
        tpot_from_first_token: FairBatching's decode deadlines also respect the TPOT measured from
            the first token (see :class:`FairBatchingPolicy`); False = the seed's envelope only.
        decode_guard_ms: FairBatching plans every decode's deadline this many ms early (>= 0; see
            :class:`FairBatchingPolicy`), for the delivery path between the engine and the client.
    """

    default_ttft_ms: float = 1000.0
    default_tpot_ms: float = 100.0
    token_budget: int | None = None
    tpot_from_first_token: bool = True
    decode_guard_ms: float = 0.0

    def __post_init__(self) -> None:
        if not (self.default_ttft_ms > 0 and self.default_tpot_ms > 0):
            raise ValueError(
                f"default SLO must be > 0 ms; got ttft {self.default_ttft_ms}, tpot {self.default_tpot_ms}"
            )
        if self.token_budget is not None and self.token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {self.token_budget}")
        if not (self.decode_guard_ms >= 0 and math.isfinite(self.decode_guard_ms)):
            raise ValueError(f"decode_guard_ms must be a finite number >= 0, got {self.decode_guard_ms}")


@dataclass(slots=True)
class VllmDefaultPolicy:
    """vLLM v1's default schedule with chunked prefill (Sarathi-style decode-first token budget).

    Source: ``vllm/v1/core/sched/scheduler.py`` ``Scheduler.schedule()`` (FCFS policy):

    1. Running requests first, in running order: each gets min(remaining_tokens, budget) tokens
       (1 for a decode; the next chunk for an unfinished chunked prefill); stop when the token
       budget is spent.
    2. Then waiting requests FCFS while the budget lasts and running + admitted < max_num_seqs;
       each gets min(remaining_tokens, budget), so the last one is chunked to what is left.

    The budget is ``token_budget`` when set, else the engine's max_num_batched_tokens (vLLM uses
    max_num_batched_tokens itself: 8192 for ``vllm serve`` on GPUs with >= 70 GiB, 2048 below,
    ``vllm/engine/arg_utils.py``), never above the engine's cap. KV allocation and preemption are
    the engine's (as in vLLM).

    Attributes:
        token_budget: fixed per-step token budget (tokens), None -> max_num_batched_tokens.
    """

    name: ClassVar[str] = "vllm-default"
    token_budget: int | None = None

    @classmethod
    def from_config(cls, config: PolicyConfig) -> VllmDefaultPolicy:
        """Build from the shared policy parameters (reads ``token_budget``)."""
        return cls(token_budget=config.token_budget)

    def form_batch(self, state: SchedState) -> Batch:
        """Propose running-first, then FCFS waiting, under the token and sequence caps."""
        batch = Batch()
        budget = state.max_num_batched_tokens
        if self.token_budget is not None:
            budget = min(budget, self.token_budget)
        for req in state.running:
            if budget <= 0:
                break
            n = min(req.prompt_tokens + req.tokens_out - req.computed_tokens, budget)
            if n <= 0:
                continue
            batch.add(req.request_id, n)
            budget -= n
        seqs_left = state.max_num_seqs - len(state.running)
        for req in state.waiting:
            if budget <= 0 or seqs_left <= 0:
                break
            n = min(req.prompt_tokens + req.tokens_out - req.computed_tokens, budget)
            if n <= 0:
                continue
            batch.add(req.request_id, n)
            budget -= n
            seqs_left -= 1
        return batch


@dataclass(slots=True)
class FcfsPolicy:
    """First come, first served over every request, prefill and decode alike.

    Running and waiting requests in one arrival order (ties: running first, then queue order);
    each gets min(remaining_tokens, budget) tokens (1 for a decode, a chunk for a prefill) while
    the token budget (max_num_batched_tokens) lasts; waiting ones also need a free sequence slot
    (max_num_seqs). An old prefill can thus take the whole budget and hold back younger decodes.
    """

    name: ClassVar[str] = "fcfs"

    @classmethod
    def from_config(cls, config: PolicyConfig) -> FcfsPolicy:
        """Build (no parameters)."""
        return cls()

    def form_batch(self, state: SchedState) -> Batch:
        """Propose requests in arrival order under the token and sequence caps."""
        batch = Batch()
        budget = state.max_num_batched_tokens
        seqs_left = state.max_num_seqs - len(state.running)
        tagged = [(r, True) for r in state.running]
        tagged.extend((r, False) for r in state.waiting)
        tagged.sort(key=lambda t: t[0].arrival_ms)  # stable: running before waiting on ties
        _add_in_order(batch, tagged, budget, seqs_left, state)
        return batch


@dataclass(slots=True)
class PrefillFirstPolicy:
    """Prefill first: every prefill before any decode (vLLM v0's default priority, chunked).

    Prefills (unfinished chunked prefills among the running, then waiting requests, all in arrival
    order) get min(remaining_tokens, budget) tokens while the token budget lasts (waiting ones
    also need a sequence slot); running decodes, in running order, get what is left, 1 token each.
    """

    name: ClassVar[str] = "prefill-first"

    @classmethod
    def from_config(cls, config: PolicyConfig) -> PrefillFirstPolicy:
        """Build (no parameters)."""
        return cls()

    def form_batch(self, state: SchedState) -> Batch:
        """Propose prefills (arrival order), then decodes, under the token and sequence caps."""
        batch = Batch()
        budget = state.max_num_batched_tokens
        seqs_left = state.max_num_seqs - len(state.running)
        prefills: list[tuple[SchedRequest, bool]] = []
        decodes: list[SchedRequest] = []
        for r in state.running:
            rem = r.prompt_tokens + r.tokens_out - r.computed_tokens
            if rem == 1 and r.tokens_out > 0:
                decodes.append(r)
            elif rem > 0:
                prefills.append((r, True))
        prefills.extend((r, False) for r in state.waiting)
        prefills.sort(key=lambda t: t[0].arrival_ms)
        budget = _add_in_order(batch, prefills, budget, seqs_left, state)
        for req in decodes:
            if budget <= 0:
                break
            batch.add(req.request_id, 1)
            budget -= 1
        return batch


def _add_in_order(
    batch: Batch, items: Sequence[tuple[SchedRequest, bool]], budget: int, seqs_left: int, state: SchedState
) -> int:
    """Add (request, is_running) in order, min(remaining, budget) tokens each; returns the budget left.

    Running requests are always proposed (the engine preempts when KV runs out, as vLLM); admission of
    waiting ones stops at the first whose chunk does not fit the KV blocks still free (vLLM: the KV
    manager answers None and the scheduler stops admitting), so its tokens are not charged.
    """
    bs = state.block_size
    kv_left = state.kv_free_blocks
    admit = True
    for req, running in items:
        if budget <= 0:
            break
        comp = req.computed_tokens
        n = min(req.prompt_tokens + req.tokens_out - comp, budget)
        if n <= 0:
            continue
        need = -(-(comp + n) // bs) - (-(-comp // bs))
        if not running:
            if not admit or seqs_left <= 0:
                continue
            if need > kv_left:
                admit = False
                continue
            seqs_left -= 1
        kv_left -= need
        batch.add(req.request_id, n)
        budget -= n
    return budget


_SLACK = itemgetter(0)


@dataclass(slots=True)
class FairBatchingPolicy:
    """FairBatching batch formation (FairBatching, arXiv 2510.14392; docs/design.md section 3).

    Slack of a request (ms) = deadline of its next token - now, deadline(j) = arrival + ttft +
    tpot * j with j = tokens_out (the first-token deadline for a prefill; envelope.py). With
    ``tpot_from_first_token`` (default) a request that has its first token also keeps
    deadline(j) <= first_token_ms + tpot * j: SLO attainment judges TPOT = (last - first) /
    (n - 1) (docs/design.md section 2), so TTFT slack left over at the first token is not spendable on
    decodes (with the seed's envelope alone, a request whose first token came 400 ms early could
    be paced to TPOT = tpot + 400 / (n - 1) and miss its TPOT target). With ``decode_guard_ms`` = g
    > 0, a request that has its first token has its slack taken g ms early (slack - g): the client
    sees each token after the engine made it, later by the delivery path (the API server's
    detokenization and streaming), and that delay varies from token to token; a decode paced to its
    deadline exactly meets its TPOT at the engine and misses it at the client whenever the last
    token's delivery is slower than the first's. Then:

    1. time_budget = max(min slack over running decodes, min tpot_slo over running decodes) (ms);
       with no running decode it is unbounded (only the token cap and KV limit the batch).
    2. Urgent decodes: slack < time_budget + min tpot_slo; the rest are non-urgent.
    3. Order: urgent decodes, then prefills (waiting requests and unfinished chunked prefills or
       recomputes; slack against their next token's deadline), then non-urgent decodes, each
       group by slack ascending (ties keep queue order).
    4. Add in that order while the batch stays inside all limits: predicted time
       ``time_model.batch_ms(new_tokens, context_tokens, chunk_prefix, num_decodes, chunk_sq) <= time_budget``
       (context = each item's computed tokens; chunk_prefix = sum of chunk x computed and chunk_sq = sum of
       chunk^2 over prefill chunks: a chunk of n tokens over prefix p adds ``(b + e*p)*n + f*n^2 + c*p``, so
       the largest n in ``room`` ms is ``floor(2*room / (B + sqrt(B^2 + 4*f*room)))``, ``B = b + e*p``,
       which is ``floor(room / B)`` at f = 0), the KV blocks still free (``kv_free_blocks``; a new request is admitted
       only when its whole remaining prompt fits, so admitted prefills cannot wedge the cache),
       the token cap (max_num_batched_tokens) and max_num_seqs. A prefill that does not fit whole
       is chunked to what is left of the time, token and KV budgets; items that do not fit are
       skipped (a later, smaller one may still fit).
    5. Never an empty batch while work exists: if nothing fits, the most urgent item alone (the
       first in the order of 3 that fits KV; else the first running one, for which the engine
       preempts as vLLM does; else the first waiting one), a prefill chunked to the token cap.

    Requests without an SLO (``ttft_ms``/``tpot_ms`` None) use ``default_ttft_ms``/``default_tpot_ms``.
    Cost: O(n log n) in the requests considered, one pass and three sorts (see
    ``scripts/bench_policy_decision.py``).

    Attributes:
        default_ttft_ms: TTFT target of requests without one (ms).
        default_tpot_ms: TPOT target of requests without one (ms).
        tpot_from_first_token: also bound decode deadlines by first_token_ms + tpot * j.
        decode_guard_ms: ms by which a decode's deadline is planned early (>= 0; 0 = the envelope
            as it is).
    """

    name: ClassVar[str] = "fairbatching"
    default_ttft_ms: float = 1000.0
    default_tpot_ms: float = 100.0
    tpot_from_first_token: bool = True
    decode_guard_ms: float = 0.0
    raise_budget_for_prefills: ClassVar[bool] = False

    @classmethod
    def from_config(cls, config: PolicyConfig) -> FairBatchingPolicy:
        """Build from the shared policy parameters (reads the default SLO and the deadline variant)."""
        return cls(config.default_ttft_ms, config.default_tpot_ms, config.tpot_from_first_token,
                   config.decode_guard_ms)

    def form_batch(self, state: SchedState) -> Batch:
        """Propose the batch of docs/design.md section 3 (see the class docstring).

        Raises:
            ValueError: if ``state.time_model`` is None (the budget needs it).
        """
        tm = state.time_model
        if tm is None:
            raise ValueError("FairBatching needs state.time_model to predict batch times")
        a = tm.a_ms
        b = tm.b_ms_per_new_token
        c = tm.c_ms_per_context_token
        e = tm.e_ms_per_chunk_prefix
        f = tm.f_ms_per_chunk_sq  # a prefill chunk of n tokens adds f * n^2 (TimeModel.f_ms_per_chunk_sq)
        b_dec = b + tm.d_ms_per_decode  # a decode's own token (TimeModel.d_ms_per_decode)
        now = state.now_ms
        d_ttft = self.default_ttft_ms
        d_tpot = self.default_tpot_ms
        anchored = self.tpot_from_first_token
        guard = self.decode_guard_ms

        # 1. slack of every request; split decodes from prefills.
        def slack_of(r: SchedRequest, out: int) -> tuple[float, float]:
            """(slack of the next token in ms, tpot in ms): FairBatching's (arXiv 2510.14392) envelope, optionally also
            bounded by first_token + tpot * out (see the class docstring)."""
            tpot = d_tpot if r.tpot_ms is None else r.tpot_ms
            ttft = d_ttft if r.ttft_ms is None else r.ttft_ms
            slack = r.arrival_ms + ttft + tpot * out - now
            first = r.first_token_ms
            if anchored and first is not None:
                slack = min(slack, first + tpot * out - now)
            if out > 0:
                slack -= guard
            return slack, tpot

        decodes: list[tuple[float, SchedRequest]] = []
        prefills: list[tuple[float, SchedRequest, int, bool]] = []
        min_slack = math.inf
        min_tpot = math.inf
        for r in state.running:
            out = r.tokens_out
            rem = r.prompt_tokens + out - r.computed_tokens
            if rem <= 0:
                continue
            slack, tpot = slack_of(r, out)
            if rem == 1 and out > 0:
                decodes.append((slack, r))
                if slack < min_slack:
                    min_slack = slack
                if tpot < min_tpot:
                    min_tpot = tpot
            else:
                prefills.append((slack, r, rem, True))
        for r in state.waiting:
            out = r.tokens_out
            rem = r.prompt_tokens + out - r.computed_tokens
            if rem > 0:
                prefills.append((slack_of(r, out)[0], r, rem, False))

        # 2.-3. budget, urgent split, order.
        prefills.sort(key=_SLACK)
        if decodes:
            budget = min_slack if min_slack > min_tpot else min_tpot
            threshold = budget + min_tpot
            urgent = [d for d in decodes if d[0] < threshold]
            non_urgent = [d for d in decodes if d[0] >= threshold]
            urgent.sort(key=_SLACK)
            non_urgent.sort(key=_SLACK)
            if self.raise_budget_for_prefills and prefills:
                # conservative inputs: see prefill_deadline_budget
                head_slack, head, head_rem, _ = prefills[0]
                decode_ms = sum(b_dec + c * r.computed_tokens for _, r in decodes)
                budget = prefill_deadline_budget(
                    budget, a + decode_ms + c * (head.computed_tokens + head_rem), tm.prompt_ms_per_token, head_rem,
                    head_slack - budget, state.max_num_batched_tokens,
                )
        else:
            budget = math.inf
            urgent = non_urgent = []

        # 4. add while time, KV, token cap and sequence cap allow.
        batch = Batch()
        items = batch.items
        t = a  # predicted batch time so far (ms)
        tokens_left = state.max_num_batched_tokens
        seqs_left = state.max_num_seqs - len(state.running)
        kv_left = state.kv_free_blocks
        bs = state.block_size
        for group in (urgent, None, non_urgent):
            if group is None:
                for _, r, rem, running in prefills:
                    if tokens_left <= 0:
                        break
                    if not running and seqs_left <= 0:
                        continue
                    comp = r.computed_tokens
                    room = budget - t - c * comp  # ms left for this item's new tokens
                    per = b + e * comp  # ms per new token of this chunk, before its chunk^2 term
                    if room < per + f:
                        continue
                    held = -(-comp // bs)
                    if not running and -(-(comp + rem) // bs) - held > kv_left:
                        continue
                    n = rem if rem < tokens_left else tokens_left
                    if room != math.inf:
                        if f > 0.0:  # per*n + f*n^2 <= room (the stable root; class docstring, step 4)
                            n_time = int(2.0 * room / (per + math.sqrt(per * per + 4.0 * f * room)) + 1e-9)
                        else:
                            n_time = int(room / per + 1e-9)  # as TimeModel.tokens_within_ms
                        if n_time < n:
                            n = n_time
                    n_kv = (held + kv_left) * bs - comp
                    if n_kv < n:
                        n = n_kv
                    if n < 1:
                        continue
                    items.append((r.request_id, n))
                    t += (per + f * n) * n + c * comp  # chunk n over prefix comp: e * n * comp + f * n^2
                    tokens_left -= n
                    kv_left -= -(-(comp + n) // bs) - held
                    if not running:
                        seqs_left -= 1
                continue
            for _, r in group:
                if tokens_left <= 0:
                    break
                comp = r.computed_tokens
                dt = b_dec + c * comp
                if t + dt > budget:
                    continue
                if comp % bs == 0:  # the new token opens a block
                    if kv_left <= 0:
                        continue
                    kv_left -= 1
                items.append((r.request_id, 1))
                t += dt
                tokens_left -= 1
        if items:
            batch.num_new_tokens = state.max_num_batched_tokens - tokens_left
            return batch

        # 5. never empty while work exists.
        pick = _most_urgent(urgent, prefills, non_urgent, state)
        if pick is not None:
            batch.add(*pick)
        return batch


def prefill_deadline_budget(
    budget_ms: float, fixed_ms: float, b_ms: float, remaining_tokens: int, slack_ms: float, token_cap: int
) -> float:
    """Step-time budget (ms) raised so that the most urgent prefill can still meet its first-token deadline.

    Our extension of FairBatching's budget (FairBatching / docs/design.md section 3 look only at decode slack;
    measured on Mooncake at TPOT 50 ms, long prompts then miss TTFT at low load, docs/bench). With
    steps of T ms, each step gives the prefill (T - F) / b tokens, F = ``fixed_ms`` (the step's fixed
    cost a, the running decodes and the prefill's own context), so R remaining tokens take about
    R * b * T / (T - F) ms. When that exceeds the prefill's slack s at T = ``budget_ms`` but some step
    no longer than a full token cap (F + b * cap) meets it, the budget becomes the smallest such T:
    T' = F * s / (s - R * b). Otherwise (it makes it anyway, or it cannot make it at all) the budget
    is unchanged, and the decodes keep their protection. :class:`PrefillDeadlineFairBatchingPolicy`
    passes conservative inputs: F with the prefill's context at its last chunk (computed +
    remaining tokens), and s less one step at the seed's budget (the step in flight when it
    arrived, the last partial chunk); with the exact ones, Mooncake's 20-27k-token prompts still
    missed a 2500 ms TTFT by 1-12 ms at 0.2 req/s, TPOT 50 ms.

    Args:
        budget_ms: FairBatching's budget max(min slack, min TPOT) (ms).
        fixed_ms: F above (ms).
        b_ms: time model's ms per prompt token (``TimeModel.prompt_ms_per_token``: b, plus f times the
            learned chunk length when the model has a chunk^2 term).
        remaining_tokens: prompt tokens the prefill still has to compute (R).
        slack_ms: the prefill's slack to its first-token deadline (s, ms).
        token_cap: max_num_batched_tokens (tokens).

    Returns:
        The step-time budget (ms), >= ``budget_ms``.
    """
    need_ms = remaining_tokens * b_ms
    if slack_ms <= need_ms:  # cannot make it even with no per-step overhead
        return budget_ms
    if budget_ms > fixed_ms and need_ms * budget_ms / (budget_ms - fixed_ms) <= slack_ms:
        return budget_ms  # on time at the seed's budget
    raised = fixed_ms * slack_ms / (slack_ms - need_ms)
    if raised > fixed_ms + b_ms * token_cap:
        return budget_ms
    return max(budget_ms, raised)


@dataclass(slots=True)
class PrefillDeadlineFairBatchingPolicy(FairBatchingPolicy):
    """FairBatching whose step budget may grow for the most urgent waiting prefill
    (:func:`prefill_deadline_budget`); everything else as :class:`FairBatchingPolicy`. Our
    extension, not the seed's policy: opt in by name (``fairbatching-pd``)."""

    name: ClassVar[str] = "fairbatching-pd"
    raise_budget_for_prefills: ClassVar[bool] = True


def _most_urgent(
    urgent: list[tuple[float, SchedRequest]],
    prefills: list[tuple[float, SchedRequest, int, bool]],
    non_urgent: list[tuple[float, SchedRequest]],
    state: SchedState,
) -> tuple[str, int] | None:
    """FairBatching's fallback item (request_id, tokens): see step 5 of :class:`FairBatchingPolicy`."""
    cap = state.max_num_batched_tokens
    bs = state.block_size
    kv = state.kv_free_blocks
    seq_free = state.max_num_seqs > len(state.running)
    ordered: list[tuple[SchedRequest, int, bool]] = [(r, 1, True) for _, r in urgent]
    ordered.extend((r, min(rem, cap), running) for _, r, rem, running in prefills if running or seq_free)
    ordered.extend((r, 1, True) for _, r in non_urgent)
    if not ordered:
        return None
    for r, n, _ in ordered:
        comp = r.computed_tokens
        if -(-(comp + n) // bs) - (-(-comp // bs)) <= kv:
            return r.request_id, n
    for r, n, running in ordered:
        if running:
            return r.request_id, n
    r, n, _ = ordered[0]
    return r.request_id, n


POLICIES: dict[str, type[BatchingPolicy]] = {
    VllmDefaultPolicy.name: VllmDefaultPolicy,
    FairBatchingPolicy.name: FairBatchingPolicy,
    PrefillDeadlineFairBatchingPolicy.name: PrefillDeadlineFairBatchingPolicy,
    FcfsPolicy.name: FcfsPolicy,
    PrefillFirstPolicy.name: PrefillFirstPolicy,
}
"""Registry: policy name -> class (each has ``from_config(PolicyConfig)``)."""


def make_policy(name: str, config: PolicyConfig | None = None) -> BatchingPolicy:
    """Build the policy registered under ``name`` with ``config`` (default :class:`PolicyConfig`).

    Raises:
        KeyError: with the known names when ``name`` is not registered.
    """
    try:
        cls = POLICIES[name]
    except KeyError:
        raise KeyError(f"unknown batching policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
    return cls.from_config(config if config is not None else PolicyConfig())


PLUGIN_POLICIES = (FairBatchingPolicy.name, PrefillDeadlineFairBatchingPolicy.name)
"""Policies the vLLM scheduler plugin runs (``FAIRBATCH_POLICY``; replica_agent/vllm_plugin.py): the
deadline-driven ones (vLLM's own scheduler is the plugin switched off, ``FAIRBATCH_PLUGIN_DISABLE=1``)."""


def plugin_policy(name: str | None, default_ttft_ms: float, default_tpot_ms: float,
                  decode_guard_ms: float = 0.0) -> BatchingPolicy:
    """The plugin's policy: ``name`` (``FAIRBATCH_POLICY``; None or blank -> ``fairbatching``) with the
    plugin's default SLO and decode guard (``FAIRBATCH_DECODE_GUARD_MS``, :class:`PolicyConfig`).

    Raises:
        ValueError: ``name`` is not one of :data:`PLUGIN_POLICIES` (the message lists them), or the
            default SLO is not > 0.
    """
    chosen = (name or "").strip() or FairBatchingPolicy.name
    if chosen not in PLUGIN_POLICIES:
        raise ValueError(f"FAIRBATCH_POLICY={chosen!r} is not a plugin policy; known: {', '.join(PLUGIN_POLICIES)}")
    return make_policy(chosen, PolicyConfig(default_ttft_ms, default_tpot_ms, decode_guard_ms=decode_guard_ms))


def decode_guard_ms(value: str | None) -> float:
    """``FAIRBATCH_DECODE_GUARD_MS`` of the plugin (ms, :class:`PolicyConfig`): 0 when unset or blank.

    Raises:
        ValueError: a value that is not a finite number >= 0 (the message names it).
    """
    v = (value or "").strip()
    if not v:
        return 0.0
    try:
        g = float(v)
    except ValueError:
        g = math.nan
    if not (g >= 0 and math.isfinite(g)):
        raise ValueError(f"FAIRBATCH_DECODE_GUARD_MS={value!r}: use a number of ms >= 0")
    return g


def plan_with_point_model(value: str | None) -> bool:
    """``FAIRBATCH_PLAN_MODEL`` of the plugin: True for ``point`` (steps sized with the online fit alone),
    False for ``conservative`` or unset/blank (the fit x its learned margin, the default).

    Raises:
        ValueError: any other value (the message names both).
    """
    v = (value or "").strip().lower() or "conservative"
    if v not in ("conservative", "point"):
        raise ValueError(f"FAIRBATCH_PLAN_MODEL={value!r}: use conservative or point")
    return v == "point"

