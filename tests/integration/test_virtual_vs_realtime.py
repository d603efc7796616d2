"""The virtual-clock simulator (loadgen/sim/virtual.py) and the real-time server agree on a short trace.

Same engine settings as the server's defaults (llama-3-8b-a100, vllm-default policy, 2048-token cap
and 256 sequences as vllm serve on an A100, block 16), the first 40 s of the Azure conversation trace at 3x its rate (89 requests in 13.3 s). The server runs at
time scale 1 (one simulated ms is one wall ms) and adds real-world jitter (timer resolution, HTTP,
the event loop), so the comparison is on aggregates with tolerances: mean TTFT within 25 % (it is the
more jitter-sensitive figure: tens of ms), mean TPOT within 10 %, and every request the same number
of tokens.

A loaded machine makes the server's process fall behind its timeline: when it wakes more than 2 ms
late the timeline jumps to the present (loadgen/sim/server.py), and that time is lost, never made up.
The server's step log records each jump (``timeline_lag_ms``), so the test measures how much slower
than the model the server ran, ``stretch = (sum of step times + sum of jumps) / sum of step times``,
and compares the real figures against the virtual ones times that stretch. On an idle machine the
stretch is 1 and the check is the plain one; on any machine the real TPOT may not be below the
virtual one by more than the tolerance (the server never runs faster than its model), and the stretch
itself is bounded, so a server that stalls is still a failure.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadgen.procs import ProcessGroup, free_port, script
from loadgen.replay import ReplayConfig, TenantSpec, replay
from loadgen.sim.engine import EngineConfig, SimEngine
from loadgen.sim.virtual import VirtualRequest, run_virtual
from loadgen.stats import OK
from loadgen.traces import embedded_trace, load_trace, select
from replica_agent.policy.batching import PolicyConfig, make_policy
from replica_agent.policy.profiles import load_profile
from tests.timing import LoopLag

pytestmark = pytest.mark.timeout(120)


MAX_STRETCH = 1.5  # slower than this and the server, not the machine, is suspect


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    tmp = tmp_path_factory.mktemp("rt")
    group = ProcessGroup(tmp / "logs")
    port = free_port()
    step_log = tmp / "steps.jsonl"
    child = group.start("sim-engine", script("fairbatch-loadgen") + ["sim-engine", "--port", str(port), "--time-scale", "1",
                                                                   "--step-log", str(step_log)])  # fmt: skip
    try:
        group.wait_http_ok(child, f"http://127.0.0.1:{port}/health", timeout_s=30)
        yield f"http://127.0.0.1:{port}", step_log
    finally:
        group.stop()


def timeline_stretch(step_log: Path) -> float:
    """(sum of step times + sum of timeline jumps) / sum of step times over the server's step log."""
    recs = [json.loads(line) for line in step_log.read_text().splitlines() if line.strip()]
    busy = sum(r["measured_ms"] for r in recs)
    lost = sum(r["timeline_lag_ms"] for r in recs)
    assert busy > 0 and lost >= 0
    return (busy + lost) / busy


def test_timeline_stretch_by_hand(tmp_path: Path) -> None:
    log = tmp_path / "steps.jsonl"
    log.write_text('{"measured_ms": 20.0, "timeline_lag_ms": 0.0}\n\n{"measured_ms": 30.0, "timeline_lag_ms": 5.0}\n')
    assert timeline_stretch(log) == pytest.approx(55.0 / 50.0)


async def test_virtual_and_real_time_engines_agree(engine: tuple[str, Path]) -> None:
    engine_url, step_log = engine
    trace = select(load_trace(embedded_trace("azure-conv")), duration_s=40.0, rate_scale=3.0)
    assert len(trace) == 89  # rows of the first 40 s (counted in the CSV)

    profile = load_profile("llama-3-8b-a100")
    engine = SimEngine(
        EngineConfig(time_model=profile.time_model, num_gpu_blocks=profile.kv_capacity_tokens // 16, block_size=16,
                     max_num_batched_tokens=2048, max_num_seqs=256, max_model_len=32768),
        make_policy("vllm-default", PolicyConfig(1000.0, 100.0)),
    )
    virtual = run_virtual([VirtualRequest(str(i), r.arrival_ms, r.prompt_tokens, r.output_tokens)
                           for i, r in enumerate(trace)], engine)

    async with LoopLag() as lag:  # the client's own lateness (it reads the tokens in this loop)
        result = await replay(trace, ReplayConfig(target=engine_url, tenants=[TenantSpec("t")], time_scale=1.0,
                                                  progress=False, max_wall_s=90))
    assert [r.outcome for r in result.records] == [OK] * len(trace), result.error_samples

    v_ttft = statistics.mean(r.ttft_ms for r in virtual.records)
    v_tpot = statistics.mean(r.tpot_ms for r in virtual.records if r.tpot_ms is not None)
    real_ttft = statistics.mean(r.ttft_ms for r in result.records)
    real_tpot = statistics.mean(r.tpot_ms for r in result.records if r.tpot_ms is not None)
    stretch = timeline_stretch(step_log)
    print(f"TTFT mean virtual {v_ttft:.1f} real {real_ttft:.1f}; TPOT mean virtual {v_tpot:.2f} real {real_tpot:.2f}; "
          f"server timeline stretch {stretch:.3f}")  # fmt: skip
    assert [len(r.token_times_ms) for r in virtual.records] == [len(r.token_times_ms) for r in result.records]
    assert stretch <= MAX_STRETCH, stretch
    assert real_tpot >= v_tpot * 0.90, (real_tpot, v_tpot)
    # the first token read late by this loop (at most lag.worst_s) lengthens a TTFT by as much
    assert v_ttft * stretch * 0.75 <= real_ttft <= v_ttft * stretch * 1.25 + lag.worst_s * 1000.0, (
        real_ttft, v_ttft, stretch, lag.worst_s)
    # the client reads each token in this test's loop: a token read late (at most lag.worst_s) lengthens its
    # request's TPOT = (last - first) / (n - 1) by at most worst / (n - 1), so the mean by at most
    # worst x mean(1 / (n - 1)) (0 on an idle machine); the server's own lateness is in the stretch
    client_ms = lag.worst_s * 1000.0 * statistics.mean(
        1.0 / (len(r.token_times_ms) - 1) for r in result.records if r.tpot_ms is not None)
    assert real_tpot >= v_tpot * stretch * 0.90, (real_tpot, v_tpot, stretch)
    assert real_tpot <= v_tpot * stretch * 1.10 + client_ms, (real_tpot, v_tpot, stretch, client_ms)
