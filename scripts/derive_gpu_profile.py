"""Derive Llama-3-8B on H100 (TP 1) from the measured profiles (issue 27 item 3: the heterogeneous fleet).

No H100 profile of Llama-3-8B exists in the shared profile set (replica_agent/data/SOURCES.md,
loadgen/data/SOURCES.md): Vidur profiled Llama-3-8B only on A100, and on H100 only Llama-2-7B and
Llama-2-70B. The derivation transfers the A100 -> H100 change of each term, measured on the one model
profiled on both GPUs in the same way (Llama-2-70B TP4, Vidur, variant ``all_batches``), onto the
Llama-3-8B A100 fits:

    ratio_a = a_H100 / a_A100       (per-step fixed cost: launches, norms, sampling)
    ratio_b = b_H100 / b_A100       (per new token: GEMM compute)
    ratio_c = c_H100 / c_A100       (per context token: attention, KV reads)
    x_H100(8B) = x_A100(8B) * ratio_x

applied to the linear profile (a, b, c: the policies' prior, ``replica_agent/data/derived_profiles.csv``)
and to the engine's own model (``loadgen/data/engine_time/llama-3-8b-h100.json``: a and d scale by
ratio_a, b and f by ratio_b (compute: f is the causal attention inside a chunk, compute-bound), c and
e by ratio_c (context reads)). The KV capacity is the A100 figure: both GPUs have 80 GB and the model's
KV bytes per token do not change.

Cross-check printed by this script: Llama-2-7B measured on H100 (Vidur) against the derived 8B. The two
models differ (Llama-3-8B: GQA with 8 KV heads, 4x fewer KV bytes per token; a larger FFN and vocabulary),
so b should come out somewhat above the 7B's and c about 4x below it.

Run: ``python scripts/derive_gpu_profile.py`` (rewrites both files; idempotent).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FITTED = ROOT / "replica_agent" / "data" / "fitted_coefficients.csv"
DERIVED = ROOT / "replica_agent" / "data" / "derived_profiles.csv"
ENGINE_A100 = ROOT / "loadgen" / "data" / "engine_time" / "llama-3-8b-a100.json"
ENGINE_H100 = ROOT / "loadgen" / "data" / "engine_time" / "llama-3-8b-h100.json"


def row(rows: list[dict[str, str]], model: str, gpu: str, tp: int, variant: str = "all_batches") -> dict[str, str]:
    """The fitted row of ``model`` on ``gpu`` at ``tp``. Raises KeyError when absent."""
    for r in rows:
        if (r["model"], r["gpu"], int(r["tp"]), r["variant"]) == (model, gpu, tp, variant):
            return r
    raise KeyError((model, gpu, tp, variant))


def ratios(rows: list[dict[str, str]]) -> dict[str, float]:
    """H100 / A100 of a, b, c on Llama-2-70B TP4 (variant all_batches)."""
    a100, h100 = row(rows, "Llama-2-70B", "A100", 4), row(rows, "Llama-2-70B", "H100", 4)
    keys = {"a": "a_ms", "b": "b_ms_per_new_token", "c": "c_ms_per_context_token"}
    return {k: float(h100[col]) / float(a100[col]) for k, col in keys.items()}


def main() -> int:
    """Write the derived profile row and the H100 engine model; print the ratios and the cross-check."""
    rows = list(csv.DictReader(FITTED.read_text().splitlines()))
    rt = ratios(rows)
    base = row(rows, "Llama-3-8B", "A100", 1)
    derived = dict.fromkeys(base, "")
    derived.update({
        "model": "Llama-3-8B", "gpu": "H100", "tp": "1", "variant": "all_batches",
        "a_ms": f"{float(base['a_ms']) * rt['a']:.6g}",
        "b_ms_per_new_token": f"{float(base['b_ms_per_new_token']) * rt['b']:.6g}",
        "c_ms_per_context_token": f"{float(base['c_ms_per_context_token']) * rt['c']:.6g}",
        "r2": base["r2"], "max_rel_err": base["max_rel_err"], "mean_rel_err": base["mean_rel_err"],
        "n_batches": "0", "kv_bytes_per_token": base["kv_bytes_per_token"],
        "kv_capacity_tokens_90pct": base["kv_capacity_tokens_90pct"],
    })  # fmt: skip
    with DERIVED.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(base), lineterminator="\n")
        w.writeheader()
        w.writerow(derived)
    eng = json.loads(ENGINE_A100.read_text())
    scale = {"a_ms": rt["a"], "d_ms": rt["a"], "b_ms": rt["b"], "f_ms": rt["b"], "c_ms": rt["c"], "e_ms": rt["c"]}
    out = {k: (float(f"{v * scale[k]:.6g}") if k in scale else v) for k, v in eng.items() if k != "meta"}
    out["meta"] = {
        "profile": "llama-3-8b-h100",
        "fitted_by": "scripts/derive_gpu_profile.py: llama-3-8b-a100.json with each term scaled by the H100/A100 "
                     "ratio of its kind measured on Llama-2-70B TP4 (Vidur, all_batches): a, d by a; b, f by b; c, e by c",
        "ratios": {k: round(v, 6) for k, v in rt.items()},
        "derived_from": "loadgen/data/engine_time/llama-3-8b-a100.json",
    }  # fmt: skip
    ENGINE_H100.write_text(json.dumps(out, indent=1) + "\n")
    seven = row(rows, "Llama-2-7B", "H100", 1)
    print(f"H100/A100 ratios on Llama-2-70B TP4: a {rt['a']:.3f}, b {rt['b']:.3f}, c {rt['c']:.3f}")
    print(f"derived llama-3-8b-h100: a {derived['a_ms']} ms, b {derived['b_ms_per_new_token']} ms/token, "
          f"c {derived['c_ms_per_context_token']} ms/context token")
    print(f"cross-check, Llama-2-7B measured on H100: a {float(seven['a_ms']):.4g}, b {float(seven['b_ms_per_new_token']):.4g}, "
          f"c {float(seven['c_ms_per_context_token']):.4g} (c / 4 for GQA: {float(seven['c_ms_per_context_token']) / 4:.4g})")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
