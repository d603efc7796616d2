"""A real ``fairbatch-agent serve --plugin-export unix:PATH --no-proxy`` process fed real datagrams.

The datagrams are built and sent by the plugin's own code (replica_agent/plugin_export.py:
``state_record``, ``step_record``, ``PluginExporter``), in the hand-worked state of
tests/unit/test_plugin_mode.py (expected PAB there: 589.464 ms / 2306 tokens; with a, b, c doubled
by the learned margin: 278.928 ms / 1294 tokens). A fake engine in this process answers /metrics
(2 running, so a silent export counts as stale), /health and /v1/models.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from aiohttp import web

from loadgen.procs import ProcessGroup, free_port, script
from proto import admission_pb2, admission_pb2_grpc
from replica_agent.plugin_export import PluginExporter, step_record
from tests.unit.test_plugin_mode import hand_record

METRICS = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 2
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 1
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} 0.5
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="1000"} 1
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{model_name="m"} 0
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{le="+Inf",model_name="m"} 0
vllm:inter_token_latency_seconds_count{model_name="m"} 0
vllm:inter_token_latency_seconds_sum{model_name="m"} 0
"""


async def fake_engine() -> tuple[web.AppRunner, int]:
    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=METRICS)

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m", "max_model_len": 4096}]})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port


def agent_metric(http_port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=5).read().decode()
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


async def next_snapshot(stream, predicate, timeout_s: float = 10.0) -> admission_pb2.BudgetSnapshot:
    async def loop():
        while True:
            snap = await stream.read()
            assert snap is not grpc.aio.EOF
            if predicate(snap):
                return snap

    return await asyncio.wait_for(loop(), timeout_s)


@pytest.fixture
def sock_dir():
    d = Path(tempfile.mkdtemp(prefix="fbp", dir="/tmp"))  # short: UNIX socket paths are <= 107 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


async def test_agent_plugin_mode_exact_pab_staleness_and_learned_margin(tmp_path, sock_dir) -> None:
    engine, engine_port = await fake_engine()
    sock = sock_dir / "agent.sock"
    http_port, grpc_port = free_port(), free_port()
    group = ProcessGroup(tmp_path / "logs")
    exporter = PluginExporter(f"unix:{sock}")
    channel = None
    try:
        child = group.start("agent", script("fairbatch-agent") + [
            "serve", "--engine-url", f"http://127.0.0.1:{engine_port}", "--http-port", str(http_port),
            "--grpc-port", str(grpc_port), "--coefficients", "10,0.1,0.001", "--slo-class", "interactive:1000:100",
            "--margin-frac", "0.1", "--plugin-export", f"unix:{sock}", "--plugin-stale-ms", "300", "--no-proxy",
            "--time-model-prior-weight", "1e12", "--time-model-min-samples", "1", "--time-model-window", "8",
            "--time-model-initial-margin", "1.0", "--time-model-margin-quantile", "0.95", "--push-interval-ms", "50",
            "--metrics-interval-ms", "50", "--time-model-refit-every", "1",  # the hand-worked values are per step
        ])
        await asyncio.to_thread(group.wait_http_ok, child, f"http://127.0.0.1:{http_port}/metrics", 30.0)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}")
        stub = admission_pb2_grpc.AdmissionServiceStub(channel)
        stream = stub.WatchBudget(admission_pb2.WatchBudgetRequest(router_id="test"))

        # busy engine, no record yet: --no-proxy has nothing to fall back to
        snap = await next_snapshot(stream, lambda s: "no plugin record yet" in s.status_detail)
        assert not snap.healthy
        assert agent_metric(http_port, "fairbatch_agent_time_model_mean_abs_error_ratio") != agent_metric(
            http_port, "fairbatch_agent_time_model_mean_abs_error_ratio")  # NaN: no step seen yet
        assert agent_metric(http_port, "fairbatch_agent_time_model_margin_ratio") == 1.0

        # the exported state -> exact PAB (hand-worked in tests/unit/test_plugin_mode.py)
        assert exporter.send(hand_record(time.time() * 1000.0))
        snap = await next_snapshot(stream, lambda s: s.healthy and s.classes[0].kv_free_tokens == 4800)
        b = snap.classes[0]
        assert snap.status_detail == ""
        assert (snap.num_running, snap.num_waiting, snap.kv_capacity_tokens) == (2, 1, 16_000)
        assert snap.kv_usage == pytest.approx(0.7)
        assert b.decode_iterations == 6  # holds for 200 ms after the record
        assert b.decode_reservation_ms == pytest.approx(61.224)
        assert b.inflight_reservation_ms == pytest.approx(249.312)
        assert b.pab_ms == pytest.approx(589.464) and b.pab_tokens == 2306 and b.kv_limited_tokens == 2306
        assert agent_metric(http_port, "fairbatch_agent_plugin_export_stale") == 0.0

        # silence while the engine reports requests: stale -> proxy-mode state, flagged, unhealthy (--no-proxy)
        snap = await next_snapshot(stream, lambda s: "plugin export stale" in s.status_detail)
        assert not snap.healthy and snap.classes[0].kv_free_tokens == 8000  # (1 - 0.5) * 16 000 from /metrics
        assert agent_metric(http_port, "fairbatch_agent_plugin_export_stale") == 1.0
        assert agent_metric(http_port, "fairbatch_agent_plugin_fallbacks_total") == 1.0

        # a step 2x slower than the model predicts (21 ms): margin 2 -> a, b, c x 2
        assert exporter.send(step_record(time.time() * 1000.0, 100, 1000, 42.0, 2))
        assert exporter.send(hand_record(time.time() * 1000.0))
        snap = await next_snapshot(stream, lambda s: s.healthy and s.coefficients.a_ms == pytest.approx(20.0))
        b = snap.classes[0]
        assert snap.coefficients.b_ms_per_new_token == pytest.approx(0.2)
        assert b.pab_ms == pytest.approx(278.928) and b.pab_tokens == 1294
        assert agent_metric(http_port, "fairbatch_agent_time_model_mean_abs_error_ratio") == pytest.approx(1.0)
        assert agent_metric(http_port, "fairbatch_agent_time_model_margin_ratio") == pytest.approx(2.0)

        # an exact step: the margin is the p95 of the ratios [1, 2] = 1.95, and the model with it
        assert exporter.send(step_record(time.time() * 1000.0, 100, 1000, 21.0, 2))
        await asyncio.sleep(0.2)
        assert agent_metric(http_port, "fairbatch_agent_time_model_mean_abs_error_ratio") == pytest.approx(0.5)
        assert agent_metric(http_port, "fairbatch_agent_time_model_margin_ratio") == pytest.approx(1.95)
        assert agent_metric(http_port, 'fairbatch_agent_plugin_records_total{kind="step"}') == 2.0
        assert exporter.dropped == 0
        stream.cancel()
    finally:
        exporter.close()
        if channel is not None:
            await channel.close()
        await asyncio.to_thread(group.stop)
        await engine.cleanup()
    assert not sock.exists()  # the agent removed its socket at shutdown
