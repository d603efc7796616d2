"""One-step-ahead error of the online time model on two engine models (issue 27 item 7).

Usage::

    python scripts/bench_time_model_error.py --out docs/bench/time_model_error.json

For each engine model (:data:`ENGINES`: the simulated engine's own step time, loadgen/sim/engine_time.py,
which the policies never see), policy and load, one fleet simulation (loadgen/fleet/sim.py, bench-fleet's
headline setup: :func:`loadgen.fleet.bench.headline_setup`, ``vllm serve``'s defaults for the profile's GPU)
per online-model variant (:data:`MODELS`: ``before`` = the five-term model at the defaults before issue 27,
``after`` = this revision's). Every step each replica's online model observes is recorded: its features,
its measured time (the engine model times its log-normal noise) and the point model's prediction before
the update (``OnlineTimeModel.observe``'s ratio). Loads are fractions of the steady-state bound under
that engine model (loadgen/fleet/bound.py; the bound comes from the engine's model, the policies plan
with their own).

Per run (JSON ``runs[]``):

- ``mean_abs_error``: mean of ``|measured / predicted - 1|`` over the steps that ended in the counted
  window [warm-up, end of arrivals], every replica's steps pooled: the simulator's quantity
  (``FleetStats.time_model_mean_abs_error``) over the steady state;
- ``sim_reported``: ``FleetStats.time_model_mean_abs_error`` as bench-fleet prints it: the mean over
  replicas of the same over each replica's last ``window`` (256) steps when the run ends, i.e. after the
  drain (mostly decode-only steps; docs/evaluation.md "Online time model");
- ``signed_mean`` (mean of ``measured / predicted - 1``), quantiles of ``|r - 1|``, ``steps``,
  ``late_step_frac`` (steps longer than the conservative model planned, FleetStats.late_steps), and
  ``slo_attainment`` (TTFT 1000 / TPOT 100 ms, requests that arrived after the warm-up; what the model
  steers, so a model change shows there too);
- ``buckets``: the same mean and signed mean by step kind, prefill tokens, mean chunk length
  (``sum chunk^2 / sum chunk`` over its prefill chunks), sequences and context tokens;
- ``replay`` (``before`` runs only; the diagnosis): the recorded steps, per replica in order, fed to
  fresh online models that differ from ``before`` in one setting (:data:`REPLAYS`), scored the same way.
  Open loop: the steps are those the ``before`` model's policies formed, so the comparison isolates the
  model from the policy it steers.

``--quick`` runs one policy at one load on a short window (a smoke test, ~20 s).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from loadgen.fleet.bench import build_arrivals, fleet_config, headline_setup, trace_rows  # noqa: E402
from loadgen.fleet.bound import steady_state_bound  # noqa: E402
from loadgen.fleet.sim import FleetSim  # noqa: E402
from loadgen.sim.engine_time import load_engine_time_model  # noqa: E402
from loadgen.stats import Slo, figures  # noqa: E402
from loadgen.traces import arrival_granularity_ms  # noqa: E402
from replica_agent.policy.calibration import CalibratorConfig, OnlineTimeModel  # noqa: E402
from replica_agent.policy.time_model import StepFeatures, TimeModel  # noqa: E402
from replica_agent.policy.profiles import load_profile, vllm_serve_batch_defaults  # noqa: E402

ENGINES: tuple[tuple[str, str, str], ...] = (
    ("shipped-8b", "llama-3-8b-a100", "llama-3-8b-a100"),
    ("shipped-70b", "llama-2-70b-h100-tp4", "llama-2-70b-h100-tp4"),
    ("splitwise-70b", "llama-2-70b-h100-tp4", "llama-2-70b-h100-tp4-splitwise"),
)
"""(label, profile the policies start from, engine-time model): the shipped component-model engines of
both benchmark profiles, and the engine fitted independently to Splitwise's end-to-end measurements
(docs/engine-time-model.md, "A second engine model")."""

BEFORE = {"refit_every": 8, "prior_weight": 5.0, "chunk_sq_term": False}
"""The fleet simulation's online model before issue 27: five terms, refitted every 8 steps, prior worth 5 steps."""

MODELS: dict[str, dict[str, Any]] = {"before": BEFORE, "after": {}}
"""Closed-loop variants: CalibratorConfig overrides of the fleet's default (FleetConfig.calibration)."""

