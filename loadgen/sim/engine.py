"""Continuous-batching core of the simulated engine (pure: no I/O, no clock reads).

Each :meth:`SimEngine.step` forms one iteration the way vLLM v1's scheduler does
(``vllm/v1/core/sched/scheduler.py``): the batching policy proposes (request, num_new_tokens)
pairs; the engine allocates KV slots for them in order and, when a *running* request cannot get
its slots, preempts by recompute the most recently arrived running request (its blocks freed,
``computed_tokens = 0``, back to the head of the waiting queue) until the allocation fits or the
request itself was the victim (then the pass goes on with the next running request). A *waiting* request that cannot get slots ends admission for the
step, and no waiting request is admitted in a step that preempted (both as in vLLM).

Step time: each step is described by its :class:`~replica_agent.policy.time_model.StepFeatures`
(per sequence i: ``chunk_i`` = tokens it computes now, ``prefix_i`` = its ``computed_tokens`` before
the step). With ``EngineConfig.engine_time`` set (loadgen/sim/engine_time.py, docs/engine-time-model.md)
``duration_ms`` is that model's step time, its seeded noise drawn per step (stream ``noise_stream`` of
the engine); without it (``--engine-time-model policy``) the step time is the policy's batch-time model
``config.time_model.step_ms(features)`` (replica_agent/policy/time_model.py: ``a + b * new_tokens + c * context_tokens``, plus
``e * sum chunk_i * prefix_i`` when e > 0), so the policy plans with the engine's own model (an oracle).

Outputs: the step that completes a request's prefill samples its first token; every later step
that includes it (a decode) samples one more; it finishes when ``tokens_out == max_tokens``.
Outputs are stamped at ``end_ms = now_ms + duration_ms``. The caller owns time: a real-time
server sleeps ``duration_ms`` and then delivers; a discrete-event simulation jumps to ``end_ms``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from loadgen.sim.kv_cache import KVCacheManager, blocks_for_tokens
from replica_agent.policy.batching import Batch, BatchingPolicy, SchedRequest, SchedState, VllmDefaultPolicy
from replica_agent.policy.time_model import StepFeatures, TimeModel

if TYPE_CHECKING:
    from loadgen.sim.engine_time import EngineTimeModel


class RequestStatus(Enum):
    """Where a request is in the engine."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(slots=True)
