"""Fit the simulated engine's step-time files (``loadgen/data/engine_time/*.json``) to the component model.

``python scripts/fit_engine_time_model.py [--out-dir loadgen/data/engine_time] [--check]``

1. The *component model* (docs/engine-time-model.md, "The component model"): the time of one engine
   iteration built from GPU kernel profiles, per layer and per GPU::

       T = L * [ sum_ops op(n)                                     # Vidur mlp.csv medians at n = new tokens
               + attn_decode(B_dec, sum_kv) * (1.1 if B_dec > 1)   # surrogate, decode sequences
               + sum_chunks attn_prefill(chunk, prefix)            # surrogate, one term per prefill chunk
               + (TP > 1) * 2 * (all_reduce(n * hidden * 2 bytes) + 0.02 ms) ]
           + emb(n) + lm_head(n_seqs)

   from the vendored CSVs in ``loadgen/data/profiles/`` (origin and licence in its SOURCES.md).
2. A batch mix (numpy seed 12345, re-seeded per profile): decode-only, prefill-only and mixed batches as
   in the component-model fits, plus prefill chunks over long prefixes up to the engine's context
   (``EXTENDED_CONTEXT`` tokens), since chunk x prefix is what the linear policy model misses.
3. A relative-error least-squares fit (weights 1/T, numpy) of
   ``a + b*new + c*context + d*seqs + e*sum(chunk*prefix) + f*sum(chunk^2)``, coefficients kept >= 0
   (active set: a negative coefficient is fixed at 0 and the rest refitted).
4. ``noise_sigma`` from the run-to-run spread of the same Vidur rows (:func:`step_noise_sigma`).

Prints the fit, its error by batch kind and the spot values; ``--check`` compares the spot values with
the component-model reference table of docs/engine-time-model.md and exits 1 when one is off by more
than 3 % (compared with the all-reduce clamped at its largest profiled message, as the reference was built;
the shipped model extrapolates it: an 8192-token TP4 all-reduce moves 128 MiB, twice the grid's top).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from replica_agent.policy.time_model import StepFeatures, TimeModel  # noqa: E402
from replica_agent.policy.profiles import load_profile  # noqa: E402

DATA = ROOT / "loadgen" / "data" / "profiles"

OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
       "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")  # fmt: skip
"""Per-layer linear/MLP ops of Vidur's mlp.csv summed per layer (``emb`` is once per iteration)."""

EXTENDED_CONTEXT = 32768
"""Longest prompt the benchmarks' engines take (``--max-model-len`` default 32768): the long-prefix chunks reach it."""

SEED = 12345


@dataclass(frozen=True, slots=True)
class Pair:
    """One model/GPU/TP pair of the component model.

    Attributes:
        name: profile name (``replica_agent/policy/profiles.py``).
        mlp_csv: vendored Vidur mlp.csv (rows of this TP degree).
        all_reduce_csv: vendored Vidur all_reduce.csv (rows of this TP, one node), None for TP 1.
        tp: tensor-parallel degree.
        layers, hidden, ffn, vocab: model dimensions.
        q_heads, kv_heads: attention heads of the whole model.
        h100: True: attention scaled from the A100 surrogate (decode bandwidth x 3.35/2.039, prefill FLOP terms / 2).
        native_context: the model's trained context (tokens), for the doc.
        kv_capacity_tokens: KV cache size (profiles' fitted_coefficients.csv), batches over it are dropped.
    """

    name: str
    mlp_csv: str
    all_reduce_csv: str | None
    tp: int
    layers: int
    hidden: int
    ffn: int
    vocab: int
    q_heads: int
    kv_heads: int
    h100: bool
    native_context: int
    kv_capacity_tokens: int