REPLAYS: dict[str, dict[str, Any]] = {
    "before": BEFORE,
    "refit_every 1": {**BEFORE, "refit_every": 1},
    "prior_weight 1": {**BEFORE, "prior_weight": 1.0},
    "forgetting 0.99": {**BEFORE, "forgetting": 0.99},
    "forgetting 0.999": {**BEFORE, "forgetting": 0.999},
    "+ chunk^2 term": {**BEFORE, "chunk_sq_term": True},
    "+ chunk^2, prior_weight 1": {**BEFORE, "chunk_sq_term": True, "prior_weight": 1.0},
    "+ chunk^2, refit_every 1": {**BEFORE, "chunk_sq_term": True, "refit_every": 1},
    "+ chunk^2, prior_weight 0.5": {**BEFORE, "chunk_sq_term": True, "prior_weight": 0.5},
    "after": {},
}
"""Open-loop variants replayed on the ``before`` runs' steps (one change at a time, then combined); ``after`` =
this revision's defaults: the chunk^2 term, prior weight 1, a solve every 4 steps."""


def noise_floor(sigma: float) -> float:
    """``E|exp(sigma Z) - 1|``, Z standard normal: the mean |measured / predicted - 1| of a model that predicts
    every step's median exactly, under the engine's log-normal noise (``exp(sigma^2/2) * erf(sigma / sqrt 2)``,
    about ``sigma * sqrt(2 / pi)``)."""
    return math.exp(sigma * sigma / 2.0) * math.erf(sigma / math.sqrt(2.0))

COLUMNS = ("t_ms", "replica", "new", "context", "prefill_cross", "prefill_sq", "seqs", "decodes", "measured_ms", "ratio")


class _Recorder(OnlineTimeModel):
    """The replica's online model, recording each observed step (COLUMNS) into ``log``."""

    def __init__(self, sim: _Sim, replica: int, log: list[tuple[float, ...]], prior: TimeModel,
                 config: CalibratorConfig) -> None:  # fmt: skip
        super().__init__(prior, config)
        self._sim, self._replica, self._log = sim, replica, log

    def observe(self, features: StepFeatures, measured_ms: float, weight: float = 1.0) -> float | None:
        r = super().observe(features, measured_ms, weight)
        f = features
        self._log.append((self._sim.now_ms, self._replica, f.new_tokens, f.context_tokens,
                          f.prefill_chunk_prefix_tokens, f.prefill_chunk_sq_tokens, f.num_seqs, f.num_decodes,
                          measured_ms, math.nan if r is None else r))  # fmt: skip
        return r


class _Sim(FleetSim):
    """FleetSim that keeps the time of the step end being handled (for the counted window)."""

    now_ms = 0.0

    def _on_step_end(self, t: float, ri: int) -> None:
        self.now_ms = t
        super()._on_step_end(t, ri)


def _calibration(base: CalibratorConfig, overrides: dict[str, Any]) -> CalibratorConfig:
    return dataclasses.replace(base, **overrides)


def _features(row: np.ndarray) -> StepFeatures:
    new, ctx, pcross, psq, seqs, dec = (int(v) for v in row[2:8])
    return StepFeatures(new, ctx, pcross, 0, seqs, pcross, dec, psq)


def summarize(steps: np.ndarray, t0_ms: float, t1_ms: float) -> dict[str, Any]:
    """The error figures of the module docstring over the steps that ended in [t0_ms, t1_ms].

    Args:
        steps: recorded steps, shape (n, len(COLUMNS)).
        t0_ms, t1_ms: the counted window (simulated ms).
    """
    s = steps[(steps[:, 0] >= t0_ms) & (steps[:, 0] <= t1_ms) & np.isfinite(steps[:, 9])]
    err = s[:, 9] - 1.0
    ab = np.abs(err)
    out: dict[str, Any] = {"steps": int(s.shape[0])}
    if not s.shape[0]:
        return out
    out.update({
        "mean_abs_error": round(float(ab.mean()), 5),
        "signed_mean": round(float(err.mean()), 5),
        "abs_error_p50": round(float(np.quantile(ab, 0.5)), 5),
        "abs_error_p90": round(float(np.quantile(ab, 0.9)), 5),
        "abs_error_p99": round(float(np.quantile(ab, 0.99)), 5),
    })
    new, pcross, psq, seqs, dec, ctx = s[:, 2], s[:, 4], s[:, 5], s[:, 6], s[:, 7], s[:, 3]
    pre = new - dec
    chunk = np.where(pre > 0, psq / np.maximum(pre, 1.0), 0.0)

    def bucket(mask: np.ndarray) -> dict[str, Any]:
        n = int(mask.sum())
        if not n:
            return {"n": 0}
        return {"n": n, "share": round(n / s.shape[0], 4), "mean_abs_error": round(float(ab[mask].mean()), 5),
                "signed_mean": round(float(err[mask].mean()), 5)}  # fmt: skip

    def edges(values: np.ndarray, cuts: Sequence[float], label: str) -> dict[str, Any]:
        res = {}
        for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
            res[f"{label} [{lo:g}, {hi:g})"] = bucket((values >= lo) & (values < hi))
        return res

    out["buckets"] = {
        "kind": {"decode-only": bucket(pre == 0), "prefill-only": bucket((pre > 0) & (dec == 0)),
                 "mixed": bucket((pre > 0) & (dec > 0))},  # fmt: skip
        "prefill_tokens": edges(pre, (0, 1, 512, 2048, 4096, 8193), "prefill tokens"),
        "mean_chunk_tokens": edges(chunk, (1, 256, 1024, 2048, 4096, 8193), "sum chunk^2 / sum chunk"),
        "seqs": edges(seqs, (1, 8, 32, 64, 128, 256, 1025), "sequences"),
        "context_tokens": edges(ctx, (0, 16384, 65536, 262144, 1 << 40), "context tokens"),
    }
    del pcross
    return out


