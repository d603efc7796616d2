"""scripts/gpu_step_profile.py end to end on CPU with the tiny shape (``--device cpu --tiny``), run by the
vLLM venv's interpreter (torch + transformers; the main venv has neither). Skipped without ``make vllm-env``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from loadgen.vllm_fleet import REPO_ROOT, vllm_venv

PY = vllm_venv() / "bin" / "python"
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]
if not PY.exists():
    pytest.skip(f"{PY} not found; run `make vllm-env`", allow_module_level=True)


def test_tiny_cpu_run_writes_a_fit_that_reproduces_its_points(tmp_path: Path) -> None:
    out = tmp_path / "tiny.json"
    r = subprocess.run([str(PY), "scripts/gpu_step_profile.py", "--device", "cpu", "--tiny", "--reps", "2",
                        "--out", str(out)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=280)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    meta = doc["meta"]
    assert meta["shape"]["hidden_size"] == 64 and meta["dtype"] == "float32"
    assert len(meta["points"]) == 8 and not meta["skipped"]
    coef = np.array([doc[k] for k in ("a_ms", "b_ms", "c_ms", "d_ms", "e_ms", "f_ms")])
    assert (coef >= 0).all()
    for p in meta["points"]:
        assert len(p["ms"]) == 2 and all(v > 0 for v in p["ms"])
    # the reported error is the fit's own on its points
    x = np.array([p["features"] for p in meta["points"]])
    y = np.array([p["median_ms"] for p in meta["points"]])
    rel = np.abs(x @ coef - y) / y
    assert meta["error_by_kind"]["all"]["mean_rel_err"] == pytest.approx(float(rel.mean()), abs=2e-3)
    assert [c["batch"] for c in meta["comparison"]][:2] == ["decode B=1 ctx 1k", "decode B=64 ctx 2k"]