PAIRS = {
    "llama-3-8b-a100": Pair("llama-3-8b-a100", "vidur_a100_Meta-Llama-3-8B_mlp.csv", None, 1, 32, 4096, 14336,
                            128256, 32, 8, False, 8192, 467_291),
    "llama-2-70b-h100-tp4": Pair("llama-2-70b-h100-tp4", "vidur_h100_Llama-2-70b-hf_mlp.csv",
                                 "vidur_h100_dgx_all_reduce.csv", 4, 80, 8192, 28672, 32000, 64, 8, True, 4096,
                                 518_559),
}  # fmt: skip

SPOT_REFERENCE = {
    # decode B=1 ctx 1k, decode B=64 ctx 2k, decode B=256 ctx 1k, prefill 2048, prefill 8192 (ms);
    # the component-model table of docs/engine-time-model.md.
    "llama-3-8b-a100": (10.9, 24.6, 45.5, 165.0, 820.0),
    "llama-2-70b-h100-tp4": (24.8, 30.9, 40.3, 156.0, 670.0),
}


def _read(name: str) -> list[dict[str, str]]:
    with open(DATA / name, newline="") as f:
        return list(csv.DictReader(f))


class Curve:
    """Piecewise-linear interpolation on a profiled grid, a linear fit over the grid's top half above it.

    Args:
        x: grid (ascending after the duplicate rows are averaged), y: values at it.
    """

    def __init__(self, x: Sequence[float], y: Sequence[float]) -> None:
        xs = np.asarray(x, dtype=float)
        ys = np.asarray(y, dtype=float)
        ux = np.unique(xs)
        uy = np.array([ys[xs == v].mean() for v in ux])  # duplicate grid rows averaged
        self.x, self.y = ux, uy
        top = ux >= ux[-1] / 2
        self.slope, self.icpt = np.polyfit(ux[top], uy[top], 1)

    def __call__(self, v: np.ndarray | float) -> np.ndarray:
        v = np.asarray(v, dtype=float)
        inside = np.interp(v, self.x, self.y)
        return np.where(v > self.x[-1], self.icpt + self.slope * v, inside)


class ComponentModel:
    """The component model of one pair (module docstring; docs/engine-time-model.md)."""

    def __init__(self, pair: Pair, extrapolate_all_reduce: bool = True) -> None:
        self.pair = pair
        self.extrapolate_all_reduce = extrapolate_all_reduce
        rows = _read(pair.mlp_csv)
        n = [float(r["num_tokens"]) for r in rows]
        self.ops = {op: Curve(n, [float(r[f"time_stats.{op}.median"]) for r in rows]) for op in OPS + ("emb",)}
        self.ar: Curve | None = None
        if pair.tp > 1:
            assert pair.all_reduce_csv is not None
            ar = [r for r in _read(pair.all_reduce_csv)
                  if int(r["num_workers"]) == pair.tp and int(r["devices_per_node"]) == pair.tp]  # fmt: skip
            self.ar = Curve([float(r["size"]) for r in ar], [float(r["time_stats.all_reduce.median"]) for r in ar])
        self.kv_per_gpu = pair.kv_heads / pair.tp
        self.q_per_gpu = pair.q_heads / pair.tp
        self.bw = 1.56e12 * (3.35 / 2.039 if pair.h100 else 1.0)  # bytes/s, decode KV read
        self.flop_div = 2.0 if pair.h100 else 1.0

    def mlp_layer_ms(self, n: float) -> float:
        """Sum of the per-layer ops at n tokens (ms per layer per GPU)."""
        return float(sum(self.ops[op](n) for op in OPS))

    def attn_decode_ms(self, b_dec: int, sum_kv: float) -> float:
        """Decode attention of b_dec sequences reading sum_kv cached tokens (ms per layer per GPU)."""
        if b_dec == 0:
            return 0.0
        kv_bytes = sum_kv * self.kv_per_gpu * 2 * 128 * 2
        t = 0.0135 - 2.33e-6 * b_dec + 1000.0 * kv_bytes / self.bw
        return t * (1.1 if b_dec > 1 else 1.0)

    def attn_prefill_ms(self, chunk: float, prefix: float) -> float:
        """Prefill attention of one chunk over its prefix (ms per layer per GPU)."""
        q = self.q_per_gpu / 32.0
        return 0.0145 + q * (1.134e-7 * chunk * prefix + 1.198e-7 * chunk * chunk + 6.75e-5 * chunk) / self.flop_div

    def step_ms(self, decode_ctx: Sequence[int], chunks: Sequence[tuple[int, int]]) -> float:
        """One iteration: decode sequences with these contexts, prefill chunks ``(chunk, prefix)`` (ms)."""
        p = self.pair
        n = len(decode_ctx) + sum(c for c, _ in chunks)
        seqs = len(decode_ctx) + len(chunks)
        per_layer = self.mlp_layer_ms(n) + self.attn_decode_ms(len(decode_ctx), float(sum(decode_ctx)))
        per_layer += sum(self.attn_prefill_ms(c, x) for c, x in chunks)
        if self.ar is not None:
            size = n * p.hidden * 2
            if not self.extrapolate_all_reduce:
                size = min(size, float(self.ar.x[-1]))  # clamped at the largest profiled message (64 MiB)
            per_layer += 2 * (float(self.ar(size)) + 0.02)
        lm_head = p.vocab / (2 * p.ffn) * float(self.ops["mlp_up_proj"](seqs))
        return p.layers * per_layer + float(self.ops["emb"](n)) + lm_head

    def kv_need(self, decode_ctx: Sequence[int], chunks: Sequence[tuple[int, int]]) -> int:
        return int(sum(decode_ctx) + len(decode_ctx) + sum(c + x for c, x in chunks))