def replay(steps: np.ndarray, prior: TimeModel, config: CalibratorConfig, t0_ms: float, t1_ms: float) -> dict[str, Any]:
    """Feed each replica's recorded steps, in order, to a fresh OnlineTimeModel(prior, config); the figures of
    :func:`summarize` over [t0_ms, t1_ms] with the replayed model's ratios (module docstring, ``replay``)."""
    out = steps.copy()
    for ri in np.unique(steps[:, 1]):
        idx = np.flatnonzero(steps[:, 1] == ri)
        cal = OnlineTimeModel(prior, config)
        for i in idx:
            r = cal.observe(_features(steps[i]), float(steps[i, 8]))
            out[i, 9] = math.nan if r is None else r
    res = summarize(out, t0_ms, t1_ms)
    res.pop("buckets", None)
    return res


def run_one(label: str, profile: str, engine_spec: str, policy: str, load: float, trace: str, replicas: int,
            duration_s: float, warmup_s: float, drain_s: float, model: str, do_replay: bool,
            rate_rps: float | None = None) -> dict[str, Any]:  # fmt: skip
    """One fleet simulation (module docstring); returns a ``runs[]`` entry. ``rate_rps`` given: that rate
    (req/s) instead of ``load`` times the steady-state bound (which is then not computed)."""
    et = load_engine_time_model(engine_spec, profile)
    assert et is not None
    prof = load_profile(profile)
    batch = vllm_serve_batch_defaults(prof.gpu).resolve(None, None)
    kept, native, _ = trace_rows(trace, arrival_granularity_ms(trace), 0)
    if rate_rps is None:
        bound = steady_state_bound([r.prompt_tokens for r in kept], [r.output_tokens for r in kept], et, 1000.0,
                                   100.0, replicas, prof.kv_capacity_tokens, batch.max_num_seqs,
                                   batch.max_num_batched_tokens, 0.9).rps  # fmt: skip
        rate = round(load * bound, 2)
    else:
        bound, rate = math.nan, rate_rps
    setup = headline_setup(kept, native, replicas, profile, 1000.0, 100.0, duration_s, drain_s, warmup_s, et)
    reqs = build_arrivals(kept, setup.native_rps, rate, duration_s, replicas, 0)
    cfg = fleet_config(setup, policy)
    default = cfg.calibration  # FleetConfig's: what bench-fleet runs
    cfg = dataclasses.replace(cfg, calibration=_calibration(default, MODELS[model]))
    log: list[tuple[float, ...]] = []
    sim = _Sim(cfg, reqs)
    for i, rep in enumerate(sim.replicas):
        rep.calibrator = _Recorder(sim, i, log, cfg.time_model, cfg.calibration)
    t_wall = time.perf_counter()
    res = sim.run()
    wall = time.perf_counter() - t_wall
    steps = np.array(log, dtype=float).reshape(-1, len(COLUMNS))
    t0, t1 = warmup_s * 1000.0, duration_s * 1000.0
    entry: dict[str, Any] = {
        "engine": label, "profile": profile, "engine_time_model": et.name, "policy": policy, "trace": trace,
        "load": load, "steady_state_bound_rps": round(bound, 2), "rate_rps": rate, "replicas": replicas,
        "model": model, "calibration": dataclasses.asdict(cfg.calibration),
        "sim_reported": round(res.stats.time_model_mean_abs_error, 5),
        "late_step_frac": round(res.stats.late_steps / max(1, res.stats.steps), 5),
        "slo_attainment": round(figures([x for x in res.records if x.arrival_ms >= t0], {t: Slo(1000.0, 100.0) for t in
                                        {x.tenant for x in res.records}}, duration_s - warmup_s).slo_attainment, 4),
        **summarize(steps, t0, t1),
        "final_model": {k: (round(v, 9) if isinstance(v, float) else v)
                        for k, v in dataclasses.asdict(sim.replicas[0].calibrator.model()).items()},  # fmt: skip
        "wall_s": round(wall, 2),
    }
    if do_replay and model == "before":
        entry["replay"] = {name: replay(steps, cfg.time_model, _calibration(default, ov), t0, t1)
                           for name, ov in REPLAYS.items()}  # fmt: skip
    return entry