class EngineRequest(SchedRequest):
    """Engine state of one request: the scheduling view (``first_token_ms`` included) plus status and token times.

    Attributes:
        seq: admission order in this engine (tie-break for equal ``arrival_ms``).
        status: see :class:`RequestStatus`.
        last_token_ms: time of the latest output token (simulated ms), None before the first.
        num_preemptions: times this request was preempted.
        block_hashes: chained hashes of its prompt's full KV blocks (loadgen/sim/prefix_cache.py);
            empty = its prompt never hits the prefix cache.
        prefix_attached: the prefix cache was looked up since admission or the last preemption.
        cached_tokens: prompt tokens the latest lookup found cached (its prefill skips them).
    """

    seq: int = 0
    status: RequestStatus = RequestStatus.WAITING
    last_token_ms: float | None = None
    num_preemptions: int = 0
    block_hashes: Sequence[int] = ()
    prefix_attached: bool = False
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Static engine settings (vLLM's scheduler and cache config).

    Attributes:
        time_model: batch-time model (ms): the policy's default model, and the step time when
            ``engine_time`` is None.
        num_gpu_blocks: KV-cache blocks (blocks), > 0.
        block_size: tokens per KV block, > 0.
        max_num_batched_tokens: token cap of one iteration (tokens), > 0.
        max_num_seqs: cap on running requests, > 0.
        max_model_len: cap on prompt + output tokens of one request (tokens), > 0.
        engine_time: the engine's own step time (loadgen/sim/engine_time.py), None = ``time_model``.
        enable_prefix_caching: vLLM's automatic prefix caching (its default; loadgen/sim/kv_cache.py).
    """

    time_model: TimeModel
    num_gpu_blocks: int
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int = 32768
    engine_time: EngineTimeModel | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("num_gpu_blocks", "block_size", "max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass(slots=True)
class EngineCounters:
    """Monotonic counters since start (vLLM's Prometheus counters).

    Attributes:
        prompt_tokens: prompt tokens of requests whose prefill completed (counted once per request).
        generation_tokens: output tokens sampled.
        request_success: requests finished with reason "length".
        num_preemptions: preemptions by recompute.
        num_aborted: requests aborted by the caller.
        num_steps: non-empty iterations run.
    """

    prompt_tokens: int = 0
    generation_tokens: int = 0
    request_success: int = 0
    num_preemptions: int = 0
    num_aborted: int = 0
    num_steps: int = 0


@dataclass(slots=True)
class RequestOutput:
    """One output token of one request in a step.

    Attributes:
        request_id: the request.
        tokens_out: output tokens sampled so far, this one included.
        finished: True when this was the last token (tokens_out == max_tokens).
        ttft_ms: first-token time - arrival (ms), set on the first token only.
        itl_ms: gap since the previous token (ms), set from the second token on.
        e2e_ms: finish time - arrival (ms), set on the last token only.
    """

    request_id: str
    tokens_out: int
    finished: bool
    ttft_ms: float | None = None
    itl_ms: float | None = None
    e2e_ms: float | None = None


@dataclass(slots=True)
class StepResult:
    """What one iteration did.

    Attributes:
        start_ms: ``now_ms`` passed to :meth:`SimEngine.step` (simulated ms).
        duration_ms: the iteration's (measured) time (ms); 0 for an empty batch.
        batch: the executed batch (the policy's proposal less what KV could not hold).
        context_tokens: tokens in KV before the step, summed over the batch (tokens).
        outputs: one entry per request that sampled a token, in batch order.
        preempted: ids preempted during this step, in preemption order.
        features: the step's token counts (new, context, sum chunk*prefix, sum chunk^2, sequences),
            the inputs of every time model; None for an empty batch.
    """

    start_ms: float
    duration_ms: float
    batch: Batch
    context_tokens: int
    outputs: list[RequestOutput] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    features: StepFeatures | None = None

    @property
    def end_ms(self) -> float:
        """Time the outputs are available: start_ms + duration_ms (simulated ms)."""
        return self.start_ms + self.duration_ms


class SimEngine:
    """Continuous batching over a paged KV cache; see the module docstring for the algorithm.

    Args:
        config: engine settings.
        policy: batch-formation policy (default :class:`VllmDefaultPolicy`).
        noise_stream: stream of ``config.engine_time``'s noise (engines of one fleet use distinct streams).

    Attributes:
        policy_time_model: the time model the *policy* is given (default ``config.time_model``);
            a caller may swap in a mis-calibrated or learned one (policy/calibration.py) while step
            durations keep following ``config.time_model``.
    """

    def __init__(self, config: EngineConfig, policy: BatchingPolicy | None = None, noise_stream: int = 0) -> None:
        self.config = config
        self._engine_time = config.engine_time.sampler(noise_stream) if config.engine_time is not None else None
        self.policy: BatchingPolicy = policy if policy is not None else VllmDefaultPolicy()
        self.policy_time_model: TimeModel = config.time_model
        self.kv = KVCacheManager(config.num_gpu_blocks, config.block_size, config.enable_prefix_caching)
        self.counters = EngineCounters()
        self.requests: dict[str, EngineRequest] = {}
        self.running: list[EngineRequest] = []
        self.waiting: deque[EngineRequest] = deque()
        self._seq = 0

    # ---- state -------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        """Requests holding KV blocks (scheduled at least once since admission or preemption)."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission (new or preempted)."""
        return len(self.waiting)

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use, 0..1."""
        return self.kv.usage

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache since start (``vllm:prefix_cache_queries``)."""
        return self.kv.queries_tokens

    @property
    def prefix_cache_hits(self) -> int:
        """Of those, tokens found cached (``vllm:prefix_cache_hits``)."""
        return self.kv.hits_tokens

    def has_work(self) -> bool:
        """True while any request is running or waiting."""
        return bool(self.running) or bool(self.waiting)

    def max_request_tokens(self) -> int:
        """Longest prompt + max_tokens one request may have: min(max_model_len, KV slots + 1)."""
        # The last output token is sampled but never written to KV, hence the + 1.
        return min(self.config.max_model_len, self.kv.capacity_tokens + 1)

    # ---- requests ----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        arrival_ms: float,
        ttft_ms: float | None = None,
        tpot_ms: float | None = None,
        block_hashes: Sequence[int] = (),
    ) -> EngineRequest:
        """Queue a new request at the tail of the waiting queue and look its prompt up in the prefix cache.

        The cached prefix (at most ``prompt_tokens - 1`` tokens, whole blocks) counts as computed:
        the request holds those blocks from now on and its prefill computes only the rest (vLLM
        looks up when it first schedules the request; here at once, so that the agent's view of
        pending prefill work is the uncached part). A preempted request looks up again before its
        next step.

        Args:
            request_id: engine-unique id.
            prompt_tokens: prompt length (tokens, >= 1).
            max_tokens: output length (tokens, >= 1); the request finishes after exactly this many.
            arrival_ms: arrival time (simulated ms).
            ttft_ms, tpot_ms: SLO targets for deadline-aware policies (ms), optional.
            block_hashes: chained hashes of the prompt's full blocks (loadgen/sim/prefix_cache.py);
                empty = no prefix-cache lookup.

        Raises:
            ValueError: on a duplicate id, prompt_tokens < 1, max_tokens < 1, or
                prompt_tokens + max_tokens above :meth:`max_request_tokens` (it could never run).
        """
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        if prompt_tokens < 1:
            raise ValueError(f"prompt must have at least 1 token, got {prompt_tokens}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if prompt_tokens + max_tokens > self.config.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.config.max_model_len} tokens; the request "
                f"needs {prompt_tokens + max_tokens} ({prompt_tokens} in the prompt, {max_tokens} in the completion)"
            )
        if blocks_for_tokens(prompt_tokens + max_tokens - 1, self.config.block_size) > self.config.num_gpu_blocks:
            raise ValueError(
                f"the request needs {prompt_tokens + max_tokens - 1} KV tokens, more than the KV cache holds "
                f"({self.kv.capacity_tokens} tokens)"
            )
        self._seq += 1
        req = EngineRequest(
            request_id=request_id,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            arrival_ms=arrival_ms,
            ttft_ms=ttft_ms,
            tpot_ms=tpot_ms,
            seq=self._seq,
            block_hashes=block_hashes,
        )
        self.requests[request_id] = req
        self.waiting.append(req)
        self._attach_prefix(req)
        return req

    def _attach_prefix(self, req: EngineRequest) -> None:
        """Look ``req``'s prompt up in the prefix cache (once per admission or preemption)."""
        req.prefix_attached = True
        if not req.block_hashes or not self.config.enable_prefix_caching:
            req.cached_tokens = 0
            return
        req.cached_tokens = self.kv.attach_prefix(req.request_id, req.block_hashes, req.prompt_tokens)
        req.computed_tokens = req.cached_tokens

    def abort(self, request_id: str) -> bool:
        """Stop a request: free its KV blocks and drop it from the queues.

        Returns:
            True when the request was in the engine (running or waiting), False otherwise.
        """
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.kv.free(request_id)  # a waiting request may hold its cached prefix
        req.status = RequestStatus.ABORTED
        self.counters.num_aborted += 1
        return True

    # ---- the iteration -----------------------------------------------------------------------

    def _preempt_newest(self) -> EngineRequest:
        """Preempt by recompute the most recently arrived running request; return it."""
        victim = max(self.running, key=lambda r: (r.arrival_ms, r.seq))
        self.running.remove(victim)
        self.kv.free(victim.request_id)
        victim.computed_tokens = 0
        victim.prefix_attached = False
        victim.status = RequestStatus.WAITING
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)
        self.counters.num_preemptions += 1
        return victim

    def step(self, now_ms: float) -> StepResult:
        """Run one iteration starting at ``now_ms`` (simulated ms); see the module docstring.

        Raises:
            ValueError: if the policy proposes an unknown request or a token count outside
                1..remaining_tokens.
        """
        cfg = self.config
        for req in self.waiting:
            if not req.prefix_attached:  # preempted since its lookup
                self._attach_prefix(req)
        proposal = self.policy.form_batch(
            SchedState(
                now_ms=now_ms,
                running=self.running,
                waiting=self.waiting,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                max_num_seqs=cfg.max_num_seqs,
                kv_free_blocks=self.kv.free_blocks,
                block_size=cfg.block_size,
                time_model=self.policy_time_model,
            )
        )
        if proposal.num_new_tokens > cfg.max_num_batched_tokens:
            raise ValueError(
                f"policy proposed {proposal.num_new_tokens} tokens, over max_num_batched_tokens "
                f"{cfg.max_num_batched_tokens}"
            )

        accepted: list[tuple[EngineRequest, int]] = []
        preempted: list[str] = []
        admission_closed = False
        for request_id, n in proposal.items:
            req = self.requests.get(request_id)
            if req is None:
                raise ValueError(f"policy proposed unknown request {request_id!r}")
            if not 1 <= n <= req.remaining_tokens:
                raise ValueError(
                    f"policy proposed {n} tokens for {request_id!r}, which has {req.remaining_tokens} to compute"
                )
            if req.status is RequestStatus.RUNNING:
                while not self.kv.allocate_slots(request_id, n):
                    victim = self._preempt_newest()
                    preempted.append(victim.request_id)
                    if victim is req:
                        break
                    for i, (acc, _) in enumerate(accepted):
                        if acc is victim:
                            del accepted[i]
                            break
                if req.status is RequestStatus.RUNNING:
                    accepted.append((req, n))
                # else it preempted itself; unlike vLLM (which stops the running pass here) the
                # remaining running requests still get their turn, so a step is never empty
                # while a running request could go on.
            else:
                # Waiting (new or preempted earlier). A request preempted in this step is waiting
                # again and, like every waiting request, is not admitted in a step that preempted.
                if admission_closed or preempted or len(self.running) >= cfg.max_num_seqs:
                    admission_closed = True
                    continue
                if not self.kv.allocate_slots(request_id, n):
                    admission_closed = True
                    continue
                if self.waiting[0] is req:
                    self.waiting.popleft()
                else:
                    self.waiting.remove(req)
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                accepted.append((req, n))

        batch = Batch()
        for req, n in accepted:
            batch.add(req.request_id, n)
        if not accepted:
            return StepResult(now_ms, 0.0, batch, 0, preempted=preempted)

        features = StepFeatures.from_items([(n, req.computed_tokens) for req, n in accepted])
        context_tokens = features.context_tokens
        if self._engine_time is not None:
            duration_ms = self._engine_time.step_ms(features, now_ms)
        else:
            duration_ms = cfg.time_model.step_ms(features)
        end_ms = now_ms + duration_ms
        counters = self.counters
        counters.num_steps += 1
        outputs: list[RequestOutput] = []
        any_finished = False
        for req, n in accepted:
            req.computed_tokens += n
            if req.computed_tokens < req.prompt_tokens + req.tokens_out:
                continue  # chunked prefill (or recompute) not complete yet
            req.tokens_out += 1
            counters.generation_tokens += 1
            out = RequestOutput(req.request_id, req.tokens_out, req.tokens_out >= req.max_tokens)
            if req.first_token_ms is None:
                req.first_token_ms = end_ms
                counters.prompt_tokens += req.prompt_tokens
                out.ttft_ms = end_ms - req.arrival_ms
            else:
                out.itl_ms = end_ms - req.last_token_ms  # type: ignore[operator]
            req.last_token_ms = end_ms
            if out.finished:
                out.e2e_ms = end_ms - req.arrival_ms
                req.status = RequestStatus.FINISHED
                self.kv.free(req.request_id)
                del self.requests[req.request_id]
                counters.request_success += 1
                any_finished = True
            outputs.append(out)
        if any_finished:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        return StepResult(now_ms, duration_ms, batch, context_tokens, outputs, preempted, features)
