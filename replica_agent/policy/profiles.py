"""Named GPU profiles: time-model coefficients and KV-cache capacity per model/GPU/TP.

Data: ``replica_agent/data/fitted_coefficients.csv`` (origin and licence in ``data/SOURCES.md``) and
``replica_agent/data/derived_profiles.csv`` (``llama-3-8b-h100``, derived here from those fits by
scripts/derive_gpu_profile.py: no H100 profile of Llama-3-8B exists).
Profile names are ``<model>-<gpu>[-tp<N>]`` in lower case, e.g. ``llama-3-8b-a100`` (TP 1) or
``llama-2-70b-h100-tp4``. The default variant is ``all_batches`` (fitted on decode-only,
prefill-only and mixed batches); ``variant`` selects another row (``decode_only``,
``splitwise_end_to_end_measured``, ...).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from functools import cache
from importlib import resources

from replica_agent.policy.time_model import TimeModel

DEFAULT_PROFILE = "llama-3-8b-a100"
DEFAULT_VARIANT = "all_batches"


@dataclass(frozen=True, slots=True)
class Profile:
    """One fitted profile.

    Attributes:
        name: profile name, e.g. ``llama-3-8b-a100``.
        variant: fit variant (row of the CSV).
        time_model: a, b, c in ms.
        kv_capacity_tokens: KV cache size at 90 % GPU memory use (tokens).
        kv_bytes_per_token: bytes of KV cache per token.
        r2, max_rel_err, mean_rel_err: fit quality (fractions).
        gpu: GPU model as the CSV names it (``A100``, ``H100``).
    """

    name: str
    variant: str
    time_model: TimeModel
    kv_capacity_tokens: int
    kv_bytes_per_token: int
    r2: float
    max_rel_err: float
    mean_rel_err: float
    gpu: str = ""


@dataclass(frozen=True, slots=True)
class ServeBatchDefaults:
    """What ``vllm serve`` uses when the user sets neither flag.

    Attributes:
        max_num_batched_tokens: token cap of one iteration (tokens); with chunked prefill (always on
            in vLLM v1) also the fixed chunked-prefill budget.
        max_num_seqs: cap on running requests (sequences).
    """

    max_num_batched_tokens: int
    max_num_seqs: int

    def resolve(self, max_num_batched_tokens: int | None, max_num_seqs: int | None) -> ServeBatchDefaults:
        """The settings an engine runs with: each given flag, else this default (None = not given)."""
        return ServeBatchDefaults(
            self.max_num_batched_tokens if max_num_batched_tokens is None else max_num_batched_tokens,
            self.max_num_seqs if max_num_seqs is None else max_num_seqs,
        )


_GIB = 1 << 30
_MIB = 1 << 20
GPU_MEMORY_BYTES: dict[str, int] = {
    "A100": 81_920 * _MIB,  # A100-80GB, the GPU of the profiles' A100 rows (shared profiles/fits.md)
    "H100": 81_559 * _MIB,  # H100-80GB SXM, nvidia-smi total (same source)
    "H200": 143_771 * _MIB,
    "B200": 183_359 * _MIB,
}
"""Total memory of the GPU models the profiles name (bytes)."""


def vllm_serve_batch_defaults(gpu: str) -> ServeBatchDefaults:
    """``vllm serve`` defaults for ``max_num_batched_tokens`` / ``max_num_seqs`` on a GPU model.

    Mirrors vLLM 0.32.0 ``EngineArgs.get_batch_defaults`` for the OpenAI API server context
    (vllm/engine/arg_utils.py): >= 160 GiB -> 16384 / 1024; >= 70 GiB and not an A100 -> 8192 /
    1024 (H100, H200); otherwise, A100-80GB included ("large max_num_batched_tokens for A100
    reduces throughput", vLLM PR #17885) -> 2048 / 256; ``CPU`` (vLLM's CPU platform, one worker)
    -> 2048 / 128.

    Args:
        gpu: GPU model, case-insensitive (``A100``, ``H100``, ``H200``, ``B200``, or ``CPU``).

    Raises:
        KeyError: for a GPU model not in :data:`GPU_MEMORY_BYTES`.
    """
    key = gpu.upper()
    if key == "CPU":  # vLLM's CPU platform (the same function's CPU branch), OpenAI API server
        return ServeBatchDefaults(2048, 128)
    if key not in GPU_MEMORY_BYTES:
        raise KeyError(f"unknown GPU {gpu!r}; known: {', '.join(sorted(GPU_MEMORY_BYTES))}")
    mem = GPU_MEMORY_BYTES[key]
    if mem >= 160 * _GIB:
        return ServeBatchDefaults(16384, 1024)
    if mem >= 70 * _GIB and "A100" not in key:
        return ServeBatchDefaults(8192, 1024)
    return ServeBatchDefaults(2048, 256)


def _profile_name(model: str, gpu: str, tp: int) -> str:
    base = f"{model}-{gpu}".lower()
    return base if tp == 1 else f"{base}-tp{tp}"


@cache
def _rows() -> tuple[dict[str, str], ...]:
    """Rows of the fitted profiles, then of the derived ones (``derived_profiles.csv``:
    scripts/derive_gpu_profile.py; data/SOURCES.md)."""
    data = resources.files("replica_agent.data")
    rows: list[dict[str, str]] = []
    for name in ("fitted_coefficients.csv", "derived_profiles.csv"):
        rows.extend(csv.DictReader(data.joinpath(name).read_text().splitlines()))
    return tuple(rows)


def available_profiles(variant: str = DEFAULT_VARIANT) -> list[str]:
    """Sorted profile names that have a row for ``variant``."""
    return sorted({_profile_name(r["model"], r["gpu"], int(r["tp"])) for r in _rows() if r["variant"] == variant})


def load_profile(name: str = DEFAULT_PROFILE, variant: str = DEFAULT_VARIANT) -> Profile:
    """Look up a profile by name and variant.

    Raises:
        KeyError: with the list of known names when ``name``/``variant`` is not in the CSV.
    """
    for r in _rows():
        if r["variant"] == variant and _profile_name(r["model"], r["gpu"], int(r["tp"])) == name.lower():
            return Profile(
                name=name.lower(),
                variant=variant,
                time_model=TimeModel(
                    float(r["a_ms"]), float(r["b_ms_per_new_token"]), float(r["c_ms_per_context_token"])
                ),
                kv_capacity_tokens=int(r["kv_capacity_tokens_90pct"]),
                kv_bytes_per_token=int(r["kv_bytes_per_token"]),
                r2=float(r["r2"]),
                max_rel_err=float(r["max_rel_err"]),
                mean_rel_err=float(r["mean_rel_err"]),
                gpu=r["gpu"],
            )
    raise KeyError(
        f"unknown profile {name!r} (variant {variant!r}); known: {', '.join(available_profiles(variant))}"
    )