def _table(runs: list[dict[str, Any]]) -> str:
    """Markdown table: engine x policy x load, before / after (steady-state mean |r - 1|; sim-reported)."""
    rows = {}
    for r in runs:
        rows.setdefault((r["engine"], r["policy"], r["load"], r["rate_rps"]), {})[r["model"]] = r
    lines = ["| engine | policy | load (rate req/s) | before: steady / sim-reported | after: steady / sim-reported | "
             "signed before / after | late steps before / after | SLO attainment before / after |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for (eng, pol, load, rate), m in rows.items():
        b, a = m.get("before", {}), m.get("after", {})

        def pc(d: dict[str, Any], k: str) -> str:
            return f"{100 * d[k]:.2f} %" if k in d else "-"

        lines.append(f"| {eng} | {pol} | {load:g} ({rate:g}) | {pc(b, 'mean_abs_error')} / {pc(b, 'sim_reported')} | "
                     f"{pc(a, 'mean_abs_error')} / {pc(a, 'sim_reported')} | {pc(b, 'signed_mean')} / "
                     f"{pc(a, 'signed_mean')} | {pc(b, 'late_step_frac')} / {pc(a, 'late_step_frac')} | "
                     f"{b.get('slo_attainment', '-')} / {a.get('slo_attainment', '-')} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench" / "time_model_error.json"))
    ap.add_argument("--engines", nargs="+", default=[e[0] for e in ENGINES], choices=[e[0] for e in ENGINES])
    ap.add_argument("--policies", nargs="+", default=["pab+fairbatching", "least-outstanding"])
    ap.add_argument("--loads", type=float, nargs="+", default=[0.4, 0.8],
                    help="fractions of the steady-state bound under the engine model (loadgen/fleet/bound.py)")
    ap.add_argument("--trace", default="azure-code")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--duration-s", type=float, default=120.0, help="arrival window (simulated s)")
    ap.add_argument("--warmup-s", type=float, default=30.0, help="steps before this are not counted (simulated s)")
    ap.add_argument("--drain-s", type=float, default=30.0)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--no-replay", action="store_true", help="skip the open-loop replays of the diagnosis")
    ap.add_argument("--quick", action="store_true", help="one policy, one load, 40 s: a smoke test")
    args = ap.parse_args(argv)
    if args.quick:
        args.policies, args.loads, args.duration_s, args.warmup_s, args.drain_s = ["pab+fairbatching"], [0.6], 40.0, 10.0, 10.0
    engines = [e for e in ENGINES if e[0] in args.engines]
    runs = []
    t0 = time.perf_counter()
    for label, profile, spec in engines:
        for policy in args.policies:
            for load in args.loads:
                for model in args.models:
                    r = run_one(label, profile, spec, policy, load, args.trace, args.replicas, args.duration_s,
                                args.warmup_s, args.drain_s, model, not args.no_replay)  # fmt: skip
                    runs.append(r)
                    print(f"{label:14s} {policy:18s} load {load:g} ({r['rate_rps']:g} req/s) {model:6s}: "
                          f"steady {100 * r.get('mean_abs_error', math.nan):5.2f} %  sim-reported "
                          f"{100 * r['sim_reported']:5.2f} %  signed {100 * r.get('signed_mean', math.nan):+5.2f} %  "
                          f"steps {r['steps']}  ({r['wall_s']:.1f} s)", flush=True)  # fmt: skip
                    for name, v in (r.get("replay") or {}).items():
                        print(f"{'':16s}replay {name:28s} {100 * v.get('mean_abs_error', math.nan):5.2f} %  "
                              f"signed {100 * v.get('signed_mean', math.nan):+5.2f} %")  # fmt: skip
    table = _table(runs)
    print(table)
    doc = {
        "what": "one-step-ahead mean |measured / predicted - 1| of the online time model (issue 27 item 7)",
        "command": "python scripts/bench_time_model_error.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "engines": [{"label": lab, "profile": p, "engine_time_model": s,
                     "noise_sigma": (et := load_engine_time_model(s, p)).noise_sigma,  # type: ignore[union-attr]
                     "noise_floor": round(noise_floor(et.noise_sigma), 5)}  # type: ignore[union-attr]
                    for lab, p, s in engines],  # fmt: skip
        "setup": {"trace": args.trace, "replicas": args.replicas, "duration_s": args.duration_s,
                  "warmup_s": args.warmup_s, "drain_s": args.drain_s, "ttft_ms": 1000.0, "tpot_ms": 100.0,
                  "counted_window_ms": [args.warmup_s * 1000.0, args.duration_s * 1000.0]},  # fmt: skip
        "models": MODELS, "replays": REPLAYS,
        "runs": runs, "table_md": table, "wall_s": round(time.perf_counter() - t0, 1),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
