"""loadgen.replay against the real simulated engine (a child process on loopback).

The engine runs the llama-3-8b-a100 profile (a = 9.8626 ms, b = 0.0726711 ms/token) at
--time-scale 0.05 (one simulated ms lasts 0.05 wall ms) and lays its steps end to end on the
simulated timeline, each at least a = 9.86 simulated ms: TPOT averaged over many tokens, and the
median TTFT (about a + b * prompt), reported in simulated ms must be at least about that, which
they would not be (20 times smaller) if loadgen forgot to divide wall latencies by the scale.
Single TTFTs are only checked positive: a step may start on the timeline slightly before a
request's wall arrival when the engine runs behind.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadgen.procs import ProcessGroup, free_port
from loadgen.replay import ReplayConfig, TenantSpec, replay
from loadgen.report import build_report
from loadgen.stats import FAILED, OK, Slo
from loadgen.traces import TraceRequest, embedded_trace, load_trace, select
from tests.timing import LoopLag

pytestmark = pytest.mark.timeout(120)

TIME_SCALE = 0.05
A_MS, B_MS = 9.8626, 0.0726711


@pytest.fixture(scope="module")
def engine_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real simulated engine on a free loopback port."""
    group = ProcessGroup(tmp_path_factory.mktemp("sim") / "logs")
    port = free_port()
    child = group.start(
        "sim-engine", [sys.executable, "-m", "loadgen.sim.server", "--port", str(port), "--time-scale", str(TIME_SCALE)]
    )
    try:
        group.wait_http_ok(child, f"http://127.0.0.1:{port}/health", timeout_s=30)
        yield f"http://127.0.0.1:{port}"
    finally:
        group.stop()


