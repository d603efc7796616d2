"""``fairbatch-agent calibrate LOG``: fit the batch-time model a, b, c from a per-step log.

Seed 000 / FairBatching (arXiv 2510.14392, batch time model): ``batch_ms = a + b * new_tokens +
c * context_tokens``, fitted per deployment by least squares (time_model.fit_time_model).

LOG: JSON lines (one object per step, as the simulator's ``--step-log`` writes, see
loadgen/sim/step_log.py) or CSV with a header; both need ``new_tokens``, ``context_tokens`` and
``measured_ms`` (other keys/columns are ignored). Blank lines are skipped.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from replica_agent.policy.time_model import FitResult, fit_time_model

_FIELDS = ("new_tokens", "context_tokens", "measured_ms")


def read_step_log(path: str | Path) -> tuple[list[float], list[float], list[float]]:
    """(new_tokens, context_tokens, measured_ms) columns of a JSONL or CSV step log.

    Raises:
        ValueError: unknown format, a missing field or a non-numeric value (message: file:line).
        OSError: when the file cannot be read.
    """
    path = Path(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    cols: tuple[list[float], list[float], list[float]] = ([], [], [])
    first = next((i for i, line in enumerate(lines) if line.strip()), None)
    if first is None:
        raise ValueError(f"{path}: empty step log")
    if lines[first].lstrip().startswith("{"):
        rows = []
        for i, line in enumerate(lines, 1):
            if line.strip():
                try:
                    rows.append((i, json.loads(line)))
                except ValueError as e:
                    raise ValueError(f"{path}:{i}: not JSON: {e}") from None
    else:
        reader = csv.DictReader(lines[first:])
        rows = [(first + 2 + k, row) for k, row in enumerate(reader)]
    for lineno, row in rows:
        for col, key in zip(cols, _FIELDS, strict=True):
            if not isinstance(row, dict) or key not in row:
                raise ValueError(f"{path}:{lineno}: missing field {key!r} (need {', '.join(_FIELDS)})")
            try:
                col.append(float(row[key]))
            except (TypeError, ValueError):
                raise ValueError(f"{path}:{lineno}: {key} must be a number, got {row[key]!r}") from None
    return cols


def calibrate(path: str | Path) -> FitResult:
    """Fit a, b, c from the step log at ``path`` (see :func:`read_step_log`, :func:`fit_time_model`)."""
    return fit_time_model(*read_step_log(path))


def format_fit(fit: FitResult) -> str:
    """Human-readable fit report (coefficients, R², relative errors) plus the --coefficients value."""
    m = fit.model
    return (
        f"steps: {fit.n}\n"
        f"a = {m.a_ms:.6g} ms\n"
        f"b = {m.b_ms_per_new_token:.6g} ms/new token\n"
        f"c = {m.c_ms_per_context_token:.6g} ms/context token\n"
        f"R^2 = {fit.r2:.6f}\n"
        f"max relative error = {fit.max_rel_err:.4%}\n"
        f"mean relative error = {fit.mean_rel_err:.4%}\n"
        f"--coefficients {m.a_ms:.6g},{m.b_ms_per_new_token:.6g},{m.c_ms_per_context_token:.6g}"
    )
