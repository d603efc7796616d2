"""``make bench-vllm``: the scheduling claims on a real engine (issue 31, docs/vllm.md "make bench-vllm").

Real ``vllm serve`` (CPU build 0.32.0) with the ``bench`` random-weight Llama of loadgen/tiny_model.py,
in real time on the 2-core machine, four stages (each writes its part of ``docs/bench/vllm-ab.json``):

1. ``fit``: one replica (stock schedule through the plugin class with ``FAIRBATCH_PLUGIN_DISABLE=1``, so
   vLLM's own step log, ``FAIRBATCH_STEP_LOG``, times every step: end of ``schedule()`` to start of
   ``update_from_output()``) runs a grid of known shapes (:data:`GRID`): lone prompts (prefill),
   prompts over a cached prefix (chunk x prefix, through vLLM's prefix cache), and B concurrent
   requests of one prompt length (decode batches; the staggered prefills give mixed steps). The step
   log is fitted to the simulated engine's form (loadgen/sim/engine_time.py) with the relative-error
   least squares of scripts/fit_engine_time_model.py (:func:`fit_step_log`), and to the policies' linear
   form ``a + b new + c context``.
2. ``single``: one replica each, vLLM's default scheduler (core 0) vs the FairBatching plugin
   (``--scheduler-cls``, core 1), side by side: every rate's window is replayed straight to both vLLMs at
   once by loadgen/replay.py (a paired A/B), at rates around the simulator's capacity.
3. ``pair``: two replicas (one core each), pab + fairbatching (plugin, agents in plugin mode) vs
   least-outstanding (stock vLLM), through the real router and agents; the agents' online time-model
   metrics (one-step-ahead error, margin, late steps) are scraped at the end of each rate.
4. ``sim``: bench-policies (loadgen/bench_policies.py ``run_point``) and bench-fleet
   (loadgen/fleet/bench.py ``run_point``) on the same scaled trace, SLO and rates with the engine-time
   model fitted in 1; measured vs simulated capacity side by side.

Workload: azure-conv with prompt and output lengths times :data:`LENGTH_SCALE` (prompts clipped so
prompt + output fit ``--max-model-len`` :data:`MAX_MODEL_LEN`) (:func:`scaled_trace`). SLO rule
(:func:`slo_rule`): TTFT = the larger of 4 x the fitted prefill of the median prompt and 2 x that of the p99
prompt, TPOT = 2 x the fitted decode step of :data:`LOADED_BATCH` sequences at the median context.

Run: ``python -m loadgen.vllm_bench [--quick] [--stages fit single pair sim] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import os
import random
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loadgen.delivery import delivery_pairs, summarize_delivery
from loadgen.procs import ProcessGroup, free_port
from loadgen.sim.slowdown import SlowdownModel, fit_slowdown
from loadgen.traces import TraceRequest, load_trace, resolve_trace
from loadgen.vllm_fleet import (
    REPO_ROOT,
    http_get_text,
    metric_value,
    omp_core,
    parse_prometheus,
    vllm_cache_root,
    vllm_env,
    vllm_serve_argv,
    vllm_venv,
    wait_vllm_ready,
)

SERVED = "bench-llama"
PROFILE = "bench-llama-cpu"
"""Profile of the bench model on one CPU core (replica_agent/data/derived_profiles.csv), fitted here."""
MAX_MODEL_LEN = 2560
LENGTH_SCALE = 0.25
"""azure-conv lengths x 0.25: its median prompt 1,033 -> 258 tokens, p90 4,076 -> 1,019; outputs 134 -> 34."""
TRACE_START_S = 600.0
"""The slice starts 600 s into azure-conv: its first minutes are sparse (191 requests in the first minute
against 337 on average), its 600-900 s run near the mean (about 5 rps); rates are bench-policies'
(arrivals / (rate / native rate of the whole trace)), and each row also reports the offered rate."""
LOADED_BATCH = 16
"""Sequences of the "loaded decode step" of the TPOT rule."""
TTFT_FACTOR = 4.0
TTFT_TAIL_FACTOR = 2.0
TPOT_FACTOR = 2.0
SCHEDULER_CLS = "replica_agent.vllm_plugin.FairBatchingScheduler"
ENGINE_TIME_FILE = REPO_ROOT / "loadgen" / "data" / "engine_time" / f"{PROFILE}.json"
DEFAULT_OUT = REPO_ROOT / "docs" / "bench" / "vllm-ab.json"
PAIR_BASELINES = ("least-outstanding",)
"""Baselines of the two-replica stage by default (``--pair-baselines`` adds others, e.g. issue 27's
``static-queue-cap``: about 5 more minutes each)."""
TENANTS = (("t0", 0.4), ("t1", 0.3), ("t2", 0.2), ("t3", 0.1))
"""bench-fleet's tenant mix (loadgen/fleet/bench.py)."""


@dataclass(frozen=True, slots=True)
class Mode:
    """Sizes of one run of the bench.

    Attributes:
        decode_batches, decode_contexts: the decode grid (B concurrent requests of each prompt length).
        decode_tokens: output tokens of each decode-grid request.
        prefills: lone prompt lengths; prefix_chunks: (prefix, chunk) pairs over vLLM's prefix cache.
        duration_s: arrival window of one rate (s, real time); rate_factors: rates as multiples of the
            simulated vllm-default capacity of one replica.
        windows: windows of the trace replayed per rate, one after the other (:func:`window_trace`); a
            rate's row pools them (:func:`pool_windows`).
    """

    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    decode_tokens: int
    prefills: tuple[int, ...]
    prefix_chunks: tuple[tuple[int, int], ...]
    duration_s: float
    rate_factors: tuple[float, ...]
    windows: int = 1


QUICK = Mode((1, 8, 32), (128, 1024), 12, (128, 512, 2048), ((1024, 512),), 20.0, (0.8, 1.2))
FULL = Mode((1, 4, 16, 32, 48), (128, 768), 24, (128, 256, 512, 1024, 2048, 2048),
            ((512, 512), (1024, 512), (1024, 1024), (1536, 384)), 75.0, (0.4, 0.7, 1.0, 1.3))  # fmt: skip


# ---- pure parts -------------------------------------------------------------------------------------