SPOT_BATCHES: tuple[tuple[str, list[list[tuple[int, int]]]], ...] = (
    ("decode B=1 ctx 1k", [[(1, 1024)]]),
    ("decode B=64 ctx 2k", [[(1, 2048)] * 64]),
    ("decode B=256 ctx 1k", [[(1, 1024)] * 256]),
    ("prefill 2048", [[(2048, 0)]]),
    ("prefill 8192", [[(8192, 0)]]),
    ("chunk 2048 at prefix 16k", [[(2048, 16384)]]),
    ("prompt 32k in 2048-token chunks (16 steps)", [[(2048, 2048 * k)] for k in range(16)]),
    ("prompt 32k in 8192-token chunks (4 steps)", [[(8192, 8192 * k)] for k in range(4)]),
)
"""Spot batches: name, then the steps (each a list of (chunk, prefix); a decode is a chunk of 1 at its context)."""


def _split(step: list[tuple[int, int]]) -> tuple[list[int], list[tuple[int, int]]]:
    return [x for c, x in step if c == 1], [(c, x) for c, x in step if c > 1]


def spot_values(cm: ComponentModel) -> tuple[float, ...]:
    """Component-model time of each SPOT_BATCHES entry, its steps summed (ms)."""
    return tuple(sum(cm.step_ms(*_split(st)) for st in steps) for _, steps in SPOT_BATCHES)


# ---- batch mix -------------------------------------------------------------------------------------

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
PREFILL_CHUNKS = (256, 512, 1024, 2048, 4096, 8192)
SHORT_PREFIXES = (0, 0, 0, 1024, 2048, 4096)
MIXED_CHUNKS = (256, 512, 1024, 2048)
LONG_CHUNKS = (256, 512, 1024, 2048, 4096, 8192)
KINDS = ("decode", "prefill", "mixed", "long-prefix")
KIND_P = (0.40, 0.18, 0.30, 0.12)


def _decode_part(rng: np.random.Generator) -> list[int]:
    b = int(rng.choice(BATCH_SIZES))
    mu = rng.uniform(128, 4096)
    return [int(v) for v in np.clip(rng.normal(mu, 0.3 * mu, size=b), 128, 4096)]


