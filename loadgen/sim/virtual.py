"""Virtual-clock mode of the simulated engine: discrete-event replay, no sleeping, no sockets.

One :class:`~loadgen.sim.engine.SimEngine` and a list of arrivals. Events are arrivals and step
ends; time jumps from one to the next:

1. Queue every request with ``arrival_ms <= t`` (``add_request`` with its SLO).
2. Idle engine: jump ``t`` to the next arrival. Otherwise run ``step(t)``; its tokens are
   stamped at ``t + duration_ms`` and ``t`` moves there (a request arriving during a step waits
   for the next one, as with the real-time server, whose loop forms a step only when the last
   one ended).

The result is every request's token times (simulated ms, same origin as the arrivals), so TTFT,
TPOT and SLO attainment follow exactly (docs/design.md section 2). Requests the engine refuses
(``add_request`` raises: longer than max_model_len or the KV cache) are recorded with
``rejected`` set and no tokens. Optional: a per-step log (step_log.py) and an online time model
(replica_agent/policy/calibration.py) that learns from every step and gives the policy its
conservative model for the next one, as the agent and the vLLM plugin do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TextIO

from loadgen.sim.engine import SimEngine
from loadgen.sim.step_log import write_step
from replica_agent.policy.calibration import OnlineTimeModel
from replica_agent.policy.time_model import TimeModel


@dataclass(frozen=True, slots=True)
class VirtualRequest:
    """One arrival of a virtual replay.

    Attributes:
        request_id: unique id.
        arrival_ms: arrival time (simulated ms).
        prompt_tokens: prompt length (tokens, >= 1).
        output_tokens: output length (tokens, >= 1).
        ttft_ms, tpot_ms: SLO given to the engine (ms); None -> the policy's default.
        block_hashes: the prompt's full-block hashes for the engine's prefix cache
            (loadgen/sim/prefix_cache.py); empty = the prompt shares nothing.
    """

    request_id: str
    arrival_ms: float
    prompt_tokens: int
    output_tokens: int
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    block_hashes: tuple[int, ...] = ()


@dataclass(slots=True)
class VirtualRecord:
    """What happened to one request.

    Attributes:
        request: the arrival.
        token_times_ms: time of each output token (simulated ms).
        rejected: the engine's refusal message, None when it was accepted.
    """

    request: VirtualRequest
    token_times_ms: list[float] = field(default_factory=list)
    rejected: str | None = None

    @property
    def ttft_ms(self) -> float | None:
        """First-token time - arrival (ms), None without tokens."""
        return self.token_times_ms[0] - self.request.arrival_ms if self.token_times_ms else None

    @property
    def tpot_ms(self) -> float | None:
        """(last - first token time) / (tokens - 1) (ms, docs/design.md section 2), None below 2 tokens."""
        n = len(self.token_times_ms)
        return (self.token_times_ms[-1] - self.token_times_ms[0]) / (n - 1) if n >= 2 else None


@dataclass(slots=True)
class VirtualRun:
    """Result of :func:`run_virtual`.

    Attributes:
        records: one per request, in input order.
        end_ms: time the last step ended (simulated ms).
        steps: non-empty steps run.
        preemptions: preemptions by recompute.
        calibrator: the online time model, when one was used.
    """

    records: list[VirtualRecord]
    end_ms: float
    steps: int
    preemptions: int
    calibrator: OnlineTimeModel | None = None


class LivelockError(RuntimeError):
    """The engine keeps stepping but emits no token (see :func:`run_virtual`)."""


def run_virtual(
    requests: Sequence[VirtualRequest],
    engine: SimEngine,
    step_log: TextIO | None = None,
    calibrator: OnlineTimeModel | None = None,
    policy_time_model: TimeModel | None = None,
    max_steps_without_token: int = 100_000,
) -> VirtualRun:
    """Replay ``requests`` through ``engine`` on a virtual clock (see the module docstring).

    Args:
        requests: arrivals (any order; replayed by arrival time, ties in input order).
        engine: a fresh engine (its policy decides the batches).
        step_log: where to write one JSON line per step (step_log.py), optional.
        calibrator: fed every step's features and duration; the policy is then given
            ``calibrator.conservative()`` (its prior should be ``policy_time_model``).
        policy_time_model: the model the policy believes (default: the engine's own).
        max_steps_without_token: steps in a row without any token (first or decode) after which the
            run is declared a livelock. A prefill finishing emits its first token, so a healthy run
            stays far below (a 32k prompt in 2k chunks is 16 steps); a policy that starves decodes
            while KV is full (prefill-first on Mooncake's 12k prompts: decodes never run, hold the
            KV, prefills are preempted and recomputed forever) reaches it.

    Raises:
        RuntimeError: if the engine makes no progress while work exists and nothing will arrive.
        LivelockError: (a RuntimeError) after ``max_steps_without_token`` token-less steps in a row.
        ValueError: if ``max_steps_without_token`` < 1.
    """
    if max_steps_without_token < 1:
        raise ValueError(f"max_steps_without_token must be >= 1, got {max_steps_without_token}")
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_ms)
    dry_steps = 0  # consecutive steps that emitted no token
    records = [VirtualRecord(r) for r in requests]
    by_id: dict[str, VirtualRecord] = {}
    base_model = policy_time_model if policy_time_model is not None else engine.config.time_model
    engine.policy_time_model = base_model
    n = len(order)
    i = 0
    t = 0.0
    steps = 0
    while i < n or engine.has_work():
        while i < n and requests[order[i]].arrival_ms <= t:
            rec = records[order[i]]
            req = rec.request
            try:
                engine.add_request(req.request_id, req.prompt_tokens, req.output_tokens, req.arrival_ms,
                                   req.ttft_ms, req.tpot_ms, req.block_hashes)  # fmt: skip
                by_id[req.request_id] = rec
            except ValueError as e:
                rec.rejected = str(e)
            i += 1
        if not engine.has_work():
            if i < n:
                t = max(t, requests[order[i]].arrival_ms)
            continue
        result = engine.step(t)
        if result.duration_ms <= 0:
            if result.preempted:
                continue  # the step only freed KV (preempted its own request); form the next one now
            if i >= n:
                raise RuntimeError(f"engine made no progress at t={t} ms with {engine.num_running} running, "
                                   f"{engine.num_waiting} waiting and no arrival left")  # fmt: skip
            t = max(t, requests[order[i]].arrival_ms)
            continue
        steps += 1
        end = result.end_ms
        dry_steps = 0 if result.outputs else dry_steps + 1
        if dry_steps >= max_steps_without_token:
            raise LivelockError(
                f"livelock: {dry_steps} steps in a row emitted no token (policy {engine.policy.name}, t={end:.0f} ms, "
                f"{engine.num_running} running, {engine.num_waiting} waiting, "
                f"{engine.counters.num_preemptions} preemptions so far): the batches only redo preempted work"
            )
        for out in result.outputs:
            by_id[out.request_id].token_times_ms.append(end)
        if step_log is not None:
            write_step(step_log, result)
        if calibrator is not None and result.features is not None:
            calibrator.observe(result.features, result.duration_ms)
            engine.policy_time_model = calibrator.conservative()
        t = end
    return VirtualRun(records, t, steps, engine.counters.num_preemptions, calibrator)
