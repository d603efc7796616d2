"""FairBatching inside real vLLM: a ``--scheduler-cls`` plugin for vLLM 0.32.0 (V1 engine).

Run::

    PYTHONPATH=/path/to/fairbatch vllm serve MODEL \\
        --scheduler-cls replica_agent.vllm_plugin.FairBatchingScheduler ...

:class:`FairBatchingScheduler` subclasses vLLM's own ``vllm.v1.core.sched.scheduler.Scheduler`` and
keeps all of its machinery (KV allocation, prefix caching, preemption, output building). Each
``schedule()`` call it:

1. builds one :class:`~replica_agent.policy.batching.SchedRequest` per request in ``self.running``
   and ``self.waiting`` (prompt tokens, ``num_computed_tokens``, output tokens so far, arrival time,
   per-request SLO, first-token time) and a :class:`~replica_agent.policy.batching.SchedState`
   (free KV blocks of the block pool, token cap, sequence cap, the time model);
2. asks :class:`~replica_agent.policy.batching.FairBatchingPolicy` for the batch;
3. makes the stock ``Scheduler.schedule()`` form that batch by, for the duration of the call only,
   (a) lowering ``self.max_num_scheduled_tokens`` to the batch's token count, (b) putting the
   batch's running requests first in ``self.running`` (policy order, the partial chunk last),
   followed by the other running requests when the batch has no waiting request (the budget runs
   out before vLLM reaches them; they stay its preemption victims), else hiding those for the call,
   and (c) leaving only the batch's waiting requests in ``self.waiting`` (policy order, the partial
   chunk last). Everything is put back afterwards (running order = vLLM's, admitted requests
   appended; waiting queue = vLLM's order, requests vLLM preempted in this call in front, as vLLM
   does).

Exact vs approximate (see docs/vllm.md, "FairBatching scheduler plugin"):

- exact: the set of requests and the tokens each one gets, whenever at most one batch item is a
  partial chunk and that item can be processed last by vLLM (it is waiting, or it is running and no
  waiting request is in the batch, or every other item is no larger than its chunk: then the chunk
  is enforced with ``long_prefill_token_threshold`` for that call), and vLLM's KV allocation
  succeeds for every item (the policy counts the blocks each item opens against the free blocks
  and only admits waiting prompts that fit whole). The batch never gets more tokens than proposed
  (the budget is the policy's total, and only the policy's waiting requests are in the queue).
- approximate: (i) prefix caching: the policy's view of a waiting request counts the prefix-cache
  hit vLLM will find at admission (the same lookup, ``get_computed_blocks``, made before forming
  the batch) only when every hit block is held by a live request; a hit on free (evictable) cached
  blocks is not counted (those blocks leave the free pool when reused, which the policy's KV count
  cannot see), so vLLM then computes fewer tokens for that prompt than proposed (seen: a preempted
  request resuming from its own cached blocks); (ii) when vLLM cannot allocate KV for a running
  item (the policy proposes one running item even with no free block, relying on preemption as
  vLLM does), it preempts the last request of ``self.running``: the latest-scheduled running
  request outside the batch, as stock vLLM would; but in a batch with waiting requests, whose
  non-batch running requests are hidden, the victim is the batch's last running item; either way no
  waiting request is admitted that step; (iii) a batch item that vLLM gives 0 tokens (max_model_len
  reached, encoder budget) leaves its tokens unused or to the partial chunk processed after it;
  (iv) two partial chunks, or a running partial chunk with larger waiting items after it: the chunk
  may get more tokens and the last waiting item fewer. Every step's export says whether the
  executed batch equalled the proposal (``"exact"``).
- not applied (stock ``schedule()`` for that step, ``"mode": "stock"``): scheduling policy
  ``priority``, KV connectors, speculative decoding, a paused scheduler, requests waiting while
  holding KV (``kv_holding_waiting``), idle steps, and any exception in the policy path (logged
  once).

Configuration (environment of ``vllm serve``, inherited by the EngineCore process):

- ``FAIRBATCH_COEFFICIENTS="a,b,c"`` (ms, ms/new token, ms/context token) or ``FAIRBATCH_PROFILE``
  (a name from replica_agent/data/fitted_coefficients.csv); default: profile ``llama-3-8b-a100``.
  These are the prior of the plugin's online time model (replica_agent/policy/calibration.py): every
  executed step's measured time (end of ``schedule()`` to the start of ``update_from_output()``)
  teaches it, and the policy's time budget uses its conservative model (fit x learned margin);
  ``FAIRBATCH_ONLINE_TIME_MODEL=0`` keeps the prior fixed;
- ``FAIRBATCH_POLICY``: ``fairbatching`` (default) or ``fairbatching-pd`` (its step budget may grow so
  the most urgent waiting prefill meets its first-token deadline; replica_agent/policy/batching.py);
  any other value stops the engine at start with the list;
- ``FAIRBATCH_DECODE_GUARD_MS``: plan each decode's deadline this many ms early (default 0), for the
  delivery path between the engine and the client (replica_agent/policy/batching.py
  ``FairBatchingPolicy``); a value that is not a number >= 0 stops the engine at start;
- ``FAIRBATCH_PLAN_MODEL``: ``conservative`` (default: steps sized with the online fit x its learned
  margin) or ``point`` (the fit alone; the margin then only reaches the agent's PAB through the export);
- ``FAIRBATCH_TTFT_MS`` / ``FAIRBATCH_TPOT_MS``: SLO of requests that carry none (default 1000 / 100);
  a request carries its own in ``vllm_xargs`` (``{"fairbatch_ttft_ms": X, "fairbatch_tpot_ms": Y}``
  in the OpenAI request body; vLLM 0.32.0 copies ``vllm_xargs`` into
  ``SamplingParams.extra_args``, which reaches ``Request.sampling_params``; HTTP headers do not reach
  the scheduler);
- ``FAIRBATCH_PLUGIN_EXPORT``: per-step state export ("plugin mode"): ``unix:PATH`` sends one JSON
  datagram per step to the UNIX datagram socket PATH (non-blocking; dropped when the reader is slow
  or absent), any other value appends one JSON line per step to that file; two record kinds, the
  state at each ``schedule()`` and the measured time of each executed step (format:
  replica_agent/plugin_export.py; reader: ``fairbatch-agent serve --plugin-export unix:PATH``);
- ``FAIRBATCH_STEP_LOG``: per-step log for ``fairbatch-agent calibrate`` (JSON lines
  ``start_ms, new_tokens, context_tokens, measured_ms, batch_size``, as loadgen/sim/step_log.py);
  ``measured_ms`` = from the end of ``schedule()`` to the start of ``update_from_output()``
  (model execution and sampling of that step, synchronous scheduling);
- ``FAIRBATCH_REQUEST_LOG``: one JSON line per request that finished in a step (a length or stop
  finish; an abort from outside the step, such as a client's disconnect, is not logged),
  ``rid, first_mono_ms, last_mono_ms, tokens``: the engine's time of its first and last output token
  (the start of ``update_from_output()`` of the step that made it, on the monotonic clock that every process of the machine shares, so a
  client on the same machine can set its own token times beside them: ``make bench-vllm``'s delivery
  delay, loadgen/vllm_bench.py); written in the stock schedule too;
- ``FAIRBATCH_PLUGIN_DISABLE=1``: run the stock scheduler (export and step log still written);
- ``FAIRBATCH_PLUGIN_FORCE=1``: apply the policy on a vLLM version other than 0.32.0.

Version pin: written against vLLM 0.32.0 (``vllm.__version__`` "0.32.0", "0.32.0+cpu"). On any other
version the class still loads but **refuses to apply the policy**: it logs a warning and runs the
stock scheduler (serving keeps working) unless ``FAIRBATCH_PLUGIN_FORCE=1``.

Imports are kept to what the vLLM venv has: vLLM itself, the standard library and
``replica_agent.policy`` / ``replica_agent.policy.profiles`` (numpy only; no pydantic, aiohttp or yaml).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import vllm
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from replica_agent.plugin_export import (
    PluginExporter,
    positive_float,
    request_slo,
    state_record,
    step_record,
    time_model_from_env,
)
from replica_agent.policy.batching import (
    Batch, SchedRequest, SchedState, decode_guard_ms, plan_with_point_model, plugin_policy,
)
from replica_agent.policy.calibration import OnlineTimeModel
from replica_agent.policy.time_model import StepFeatures, TimeModel

logger = logging.getLogger("vllm.fairbatch")

PINNED_VLLM_VERSION = "0.32.0"
_SLO_ATTR = "_fairbatch_slo"  # (ttft_ms, tpot_ms) cached on the vLLM Request
_FIRST_ATTR = "_fairbatch_first_token_ms"  # wall-clock ms of the first output token
_FIRST_MONO_ATTR = "_fairbatch_first_token_mono_ms"  # FAIRBATCH_REQUEST_LOG: monotonic ms of the first token
_LAST_MONO_ATTR = "_fairbatch_last_token_mono_ms"  # ... and of the latest one


def vllm_version_supported(version: str | None = None) -> bool:
    """True when ``version`` (default ``vllm.__version__``) is the pinned 0.32.0 (any local suffix)."""
    v = vllm.__version__ if version is None else version
    return v.split("+", 1)[0] == PINNED_VLLM_VERSION


class FairBatchingScheduler(Scheduler):
    """vLLM 0.32.0 ``Scheduler`` whose batches are formed by :class:`FairBatchingPolicy` (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        env = os.environ
        self.fb_version_ok = vllm_version_supported()
        force = env.get("FAIRBATCH_PLUGIN_FORCE") == "1"
        disabled = env.get("FAIRBATCH_PLUGIN_DISABLE") == "1"
        if not self.fb_version_ok:
            logger.warning(
                "FairBatching plugin targets vLLM %s, this is %s: %s", PINNED_VLLM_VERSION, vllm.__version__,
                "applying the policy anyway (FAIRBATCH_PLUGIN_FORCE=1)" if force
                else "refusing to apply the policy, running the stock scheduler (set FAIRBATCH_PLUGIN_FORCE=1)",
            )
        self.fb_enabled = (self.fb_version_ok or force) and not disabled
        self.fb_time_model, tm_source = time_model_from_env()
        self.fb_calibrator = (OnlineTimeModel(self.fb_time_model)
                              if env.get("FAIRBATCH_ONLINE_TIME_MODEL", "1") != "0" else None)  # fmt: skip
        self.fb_default_ttft_ms = positive_float(env.get("FAIRBATCH_TTFT_MS")) or 1000.0
        self.fb_default_tpot_ms = positive_float(env.get("FAIRBATCH_TPOT_MS")) or 100.0
        self.fb_policy = plugin_policy(env.get("FAIRBATCH_POLICY"), self.fb_default_ttft_ms, self.fb_default_tpot_ms,
                                       decode_guard_ms(env.get("FAIRBATCH_DECODE_GUARD_MS")))
        self.fb_plan_point = plan_with_point_model(env.get("FAIRBATCH_PLAN_MODEL"))
        self.fb_block_size = int(self.cache_config.block_size)
        self.fb_prefix_lookup = bool(self.cache_config.enable_prefix_caching)
        export = env.get("FAIRBATCH_PLUGIN_EXPORT")
        self.fb_export = PluginExporter(export) if export else None
        step_log = env.get("FAIRBATCH_STEP_LOG")
        self.fb_step_log = open(step_log, "a", buffering=1, encoding="utf-8") if step_log else None  # noqa: SIM115
        request_log = env.get("FAIRBATCH_REQUEST_LOG")
        self.fb_request_log = open(request_log, "a", buffering=1, encoding="utf-8") if request_log else None  # noqa: SIM115
        self.fb_step = 0
        self.fb_steps_policy = 0
        self.fb_steps_exact = 0
        self.fb_steps_stock = 0
        self.fb_error_logged = False
        self.fb_pending: tuple[float, StepFeatures] | None = None  # (end of schedule s, what the step computes)
        logger.info(
            "FairBatching scheduler plugin (vLLM %s): policy %s, time model %s, default SLO ttft %.0f ms / "
            "tpot %.0f ms, export %s, step log %s, block size %d",
            vllm.__version__, "on" if self.fb_enabled else "OFF (stock)", tm_source, self.fb_default_ttft_ms,
            self.fb_default_tpot_ms, export or "-", step_log or "-", self.fb_block_size,
        )

    # ---- the policy view ------------------------------------------------------------------------

    def _fb_sched_request(self, req: Any, waiting: bool = False) -> SchedRequest:
        slo = getattr(req, _SLO_ATTR, None)
        if slo is None:
            slo = request_slo(req)
            setattr(req, _SLO_ATTR, slo)
        computed = req.num_computed_tokens
        if waiting and computed == 0 and self.fb_prefix_lookup:
            # the prefix-cache hit vLLM will find at admission (a lookup, no allocation): the
            # policy then sizes the prompt's chunk and predicts its time as vLLM will run it. Only
            # when every hit block is held by a live request: a free (evictable) cached block
            # leaves the free pool when reused, which the policy's KV count would miss.
            blocks, hit = self.kv_cache_manager.get_computed_blocks(req)[:2]
            if hit and all(b.ref_cnt > 0 for group in blocks.blocks for b in group):
                computed = hit
        return SchedRequest(
            request_id=req.request_id,
            prompt_tokens=req.num_prompt_tokens,
            computed_tokens=computed,
            tokens_out=req.num_output_tokens,
            max_tokens=max(1, req.max_tokens),
            arrival_ms=req.arrival_time * 1000.0,
            ttft_ms=slo[0],
            tpot_ms=slo[1],
            first_token_ms=getattr(req, _FIRST_ATTR, None),
        )

    def _fb_stock_reason(self) -> str | None:
        """Why this step must use the stock schedule (None: the policy applies)."""
        if not self.fb_enabled:
            return "disabled"
        if self.policy != SchedulingPolicy.FCFS:
            return "priority-policy"
        if self.connector is not None or self.num_spec_tokens > 0 or self.num_lookahead_tokens > 0:
            return "connector-or-spec"
        if self._pause_state.name != "UNPAUSED":
            return "paused"
        if len(self.kv_holding_waiting) > 0:
            return "kv-holding-waiting"
        return None

    def _fb_state(self, now_ms: float, running: list[Any], waiting: list[Any]) -> tuple[SchedState, dict[str, Any]]:
        by_id: dict[str, Any] = {}
        s_run = []
        for r in running:
            by_id[r.request_id] = r
            s_run.append(self._fb_sched_request(r))
        s_wait = []
        for r in waiting:
            if r.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                continue  # blocked (grammar, remote KV, streaming input): vLLM would skip it
            by_id[r.request_id] = r
            s_wait.append(self._fb_sched_request(r, waiting=True))
        state = SchedState(
            now_ms=now_ms,
            running=s_run,
            waiting=s_wait,
            max_num_batched_tokens=self.max_num_scheduled_tokens,
            max_num_seqs=min(self.max_num_running_reqs, self.max_num_active_reqs),
            kv_free_blocks=self.kv_cache_manager.block_pool.get_num_free_blocks(),
            block_size=self.fb_block_size,
            time_model=self._fb_plan_model(),
        )
        return state, by_id

    def _fb_plan_model(self) -> TimeModel:
        """The model the policy plans with: the online fit x its margin (``FAIRBATCH_PLAN_MODEL=point``: the
        fit alone), or the fixed prior."""
        if self.fb_calibrator is None:
            return self.fb_time_model
        return self.fb_calibrator.model() if self.fb_plan_point else self.fb_calibrator.conservative()

    # ---- schedule ---------------------------------------------------------------------------------

    def schedule(self, throttle_prefills: bool = False):  # type: ignore[override]
        now = time.time()
        self.fb_step += 1
        reason = self._fb_stock_reason()
        if reason is None and not self.running and not self.waiting:
            reason = "idle"  # only finished requests left to report: nothing to form
        state: SchedState | None = None
        batch: Batch | None = None
        running0 = list(self.running)
        waiting0 = list(self.waiting)
        if reason is None or self.fb_export is not None:
            try:
                state, by_id = self._fb_state(now * 1000.0, running0, waiting0)
                if reason is None:
                    batch = self.fb_policy.form_batch(state)
                    if not batch.items:
                        reason = "empty-proposal"
            except Exception:  # never take the engine down: stock schedule for this step
                reason = "policy-error"
                if not self.fb_error_logged:
                    logger.exception("FairBatching policy failed; stock schedule for this step")
                    self.fb_error_logged = True
        if reason is not None:
            out = super().schedule(throttle_prefills)
            self.fb_steps_stock += 1
            exact = None
        else:
            remaining = {q.request_id: q.remaining_tokens for group in (state.running, state.waiting) for q in group}
            out = self._fb_schedule_batch(throttle_prefills, batch, by_id, remaining, running0, waiting0)
            self.fb_steps_policy += 1
            exact = dict(batch.items) == dict(out.num_scheduled_tokens)
            self.fb_steps_exact += exact
        sched = out.num_scheduled_tokens
        new_tokens = out.total_num_scheduled_tokens
        items = []
        for rid, n in sched.items():
            r = self.requests.get(rid)
            if r is not None:  # computed before this step (vLLM already advanced it)
                items.append((n, max(0, r.num_computed_tokens - n)))
        features = StepFeatures.from_items(items)
        ctx = features.context_tokens
        self.fb_pending = (time.time(), features) if new_tokens > 0 else None
        if self.fb_export is not None:
            self._fb_export_step(now, reason, state, batch, sched, new_tokens, ctx, exact)
        return out

    def _fb_schedule_batch(self, throttle_prefills: bool, batch: Batch, by_id: dict[str, Any],
                           remaining: dict[str, int], running0: list[Any], waiting0: list[Any]):
        """Run the stock schedule() constrained to ``batch`` (see the module docstring), then restore."""
        sel = dict(batch.items)
        full: dict[str, bool] = {}  # request id -> gets all its remaining tokens
        for rid, n in batch.items:
            full[rid] = n >= remaining[rid]
        sel_running = [by_id[rid] for rid, _ in batch.items if by_id[rid].status == RequestStatus.RUNNING]
        sel_waiting = [by_id[rid] for rid, _ in batch.items if by_id[rid].status != RequestStatus.RUNNING]
        # the partial chunk goes last in its queue (stock gives the last item what is left of the budget)
        sel_running.sort(key=lambda r: not full[r.request_id])
        sel_waiting.sort(key=lambda r: not full[r.request_id])
        partial_running = [r for r in sel_running if not full[r.request_id]]
        threshold = None
        if partial_running and sel_waiting:
            chunk = sel[partial_running[-1].request_id]
            others = [n for rid, n in batch.items if rid != partial_running[-1].request_id]
            if len(partial_running) == 1 and all(n <= chunk for n in others):
                threshold = chunk
        sel_ids = set(sel)
        saved_budget = self.max_num_scheduled_tokens
        saved_threshold = self.scheduler_config.long_prefill_token_threshold
        self.max_num_scheduled_tokens = batch.num_new_tokens
        if threshold is not None:
            self.scheduler_config.long_prefill_token_threshold = threshold
        # The running requests outside the batch stay after the batch's ones when no waiting request
        # is in the batch: the budget is spent before the loop reaches them, and they remain vLLM's
        # preemption victims (running[-1]) should an allocation fail. Otherwise they are hidden for
        # the call: stock would give them tokens before it reaches the waiting queue.
        hide = bool(sel_waiting)
        if hide:
            self.running[:] = sel_running
        else:
            self.running[:] = sel_running + [r for r in running0 if r.request_id not in sel_ids]
        self.waiting.clear()
        self.waiting.extend(sel_waiting)
        try:
            return super().schedule(throttle_prefills)
        finally:
            self.max_num_scheduled_tokens = saved_budget
            if threshold is not None:
                self.scheduler_config.long_prefill_token_threshold = saved_threshold
            # running: vLLM's order, minus the preempted, plus the admitted (in admission order)
            still = {id(r) for r in self.running}
            orig = {id(r) for r in running0}
            restored = [r for r in running0 if id(r) in still or (hide and r.request_id not in sel_ids)]
            restored.extend(r for r in self.running if id(r) not in orig)
            self.running[:] = restored
            # waiting: preempted in this call first (vLLM prepends them), then the original queue
            # minus the admitted
            in_queue = list(self.waiting)
            wait_orig = {id(r) for r in waiting0}
            admitted = {id(r) for r in self.running}
            new_queue = [r for r in in_queue if id(r) not in wait_orig]
            new_queue.extend(r for r in waiting0 if id(r) not in admitted)
            self.waiting.clear()
            self.waiting.extend(new_queue)

    # ---- export and step log ------------------------------------------------------------------------

    def _fb_export_step(self, now: float, reason: str | None, state: SchedState | None, batch: Batch | None,
                        sched: dict[str, int], new_tokens: int, ctx: int, exact: bool | None) -> None:
        if state is None:  # the state could not be built (policy error): nothing to export
            return
        self.fb_export.send(state_record(
            self.fb_step, now * 1000.0, reason, state, batch, sched, new_tokens, ctx, exact,
            self.kv_cache_manager.block_pool.num_gpu_blocks, self.fb_block_size,
            self.fb_default_ttft_ms, self.fb_default_tpot_ms, self._fb_plan_model(), self.fb_export.dropped,
        ))

    def update_from_output(self, scheduler_output, model_runner_output):  # type: ignore[override]
        t_start = time.time()
        pending, self.fb_pending = self.fb_pending, None
        if self.fb_request_log is not None:  # finished requests leave self.requests in the update: hold them
            t_mono_ms = time.monotonic() * 1000.0
            held = [(r, r.num_output_tokens) for rid in scheduler_output.num_scheduled_tokens
                    if (r := self.requests.get(rid)) is not None]  # fmt: skip
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for rid in scheduler_output.num_scheduled_tokens:
            r = self.requests.get(rid)
            if r is not None and r.num_output_tokens > 0 and getattr(r, _FIRST_ATTR, None) is None:
                setattr(r, _FIRST_ATTR, t_start * 1000.0)
        if self.fb_request_log is not None:
            self._fb_log_requests(held, t_mono_ms)
        if pending is not None:
            t_end_sched, f = pending
            ms = (t_start - t_end_sched) * 1000.0
            if ms > 0 and self.fb_calibrator is not None:
                self.fb_calibrator.observe(f, ms)
        if pending is not None and (self.fb_step_log is not None or self.fb_export is not None):
            if ms > 0:
                rec = step_record(t_end_sched * 1000.0, f.new_tokens, f.context_tokens, ms, f.num_seqs,
                                  f.prefill_chunk_prefix_tokens, f.num_decodes, f.prefill_chunk_sq_tokens)  # fmt: skip
                if self.fb_export is not None:  # plugin mode: the agent's online time model
                    self.fb_export.send(rec)
                if self.fb_step_log is not None:
                    line = {k: v for k, v in rec.items() if k not in ("v", "kind")}
                    # the all-items sums too (a decode is a chunk of 1 at its context): the features of the
                    # simulated engine's time model (loadgen/sim/engine_time.py), fitted from this log by
                    # loadgen/vllm_bench.py
                    line["chunk_prefix_tokens"] = f.chunk_prefix_tokens
                    line["chunk_sq_tokens"] = f.chunk_sq_tokens
                    try:
                        self.fb_step_log.write(json.dumps(line, separators=(",", ":")) + "\n")
                    except OSError:
                        pass
        return outputs

    def _fb_log_requests(self, held: list[tuple[Any, int]], t_mono_ms: float) -> None:
        """``FAIRBATCH_REQUEST_LOG``: the engine's token times of each request (module docstring): a request
        whose output grew in this step made its token at ``t_mono_ms`` (monotonic ms, the clock every
        process of the machine shares); at its end one JSON line with its first and last token times."""
        for r, before in held:
            n = r.num_output_tokens
            if n > before:
                if getattr(r, _FIRST_MONO_ATTR, None) is None:
                    setattr(r, _FIRST_MONO_ATTR, t_mono_ms)
                setattr(r, _LAST_MONO_ATTR, t_mono_ms)
            if r.is_finished() and getattr(r, _FIRST_MONO_ATTR, None) is not None:
                line = {"rid": r.request_id, "first_mono_ms": round(getattr(r, _FIRST_MONO_ATTR), 3),
                        "last_mono_ms": round(getattr(r, _LAST_MONO_ATTR), 3), "tokens": n}  # fmt: skip
                try:
                    self.fb_request_log.write(json.dumps(line, separators=(",", ":")) + "\n")  # type: ignore[union-attr]
                except OSError:
                    pass

    def shutdown(self) -> None:
        logger.info(
            "FairBatching plugin: %d steps, %d by the policy (%d executed exactly as proposed), %d stock; "
            "export sent %d dropped %d",
            self.fb_step, self.fb_steps_policy, self.fb_steps_exact, self.fb_steps_stock,
            self.fb_export.sent if self.fb_export else 0, self.fb_export.dropped if self.fb_export else 0,
        )
        try:
            super().shutdown()
        finally:
            if self.fb_export is not None:
                self.fb_export.close()
            if self.fb_step_log is not None:
                self.fb_step_log.close()
            if self.fb_request_log is not None:
                self.fb_request_log.close()