def draw_batches(cm: ComponentModel, n: int = 2000, seed: int = SEED) -> list[tuple[str, list[int], list[tuple[int, int]]]]:
    """Candidate batches ``(kind, decode contexts, chunks)``; those over the KV capacity are dropped.

    Kinds: decode-only (B from BATCH_SIZES, contexts Normal(mu, 0.3 mu) clipped to 128..4096, mu ~ U(128, 4096));
    prefill-only (one chunk from PREFILL_CHUNKS, a chunk <= 2048 gets a prefix from SHORT_PREFIXES);
    mixed (a decode part plus one chunk from MIXED_CHUNKS); long-prefix (one chunk from LONG_CHUNKS at a
    prefix ~ U(4096, EXTENDED_CONTEXT - chunk), with a decode part half of the time).
    """
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        kind = str(rng.choice(KINDS, p=KIND_P))
        dec: list[int] = []
        chunks: list[tuple[int, int]] = []
        if kind == "decode":
            dec = _decode_part(rng)
        elif kind == "prefill":
            c = int(rng.choice(PREFILL_CHUNKS))
            x = int(rng.choice(SHORT_PREFIXES)) if c <= 2048 else 0
            chunks = [(c, x)]
        elif kind == "mixed":
            dec = _decode_part(rng)
            chunks = [(int(rng.choice(MIXED_CHUNKS)), 0)]
        else:
            c = int(rng.choice(LONG_CHUNKS))
            x = int(rng.integers(4096, EXTENDED_CONTEXT - c + 1))
            chunks = [(c, x)]
            if rng.random() < 0.5:
                dec = _decode_part(rng)
        if cm.kv_need(dec, chunks) <= cm.pair.kv_capacity_tokens:
            out.append((kind, dec, chunks))
    return out


def features(dec: Sequence[int], chunks: Sequence[tuple[int, int]]) -> np.ndarray:
    """[1, new, context, seqs, sum chunk*prefix, sum chunk^2] of one batch (a decode is a chunk of 1 at its context)."""
    items = [(1, c) for c in dec] + list(chunks)
    return np.array([1.0, sum(c for c, _ in items), sum(x for _, x in items), len(items),
                     sum(c * x for c, x in items), sum(c * c for c, _ in items)])  # fmt: skip