def scaled_trace(reqs: Sequence[TraceRequest], scale: float = LENGTH_SCALE,
                 max_model_len: int = MAX_MODEL_LEN) -> list[TraceRequest]:  # fmt: skip
    """Lengths times ``scale`` (rounded, at least 1 token each), prompt clipped to ``max_model_len - output``.

    Args:
        reqs: the trace (arrivals kept as they are).
        scale: length factor, > 0.
        max_model_len: the engine's context (tokens); outputs are clipped to half of it first.

    Raises:
        ValueError: ``scale`` not > 0.
    """
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    out = []
    for r in reqs:
        o = min(max_model_len // 2, max(1, round(r.output_tokens * scale)))
        p = min(max_model_len - o, max(1, round(r.prompt_tokens * scale)))
        out.append(TraceRequest(r.arrival_ms, p, o))
    return out


def step_features(rec: dict[str, Any]) -> tuple[np.ndarray, str]:
    """``[1, new, context, seqs, sum chunk x prefix, sum chunk^2]`` of one step-log line and its kind.

    The line is the plugin's step log (replica_agent/vllm_plugin.py): ``new_tokens``, ``context_tokens``,
    ``batch_size``, ``num_decodes``, ``chunk_prefix_tokens`` and ``chunk_sq_tokens`` (all items, a decode
    being a chunk of 1 at its context). Kind: ``decode`` (every item a decode), ``prefill`` (none) or
    ``mixed``.

    Raises:
        KeyError: a field is missing (a log from a plugin without the all-items sums).
    """
    n, dec = int(rec["batch_size"]), int(rec["num_decodes"])
    kind = "decode" if dec == n else "prefill" if dec == 0 else "mixed"
    x = np.array([1.0, rec["new_tokens"], rec["context_tokens"], n, rec["chunk_prefix_tokens"],
                  rec["chunk_sq_tokens"]], dtype=float)  # fmt: skip
    return x, kind


def _fit_module() -> Any:
    """scripts/fit_engine_time_model.py as a module (scripts/ is not a package)."""
    name = "fit_engine_time_model"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / "fit_engine_time_model.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # its dataclasses look their module up while the file runs
    spec.loader.exec_module(mod)
    return mod


def fit_step_log(lines: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Fit the engine-time form and the policies' linear form to measured steps.

    Engine form (loadgen/sim/engine_time.py): ``a + b new + c context + d seqs + e sum(chunk x prefix) +
    f sum(chunk^2)``; linear form ``a + b new + c context``; both by relative-error least squares with
    coefficients >= 0 (scripts/fit_engine_time_model.py ``fit_relative``). ``noise_sigma`` = the standard
    deviation of ``ln(measured / fitted)`` over every step (model error included: an upper bound of the
    engine's own noise).

    Args:
        lines: step-log lines (:func:`step_features`), ``measured_ms`` > 0.

    Returns:
        ``{"engine": {a_ms..f_ms, noise_sigma}, "linear": {a_ms, b_ms, c_ms}, "error_by_kind": {kind:
        {n, mean_rel_err, max_rel_err, linear_mean_rel_err}}}``.

    Raises:
        ValueError: fewer than 6 steps.
    """
    rows = [(step_features(r), float(r["measured_ms"])) for r in lines if float(r["measured_ms"]) > 0]
    if len(rows) < 6:
        raise ValueError(f"need at least 6 measured steps, got {len(rows)}")
    x = np.array([f for (f, _), _ in rows])
    kinds = np.array([k for (_, k), _ in rows])
    y = np.array([ms for _, ms in rows])
    fit_relative = _fit_module().fit_relative
    coef = fit_relative(x, y)
    lin = fit_relative(x[:, :3], y)
    pred, lin_pred = x @ coef, x[:, :3] @ lin
    rel, lin_rel = np.abs(pred - y) / y, np.abs(lin_pred - y) / y
    by_kind: dict[str, Any] = {}
    for k in ("decode", "prefill", "mixed", "all"):
        m = np.ones(len(y), bool) if k == "all" else kinds == k
        if m.any():
            by_kind[k] = {"n": int(m.sum()), "mean_rel_err": round(float(rel[m].mean()), 4),
                          "max_rel_err": round(float(rel[m].max()), 4),
                          "linear_mean_rel_err": round(float(lin_rel[m].mean()), 4)}  # fmt: skip
    engine = {k: float(f"{v:.6g}") for k, v in zip(("a_ms", "b_ms", "c_ms", "d_ms", "e_ms", "f_ms"), coef, strict=True)}
    engine["noise_sigma"] = round(float(np.std(np.log(y / pred))), 4)
    linear = {k: float(f"{v:.6g}") for k, v in zip(("a_ms", "b_ms", "c_ms"), lin, strict=True)}
    linear.update({"r2": round(float(1.0 - np.sum((lin_pred - y) ** 2) / np.sum((y - y.mean()) ** 2)), 4),
                   "max_rel_err": round(float(lin_rel.max()), 4), "mean_rel_err": round(float(lin_rel.mean()), 4)})
    return {"engine": engine, "linear": linear, "error_by_kind": by_kind}


def predicted_ms(lines: Sequence[dict[str, Any]], engine: dict[str, float]) -> np.ndarray:
    """The fitted engine form's step time (ms) of each step-log line (:func:`step_features`); ``engine``:
    the coefficients ``a_ms`` .. ``f_ms``."""
    coef = np.array([engine[k] for k in ("a_ms", "b_ms", "c_ms", "d_ms", "e_ms", "f_ms")])
    return np.array([float(step_features(r)[0] @ coef) for r in lines])


def step_time_drift(lines: Sequence[dict[str, Any]], engine: dict[str, float]) -> dict[str, Any]:
    """How the steps of a run compare with the fitted engine model: quantiles of measured / predicted
    over the step-log ``lines`` (:func:`step_features`); ``{"steps": 0}`` when there is none. A median
    above 1 means the engine ran slower during the run than when it was fitted (CPU contention)."""
    lines = [r for r in lines if float(r["measured_ms"]) > 0]
    ratios = [float(r["measured_ms"]) / p for r, p in zip(lines, predicted_ms(lines, engine), strict=True)]
    if not ratios:
        return {"steps": 0}
    q = np.quantile(ratios, [0.1, 0.5, 0.9])
    return {"steps": len(ratios), "p10_ratio": round(float(q[0]), 3), "median_ratio": round(float(q[1]), 3),
            "p90_ratio": round(float(q[2]), 3), "mean_ratio": round(float(np.mean(ratios)), 3)}


def fit_run_slowdown(logs: Sequence[tuple[Path, int]], engine: dict[str, float]) -> dict[str, Any] | None:
    """The correlated slowdown of a run's engine steps against the fitted engine model (loadgen/sim/slowdown.py
    :func:`fit_slowdown` on ``z = ln(measured / predicted)`` per step, each log a series).

    Args:
        logs: ``(step log, lines to skip)`` (the grid's steps lead the stock replica's log when the fit
            stage ran in the same work directory); missing files are skipped.
        engine: the fitted coefficients ``a_ms`` .. ``f_ms``.

    Returns:
        ``{"model": SlowdownModel JSON, "white_sigma", "var", "steps", "rms_error", "lags_s", "cov",
        "cov_fit", "logs"}``, or None with fewer than 50 steps.
    """
    series, names = [], []
    for path, skip in logs:
        lines = [r for r in _read_log(path, skip) if float(r["measured_ms"]) > 0]
        if not lines:
            continue
        pred = predicted_ms(lines, engine)
        meas = np.array([float(r["measured_ms"]) for r in lines])
        t = np.array([float(r["start_ms"]) for r in lines]) / 1000.0
        keep = pred > 0
        series.append((t[keep], np.log(meas[keep] / pred[keep])))
        names.append(path.name)
    if sum(len(z) for _, z in series) < 50:
        return None
    fit = fit_slowdown(series)
    return {"model": fit["model"].to_dict(), "white_sigma": round(fit["white_sigma"], 4), "var": round(fit["var"], 4),
            "steps": fit["steps"], "rms_error": fit["rms_error"], "lags_s": fit["lags_s"], "cov": fit["cov"],
            "cov_fit": fit["cov_fit"], "logs": names}  # fmt: skip


def run_slowdowns(work: Path, engine: dict[str, float], stock_skip: int = 0) -> dict[str, Any]:
    """:func:`fit_run_slowdown` per setup from a bench work directory: ``single`` from the stock replica's log
    (its first ``stock_skip`` lines skipped) and the FairBatching replica's, ``pair`` from the pab+fairbatching
    replicas' logs (the baselines run stock vLLM without a step log). A setup without steps is left out."""
    out = {}
    single = fit_run_slowdown([(work / "stock-steps.jsonl", stock_skip), (work / "single-fairbatching-steps.jsonl", 0)], engine)
    if single:
        out["single"] = single
    pair = fit_run_slowdown([(p, 0) for p in sorted(work.glob("pair-pab+fairbatching-*-steps.jsonl"))], engine)
    if pair:
        out["pair"] = pair
    return out


def _read_log(path: Path, skip: int = 0) -> list[dict[str, Any]]:
    """The JSON lines of ``path`` after the first ``skip`` ([] when there is no file); a line that is not
    JSON (the last one of a process killed mid-write) is left out."""
    if not path.exists():
        return []
    out = []
    for x in path.read_text().splitlines()[skip:]:
        if x.strip():
            try:
                out.append(json.loads(x))
            except json.JSONDecodeError:
                continue
    return out


def engine_ms(engine: dict[str, float], items: Sequence[tuple[int, int]]) -> float:
    """Mean step time (ms) of the fitted engine form for a batch of ``(chunk, prefix)`` items."""
    new = sum(c for c, _ in items)
    ctx = sum(p for _, p in items)
    cross = sum(c * p for c, p in items)
    sq = sum(c * c for c, _ in items)
    return (engine["a_ms"] + engine["b_ms"] * new + engine["c_ms"] * ctx + engine["d_ms"] * len(items)
            + engine["e_ms"] * cross + engine["f_ms"] * sq)  # fmt: skip


def slo_rule(engine: dict[str, float], reqs: Sequence[TraceRequest]) -> dict[str, Any]:
    """The bench's SLO (module docstring): TTFT = the larger of 4 x prefill(median prompt) and
    2 x prefill(p99 prompt), so that every prompt but the longest 1 % can start on time with one prompt
    of its own size ahead of it (with the median rule alone, 13.6 % of the slice could not be prefilled
    on time on an idle engine: docs/vllm.md "Results", 2026-12-06); TPOT = 2 x the decode step of
    :data:`LOADED_BATCH` sequences at context median prompt + median output / 2; both rounded to 10 ms.

    Args:
        engine: the fitted engine form (:func:`engine_ms`).
        reqs: the (scaled) trace; prompt p99 by numpy's linear interpolation, truncated to a token.
    """
    prompts = [r.prompt_tokens for r in reqs]
    p = int(np.median(prompts))
    p99 = int(np.percentile(prompts, 99))
    o = int(np.median([r.output_tokens for r in reqs]))
    prefill = engine_ms(engine, [(p, 0)])
    prefill99 = engine_ms(engine, [(p99, 0)])
    decode = engine_ms(engine, [(1, p + o // 2)] * LOADED_BATCH)
    ttft = max(TTFT_FACTOR * prefill, TTFT_TAIL_FACTOR * prefill99)
    return {"ttft_ms": max(10.0, round(ttft, -1)), "tpot_ms": max(10.0, round(TPOT_FACTOR * decode, -1)),
            "rule": f"TTFT = max({TTFT_FACTOR:g} x prefill of the median prompt ({p} tokens: {prefill:.0f} ms), "
                    f"{TTFT_TAIL_FACTOR:g} x prefill of the p99 prompt ({p99} tokens: {prefill99:.0f} ms)); "
                    f"TPOT = {TPOT_FACTOR:g} x decode step of {LOADED_BATCH} sequences at context {p + o // 2} "
                    f"({decode:.0f} ms)", "median_prompt": p, "p99_prompt": p99, "median_output": o}  # fmt: skip


def window(trace: Sequence[TraceRequest], native_rps: float, rate_rps: float, duration_s: float) -> list[TraceRequest]:
    """bench-policies' window (loadgen/bench_policies.py ``run_point``): arrivals / (rate / native), the
    first ``duration_s`` seconds."""
    scale = rate_rps / native_rps
    out = []
    for r in trace:
        t = r.arrival_ms / scale
        if t >= duration_s * 1000.0:
            break
        out.append(TraceRequest(t, r.prompt_tokens, r.output_tokens))
    return out


def window_trace(trace: Sequence[TraceRequest], native_rps: float, rate_rps: float, duration_s: float,
                 k: int) -> list[TraceRequest]:  # fmt: skip
    """The trace re-based so that its first ``duration_s`` seconds at ``rate_rps`` (:func:`window`) are the
    ``k``-th window of ``trace`` (``k`` = 0: ``trace`` itself): arrivals from ``k x duration_s`` scaled
    seconds on, moved back by that much. Raises ValueError for ``k`` < 0."""
    if k < 0:
        raise ValueError(f"window index must be >= 0, got {k}")
    if k == 0:
        return list(trace)
    shift_ms = k * duration_s * 1000.0 * rate_rps / native_rps
    return [TraceRequest(r.arrival_ms - shift_ms, r.prompt_tokens, r.output_tokens) for r in trace if r.arrival_ms >= shift_ms]


_SUMMED = ("requests", "ok", "failed")


def pool_windows(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One row for a rate from its windows' rows: counts (``requests``, ``ok``, ``failed``, and the
    ``rejected`` / ``not_ok_reasons`` counters) summed; every other number (attainment, miss fractions,
    means, and the windows' percentiles, an approximation of the pooled percentile) the mean weighted by
    requests, nested objects alike; ``window_rows`` keeps the rows. One row: returned as it is.

    Raises:
        ValueError: no rows.
    """
    if not rows:
        raise ValueError("no rows to pool")
    if len(rows) == 1:
        return dict(rows[0])
    w = [max(1, int(r.get("requests") or 0)) for r in rows]

    def mean(vals: list[Any]) -> Any:
        pairs = [(v, wi) for v, wi in zip(vals, w, strict=True) if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if pairs:
            return sum(v * wi for v, wi in pairs) / sum(wi for _, wi in pairs)
        dicts = [v for v in vals if isinstance(v, dict)]
        if dicts and len(dicts) == len(vals):
            keys = {k for d in dicts for k in d}
            return {k: mean([d.get(k) for d in dicts]) for k in keys}
        return vals[0]

    out: dict[str, Any] = {}
    for key in rows[0]:
        vals = [r.get(key) for r in rows]
        if key in _SUMMED:
            out[key] = sum(int(v or 0) for v in vals)
        elif key in ("rejected", "not_ok_reasons"):
            c: Counter[str] = Counter()
            for v in vals:
                c.update(v or {})
            out[key] = dict(c)
        elif key in ("rate_rps", "loadavg_before"):
            out[key] = vals[0]
        elif key in ("loadavg_after", "time_model", "per_replica"):
            out[key] = vals[-1]
        else:
            out[key] = mean(vals)
    out["window_rows"] = [dict(r) for r in rows]
    return out


def verdict(a: float, b: float, tol: float = 0.05) -> str:
    """``gain`` / ``loss`` when ``a`` is more than ``tol`` above / below ``b``, else ``no gain``."""
    if b <= 0:
        return "gain" if a > 0 else "no gain"
    r = a / b
    return "gain" if r > 1 + tol else "loss" if r < 1 - tol else "no gain"


def decide(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """The verdict of policy ``a`` against ``b`` (each ``{"capacity_rps", "capacity_bound", "rows"}``):
    by capacity (:func:`verdict`) when both were bracketed by the sweep ("interpolated"), else by the
    mean attainment over the rates both ran (``gain`` / ``loss`` beyond 0.05 either way)."""
    if a["capacity_bound"] == b["capacity_bound"] == "interpolated":
        return {"verdict": verdict(a["capacity_rps"], b["capacity_rps"]), "by": "capacity",
                "a": a["capacity_rps"], "b": b["capacity_rps"]}  # fmt: skip
    n = min(len(a["rows"]), len(b["rows"]))
    ma = float(np.mean([r["slo_attainment"] or 0.0 for r in a["rows"][:n]])) if n else 0.0
    mb = float(np.mean([r["slo_attainment"] or 0.0 for r in b["rows"][:n]])) if n else 0.0
    v = "gain" if ma > mb + 0.05 else "loss" if ma < mb - 0.05 else "no gain"
    return {"verdict": v, "by": "mean attainment over the sweep (a capacity outside it)", "a": round(ma, 3), "b": round(mb, 3)}


def verdicts(doc: dict[str, Any]) -> dict[str, Any]:
    """:func:`decide` for each measured pair: fairbatching vs vllm-default, pab+fairbatching vs each baseline."""
    out: dict[str, Any] = {}
    s = doc.get("single", {})
    if "fairbatching" in s and "vllm-default" in s:
        out["fairbatching vs vllm-default"] = decide(s["fairbatching"], s["vllm-default"])
    p = doc.get("pair", {})
    for b in (k for k in p if k != "pab+fairbatching"):
        if "pab+fairbatching" in p:
            out[f"pab+fairbatching vs {b}"] = decide(p["pab+fairbatching"], p[b])
    return out


MERGED_SECTIONS = ("single", "pair", "simulated", "simulated_front", "simulated_slowdown", "simulated_delivery")


def add_derived(doc: dict[str, Any]) -> None:
    """Set ``doc``'s verdicts (:func:`verdicts`) and the comparison of each simulated variant with the
    measured rows (:func:`comparison`: ``comparison``, ``comparison_front``, ``comparison_slowdown``,
    ``comparison_delivery``)."""
    measured = {k: doc[k] for k in ("single", "pair") if k in doc}
    doc["verdicts"] = verdicts(doc)
    for sim, cmp in (("simulated", "comparison"), ("simulated_front", "comparison_front"),
                     ("simulated_slowdown", "comparison_slowdown"),
                     ("simulated_delivery", "comparison_delivery")):  # fmt: skip
        if sim in doc:
            doc[cmp] = comparison(measured, doc[sim])


def merge_results(docs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One result from runs of the same workload at different rates (e.g. a second run at higher rates to
    bracket a capacity): per section, setup and policy the rows of every run sorted by rate, the capacity
    read again from them; verdicts and comparisons recomputed. The first run gives everything else, and
    ``merged_from`` keeps each run's rates, windows, single order, load averages and slowdown.

    Raises:
        ValueError: fewer than two runs, or runs with different SLOs or windows.
    """
    if len(docs) < 2:
        raise ValueError("merge needs at least two results")
    first = docs[0]
    for d in docs[1:]:
        if d.get("slo", {}).get("ttft_ms") != first.get("slo", {}).get("ttft_ms") or d.get("windows", 1) != first.get("windows", 1):
            raise ValueError("merge needs runs of the same SLO and windows per rate")
    out = {k: v for k, v in first.items() if k not in MERGED_SECTIONS}
    for sec in MERGED_SECTIONS:
        parts = [d[sec] for d in docs if sec in d]
        if not parts:
            continue
        merged: dict[str, Any] = {k: v for k, v in parts[0].items() if k not in ("single", "pair")} if sec.startswith("sim") else {}
        setups = ("single", "pair") if sec.startswith("sim") else (None,)
        for setup in setups:
            pols: dict[str, Any] = {}
            for part in parts:
                block = part.get(setup, {}) if setup else part
                for pol, v in block.items():
                    if not isinstance(v, dict) or "rows" not in v:
                        continue
                    cur = pols.setdefault(pol, {k: x for k, x in v.items() if k not in ("rows", "seed_capacity_rps")})
                    cur.setdefault("rows", []).extend(v["rows"])
            for v in pols.values():
                v["rows"].sort(key=lambda r: r["rate_rps"])
                v.update(_capacity(v["rows"]))
            if setup:
                merged[setup] = pols
            else:
                merged = pols
        out[sec] = merged
    add_derived(out)
    out["merged_from"] = [{k: d.get(k) for k in ("rates_rps", "windows", "single_order", "started_loadavg", "finished_loadavg",
                                                  "wall_s", "slowdown")} for d in docs]  # fmt: skip
    out["wall_s"] = round(sum(float(d.get("wall_s") or 0.0) for d in docs), 1)
    return out


def loadavg() -> list[float]:
    """``/proc/loadavg``'s 1, 5 and 15 minute figures ([] where there is none)."""
    try:
        return [float(v) for v in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


# ---- real engines -----------------------------------------------------------------------------------

def bench_model_dir() -> Path:
    """``$FAIRBATCH_BENCH_MODEL``, else ``<repo>/.cache/bench-llama`` (built on first use)."""
    return Path(os.environ.get("FAIRBATCH_BENCH_MODEL") or REPO_ROOT / ".cache" / "bench-llama")


def ensure_bench_model(say: Callable[[str], None]) -> Path:
    """Build the bench model with the vLLM venv's interpreter when it is missing (about 10 s)."""
    d = bench_model_dir()
    if not (d / "model.safetensors").exists():
        say(f"building the bench model into {d}")
        subprocess.run([str(vllm_venv() / "bin" / "python"), "-m", "loadgen.tiny_model", str(d), "--size", "bench"],
                       cwd=REPO_ROOT, check=True, timeout=600)  # fmt: skip
    return d


def engine_argv(port: int, plugin: bool, extra: Sequence[str] = ()) -> list[str]:
    """``vllm serve`` of the bench model at nice 0 (the bench measures the engine, not the code under test)."""
    args = ["--scheduler-cls", SCHEDULER_CLS] if plugin else []
    return vllm_serve_argv(port, model_dir=bench_model_dir(), served_model_name=SERVED, max_model_len=MAX_MODEL_LEN,
                           extra_args=[*args, *extra], nice=0)  # fmt: skip


@dataclass(frozen=True, slots=True)
class PluginSettings:
    """What the plugin replicas run (replica_agent/vllm_plugin.py); None / 0 = the plugin's defaults.

    Attributes:
        policy: ``FAIRBATCH_POLICY`` (default ``fairbatching``).
        plan_model: ``FAIRBATCH_PLAN_MODEL`` (default ``conservative``).
        decode_guard_ms: ``FAIRBATCH_DECODE_GUARD_MS`` (ms >= 0; default 0); the simulated FairBatching
            replicas of the ``sim`` stage plan with the same guard.
    """

    policy: str | None = None
    plan_model: str | None = None
    decode_guard_ms: float = 0.0


def plugin_env(coef: Sequence[float], slo: dict[str, Any] | None, *, disable: bool = False,
               step_log: Path | None = None, export: str | None = None,
               plugin: PluginSettings = PluginSettings(), request_log: Path | None = None) -> dict[str, str]:  # fmt: skip
    """Environment of a replica running the plugin class (``disable``: stock schedule, step log only;
    ``plugin``: the policy, plan model and decode guard, each named only when set; ``request_log``:
    ``FAIRBATCH_REQUEST_LOG``, the engine's token times per request, loadgen/delivery.py)."""
    env = {"PYTHONPATH": str(REPO_ROOT), "FAIRBATCH_COEFFICIENTS": ",".join(f"{c:g}" for c in coef)}
    if plugin.policy:
        env["FAIRBATCH_POLICY"] = plugin.policy
    if plugin.plan_model:
        env["FAIRBATCH_PLAN_MODEL"] = plugin.plan_model
    if plugin.decode_guard_ms:
        env["FAIRBATCH_DECODE_GUARD_MS"] = f"{plugin.decode_guard_ms:g}"
    if slo:
        env["FAIRBATCH_TTFT_MS"], env["FAIRBATCH_TPOT_MS"] = str(slo["ttft_ms"]), str(slo["tpot_ms"])
    if disable:
        env["FAIRBATCH_PLUGIN_DISABLE"] = "1"
    if step_log is not None:
        env["FAIRBATCH_STEP_LOG"] = str(step_log)
    if export is not None:
        env["FAIRBATCH_PLUGIN_EXPORT"] = export
    if request_log is not None:
        env["FAIRBATCH_REQUEST_LOG"] = str(request_log)
    return env


async def _complete(session: Any, url: str, ids: list[int], max_tokens: int) -> None:
    body = {"model": SERVED, "prompt": ids, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"grid request failed: HTTP {r.status}: {(await r.text())[:300]}")
        await r.read()


async def run_grid(url: str, mode: Mode, seed: int = 0) -> None:
    """Send the grid of :class:`Mode` to one engine (token-id prompts of exact lengths, unique per request
    except the prefix pairs, which share their prefix on purpose)."""
    import aiohttp

    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(4, 900) for _ in range(n)]

    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        await _complete(s, url, ids(64), 4)  # warm-up
        for n in mode.prefills:
            await _complete(s, url, ids(n), 2)
        for prefix, chunk in mode.prefix_chunks:
            base = ids(prefix)
            await _complete(s, url, base, 1)
            await _complete(s, url, base + ids(chunk), 2)  # computes `chunk` tokens over the cached prefix
        for ctx in mode.decode_contexts:
            for b in mode.decode_batches:
                await asyncio.gather(*(_complete(s, url, ids(ctx), mode.decode_tokens) for _ in range(b)))


def cache_info(url: str) -> dict[str, Any]:
    """KV blocks, block size and batching caps vLLM reports on /metrics (``vllm:cache_config_info``)."""
    samples = parse_prometheus(http_get_text(url + "/metrics"))
    for labels, _ in samples.get("vllm:cache_config_info", []):
        return {"num_gpu_blocks": int(labels.get("num_gpu_blocks", 0)), "block_size": int(labels.get("block_size", 0))}
    return {}


@dataclass(slots=True)
class StockReplica:
    """The stage-1 replica: the plugin class with ``FAIRBATCH_PLUGIN_DISABLE=1``, i.e. vLLM's own
    ``Scheduler.schedule()`` on every step plus the step log; kept for stage 2's vllm-default runs."""

    group: ProcessGroup
    url: str
    step_log: Path
    startup_s: float


def start_stock_replica(work: Path, say: Callable[[str], None]) -> StockReplica:
    """Start the stage-1 replica on core 0 (raises RuntimeError when it does not come up)."""
    step_log = work / "stock-steps.jsonl"
    step_log.unlink(missing_ok=True)
    group = ProcessGroup(work / "logs-stock")
    port = free_port()
    try:
        env = {**vllm_env(0, vllm_cache_root()), **plugin_env((1.0, 0.1, 0.0), None, disable=True, step_log=step_log,
                                                              request_log=work / "stock-requests.jsonl")}  # fmt: skip
        child = group.start("vllm-stock", engine_argv(port, plugin=True), env=env)
        url = f"http://127.0.0.1:{port}"
        startup = wait_vllm_ready(group, child, url)
    except BaseException:
        group.stop(grace_s=10.0)
        raise
    say(f"stock replica (vLLM's scheduler, step log on) up in {startup:.0f} s")
    return StockReplica(group, url, step_log, startup)


def stage_fit(mode: Mode, rep: StockReplica, say: Callable[[str], None]) -> dict[str, Any]:
    """Stage 1 (module docstring): the grid through the stock replica; the fits; the measured spots."""
    t0 = time.monotonic()
    load_before = loadavg()
    kv = cache_info(rep.url)
    asyncio.run(run_grid(rep.url, mode))
    startup = rep.startup_s
    lines = [json.loads(x) for x in rep.step_log.read_text().splitlines() if x.strip()]
    lines = lines[1:]  # the warm-up request's first step (first call of each kernel)
    fit = fit_step_log(lines)
    spots = {}
    for name, pred in (("prefill 2048", lambda r: r["new_tokens"] == 2048 and r["num_decodes"] == 0),
                       ("decode B=1", lambda r: r["batch_size"] == 1 and r["num_decodes"] == 1),
                       ("decode B=16", lambda r: r["batch_size"] == 16 and r["num_decodes"] == 16),
                       ("decode B=32", lambda r: r["batch_size"] == 32 and r["num_decodes"] == 32)):  # fmt: skip
        ms = [r["measured_ms"] for r in lines if pred(r)]
        if ms:
            spots[name] = {"median_ms": round(float(np.median(ms)), 2), "n": len(ms)}
    say(f"grid: {len(lines)} steps in {time.monotonic() - t0:.0f} s; fit {fit['engine']}; error {fit['error_by_kind']['all']}")
    return {"steps": len(lines), "wall_s": round(time.monotonic() - t0, 1), "startup_s": round(startup, 1),
            "loadavg_before": load_before, "loadavg_after": loadavg(), "kv": kv, "measured_spots": spots,
            "grid": {"prefills": mode.prefills, "prefix_chunks": mode.prefix_chunks, "decode_batches": mode.decode_batches,
                     "decode_contexts": mode.decode_contexts, "decode_tokens": mode.decode_tokens}, **fit}  # fmt: skip


def engine_time_json(fit: dict[str, Any]) -> dict[str, Any]:
    """The engine-time file (loadgen/data/engine_time/ format) of a :func:`stage_fit` result."""
    return {**fit["engine"], "seed": 0, "meta": {
        "profile": PROFILE,
        "fitted_by": "loadgen/vllm_bench.py stage fit (make bench-vllm; docs/vllm.md)",
        "data": "vLLM 0.32.0 CPU step log (FAIRBATCH_STEP_LOG, stock schedule), bench model of loadgen/tiny_model.py, "
                "one core (VLLM_CPU_OMP_THREADS_BIND=0, OMP_NUM_THREADS=1), float32, --enforce-eager",
        "steps": fit["steps"], "grid": fit["grid"], "error_by_kind": fit["error_by_kind"],
        "linear_fit": fit["linear"], "measured_spots": fit["measured_spots"],
        "loadavg": [fit["loadavg_before"], fit["loadavg_after"]],
        "noise": {"sigma_from": "std of ln(measured / fitted) over the grid's steps (model error included)"},
    }}  # fmt: skip


PROFILE_CSV = REPO_ROOT / "replica_agent" / "data" / "derived_profiles.csv"


def write_profile_row(fit: dict[str, Any], path: Path = PROFILE_CSV) -> None:
    """Replace (or add) the ``bench-llama,CPU,1,all_batches`` row of derived_profiles.csv with the linear
    fit of ``fit`` (the policies' and agents' prior; KV capacity from vLLM's ``cache_config_info``)."""
    import csv
    import io

    from replica_agent.policy import profiles

    text = path.read_text()
    rows = list(csv.DictReader(io.StringIO(text)))
    header = text.splitlines()[0].split(",")
    lin = fit["linear"]
    kv = fit.get("kv") or {}
    row = {k: "" for k in header}
    row.update({"model": "bench-llama", "gpu": "CPU", "tp": "1", "variant": "all_batches", "a_ms": f"{lin['a_ms']:g}",
                "b_ms_per_new_token": f"{lin['b_ms']:g}", "c_ms_per_context_token": f"{lin['c_ms']:g}",
                "r2": f"{lin['r2']:g}", "max_rel_err": f"{lin['max_rel_err']:g}", "mean_rel_err": f"{lin['mean_rel_err']:g}",
                "n_batches": str(fit["steps"]), "kv_bytes_per_token": str(BENCH_KV_BYTES_PER_TOKEN),
                "kv_capacity_tokens_90pct": str(kv.get("num_gpu_blocks", 2048) * kv.get("block_size", 128))})  # fmt: skip
    rows = [r for r in rows if not (r["model"] == "bench-llama" and r["gpu"] == "CPU")] + [row]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=header, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    path.write_text(buf.getvalue())
    profiles._rows.cache_clear()


BENCH_KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 64 * 4
"""The bench model's KV bytes per token: 4 layers x (K, V) x 2 KV heads x 64 x 4 bytes (float32)."""


def _replay(targets: Sequence[str], reqs: list[TraceRequest], slo: dict[str, Any], keys: dict[str, str] | None,
            timeout_s: float, prompt_offset: int = 0) -> list[dict[str, Any]]:  # fmt: skip
    """Replay ``reqs`` at every one of ``targets`` at once (loadgen/replay.py, one event loop) and return
    the figures of each (loadgen/stats.py), in order, each with ``client_tokens`` (what :func:`_sweep`'s
    ``client_log`` keeps). ``prompt_offset``: ReplayConfig's, so that a window shares no prompt prefix with
    the windows an engine served before it."""
    from loadgen.replay import ReplayConfig, TenantSpec, replay
    from loadgen.stats import Slo, figures

    tenants = [TenantSpec(n, w, (keys or {}).get(n)) for n, w in TENANTS]

    async def run_all() -> list[Any]:
        cfgs = [ReplayConfig(target=t, tenants=tenants, model=SERVED, time_scale=1.0, request_timeout_s=timeout_s,
                             max_wall_s=timeout_s + reqs[-1].arrival_ms / 1000.0 + 30.0, progress=False,
                             prompt_offset=prompt_offset)
                for t in targets]  # fmt: skip
        return list(await asyncio.gather(*(replay(reqs, c) for c in cfgs)))

    s = Slo(slo["ttft_ms"], slo["tpot_ms"])
    dur = max(1e-9, reqs[-1].arrival_ms / 1000.0)
    out = []
    for res in asyncio.run(run_all()):
        t0, k = res.start_monotonic_s * 1000.0, res.time_scale  # wall ms = t0 + record ms x time scale
        f = figures(res.records, {n: s for n, _ in TENANTS}, dur)
        n = max(1, f.requests_total)
        ok = [r for r in res.records if r.outcome == "ok"]
        out.append({
            "requests": f.requests_total, "ok": f.completed, "rejected": f.rejected, "failed": f.failed,
            "slo_attainment": f.slo_attainment,
            "ttft_miss_frac": sum(1 for r in ok if (r.ttft_ms or 0) > s.ttft_ms) / n,
            "tpot_miss_frac": sum(1 for r in ok if (t := r.tpot_ms) is not None and t > s.tpot_ms) / n,
            "ttft_p50_ms": f.ttft_ms.p50, "ttft_p99_ms": f.ttft_ms.p99, "tpot_p50_ms": f.tpot_ms.p50,
            "tpot_p99_ms": f.tpot_ms.p99, "goodput_rps": f.goodput_rps, "per_replica": f.per_replica_requests,
            "ttft_mean_ms": f.ttft_ms.mean, "tpot_mean_ms": f.tpot_ms.mean,
            "not_ok_reasons": dict(Counter(f"{r.outcome}:{r.reason}" for r in res.records if r.outcome != "ok")),
            "wall_s": round(res.wall_s, 1),
            # each ok request's first and last token as the client read them (monotonic ms; loadgen/delivery.py)
            "client_tokens": [{"key": f"lg-{res.run_id}-{i}", "first_mono_ms": round(t0 + k * r.token_times_ms[0], 3),
                               "last_mono_ms": round(t0 + k * r.token_times_ms[-1], 3)}
                              for i, r in enumerate(res.records) if r.outcome == "ok" and r.token_times_ms],
        })  # fmt: skip
    return out


ENGINE_LATENCY = {"ttft": "vllm:time_to_first_token_seconds", "queue": "vllm:request_queue_time_seconds",
                  "prefill": "vllm:request_prefill_time_seconds", "itl": "vllm:inter_token_latency_seconds"}
"""vLLM's request-latency histograms (vllm/v1/metrics/loggers.py): ``ttft`` from the request's arrival at the
API server to its first token there; ``queue`` (engine core: queued -> first scheduled) and ``prefill``
(scheduled -> first token) from the engine core's own timestamps; ``itl`` between tokens at the API server."""


def engine_latency_sums(samples: dict[str, list[tuple[dict[str, str], float]]]) -> dict[str, tuple[float, float]]:
    """``{key: (sum_s, count)}`` of each :data:`ENGINE_LATENCY` histogram in parsed ``/metrics`` samples
    (:func:`loadgen.vllm_fleet.parse_prometheus`); a missing histogram reads (0, 0)."""
    return {k: (metric_value(samples, f"{name}_sum") or 0.0, metric_value(samples, f"{name}_count") or 0.0)
            for k, name in ENGINE_LATENCY.items()}  # fmt: skip


def latency_breakdown(before: Sequence[dict[str, tuple[float, float]]], after: Sequence[dict[str, tuple[float, float]]],
                      client_ttft_mean_ms: float | None) -> dict[str, Any]:  # fmt: skip
    """Where a rate's TTFT went, from the engines' histograms before and after it (one dict per engine,
    :func:`engine_latency_sums`), summed over the engines: ``{key}_mean_ms`` = (sum after - sum before) /
    (count after - count before) x 1000 (None without new samples), and ``front_ms`` = the client's mean
    TTFT - mean queue - mean prefill: the time outside the engine core's scheduling (the client, the
    router and agent where present, vLLM's API server: tokenization, detokenization, output streaming).

    Raises:
        ValueError: ``before`` and ``after`` of different lengths.
    """
    if len(before) != len(after):
        raise ValueError("one before and one after per engine")
    out: dict[str, Any] = {}
    for k in ENGINE_LATENCY:
        ds = sum(a[k][0] - b[k][0] for b, a in zip(before, after, strict=True))
        dn = sum(a[k][1] - b[k][1] for b, a in zip(before, after, strict=True))
        out[f"{k}_mean_ms"] = round(1000.0 * ds / dn, 2) if dn > 0 else None
    q, pf = out["queue_mean_ms"], out["prefill_mean_ms"]
    out["front_ms"] = (round(client_ttft_mean_ms - q - pf, 2)
                       if client_ttft_mean_ms is not None and q is not None and pf is not None else None)  # fmt: skip
    return out


def _wait_idle(url: str, timeout_s: float = 120.0) -> None:
    """Until vLLM reports no running or waiting request (or ``timeout_s``)."""
    t_end = time.monotonic() + timeout_s
    while time.monotonic() < t_end:
        s = parse_prometheus(http_get_text(url + "/metrics"))
        if not (metric_value(s, "vllm:num_requests_running") or 0) and not (metric_value(s, "vllm:num_requests_waiting") or 0):
            return
        time.sleep(1.0)


def _sweep(targets: dict[str, str], engine_urls: list[str], trace: list[TraceRequest], native: float,
           rates: list[float], mode: Mode, slo: dict[str, Any], keys: dict[str, str] | None, say: Callable[[str], None],
           after: Callable[[], dict[str, Any]] | None = None, alternate: bool = False,
           client_log: Path | None = None) -> dict[str, list[dict[str, Any]]]:  # fmt: skip
    """Each rate's ``mode.windows`` windows (:func:`window_trace`) replayed at every target at once (name -> URL),
    each followed by a wait until every engine of ``engine_urls`` is idle; ``alternate``: each window replayed
    at one target after the other instead (target i's engine is ``engine_urls[i]``), so only one engine
    works at a time. ``client_log``: each ok request's first and last token read by the client (monotonic ms)
    appended there as JSON lines ``target, rate, key, first_mono_ms, last_mono_ms`` (loadgen/delivery.py).
    Returns name -> one row per rate (:func:`pool_windows` of its windows)."""
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in targets}
    sent = 0  # requests replayed so far: each window's prompts start past them (no prefix-cache hit on old ones)
    for rate in rates:
        per_window: dict[str, list[dict[str, Any]]] = {name: [] for name in targets}
        for k in range(mode.windows):
            wt = window_trace(trace, native, rate, mode.duration_s, k)
            n = len(window(wt, native, rate, mode.duration_s))
            for tg, eu in sweep_groups(targets, engine_urls, alternate):
                for name, row in _sweep_window(tg, eu, wt, native, rate, mode, slo, keys, say, after, sent,
                                               client_log).items():  # fmt: skip
                    per_window[name].append({**row, "window": k} if mode.windows > 1 else row)
            sent += n
        for name in targets:
            rows[name].append(pool_windows(per_window[name]))
    return rows


def sweep_groups(targets: dict[str, str], engine_urls: list[str],
                 alternate: bool) -> list[tuple[dict[str, str], list[str]]]:  # fmt: skip
    """How one window is replayed: ``[(targets, engine_urls)]`` (every target at once), or with ``alternate``
    one group per target, in order, with its own engine (target i's is ``engine_urls[i]``).

    Raises:
        ValueError: ``alternate`` with a different number of targets and engines.
    """
    if not alternate:
        return [(dict(targets), list(engine_urls))]
    if len(targets) != len(engine_urls):
        raise ValueError(f"alternate replay needs one engine per target, got {len(targets)} and {len(engine_urls)}")
    return [({n: u}, [engine_urls[i]]) for i, (n, u) in enumerate(targets.items())]


def _sweep_window(targets: dict[str, str], engine_urls: list[str], trace: list[TraceRequest], native: float, rate: float,
                  mode: Mode, slo: dict[str, Any], keys: dict[str, str] | None, say: Callable[[str], None],
                  after: Callable[[], dict[str, Any]] | None, prompt_offset: int = 0,
                  client_log: Path | None = None) -> dict[str, dict[str, Any]]:  # fmt: skip
    """One window of one rate at every target (:func:`_sweep`), its prompts from ``prompt_offset`` on.
    Returns name -> row."""
    out: dict[str, dict[str, Any]] = {}
    reqs = window(trace, native, rate, mode.duration_s)
    la = loadavg()
    hist0 = [engine_latency_sums(parse_prometheus(http_get_text(u + "/metrics"))) for u in engine_urls]
    results = _replay(list(targets.values()), reqs, slo, keys, timeout_s=max(60.0, 20 * slo["ttft_ms"] / 1000.0),
                      prompt_offset=prompt_offset)
    la_after = loadavg()
    extra = after() if after is not None else None
    for u in engine_urls:
        _wait_idle(u)
    hist1 = [engine_latency_sums(parse_prometheus(http_get_text(u + "/metrics"))) for u in engine_urls]
    # the engines of each target: all of them for one target (a fleet), else the target's own (side by side)
    per_target = ([list(range(len(engine_urls)))] if len(targets) == 1
                  else [[i] for i in range(len(engine_urls))])  # fmt: skip
    for (name, res), idx in zip(zip(targets, results, strict=True), per_target, strict=True):
        client = res.pop("client_tokens")
        if client_log is not None:
            with client_log.open("a") as fh:
                fh.writelines(json.dumps({"target": name, "rate": round(rate, 4), **c}, separators=(",", ":")) + "\n"
                              for c in client)  # fmt: skip
        row = {"rate_rps": round(rate, 4), "offered_rps": round(len(reqs) / mode.duration_s, 3), "loadavg_before": la,
               **res, "loadavg_after": la_after,
               "latency_breakdown": latency_breakdown([hist0[i] for i in idx], [hist1[i] for i in idx],
                                                      res["ttft_mean_ms"])}  # fmt: skip
        if extra is not None:
            row["time_model"] = extra
        say(f"  {name} at {rate:.3f} rps: {row['requests']} requests, attainment {row['slo_attainment']:.3f}, "
            f"TTFT p99 {_f(row['ttft_p99_ms'], '.0f')} ms, TPOT p99 {_f(row['tpot_p99_ms'], '.0f')} ms (load {la})")
        out[name] = row
    return out


def _capacity(rows: list[dict[str, Any]], target: float = 0.9) -> dict[str, Any]:
    from loadgen.bench_policies import capacity

    cap, bound = capacity(rows, target)
    return {"capacity_rps": round(cap, 4), "capacity_bound": bound}


def stage_single(mode: Mode, work: Path, trace: list[TraceRequest], native: float, rates: list[float],
                 slo: dict[str, Any], coef: Sequence[float], engine: dict[str, float], say: Callable[[str], None],
                 stock: StockReplica | None = None, plugin: PluginSettings = PluginSettings(),
                 side_by_side: bool = False) -> dict[str, Any]:  # fmt: skip
    """Stage 2: one replica each on its own core: vLLM's scheduler (``stock``, the stage-1 replica on core 0
    when given) and the FairBatching plugin (core 1). Each window of each rate is replayed at one replica
    and then the other (the windows interleaved, so both see the machine of the same minutes, and only one
    engine, its API server and the client compete for the two cores); ``side_by_side``: at both at once
    (a paired A/B, but two engines, two API servers and the client on two cores). Both replicas are
    stopped here."""
    rep = stock or start_stock_replica(work, say)
    skip = len(_read_log(rep.step_log))  # the grid's steps, when this is the stage-1 replica
    group = ProcessGroup(work / "logs-single-fairbatching")
    fb_log = work / "single-fairbatching-steps.jsonl"
    try:
        port = free_port()
        env = {**vllm_env(omp_core(1), vllm_cache_root()), **plugin_env(coef, slo, step_log=fb_log, plugin=plugin,
                                                                     request_log=work / "single-fairbatching-requests.jsonl")}  # fmt: skip
        child = group.start("vllm-fairbatching", engine_argv(port, True), env=env)
        url = f"http://127.0.0.1:{port}"
        startup = wait_vllm_ready(group, child, url)
        say(f"one replica each: vllm-default on core 0, fairbatching on core {omp_core(1)} (up in {startup:.0f} s)")
        client_log = work / "single-client-tokens.jsonl"
        rows = _sweep({"vllm-default": rep.url, "fairbatching": url}, [rep.url, url], trace, native, rates, mode, slo,
                      None, say, alternate=not side_by_side, client_log=client_log)  # fmt: skip
    finally:
        group.stop(grace_s=10.0)
        rep.group.stop(grace_s=10.0)
    delivery = run_delivery(work)
    return {
        "vllm-default": {"rows": rows["vllm-default"], **_capacity(rows["vllm-default"]), "core": 0,
                         "startup_s": round(rep.startup_s, 1),
                         "scheduler": "vLLM's Scheduler.schedule() (plugin class, FAIRBATCH_PLUGIN_DISABLE=1)",
                         "step_time_vs_fit": step_time_drift(_read_log(rep.step_log, skip), engine),
                         **delivery["vllm-default"]},
        "fairbatching": {"rows": rows["fairbatching"], **_capacity(rows["fairbatching"]), "core": omp_core(1),
                         "startup_s": round(startup, 1), "scheduler": f"FairBatching plugin ({SCHEDULER_CLS})",
                         "step_time_vs_fit": step_time_drift(_read_log(fb_log), engine),
                         **delivery["fairbatching"]},
    }


def rate_key(rate: float) -> str:
    """The key of a rate in ``delivery_by_rate`` (measured and simulated alike): ``f"{round(rate, 4):g}"``."""
    return f"{round(rate, 4):g}"


def run_delivery(work: Path) -> dict[str, dict[str, Any]]:
    """The one-replica stage's delivery delays from a work dir (the client's ``single-client-tokens.jsonl``
    and each engine's ``FAIRBATCH_REQUEST_LOG``; loadgen/delivery.py): per policy ``{"delivery": summary of
    every rate (quantiles only), "delivery_by_rate": {rate: summary}}`` (rates by :func:`rate_key`, each
    summary with its centred pairs for the simulator)."""
    client = _read_log(work / "single-client-tokens.jsonl")
    out = {}
    for name, log in (("vllm-default", "stock-requests.jsonl"), ("fairbatching", "single-fairbatching-requests.jsonl")):
        engine = _read_log(work / log)
        mine = [c for c in client if c["target"] == name]
        by_rate = {rate_key(r): summarize_delivery(delivery_pairs([c for c in mine if c.get("rate") == r], engine))
                   for r in sorted({c["rate"] for c in mine if c.get("rate") is not None})}  # fmt: skip
        pooled = summarize_delivery(delivery_pairs(mine, engine), max_samples=0)  # the pairs: per rate only
        pooled.pop("centred_pairs_ms", None)
        out[name] = {"delivery": pooled, "delivery_by_rate": by_rate}
    return out


def _agent_time_model(agent_url: str) -> dict[str, Any]:
    """The agent's online time-model metrics (replica_agent/metrics.py), summed over the step sources (a
    plugin-mode agent learns from the plugin's step records, a proxy-mode one from relayed token gaps)."""
    s = parse_prometheus(http_get_text(agent_url + "/metrics"))
    steps = metric_value(s, "fairbatch_agent_time_model_steps_total") or 0.0
    late = metric_value(s, "fairbatch_agent_time_model_late_steps_total") or 0.0
    sources = sorted({lab["source"] for lab, _ in s.get("fairbatch_agent_time_model_steps_total", [])})
    coef = {lab["term"]: v for lab, v in s.get("fairbatch_agent_time_model_coefficient", [])}
    resid = {lab["level"]: v for lab, v in s.get("fairbatch_agent_time_model_residual_ratio", [])}
    return {"sources": sources, "steps": steps, "late_steps": late, "late_share": late / steps if steps else None,
            "mean_abs_error_ratio": metric_value(s, "fairbatch_agent_time_model_mean_abs_error_ratio"),
            "margin_ratio": metric_value(s, "fairbatch_agent_time_model_margin_ratio"),
            "residual_ratio": resid, "coefficients": coef}  # fmt: skip


def stage_pair(mode: Mode, work: Path, trace: list[TraceRequest], native: float, rates: list[float],
               slo: dict[str, Any], coef: Sequence[float], engine: dict[str, float],
               say: Callable[[str], None], baselines: Sequence[str] = PAIR_BASELINES,
               plugin: PluginSettings = PluginSettings()) -> dict[str, Any]:  # fmt: skip
    """Stage 3: two replicas (cores 0 and 1) behind agents and the router: pab + fairbatching (plugin,
    agents in plugin mode) vs each of ``baselines`` (router placement profiles, router/placement/baselines.py;
    stock vLLM, agents in proxy mode)."""
    from loadgen.vllm_fleet import start_vllm_fleet

    keys = {n: f"fb-{n}-{secrets.token_urlsafe(12)}" for n, _ in TENANTS}
    slo_class = {"interactive": {"ttft_ms": slo["ttft_ms"], "tpot_ms": slo["tpot_ms"], "priority": 0, "sheddable": True,
                                 "max_queue_ms": 2.0 * slo["ttft_ms"]}}  # fmt: skip
    tenants = {n: {"weight": w, "slo_class": "interactive"} for n, w in TENANTS}
    out: dict[str, Any] = {}
    sock_dir = Path(tempfile.mkdtemp(prefix="fb-ab-", dir="/tmp"))
    for name, on, placement in (("pab+fairbatching", True, "pab"), *((b, False, b) for b in baselines)):
        overrides = {"slo_classes": slo_class, "tenants": tenants, "placement": {"profile": placement}}

        def env_of(r: Any, on: bool = on, name: str = name) -> dict[str, str]:
            e: dict[str, str] = {}
            if on:
                e.update(plugin_env(coef, slo, export=f"unix:{sock_dir}/{r.replica_id}.sock", plugin=plugin,
                                    step_log=work / f"pair-{name}-{r.replica_id}-steps.jsonl"))  # fmt: skip
            return e

        def agent_of(r: Any, on: bool = on) -> list[str]:
            return ["--plugin-export", f"unix:{sock_dir}/{r.replica_id}.sock"] if on else []

        fleet = start_vllm_fleet(
            work / f"pair-{name}", [None, None], api_keys=keys, config_overrides=overrides, log=say,
            model_dir=bench_model_dir(), served_model_name=SERVED, max_model_len=MAX_MODEL_LEN,
            engine_args=["--scheduler-cls", SCHEDULER_CLS] if on else [], engine_env=env_of,
            per_replica_agent_args=agent_of, coefficients=coef,
        )
        try:
            urls = [r.engine_url for r in fleet.replicas]
            after = (lambda f=fleet: {r.replica_id: _agent_time_model(r.agent_url) for r in f.replicas})
            rows = _sweep({name: fleet.router_url}, urls, trace, native, rates, mode, slo, keys, say, after)[name]
            out[name] = {"rows": rows, **_capacity(rows), "startup_s": round(fleet.startup_s, 1)}
        finally:
            fleet.stop()
        if on:
            out[name]["step_time_vs_fit"] = {
                r.replica_id: step_time_drift(_read_log(work / f"pair-{name}-{r.replica_id}-steps.jsonl"), engine)
                for r in fleet.replicas}  # fmt: skip
    shutil.rmtree(sock_dir, ignore_errors=True)
    return out


# ---- the simulator on the same workload -------------------------------------------------------------

def measured_front_ms(doc: dict[str, Any], setup: str) -> float | None:
    """The median ``front_ms`` (:func:`latency_breakdown`) over every measured row of ``setup`` (``single``
    or ``pair``, every policy), None when none was measured."""
    vals = [r["latency_breakdown"]["front_ms"] for m in doc.get(setup, {}).values() for r in m.get("rows", [])
            if (r.get("latency_breakdown") or {}).get("front_ms") is not None]  # fmt: skip
    return round(float(np.median(vals)), 2) if vals else None


def stage_sim(trace: list[TraceRequest], native: float, rates: list[float], pair_rates: list[float], mode: Mode,
              slo: dict[str, Any], engine_time: Any, baselines: Sequence[str] = PAIR_BASELINES,
              front_ms: tuple[float, float] = (0.0, 0.0), seeds: int = 1,
              slowdown: dict[str, Any] | None = None, decode_guard_ms: float = 0.0,
              delivery: dict[str, dict[str, Sequence[Sequence[float]]]] | None = None) -> dict[str, Any]:  # fmt: skip
    """Stage 4: bench-policies (one replica) and bench-fleet (two replicas) at the measured rates and windows
    (an empty ``rates`` or ``pair_rates`` skips that setup).

    Args:
        front_ms: the engine front delay (single, pair) the simulated engines add (``engine_front_ms``).
        seeds: engine-noise seeds per point (the engine model's seed + 0 .. seeds - 1); a row's
            ``slo_attainment`` is the mean over the seeds (each pooling the rate's windows as the
            measured rows do), ``attainment_p10`` / ``attainment_p90`` their spread, and
            ``capacity_rps`` is read from the mean curve; ``seed_capacity_rps`` per seed.
        slowdown: per setup (``single``, ``pair``) a :func:`fit_run_slowdown` result: the engines then
            step with that correlated slowdown and its white noise in place of ``noise_sigma``.
        decode_guard_ms: the FairBatching replicas' decode guard (:class:`PluginSettings`), as measured.
        delivery: one-replica policy -> rate (:func:`rate_key`) -> its measured centred delivery pairs
            (loadgen/delivery.py, ``summarize_delivery``'s ``centred_pairs_ms``): its simulated tokens at
            that rate reach the client as its real ones did (BenchSetup.delivery_ms); None or a rate not
            there: at their steps' ends.
    """
    from loadgen.bench_policies import BenchSetup
    from loadgen.bench_policies import run_point as policies_point
    from loadgen.fleet.bench import Setup
    from loadgen.fleet.bench import run_point as fleet_point
    from replica_agent.policy.profiles import load_profile, vllm_serve_batch_defaults

    def engine_of(setup_name: str, seed: int) -> Any:
        e = dataclasses.replace(engine_time, seed=engine_time.seed + seed)
        fit = (slowdown or {}).get(setup_name)
        if fit:
            e = dataclasses.replace(e, noise_sigma=fit["white_sigma"], slowdown=SlowdownModel.from_dict(fit["model"]))
        return e

    def point(run: Callable[[int, int, float], dict[str, Any]], rate: float, keys: Sequence[str]) -> dict[str, Any]:
        per_seed = [pool_windows([{k: v for k, v in run(seed, w, rate).items() if k in keys}
                                  for w in range(mode.windows)]) for seed in range(seeds)]  # fmt: skip
        att = [r["slo_attainment"] for r in per_seed]
        row = {k: float(np.mean([r[k] for r in per_seed if r.get(k) is not None]))
               if any(r.get(k) is not None for r in per_seed) else None for k in keys if k not in ("rate_rps", "requests")}  # fmt: skip
        row.update({"rate_rps": rate, "requests": per_seed[0].get("requests"), "seeds": seeds,
                    "attainment_p10": float(np.quantile(att, 0.1)), "attainment_p90": float(np.quantile(att, 0.9)),
                    "seed_attainment": att})  # fmt: skip
        return row

    def with_capacity(rows: list[dict[str, Any]]) -> dict[str, Any]:
        seed_caps = [_capacity([{"rate_rps": r["rate_rps"], "slo_attainment": r["seed_attainment"][i]} for r in rows])["capacity_rps"]
                     for i in range(seeds)]  # fmt: skip
        return {"rows": rows, **_capacity(rows), "seed_capacity_rps": seed_caps}

    prof = load_profile(PROFILE)
    batch = vllm_serve_batch_defaults(prof.gpu)
    setup = BenchSetup(tuple(trace), native, PROFILE, "all_batches", slo["ttft_ms"], slo["tpot_ms"], mode.duration_s,
                       batch.max_num_batched_tokens, batch.max_num_seqs, 128, MAX_MODEL_LEN, None, engine_time,
                       engine_front_ms=front_ms[0], decode_guard_ms=decode_guard_ms)  # fmt: skip
    single_keys = ("rate_rps", "requests", "slo_attainment", "ttft_miss_frac", "tpot_miss_frac", "ttft_p99_ms", "tpot_p99_ms")
    single = {}
    for p in ("vllm-default", "fairbatching") if rates else ():
        def run1(seed: int, w: int, r: float, p: str = p) -> dict[str, Any]:
            st = dataclasses.replace(setup, trace=tuple(window_trace(trace, native, r, mode.duration_s, w)),
                                     engine_time=engine_of("single", seed),
                                     delivery_ms=tuple((float(a), float(b))
                                                       for a, b in (delivery or {}).get(p, {}).get(rate_key(r), ())))  # fmt: skip
            return policies_point(st, p, r)
        single[p] = with_capacity([point(run1, r, single_keys) for r in rates])
    fsetup = Setup(tuple(trace), native, 2, PROFILE, slo["ttft_ms"], slo["tpot_ms"], mode.duration_s, 60.0, 1, 100.0,
                   0.5, "fair", prof.time_model.tokens_within_ms(slo["ttft_ms"]), True, MAX_MODEL_LEN, 0,
                   batch.max_num_batched_tokens, batch.max_num_seqs, 0.0, engine_time, 0.0, 0.0, "reserve", None, 1,
                   True, engine_front_ms=front_ms[1], decode_guard_ms=decode_guard_ms)  # fmt: skip
    pair_keys = ("rate_rps", "requests", "slo_attainment", "ttft_p99_ms", "tpot_p99_ms", "late_step_frac", "refused_share")
    pair = {}
    for p in ("pab+fairbatching", *baselines) if pair_rates else ():
        def run2(seed: int, w: int, r: float, p: str = p) -> dict[str, Any]:
            st = dataclasses.replace(fsetup, trace=tuple(window_trace(trace, native, r, mode.duration_s, w)),
                                     engine_time=engine_of("pair", seed))  # fmt: skip
            return fleet_point(st, p, r)
        pair[p] = with_capacity([point(run2, r, pair_keys) for r in pair_rates])
    return {"single": single, "pair": pair, "engine_front_ms": {"single": front_ms[0], "pair": front_ms[1]},
            "seeds": seeds, "windows": mode.windows,
            "slowdown": {k: v["model"] for k, v in (slowdown or {}).items() if v}}


def sim_capacity_guess(trace: list[TraceRequest], native: float, mode: Mode, slo: dict[str, Any], engine_time: Any) -> float:
    """The simulated vllm-default capacity of one replica (rates 0.1 .. 6.4 rps, doubling, then interpolated)."""
    from loadgen.bench_policies import BenchSetup, run_point
    from replica_agent.policy.profiles import load_profile, vllm_serve_batch_defaults

    batch = vllm_serve_batch_defaults(load_profile(PROFILE).gpu)
    setup = BenchSetup(tuple(trace), native, PROFILE, "all_batches", slo["ttft_ms"], slo["tpot_ms"], 60.0,
                       batch.max_num_batched_tokens, batch.max_num_seqs, 128, MAX_MODEL_LEN, None, engine_time)  # fmt: skip
    rows = [run_point(setup, "vllm-default", 0.1 * 2**k) for k in range(7)]
    return _capacity(rows)["capacity_rps"] or 0.1


# ---- main -------------------------------------------------------------------------------------------

def comparison(measured: dict[str, Any], simulated: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows ``{setup, policy, measured_capacity_rps, simulated_capacity_rps, gap}`` (gap = sim / measured - 1)."""
    out = []
    for setup in ("single", "pair"):
        for pol, m in measured.get(setup, {}).items():
            s = simulated.get(setup, {}).get(pol)
            if s is None:
                continue
            mc, sc = m["capacity_rps"], s["capacity_rps"]
            out.append({"setup": setup, "policy": pol, "measured_capacity_rps": mc, "simulated_capacity_rps": sc,
                        "gap": round(sc / mc - 1.0, 3) if mc > 0 else None,
                        "attainment": [{"rate_rps": a["rate_rps"], "measured": a["slo_attainment"], "simulated": b["slo_attainment"],
                                        **({"simulated_p10": b["attainment_p10"], "simulated_p90": b["attainment_p90"]}
                                           if "attainment_p10" in b else {})}
                                       for a, b in zip(m["rows"], s["rows"], strict=False)]})  # fmt: skip
    return out


def _f(v: Any, fmt: str = ".3f") -> str:
    return "-" if v is None else format(v, fmt)


def markdown_table(doc: dict[str, Any]) -> str:
    """The docs/vllm.md tables of a result JSON: capacity per setup and policy, measured and simulated,
    attainment per rate, verdicts, the agents' time model and the fit."""
    lines = []
    slo = doc.get("slo", {})
    lines.append(f"Mode `{doc.get('mode')}`; SLO TTFT {_f(slo.get('ttft_ms'), 'g')} ms, TPOT {_f(slo.get('tpot_ms'), 'g')} ms "
                 f"({slo.get('rule', '')}); load average at start {doc.get('started_loadavg')}, at the end "
                 f"{doc.get('finished_loadavg')}; {doc.get('wall_s')} s in all.")
    sims = doc.get("simulated", {})
    lines.append(f"Windows per rate: {doc.get('windows', 1)}; simulated points: the mean of {sims.get('seeds', 1)} engine "
                 "seed(s).")
    lines += ["", "| setup | policy | rate (offered) rps | attainment measured | attainment simulated | attainment "
              "simulated + front | attainment simulated + front + slowdown (p10-p90 over seeds) | capacity measured "
              "(rps) | capacity simulated (rps) | sim / measured | sim + front / measured | sim + front + slowdown "
              "/ measured |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    sim, simf, sims_ = doc.get("simulated", {}), doc.get("simulated_front", {}), doc.get("simulated_slowdown", {})
    bound = {"at-least": ">= ", "below-sweep": "< "}
    for setup in ("single", "pair"):
        for pol, m in doc.get(setup, {}).items():
            s = sim.get(setup, {}).get(pol, {})
            sf = simf.get(setup, {}).get(pol, {})
            fatt = " / ".join(_f(r["slo_attainment"], ".2f") for r in sf.get("rows", []))
            fratio = _f(sf["capacity_rps"] / m["capacity_rps"], ".2f") if sf and m["capacity_rps"] > 0 else "-"
            ss = sims_.get(setup, {}).get(pol, {})
            satt_slow = " / ".join(f"{r['slo_attainment']:.2f}" + (f" ({r['attainment_p10']:.2f}-{r['attainment_p90']:.2f})"
                                                                   if "attainment_p10" in r else "")
                                   for r in ss.get("rows", []))  # fmt: skip
            sratio = (bound.get(ss.get("capacity_bound", ""), "") + _f(ss["capacity_rps"] / m["capacity_rps"], ".2f")
                      if ss and m["capacity_rps"] > 0 else "-")  # fmt: skip
            rates = " / ".join(f"{r['rate_rps']:.2f} ({r.get('offered_rps', 0):.2f})" for r in m["rows"])
            att = " / ".join(_f(r["slo_attainment"], ".2f") for r in m["rows"])
            satt = " / ".join(_f(r["slo_attainment"], ".2f") for r in s.get("rows", []))
            mc = bound.get(m["capacity_bound"], "") + _f(m["capacity_rps"], ".2f")
            sc = bound.get(s.get("capacity_bound", ""), "") + _f(s.get("capacity_rps"), ".2f") if s else "-"
            ratio = _f(s["capacity_rps"] / m["capacity_rps"], ".2f") if s and m["capacity_rps"] > 0 else "-"
            name = "1 replica" if setup == "single" else "2 replicas"
            lines.append(f"| {name} | {pol} | {rates} | {att} | {satt or '-'} | {fatt or '-'} | {satt_slow or '-'} | {mc} "
                         f"| {sc} | {ratio} | {fratio} | {sratio} |")
    simd = doc.get("simulated_delivery", {}).get("single", {})
    if simd:
        lines += ["", "Delivery (loadgen/delivery.py: client time - engine time of the first and last token, ms) and the "
                  "simulator with it (sim + front + the run's slowdown, when fitted, + delivery):", "",
                  "| policy | requests | d_first p50 / p90 | d_last - d_first p10 / p50 / p90 / p99 | attainment simulated "
                  "+ delivery | capacity | / measured |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for pol, m in doc.get("single", {}).items():
            d, sd = m.get("delivery") or {}, simd.get(pol, {})
            if not d.get("requests") or not sd:
                continue
            df, dd = d["d_first_ms"], d["d_last_minus_first_ms"]
            att = " / ".join(_f(r["slo_attainment"], ".2f") for r in sd.get("rows", []))
            ratio = (bound.get(sd.get("capacity_bound", ""), "") + _f(sd["capacity_rps"] / m["capacity_rps"], ".2f")
                     if m["capacity_rps"] > 0 else "-")  # fmt: skip
            lines.append(f"| {pol} | {d['requests']} | {df['p50']:.1f} / {df['p90']:.1f} | {dd['p10']:.1f} / {dd['p50']:.1f} / "
                         f"{dd['p90']:.1f} / {dd['p99']:.1f} | {att} | {bound.get(sd.get('capacity_bound', ''), '')}"
                         f"{_f(sd.get('capacity_rps'), '.2f')} | {ratio} |")
    doc = {**doc, "verdicts": verdicts(doc)}
    if doc["verdicts"]:
        lines += ["", "Verdicts (by capacity at attainment >= 0.9, 5 % either way = no gain, when the sweep brackets "
                  "both; else by mean attainment, 0.05 either way): "
                  + "; ".join(f"{k}: **{v['verdict']}** ({v['a']} vs {v['b']}, {v['by']})" for k, v in doc["verdicts"].items())
                  + "."]
    bd = [(setup, pol, r) for setup in ("single", "pair") for pol, m in doc.get(setup, {}).items() for r in m["rows"]
          if r.get("latency_breakdown")]  # fmt: skip
    if bd:
        lines += ["", "| setup | policy | rate (rps) | client TTFT mean (ms) | vLLM TTFT mean | engine queue mean | engine "
                  "prefill mean | front (client - queue - prefill) | vLLM ITL mean | not ok |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for setup, pol, r in bd:
            b = r["latency_breakdown"]
            lines.append(f"| {setup} | {pol} | {r['rate_rps']:.2f} | {_f(r.get('ttft_mean_ms'), '.0f')} | "
                         f"{_f(b.get('ttft_mean_ms'), '.0f')} | {_f(b.get('queue_mean_ms'), '.0f')} | "
                         f"{_f(b.get('prefill_mean_ms'), '.0f')} | {_f(b.get('front_ms'), '.0f')} | {_f(b.get('itl_mean_ms'), '.1f')} | "
                         f"{', '.join(f'{k} {v}' for k, v in (r.get('not_ok_reasons') or {}).items()) or '-'} |")
    drift = []
    for setup in ("single", "pair"):
        for pol, m in doc.get(setup, {}).items():
            d = m.get("step_time_vs_fit")
            for rid, v in ((None, d),) if d and "steps" in d else (d or {}).items():
                if v and v.get("steps"):
                    drift.append(f"{setup} {pol}{' ' + rid if rid else ''}: {v['median_ratio']:.2f} "
                                 f"(p10 {v['p10_ratio']:.2f}, p90 {v['p90_ratio']:.2f}, {v['steps']} steps)")
    if drift:
        lines += ["", "Engine steps during the runs against the fitted model (median measured / predicted): "
                  + "; ".join(drift) + "."]
    tm = [(r["rate_rps"], rid, t) for r in doc.get("pair", {}).get("pab+fairbatching", {}).get("rows", [])
          for rid, t in (r.get("time_model") or {}).items()]  # fmt: skip
    if tm:
        lines += ["", "| rate (rps) | replica | steps learned | one-step-ahead mean abs error | p90 residual | margin "
                  "| late steps |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for rate, rid, t in tm:
            lines.append(f"| {rate:.2f} | {rid} | {t['steps']:.0f} | {_f(t['mean_abs_error_ratio'])} | "
                         f"{_f(t['residual_ratio'].get('0.9'))} | {_f(t['margin_ratio'])} | {_f(t['late_share'])} |")
    fit = doc.get("fit")
    if fit:
        e = fit["engine"]
        lines += ["", f"Fit ({fit['steps']} steps, load average {fit['loadavg_before']} -> {fit['loadavg_after']}): "
                  + ", ".join(f"{k} {v:g}" for k, v in e.items())
                  + "; mean / max relative error " + ", ".join(f"{k} {v['mean_rel_err']:.3f} / {v['max_rel_err']:.3f}"
                                                             for k, v in fit["error_by_kind"].items())
                  + "; measured " + ", ".join(f"{k} {v['median_ms']:.0f} ms" for k, v in fit["measured_spots"].items()) + "."]
    return "\n".join(lines)


def _run_stages(args: argparse.Namespace, mode: Mode, doc: dict[str, Any], work: Path, et_out: Path,
                holder: list[StockReplica | None], say: Callable[[str], None]) -> None:
    """The stages of ``args.stages`` in order, results into ``doc``; ``holder[0]``: the live stock replica."""
    from loadgen.sim.engine_time import EngineTimeModel

    # the guard the plugin replicas ran with (a sim-only run simulates the measured result's)
    guard = float(doc.get("plugin_decode_guard_ms") or 0.0)
    plugin = PluginSettings(args.plugin_policy, args.plugin_plan_model, guard)
    if "fit" in args.stages:
        holder[0] = start_stock_replica(work, say)
        fit = stage_fit(mode, holder[0], say)
        if "single" not in args.stages:
            holder[0].group.stop(grace_s=10.0)
            holder[0] = None
        doc["fit"] = fit
        et_out.parent.mkdir(parents=True, exist_ok=True)
        et_out.write_text(json.dumps(engine_time_json(fit), indent=1) + "\n")
        say(f"engine-time fit written to {et_out}")
        if et_out.resolve() == ENGINE_TIME_FILE.resolve():
            write_profile_row(fit)
            say(f"profile {PROFILE} (linear fit) written to {PROFILE_CSV.relative_to(REPO_ROOT)}")
    et_path = et_out if et_out.exists() else ENGINE_TIME_FILE
    et_doc = json.loads(et_path.read_text())
    engine = {k: et_doc[k] for k in ("a_ms", "b_ms", "c_ms", "d_ms", "e_ms", "f_ms")}
    engine_time = EngineTimeModel.from_dict(et_doc, str(et_path))
    lin = et_doc["meta"]["linear_fit"]
    coef = (lin["a_ms"], lin["b_ms"], lin["c_ms"])
    full = load_trace(resolve_trace("azure-conv"))
    native = len(full) / max(1e-9, (full[-1].arrival_ms - full[0].arrival_ms) / 1000.0)
    trace = [TraceRequest(r.arrival_ms - TRACE_START_S * 1000.0, r.prompt_tokens, r.output_tokens)
             for r in scaled_trace(full) if r.arrival_ms >= TRACE_START_S * 1000.0]  # fmt: skip
    slo = slo_rule(engine, trace)
    guess = sim_capacity_guess(trace, native, mode, slo, engine_time)
    measured_rates = (doc.get("rates_rps") or {}).get("single") if not {"single", "pair"} & set(args.stages) else None
    rates = (sorted(args.rates) if args.rates else list(measured_rates) if measured_rates  # a sim-only run: the measured
             else [round(f * guess, 3) for f in mode.rate_factors])  # fmt: skip
    pair_rates = [round(2 * r, 3) for r in rates]
    doc.update({"workload": {"trace": "azure-conv", "trace_start_s": TRACE_START_S, "length_scale": LENGTH_SCALE,
                             "max_model_len": MAX_MODEL_LEN,
                             "native_rps": round(native, 4), "duration_s": mode.duration_s},
                "slo": slo, "engine_time_file": str(et_path.relative_to(REPO_ROOT)) if et_path.is_relative_to(REPO_ROOT) else str(et_path),
                "planning_coefficients_ms": coef, "simulated_capacity_guess_rps": guess,
                "rates_rps": {"single": rates, "pair": pair_rates}})  # fmt: skip
    say(f"SLO: {slo['rule']} -> TTFT {slo['ttft_ms']:g} ms, TPOT {slo['tpot_ms']:g} ms; rates {rates} (x2 for two replicas)")
    stock_skip = len(_read_log(holder[0].step_log)) if holder[0] is not None else 0  # the grid's steps
    if "single" in args.stages:
        rep, holder[0] = holder[0], None
        doc["single"] = stage_single(mode, work, trace, native, rates, slo, coef, engine, say, rep, plugin,
                                     args.single_side_by_side)  # fmt: skip
        doc["single_order"] = "side by side" if args.single_side_by_side else "alternate"
    if "pair" in args.stages:
        doc["pair"] = stage_pair(mode, work, trace, native, pair_rates, slo, coef, engine, say, args.pair_baselines,
                                 plugin)  # fmt: skip
    if {"single", "pair"} & set(args.stages):
        doc["slowdown"] = {**doc.get("slowdown", {}), **run_slowdowns(work, engine, stock_skip), "from": "this run"}
    if args.slowdown_logs:
        doc["slowdown"] = {**run_slowdowns(Path(args.slowdown_logs), engine), "from": str(args.slowdown_logs)}
    if args.delivery_logs and "single" in doc:
        for name, d in run_delivery(Path(args.delivery_logs)).items():
            if name in doc["single"]:
                doc["single"][name].update(d)
    if args.slowdown_from:
        other = json.loads(Path(args.slowdown_from).read_text()).get("slowdown") or {}
        doc["slowdown"] = {**{k: v for k, v in other.items() if k in ("single", "pair")}, "from": str(args.slowdown_from)}
    if "sim" in args.stages:
        if "single" in doc or "pair" in doc:  # simulate the setups that were measured
            rates, pair_rates = (rates if "single" in doc else []), (pair_rates if "pair" in doc else [])
        doc["simulated"] = stage_sim(trace, native, rates, pair_rates, mode, slo, engine_time, args.pair_baselines,
                                     seeds=args.sim_seeds, decode_guard_ms=guard)  # fmt: skip
        fronts = (measured_front_ms(doc, "single"), measured_front_ms(doc, "pair"))
        front = (fronts[0] or 0.0, fronts[1] or 0.0)
        if any(f is not None for f in fronts):  # the same, with the time outside the engine core measured above
            doc["simulated_front"] = stage_sim(trace, native, rates, pair_rates, mode, slo, engine_time,
                                               args.pair_baselines, front, seeds=args.sim_seeds, decode_guard_ms=guard)  # fmt: skip
        slow = {k: v for k, v in (doc.get("slowdown") or {}).items() if k in ("single", "pair")}
        if slow:  # and with the run's own correlated slowdowns of the engine steps
            doc["simulated_slowdown"] = stage_sim(trace, native, rates, pair_rates, mode, slo, engine_time,
                                                  args.pair_baselines, front, seeds=args.sim_seeds, slowdown=slow,
                                                  decode_guard_ms=guard)  # fmt: skip
            doc["simulated_slowdown"]["slowdown_from"] = doc["slowdown"].get("from")
        pairs = {p: {r: d["centred_pairs_ms"] for r, d in (m.get("delivery_by_rate") or {}).items() if d.get("centred_pairs_ms")}
                 for p, m in doc.get("single", {}).items()}  # fmt: skip
        pairs = {p: v for p, v in pairs.items() if v}
        if pairs and rates:  # and with each policy's tokens reaching the client as its real ones did
            doc["simulated_delivery"] = stage_sim(trace, native, rates, [], mode, slo, engine_time, args.pair_baselines,
                                                  front, seeds=args.sim_seeds, slowdown=slow or None,
                                                  decode_guard_ms=guard, delivery=pairs)  # fmt: skip


def _nonnegative_ms(text: str) -> float:
    """argparse type of ``--plugin-decode-guard-ms``: the plugin's own rule (``decode_guard_ms``)."""
    from replica_agent.policy.batching import decode_guard_ms

    try:
        return decode_guard_ms(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def main(argv: Sequence[str] | None = None) -> int:
    """Run the stages; write the JSON (and, after a full ``fit``, the engine-time file). Returns the exit code."""
    ap = argparse.ArgumentParser(prog="python -m loadgen.vllm_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small grid, 20 s per rate, two rates (validation, ~8 min)")
    ap.add_argument("--stages", nargs="+", default=["fit", "single", "pair", "sim"], choices=["fit", "single", "pair", "sim"])
    ap.add_argument("--out", default=None, help=f"result JSON (default: {DEFAULT_OUT.relative_to(REPO_ROOT)}; "
                                                "--quick: out/vllm-ab-quick.json)")  # fmt: skip
    ap.add_argument("--engine-time-out", default=None,
                    help=f"where a fit writes the engine-time file (default: {ENGINE_TIME_FILE.relative_to(REPO_ROOT)} in "
                         "full mode, out/ with --quick)")  # fmt: skip
    ap.add_argument("--rates", type=float, nargs="+", default=None, help="one-replica rates (rps; default: the "
                    "mode's factors x the simulated vllm-default capacity); two replicas run at twice these")
    ap.add_argument("--pair-baselines", nargs="+", default=list(PAIR_BASELINES), metavar="PROFILE",
                    help="router placement profiles the two-replica stage compares with pab+fairbatching (default: "
                         "least-outstanding; e.g. also static-queue-cap)")  # fmt: skip
    ap.add_argument("--plugin-policy", default=None, choices=["fairbatching", "fairbatching-pd"],
                    help="FAIRBATCH_POLICY of the plugin replicas (default: the plugin's, fairbatching); the rows "
                         "keep the name fairbatching and the JSON says which ran (plugin_policy)")  # fmt: skip
    ap.add_argument("--plugin-plan-model", default=None, choices=["conservative", "point"],
                    help="FAIRBATCH_PLAN_MODEL of the plugin replicas (default: the plugin's, conservative)")
    ap.add_argument("--plugin-decode-guard-ms", type=_nonnegative_ms, default=0.0, metavar="MS",
                    help="FAIRBATCH_DECODE_GUARD_MS of the plugin replicas (default 0): each decode's deadline "
                         "planned this many ms early; the simulated FairBatching replicas use the same")  # fmt: skip
    ap.add_argument("--windows", type=int, default=1, help="trace windows replayed per rate, one after the other "
                    "(default 1); a rate's row pools them")
    ap.add_argument("--single-side-by-side", action="store_true",
                    help="one-replica stage: replay each window at both replicas at once (before 2026-12-07 the only way) "
                         "instead of one after the other")  # fmt: skip
    ap.add_argument("--sim-seeds", type=int, default=8, help="engine-noise seeds per simulated point (default 8): the "
                    "simulated attainment is their mean, with the 10-90 %% spread")
    ap.add_argument("--slowdown-logs", metavar="DIR", default=None,
                    help="fit the simulated engines' correlated slowdowns from the step logs of an earlier run's work "
                         "directory (its path is printed at the end of a run)")  # fmt: skip
    ap.add_argument("--delivery-logs", metavar="DIR", default=None,
                    help="with the sim stage alone: take the one-replica delivery delays again from that earlier run's "
                         "work dir (loadgen/delivery.py)")  # fmt: skip
    ap.add_argument("--slowdown-from", metavar="JSON", default=None,
                    help="take the simulated engines' correlated slowdowns from another result JSON (out of sample)")
    ap.add_argument("--table", metavar="JSON", default=None, help="only print the markdown tables of a result JSON")
    ap.add_argument("--merge", metavar="JSON", nargs="+", default=None,
                    help="merge results of the same workload at different rates into --out (rows by rate, capacities, "
                         "verdicts and comparisons recomputed) and print its tables")  # fmt: skip
    args = ap.parse_args(argv)
    if args.table:
        print(markdown_table(json.loads(Path(args.table).read_text())))
        return 0
    if args.merge:
        if not args.out:
            ap.error("--merge needs --out")
        merged = merge_results([json.loads(Path(p).read_text()) for p in args.merge])
        Path(args.out).write_text(json.dumps(merged, indent=1, default=list) + "\n")
        print(markdown_table(merged))
        return 0
    mode = QUICK if args.quick else FULL
    if args.windows < 1 or args.sim_seeds < 1:
        ap.error("--windows and --sim-seeds must be >= 1")
    mode = dataclasses.replace(mode, windows=args.windows)
    out = Path(args.out or (REPO_ROOT / "out" / "vllm-ab-quick.json" if args.quick else DEFAULT_OUT))
    et_out = Path(args.engine_time_out or (REPO_ROOT / "out" / f"{PROFILE}-quick.json" if args.quick else ENGINE_TIME_FILE))
    out.parent.mkdir(parents=True, exist_ok=True)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    t0 = time.monotonic()
    doc: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    measuring = bool({"fit", "single", "pair"} & set(args.stages))
    # a run of the sim stage alone on an earlier result keeps that result's own run figures
    run_keys = ("started_loadavg", "wall_s", "finished_loadavg") if measuring else ("sim_started_loadavg", "sim_wall_s",
                                                                                     "sim_finished_loadavg")  # fmt: skip
    doc[run_keys[0]] = loadavg()
    if not measuring and doc.get("windows"):
        mode = dataclasses.replace(mode, windows=int(doc["windows"]))  # simulate the windows that were measured
    if measuring or "mode" not in doc:
        doc.update({"mode": "quick" if args.quick else "full", "nproc": os.cpu_count(), "windows": mode.windows,
                    "plugin_policy": args.plugin_policy or "fairbatching",
                    "plugin_plan_model": args.plugin_plan_model or "conservative",
                    "plugin_decode_guard_ms": args.plugin_decode_guard_ms})  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="fairbatch-vllm-ab-"))
    if measuring:
        ensure_bench_model(say)
    holder: list[StockReplica | None] = [None]
    try:
        _run_stages(args, mode, doc, work, et_out, holder, say)
    finally:
        if holder[0] is not None:
            holder[0].group.stop(grace_s=10.0)
        doc[run_keys[1]] = round(time.monotonic() - t0, 1)
        doc[run_keys[2]] = loadavg()
        add_derived(doc)
        out.write_text(json.dumps(doc, indent=1, default=list) + "\n")
        say(f"written {out} ({doc[run_keys[1]]:.0f} s); work dir {work}")
        try:
            print(markdown_table(doc))
        except (KeyError, TypeError, ZeroDivisionError) as e:  # a partial run: the JSON is what counts
            say(f"no table for this partial result ({e!r})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
