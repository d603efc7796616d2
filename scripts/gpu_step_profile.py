"""Time a Llama-3-8B-shaped forward pass (random weights) over a step grid on a GPU and fit the engine-time model.

``python scripts/gpu_step_profile.py [--device cuda] [--tiny] [--out FILE] [--max-seconds 480]``

Prepared for a GPU machine (issue 31, item 4; it has torch + transformers); on CPU only its tiny shape
is meant to run (``--device cpu --tiny``: the test, seconds). What it does:

1. Builds ``LlamaForCausalLM`` from a Llama-3-8B ``LlamaConfig`` (hidden 4096, FFN 14336, 32 layers,
   32 query / 8 KV heads of 128, vocabulary 128256; Meta's config.json) with random weights in
   bfloat16 on the device, nothing downloaded; ``--tiny``: hidden 64, 2 layers (the test).
2. Times one forward (``torch.inference_mode``, synchronised, median of ``--reps`` after one warm-up;
   logits of the last position only, as vLLM computes them) for every point of :func:`grid`:
   prefill chunks of n tokens over a prefix of p cached tokens (the cache filled with random K/V, so
   no prefill is run to make it), and decode batches of B sequences at context C (B x 1 tokens over B
   caches of C). Points are run cheapest first and stop at ``--max-seconds``.
3. Fits ``a + b new + c context + d seqs + e sum(chunk x prefix) + f sum(chunk^2)`` with the
   relative-error least squares of scripts/fit_engine_time_model.py (``fit_relative``; a decode is a
   chunk of 1 at its context) and writes the engine-time JSON (loadgen/data/engine_time/ format) with
   every point, the error by kind and the spot batches of fit_engine_time_model.py next to those of
   loadgen/data/engine_time/llama-3-8b-a100.json (``comparison``).

What this forward is not: vLLM's engine. HuggingFace eager attention (SDPA), no paged KV, no CUDA
graphs, no mixed prefill + decode batch (HF pads a batch to one length; vLLM packs it): the fit
covers decode-only and prefill-only steps, and the engine's scheduling overhead per step (``a``) is
missing. Compare the per-token terms (b, c, e, f) with the Vidur-based file first.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 8192,
             "rope_theta": 500000.0}  # fmt: skip
"""Meta-Llama-3-8B config.json (the shape of loadgen/data/engine_time/llama-3-8b-a100.json)."""
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256, "max_position_embeddings": 2048}  # fmt: skip

MAX_CACHE_TOKENS = 131072
"""Largest B x C (or prefix) of a point: 16 GiB of bf16 KV cache at the 8B shape (128 KiB per token)."""


def grid(tiny: bool = False) -> list[tuple[str, list[tuple[int, int]]]]:
    """The points ``(label, items)``: items are ``(chunk, prefix)`` pairs, one per sequence (all of one point
    equal, as one HF forward takes them). The shapes of the component-model batch mix
    (scripts/fit_engine_time_model.py: decode B 1..256 at contexts 128..4096, prefill chunks 256..8192,
    chunks over prefixes up to 32k) within :data:`MAX_CACHE_TOKENS`; ``tiny``: a handful, short."""
    if tiny:
        pts = [(f"prefill {n}", [(n, 0)]) for n in (16, 64, 128)]
        pts += [("chunk 64 at prefix 128", [(64, 128)])]
        pts += [(f"decode B={b} ctx {c}", [(1, c)] * b) for b in (1, 4) for c in (32, 128)]
        return pts
    pts = [(f"prefill {n}", [(n, 0)]) for n in (128, 256, 512, 1024, 2048, 4096, 8192)]
    pts += [(f"chunk {n} at prefix {p}", [(n, p)]) for n, p in ((512, 2048), (2048, 2048), (2048, 8192),
                                                                 (2048, 16384), (1024, 24576), (2048, 30720))]  # fmt: skip
    pts += [(f"decode B={b} ctx {c}", [(1, c)] * b) for b in (1, 8, 32, 64, 128, 256) for c in (128, 512, 1024, 2048, 4096)
            if b * c <= MAX_CACHE_TOKENS]  # fmt: skip
    return pts


def point_features(items: Sequence[tuple[int, int]]) -> list[float]:
    """``[1, new, context, seqs, sum chunk x prefix, sum chunk^2]`` (scripts/fit_engine_time_model.py ``features``)."""
    return [1.0, float(sum(c for c, _ in items)), float(sum(p for _, p in items)), float(len(items)),
            float(sum(c * p for c, p in items)), float(sum(c * c for c, _ in items))]  # fmt: skip


def _cost(items: Sequence[tuple[int, int]]) -> float:
    return sum(c * (c + p) for c, p in items) + 1e3 * len(items)


def time_point(model: Any, cfg: Any, items: Sequence[tuple[int, int]], device: str, dtype: Any, reps: int) -> list[float]:
    """Wall ms of ``reps`` forwards of one point (after one warm-up), synchronised on CUDA."""
    import torch
    from transformers import DynamicCache

    b, (chunk, prefix) = len(items), items[0]
    kv, hd = cfg.num_key_value_heads, cfg.head_dim
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (b, chunk), device=device, generator=gen)
    pos = torch.arange(prefix, prefix + chunk, device=device)

    def cache() -> Any:
        if prefix == 0:
            return None
        c = DynamicCache()
        for layer in range(cfg.num_hidden_layers):
            k = torch.randn(b, kv, prefix, hd, device=device, dtype=dtype, generator=gen)
            c.update(k, torch.randn_like(k), layer)
        return c

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    out = []
    with torch.inference_mode():
        for i in range(reps + 1):
            c = cache()
            sync()
            t0 = time.perf_counter()
            kwargs: dict[str, Any] = {"past_key_values": c, "use_cache": c is not None, "cache_position": pos,
                                      "position_ids": pos.unsqueeze(0).expand(b, -1), "logits_to_keep": 1}  # fmt: skip
            model(input_ids=ids, **kwargs)
            sync()
            if i > 0:
                out.append((time.perf_counter() - t0) * 1000.0)
            del c
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Measure, fit, write the JSON; print a table. Returns the exit code."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="torch device (cuda, cuda:1, cpu)")
    ap.add_argument("--tiny", action="store_true", help="a tiny Llama and a short grid (the CPU test)")
    ap.add_argument("--out", default=None, help="JSON path (default: out/gpu-step-profile-<gpu>.json)")
    ap.add_argument("--reps", type=int, default=3, help="timed forwards per point (median)")
    ap.add_argument("--max-seconds", type=float, default=480.0, help="stop measuring after this many seconds")
    args = ap.parse_args(argv)
    import numpy as np
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    from fit_engine_time_model import SPOT_BATCHES, _split, features, fit_relative

    t_start = time.monotonic()
    on_cuda = args.device.startswith("cuda")
    if on_cuda and not torch.cuda.is_available():
        print("gpu_step_profile: CUDA is not available here; run with --device cpu --tiny to test", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if on_cuda else torch.float32
    shape = TINY if args.tiny else LLAMA3_8B
    cfg = LlamaConfig(**shape, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    gpu = torch.cuda.get_device_name(args.device) if on_cuda else platform.processor() or "cpu"
    build_s = time.monotonic() - t_start
    pts = sorted(grid(args.tiny), key=lambda p: _cost(p[1]))
    rows, skipped = [], []
    for label, items in pts:
        if time.monotonic() - t_start > args.max_seconds:
            skipped.append(label)
            continue
        try:
            ms = time_point(model, cfg, items, args.device, dtype, args.reps)
        except torch.OutOfMemoryError:
            skipped.append(label + " (out of memory)")
            torch.cuda.empty_cache()
            continue
        rows.append({"label": label, "items": [len(items), *items[0]], "features": point_features(items),
                     "median_ms": float(np.median(ms)), "ms": [round(v, 4) for v in ms]})  # fmt: skip
        print(f"{label:<28} {np.median(ms):10.3f} ms", flush=True)
    x = np.array([r["features"] for r in rows])
    y = np.array([r["median_ms"] for r in rows])
    coef = fit_relative(x, y)
    pred = x @ coef
    rel = np.abs(pred - y) / y
    kinds = np.array([r["label"].split()[0] for r in rows])
    by_kind = {k: {"n": int((kinds == k).sum()), "mean_rel_err": round(float(rel[kinds == k].mean()), 4),
                   "max_rel_err": round(float(rel[kinds == k].max()), 4)} for k in ("prefill", "chunk", "decode")
               if (kinds == k).any()}  # fmt: skip
    by_kind["all"] = {"n": int(rel.size), "mean_rel_err": round(float(rel.mean()), 4), "max_rel_err": round(float(rel.max()), 4)}
    reps = [np.log(np.array(r["ms"]) / r["median_ms"]) for r in rows if len(r["ms"]) > 1]
    sigma = float(np.sqrt(np.mean(np.concatenate(reps) ** 2))) if reps else 0.0
    model_json = {k: float(f"{v:.6g}") for k, v in zip(("a_ms", "b_ms", "c_ms", "d_ms", "e_ms", "f_ms"), coef, strict=True)}
    ref_path = ROOT / "loadgen" / "data" / "engine_time" / "llama-3-8b-a100.json"
    ref = json.loads(ref_path.read_text())
    comparison = []
    for name, steps in SPOT_BATCHES:
        f = [features(*_split(st)) for st in steps]
        ours = sum(float(v @ coef) for v in f)
        theirs = sum(float(v @ np.array([ref[k] for k in ("a_ms", "b_ms", "c_ms", "d_ms", "e_ms", "f_ms")])) for v in f)
        comparison.append({"batch": name, "this_ms": round(ours, 2), "llama-3-8b-a100_ms": round(theirs, 2),
                           "ratio": round(ours / theirs, 3) if theirs > 0 else None})  # fmt: skip
    slug = "".join(ch if ch.isalnum() else "-" for ch in gpu.lower()).strip("-") or "device"
    doc = {**model_json, "noise_sigma": round(sigma, 4), "seed": 0, "meta": {
        "profile": f"llama-3-8b-{slug}" + ("-tiny" if args.tiny else ""),
        "fitted_by": "scripts/gpu_step_profile.py (HF transformers forward, random weights; see its docstring)",
        "device": gpu, "dtype": str(dtype).replace("torch.", ""), "shape": shape,
        "torch": torch.__version__, "transformers": transformers.__version__, "reps": args.reps,
        "points": rows, "skipped": skipped, "error_by_kind": by_kind, "build_s": round(build_s, 1),
        "wall_s": round(time.monotonic() - t_start, 1),
        "noise": {"sigma_from": "RMS of ln(rep / median) over every point's timed forwards"},
        "comparison_with": str(ref_path.relative_to(ROOT)), "comparison": comparison,
    }}  # fmt: skip
    out = Path(args.out or ROOT / "out" / f"gpu-step-profile-{slug}{'-tiny' if args.tiny else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(", ".join(f"{k}={v:.6g}" for k, v in model_json.items()) + f"; mean rel err {by_kind['all']['mean_rel_err']:.3f}")
    for c in comparison:
        print(f"  {c['batch']:<44} {c['this_ms']:>10} ms  vs a100 file {c['llama-3-8b-a100_ms']:>10} ms")
    print(f"written {out} in {doc['meta']['wall_s']:.0f} s" + (f"; {len(skipped)} points skipped" if skipped else ""))
    return 0 if math.isfinite(by_kind["all"]["mean_rel_err"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