def fit_relative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares of x @ coef ~ y with weights 1/y (relative error), coefficients >= 0 (active set).

    Args:
        x: design, shape (n, k); y: measured ms, shape (n,), > 0.
    """
    free = np.ones(x.shape[1], dtype=bool)
    coef = np.zeros(x.shape[1])
    w = 1.0 / y
    while True:
        sol, *_ = np.linalg.lstsq(x[:, free] * w[:, None], y * w, rcond=None)
        coef[:] = 0.0
        coef[free] = sol
        if (coef >= 0).all():
            return coef
        free &= coef > 0  # fix the negative ones at 0, refit the rest


# ---- noise ----------------------------------------------------------------------------------------

def step_noise_sigma(cm: ComponentModel) -> tuple[float, dict[str, float]]:
    """``noise_sigma`` of the log step time from the run-to-run spread of the Vidur rows (docs/engine-time-model.md, "Noise").

    Each Vidur mlp.csv row holds, per op, the median and the std over its repeated CUDA-timed runs. One
    engine step runs the same L layers back to back on one GPU, so a run's deviation is taken as shared by
    all layers (a slow clock or a busy memory system slows every layer): the relative spread of a step
    is then that of one layer, ``cv(n) = sum_ops std(n) / sum_ops median(n)`` (independent layers would
    divide it by sqrt(L); that is the lower estimate, also returned). ``sigma = sqrt(ln(1 + mean_n cv(n)^2))``
    (a log-normal with that coefficient of variation), the mean over every profiled row.
    Cross-check, also returned: the few num_tokens profiled twice give ``r = ln S_1 - ln S_2`` of the
    step's summed medians, ``sigma_between = std(r) / sqrt(2)``.
    """
    p = cm.pair
    rows = _read(p.mlp_csv)
    cv = np.array([sum(float(r[f"time_stats.{op}.std"]) for op in OPS)
                   / sum(float(r[f"time_stats.{op}.median"]) for op in OPS) for r in rows])  # fmt: skip
    sigma = math.sqrt(math.log1p(float(np.mean(cv**2))))
    by_n: dict[int, list[dict[str, str]]] = {}
    for r in rows:
        by_n.setdefault(int(r["num_tokens"]), []).append(r)

    def total(r: dict[str, str]) -> float:
        return p.layers * sum(float(r[f"time_stats.{op}.median"]) for op in OPS) + float(r["time_stats.emb.median"])

    diffs = [math.log(total(rs[0])) - math.log(total(rs[1])) for rs in by_n.values() if len(rs) >= 2]
    return sigma, {
        "rows": int(cv.size),
        "cv_median": round(float(np.median(cv)), 4),
        "cv_p90": round(float(np.percentile(cv, 90)), 4),
        "sigma_if_layers_independent": round(sigma / math.sqrt(p.layers), 4),
        "sigma_between_duplicate_rows": round(float(np.std(diffs, ddof=1) / math.sqrt(2.0)), 4) if len(diffs) > 1 else None,
        "duplicate_rows": len(diffs),
    }


# ---- main -----------------------------------------------------------------------------------------

def fit_pair(name: str) -> dict:
    """Fit one pair; returns the JSON of the engine-time file plus a ``report`` dict for the doc."""
    cm = ComponentModel(PAIRS[name])
    batches = draw_batches(cm)
    x = np.array([features(d, c) for _, d, c in batches])
    y = np.array([cm.step_ms(d, c) for _, d, c in batches])
    coef = fit_relative(x, y)
    pred = x @ coef
    rel = np.abs(pred - y) / y
    kinds = np.array([k for k, _, _ in batches])
    by_kind = {k: {"n": int((kinds == k).sum()), "mean_rel_err": float(rel[kinds == k].mean()),
                   "max_rel_err": float(rel[kinds == k].max())} for k in KINDS if (kinds == k).any()}  # fmt: skip
    by_kind["all"] = {"n": int(rel.size), "mean_rel_err": float(rel.mean()), "max_rel_err": float(rel.max())}
    lin = _linear_policy_model(name)
    lin_pred = np.array([lin.step_ms(StepFeatures.from_items([(1, x) for x in d] + list(c))) for _, d, c in batches])
    lin_rel = (lin_pred - y) / y
    linear_by_kind = {k: {"mean_signed_rel_err": float(lin_rel[kinds == k].mean()),
                          "mean_rel_err": float(np.abs(lin_rel[kinds == k]).mean()),
                          "min_rel_err": float(lin_rel[kinds == k].min())} for k in KINDS if (kinds == k).any()}  # fmt: skip
    linear_by_kind["all"] = {"mean_signed_rel_err": float(lin_rel.mean()), "mean_rel_err": float(np.abs(lin_rel).mean()),
                             "min_rel_err": float(lin_rel.min())}  # fmt: skip
    sigma, noise_info = step_noise_sigma(cm)
    spots = spot_values(cm)
    spot_fit = [sum(float(features(*_split(st)) @ coef) for st in steps) for _, steps in SPOT_BATCHES]
    spots_clamped = spot_values(ComponentModel(cm.pair, extrapolate_all_reduce=False))
    spot_linear = [sum(lin.step_ms(StepFeatures.from_items(st)) for st in steps) for _, steps in SPOT_BATCHES]
    model = {k: float(f"{v:.6g}") for k, v in zip(("a_ms", "b_ms", "c_ms", "d_ms", "e_ms", "f_ms"), coef, strict=True)}
    return {
        **model,
        "noise_sigma": round(sigma, 4),
        "seed": 0,
        "meta": {
            "profile": name,
            "fitted_by": "scripts/fit_engine_time_model.py (docs/engine-time-model.md)",
            "data": [cm.pair.mlp_csv] + ([cm.pair.all_reduce_csv] if cm.pair.all_reduce_csv else []),
            "batches": int(rel.size), "batch_seed": SEED,
            "error_by_kind": {k: {kk: round(vv, 4) if isinstance(vv, float) else vv for kk, vv in v.items()}
                              for k, v in by_kind.items()},  # fmt: skip
            "noise": {"sigma_from": "Vidur mlp.csv per-op std/median over repeated runs, layers of a step correlated",
                      **noise_info},
        },
        "report": {"linear_by_kind": linear_by_kind, "spots_component": spots, "spots_fit": spot_fit, "spots_clamped": spots_clamped,
                   "spots_linear": spot_linear},
    }


# ---- the Splitwise engine model (an independent second engine) -----------------------------------

SPLITWISE_CSV = "splitwise_llama2-70b_h100-80gb_tp4.csv"
"""Splitwise's end-to-end measurements of Llama-2-70B on DGX-H100 at TP4 (vendored rows; SOURCES.md)."""

