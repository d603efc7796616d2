"""Per-step log of an engine: one JSON line per executed iteration (input of ``fairbatch-agent calibrate``).

Line format (JSONL): ``{"start_ms": float, "new_tokens": int, "context_tokens": int,
"measured_ms": float, "batch_size": int, "chunk_prefix_tokens": int, "chunk_sq_tokens": int,
"timeline_lag_ms": float}``:
simulated start time, tokens computed, tokens in KV before the step summed over the batch (the time
model's inputs: replica_agent/policy/time_model.py, docs/architecture.md "Time model, learned
online"), the step's duration in ms, the number of requests in it,
and the rest of the step's :class:`~replica_agent.policy.time_model.StepFeatures` (sum over the batch
of chunk_i * prefix_i and of chunk_i^2; ``batch_size`` is its ``num_seqs``), and the simulated ms the
engine's timeline jumped forward just before this step because its process fell behind (the real-time
server, loadgen/sim/server.py; 0 in the virtual-clock simulator and whenever the process kept up). ``fairbatch-agent calibrate`` also reads
CSV with a header naming at least ``new_tokens,context_tokens,measured_ms``.
"""

from __future__ import annotations

import json
from typing import TextIO

from loadgen.sim.engine import StepResult


def step_record(result: StepResult, lag_ms: float = 0.0) -> dict[str, float | int]:
    """The log record of one non-empty step; ``lag_ms``: the timeline's jump before it (ms, >= 0)."""
    return {
        "start_ms": round(result.start_ms, 6),
        "new_tokens": result.batch.num_new_tokens,
        "context_tokens": result.context_tokens,
        "measured_ms": round(result.duration_ms, 6),
        "batch_size": len(result.batch),
        "chunk_prefix_tokens": f.chunk_prefix_tokens if (f := result.features) is not None else 0,
        "chunk_sq_tokens": f.chunk_sq_tokens if f is not None else 0,
        "timeline_lag_ms": round(lag_ms, 6),
    }


def write_step(out: TextIO, result: StepResult, lag_ms: float = 0.0) -> None:
    """Append one step to ``out`` (skips empty steps); ``lag_ms`` as in :func:`step_record`."""
    if result.duration_ms > 0:
        out.write(json.dumps(step_record(result, lag_ms), separators=(",", ":")) + "\n")