async def test_replay_azure_slice_all_complete(engine_url: str) -> None:
    trace = select(load_trace(embedded_trace("azure-conv")), duration_s=20.0, rate_scale=1.0)
    assert 30 <= len(trace) <= 200
    cfg = ReplayConfig(target=engine_url, tenants=[TenantSpec("acme", 3), TenantSpec("beta", 1)],
                       time_scale=TIME_SCALE, progress=False, max_wall_s=60)
    async with LoopLag() as lag:
        result = await replay(trace, cfg)
    assert result.model == "llama-3-8b-a100"  # discovered from /v1/models
    assert len(result.records) == len(trace)
    assert [r.outcome for r in result.records] == [OK] * len(trace), result.error_samples
    assert {r.tenant for r in result.records} == {"acme", "beta"}
    for req, rec in zip(trace, result.records, strict=True):
        assert rec.output_tokens == req.output_tokens
        assert len(rec.token_times_ms) == req.output_tokens  # one chunk per token from the simulator
        assert rec.prompt_tokens == req.prompt_tokens  # usage: make_prompt gives exactly N tokens
        assert rec.ttft_ms is not None and rec.ttft_ms > 0
        if req.output_tokens >= 10:  # averaged over >= 9 steps laid end to end, each >= a
            # less the client's own lateness: its first token read late by at most lag.worst_s (wall), which
            # shortens the span it sees (a loaded machine once read all 16 tokens of a request at once)
            late_ms = lag.worst_s * 1000.0 / TIME_SCALE / (req.output_tokens - 1)
            assert rec.tpot_ms is not None and rec.tpot_ms > 0.8 * A_MS - late_ms
        assert rec.token_times_ms == sorted(rec.token_times_ms)
    # arrivals follow the trace, in simulated ms (sent at arrival * scale wall ms), never early
    assert all(rec.arrival_ms >= req.arrival_ms - 1.0 for req, rec in zip(trace, result.records, strict=True))
    # sent on time: a median send lag of 0.1 wall s (2,000 simulated ms at scale 0.05) on an idle machine,
    # wider as this loop (which sends them) was seen held up during the replay (tests/timing.py)
    lags = sorted(rec.send_lag_ms for rec in result.records)
    assert lags[len(lags) // 2] <= lag.bound_s(0.0, slack_s=0.1) * 1000.0 / TIME_SCALE
    # simulated duration >= the trace window's last arrival
    assert result.duration_s >= trace[-1].arrival_ms / 1000.0
    assert result.wall_s < result.duration_s  # time scale 0.05: faster than simulated time

    doc = build_report(result, {"acme": Slo(60_000.0, 5_000.0), "beta": Slo(60_000.0, 5_000.0)},
                       {"trace": "azure-conv", "rate_scale": 1.0, "duration_s": 20.0})
    assert doc["completed"] == doc["requests_total"] == len(trace)
    assert doc["time_scale"] == TIME_SCALE
    assert doc["tpot_ms"]["p50"] > 0.8 * A_MS
    # not rescaled by the report: its mean TPOT is the records' own (simulated ms; a second division by the
    # scale would make it 20 times larger), with no bound on how slow the machine made the steps
    tpots = [rec.tpot_ms for rec in result.records if rec.tpot_ms is not None]
    assert doc["tpot_ms"]["mean"] == pytest.approx(sum(tpots) / len(tpots))
    prefill_ms = sorted(A_MS + B_MS * r.prompt_tokens for r in trace)
    assert doc["ttft_ms"]["p50"] > 0.8 * prefill_ms[len(prefill_ms) // 2]
    assert doc["itl_ms"]["mean"] > 0
    assert doc["slo_attainment"] > 0.9


async def test_replay_chat_and_token_prompts(engine_url: str) -> None:
    trace = [TraceRequest(0.0, 300, 5), TraceRequest(10.0, 7, 1), TraceRequest(20.0, 1000, 3)]
    for endpoint, fmt in (("chat", "text"), ("completions", "tokens")):
        cfg = ReplayConfig(target=engine_url, endpoint=endpoint, prompt_format=fmt, time_scale=TIME_SCALE,
                           progress=False, max_wall_s=30)
        result = await replay(trace, cfg)
        for req, rec in zip(trace, result.records, strict=True):
            assert rec.outcome == OK, (endpoint, fmt, result.error_samples)
            assert rec.prompt_tokens == req.prompt_tokens, (endpoint, fmt)
            assert rec.output_tokens == len(rec.token_times_ms) == req.output_tokens


async def test_replay_errors_and_wall_limit(engine_url: str) -> None:
    # prompt longer than the engine's max-model-len (32768) -> HTTP 400 -> failed
    bad = await replay([TraceRequest(0.0, 40_000, 2), TraceRequest(1.0, 10, 2)],
                       ReplayConfig(target=engine_url, time_scale=TIME_SCALE, progress=False, max_wall_s=30))
    assert [r.outcome for r in bad.records] == [FAILED, OK]
    assert bad.records[0].reason == "http-400" and "http-400" in bad.error_samples
    # a wall limit cuts the replay: unsent requests and running ones are failed, counts still add up
    trace = [TraceRequest(0.0, 100, 2000), TraceRequest(600_000.0, 10, 2)]
    cut = await replay(trace, ReplayConfig(target=engine_url, time_scale=TIME_SCALE, progress=False, max_wall_s=0.5))
    assert [(r.outcome, r.reason) for r in cut.records] == [(FAILED, "wall-limit"), (FAILED, "not-sent")]
    doc = build_report(cut, {"default": Slo(500.0, 50.0)}, {})
    assert doc["failed"] == 2 and doc["failed_reasons"] == {"not-sent": 1, "wall-limit": 1}


async def test_replay_unreachable_target_fails_cleanly(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    result = await replay([TraceRequest(0.0, 10, 2)],
                          ReplayConfig(target=url, model="m", progress=False, request_timeout_s=5.0, max_wall_s=10))
    assert result.records[0].outcome == FAILED
    assert result.records[0].reason.startswith("client-")


async def test_prompt_offset_keeps_a_second_replay_off_the_prefix_cache(engine_url: str) -> None:
    import aiohttp

    from loadgen.vllm_fleet import metric_value, parse_prometheus

    async def hits() -> float:
        async with aiohttp.ClientSession() as s, s.get(engine_url + "/metrics") as r:
            return metric_value(parse_prometheus(await r.text()), "vllm:prefix_cache_hits_total") or 0.0

    # lengths unlike every other test's here, so only these replays can hit each other's blocks
    trace = [TraceRequest(10.0 * i, 640 + 16 * i, 1) for i in range(4)]
    cfg = ReplayConfig(target=engine_url, time_scale=TIME_SCALE, progress=False, max_wall_s=30, prompt_offset=5000)
    first = await replay(trace, cfg)
    assert all(r.outcome == OK for r in first.records)
    h0 = await hits()
    await replay(trace, cfg)  # the same indices again: the same prompts, cached whole blocks
    h1 = await hits()
    assert h1 - h0 >= 4 * 600  # every prompt hits at least its first 600 tokens (whole blocks)
    await replay(trace, ReplayConfig(target=engine_url, time_scale=TIME_SCALE, progress=False, max_wall_s=30,
                                     prompt_offset=5000 + len(trace)))  # fmt: skip
    assert await hits() == h1  # indices past the earlier ones: their first block differs, no hit
    with pytest.raises(ValueError):
        ReplayConfig(target=engine_url, prompt_offset=-1)