SPLITWISE_PROFILE = "llama-2-70b-h100-tp4"
SPLITWISE_NAME = "llama-2-70b-h100-tp4-splitwise"
E_OVER_F = 1.134e-7 / 1.198e-7
"""``e / f`` of the Splitwise model: the ratio of the chunk x prefix and chunk^2 coefficients of the prefill
attention surrogate (docs/engine-time-model.md, fitted to Vidur's A100 attention table), since Splitwise
never prefills over a prefix and cannot tell ``e`` apart."""


def splitwise_points(rows: Sequence[dict[str, str]]) -> list[tuple[str, list[tuple[int, int]], float, int]]:
    """The steps of the Splitwise rows: ``(label, items, median ms, repeats)``, one per distinct configuration.

    - A prefill: ``prompt_time`` (ms) is one iteration that prefills ``batch_size`` prompts of
      ``prompt_size`` tokens: items ``[(prompt_size, 0)] * batch_size``. One point per distinct
      (prompt_size, batch_size), the median over its rows (the output-length sweep repeats the
      512-token prefill: 35 rows for (512, 1)).
    - A decode: ``token_time`` (ms) is the mean decode iteration of the run (``e2e_time = prompt_time +
      (token_size - 1) * token_time`` on these rows): ``batch_size`` sequences of one new token each; decode
      j = 1 .. O - 1 reads ``P + j - 1`` tokens, so the mean iteration reads ``P + (O - 2) / 2``; the form is
      linear in its features, so the mean step time is the step time at the mean features. One point per
      distinct (prompt_size, batch_size, token_size), the median over its rows (15 for 512/1/128).
    """
    pre: dict[tuple[int, int], list[float]] = {}
    dec: dict[tuple[int, int, int], list[float]] = {}
    for r in rows:
        p, b, o = int(r["prompt_size"]), int(r["batch_size"]), int(r["token_size"])
        pre.setdefault((p, b), []).append(float(r["prompt_time"]))
        dec.setdefault((p, b, o), []).append(float(r["token_time"]))
    out = []
    for (p, b), ms in sorted(pre.items()):
        out.append((f"prefill {b} x {p}", [(p, 0)] * b, float(np.median(ms)), len(ms)))
    for (p, b, o), ms in sorted(dec.items()):
        out.append((f"decode B={b} prompt {p} out {o}", [(1, p + (o - 2) // 2)] * b, float(np.median(ms)), len(ms)))
    return out


def splitwise_noise_sigma(rows: Sequence[dict[str, str]]) -> tuple[float, dict[str, float]]:
    """``noise_sigma`` from the run-to-run spread of Splitwise's single-step measurements (``prompt_time``).

    Each prompt_time is one engine iteration; the rows of one (prompt_size, batch_size) repeat it. With
    ``r = ln(t / median of its configuration)`` over all rows, ``sigma = mean |r| / sqrt(2 / pi)``: the
    log-normal whose mean absolute log deviation is the measured one (the spread is heavy-tailed: most
    repeats agree within 1 %, about one in nine is 10-20 % slower; a robust MAD estimate is given too).
    ``token_time`` rows are means over >= 127 iterations and say nothing about one step's spread.
    """
    by: dict[tuple[int, int], list[float]] = {}
    for r in rows:
        by.setdefault((int(r["prompt_size"]), int(r["batch_size"])), []).append(float(r["prompt_time"]))
    dev = np.concatenate([np.log(v) - np.log(np.median(v)) for v in map(np.array, by.values())])
    sigma = float(np.mean(np.abs(dev))) / math.sqrt(2.0 / math.pi)
    return sigma, {
        "rows": int(dev.size), "configurations": len(by),
        "mean_abs_log_dev": round(float(np.mean(np.abs(dev))), 4),
        "sigma_mad": round(1.4826 * float(np.median(np.abs(dev))), 4),
        "share_over_5pct": round(float(np.mean(np.abs(dev) > 0.05)), 3),
    }


def fit_splitwise() -> dict:
    """Fit the Splitwise engine model (docs/engine-time-model.md, "A second engine model: Splitwise").

    The form of the shipped files, ``a + b*new + c*context + d*seqs + e*sum(chunk*prefix) + f*sum(chunk^2)``,
    fitted by relative-error least squares (:func:`fit_relative`, coefficients >= 0) to the
    :func:`splitwise_points` of the vendored rows, with ``e = E_OVER_F * f`` (one column
    ``E_OVER_F * cross + chunk^2``); ``noise_sigma`` from :func:`splitwise_noise_sigma`.
    Returns the JSON of the engine-time file plus a ``report`` (every point: measured, fitted).
    """
    rows = _read(SPLITWISE_CSV)
    pts = splitwise_points(rows)
    x6 = np.array([features([c for n, c in items if n == 1], [(n, c) for n, c in items if n > 1])
                   for _, items, _, _ in pts])  # fmt: skip
    y = np.array([ms for _, _, ms, _ in pts])
    x5 = np.column_stack([x6[:, :4], E_OVER_F * x6[:, 4] + x6[:, 5]])
    a, b, c, d, f = fit_relative(x5, y)
    coef = np.array([a, b, c, d, E_OVER_F * f, f])
    pred = x6 @ coef
    rel = (pred - y) / y
    kinds = np.array([lab.split()[0] for lab, _, _, _ in pts])
    by_kind = {k: {"n": int((kinds == k).sum()), "mean_rel_err": round(float(np.abs(rel[kinds == k]).mean()), 4),
                   "max_rel_err": round(float(np.abs(rel[kinds == k]).max()), 4)} for k in ("prefill", "decode")}  # fmt: skip
    by_kind["all"] = {"n": int(rel.size), "mean_rel_err": round(float(np.abs(rel).mean()), 4),
                      "max_rel_err": round(float(np.abs(rel).max()), 4)}  # fmt: skip
    sigma, noise = splitwise_noise_sigma(rows)
    model = {k: float(f"{v:.6g}") for k, v in zip(("a_ms", "b_ms", "c_ms", "d_ms", "e_ms", "f_ms"), coef, strict=True)}
    return {
        **model,
        "noise_sigma": round(sigma, 4),
        "seed": 0,
        "meta": {
            "profile": SPLITWISE_PROFILE,
            "fitted_by": "scripts/fit_engine_time_model.py fit_splitwise (docs/engine-time-model.md)",
            "data": [SPLITWISE_CSV],
            "source": "Mutinifni/splitwise-sim data/perf_model.csv @ 8f99e7dc (MIT; Patel et al., Splitwise, ISCA 2024): "
                      "end-to-end measurements, Llama-2-70B, DGX-H100, TP4",
            "points": int(rel.size), "rows": len(rows),
            "e_over_f": round(E_OVER_F, 4),
            "error_by_kind": by_kind,
            "noise": {"sigma_from": "Splitwise prompt_time repeats (single steps), mean |ln(t / median)| / sqrt(2/pi)",
                      **noise},
        },
        "report": {"points": [(lab, ms, float(p)) for (lab, _, ms, _), p in zip(pts, pred, strict=True)]},
    }


def _linear_policy_model(name: str) -> TimeModel:
    """The policies' linear model of this profile (replica_agent/policy/profiles.py, variant all_batches)."""
    return load_profile(name).time_model


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default=str(ROOT / "loadgen" / "data" / "engine_time"))
    ap.add_argument("--check", action="store_true", help="exit 1 when a spot value is off the reference by > 3 %%")
    ap.add_argument("--dry-run", action="store_true", help="print only, write no file")
    args = ap.parse_args(argv)
    bad = 0
    for name in PAIRS:
        res = fit_pair(name)
        rep = res.pop("report")
        m = res["meta"]
        print(f"== {name}: " + ", ".join(f"{k}={res[k]:.6g}" for k in ("a_ms", "b_ms", "c_ms", "d_ms", "e_ms", "f_ms"))
              + f", noise_sigma={res['noise_sigma']} ({m['noise']})")  # fmt: skip
        for k, v in m["error_by_kind"].items():
            print(f"   {k:<12} n={v['n']:<5} mean {100 * v['mean_rel_err']:5.1f} %  max {100 * v['max_rel_err']:5.1f} %")
        for k, v in rep["linear_by_kind"].items():
            print(f"   linear policy model vs component, {k:<12} mean {100 * v['mean_signed_rel_err']:+5.1f} %  "
                  f"|mean| {100 * v['mean_rel_err']:5.1f} %  worst under-prediction {100 * v['min_rel_err']:+5.1f} %")
        print(f"   {'spot':<44} {'component':>9} {'fit':>8} {'linear':>8} {'AR clamped':>10}  reference")
        for i, (spot, _) in enumerate(SPOT_BATCHES):
            comp, fit, clamped = rep["spots_component"][i], rep["spots_fit"][i], rep["spots_clamped"][i]
            ref = SPOT_REFERENCE[name][i] if i < len(SPOT_REFERENCE[name]) else None
            off = "" if ref is None else f"{ref:g} ({100 * (comp / ref - 1):+.1f} %; clamped {100 * (clamped / ref - 1):+.1f} %)"
            if ref is not None and abs(clamped / ref - 1) > 0.03:  # the reference clamps the all-reduce
                bad += 1
            print(f"   {spot:<44} {comp:9.1f} {fit:8.1f} {rep['spots_linear'][i]:8.1f} "
                  f"{rep['spots_clamped'][i]:10.1f}  {off}")  # fmt: skip
        if not args.dry_run:
            out = Path(args.out_dir) / f"{name}.json"
            out.write_text(json.dumps(res, indent=1) + "\n")
            print(f"   wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    res = fit_splitwise()
    rep = res.pop("report")
    m = res["meta"]
    print(f"== {SPLITWISE_NAME} (Splitwise, {m['points']} points of {m['rows']} rows): "
          + ", ".join(f"{k}={res[k]:.6g}" for k in ("a_ms", "b_ms", "c_ms", "d_ms", "e_ms", "f_ms"))
          + f", noise_sigma={res['noise_sigma']} ({m['noise']})")  # fmt: skip
    for k, v in m["error_by_kind"].items():
        print(f"   {k:<12} n={v['n']:<5} mean {100 * v['mean_rel_err']:5.1f} %  max {100 * v['max_rel_err']:5.1f} %")
    for lab, ms, p in rep["points"]:
        print(f"   {lab:<32} measured {ms:8.1f}  fit {p:8.1f}  ({100 * (p / ms - 1):+5.1f} %)")
    if not args.dry_run:
        out = Path(args.out_dir) / f"{SPLITWISE_NAME}.json"
        out.write_text(json.dumps(res, indent=1) + "\n")
        print(f"   wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 1 if args.check and bad else 0


if __name__ == "__main__":
    sys.exit(main())
