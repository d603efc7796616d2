"""The simulated engine over real loopback HTTP (loadgen/sim/server.py).

Servers listen on 127.0.0.1 at a free port, at time scale 0.05 (one simulated ms lasts 50 us),
and are called with aiohttp's client, as the agent and loadgen call vLLM.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from loadgen.procs import ProcessGroup, free_port
from loadgen.sim.server import SIM_SERVER, SimServer, SimServerConfig, start_server
from loadgen.sim.tokenizer import count_tokens, make_prompt, render_chat

pytestmark = pytest.mark.timeout(30)

MODEL = "sim-model"


@asynccontextmanager
async def running(**overrides: Any) -> AsyncIterator[tuple[str, SimServer, aiohttp.ClientSession]]:
    """Start a sim engine on a free loopback port; yield (base url, its SimServer, a client session)."""
    cfg = SimServerConfig(
        port=free_port(), time_scale=0.05, served_model_name=MODEL, max_model_len=1024, num_gpu_blocks=512
    )
    for k, v in overrides.items():
        setattr(cfg, k, v)
    runner = await start_server(cfg)
    try:
        async with aiohttp.ClientSession() as session:
            yield f"http://127.0.0.1:{cfg.port}", runner.app[SIM_SERVER], session
    finally:
        await runner.cleanup()


def sse_events(body: str) -> list[str]:
    """The data payloads of an SSE body, in order."""
    assert body.endswith("\n\n")
    events = []
    for block in body.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        events.append(block[len("data: ") :])
    return events


async def wait_for(cond: Any, timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def scrape(session: aiohttp.ClientSession, base: str) -> dict[str, float]:
    """Metric samples without labels' detail: ``name{labels}`` -> value, and ``name`` -> value for the first."""
    async with session.get(f"{base}/metrics") as r:
        assert r.status == 200
        text = await r.text()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, value = line.rsplit(" ", 1)
        samples[key] = float(value)
        samples.setdefault(key.split("{", 1)[0], float(value))
    return samples


async def test_completion_non_stream_text_prompt_and_request_id() -> None:
    async with running() as (base, _sim, s):
        prompt = make_prompt(37)
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 5}
        async with s.post(f"{base}/v1/completions", json=body, headers={"X-Request-Id": "req-1"}) as r:
            assert r.status == 200
            assert r.headers["X-Request-Id"] == "req-1"
            data = await r.json()
        assert data["id"] == "cmpl-req-1" and data["object"] == "text_completion" and data["model"] == MODEL
        assert isinstance(data["created"], int)
        (choice,) = data["choices"]
        assert choice["text"] == " tok" * 5 and choice["finish_reason"] == "length"
        assert data["usage"]["prompt_tokens"] == count_tokens(prompt) == 37
        assert (data["usage"]["completion_tokens"], data["usage"]["total_tokens"]) == (5, 42)


async def test_completion_stream_token_ids_with_usage() -> None:
    async with running() as (base, _sim, s):
        body = {"prompt": list(range(50)), "max_tokens": 7, "stream": True, "stream_options": {"include_usage": True}}
        async with s.post(f"{base}/v1/completions", json=body) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            rid = r.headers["X-Request-Id"]
            events = sse_events(await r.text())
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        tokens, usage = chunks[:-1], chunks[-1]
        assert len(tokens) == 7
        assert all(c["id"] == f"cmpl-{rid}" and c["object"] == "text_completion" for c in chunks)
        assert [c["choices"][0]["finish_reason"] for c in tokens] == [None] * 6 + ["length"]
        assert all(c["choices"][0]["text"] == " tok" and c["choices"][0]["stop_reason"] is None for c in tokens)
        assert usage["choices"] == []
        assert usage["usage"] == {"prompt_tokens": 50, "total_tokens": 57, "completion_tokens": 7}


async def test_prompt_forms_and_default_max_tokens() -> None:
    async with running() as (base, _sim, s):
        for prompt, expect in (([make_prompt(9)], 9), ([[5, 6, 7]], 3), ("abcde", 2)):
            async with s.post(f"{base}/v1/completions", json={"prompt": prompt}) as r:
                data = await r.json()
            # completions default max_tokens: 16
            assert data["usage"] == {
                "prompt_tokens": expect, "total_tokens": expect + 16, "completion_tokens": 16,
                "prompt_tokens_details": None,
            }  # fmt: skip


async def test_chat_stream_and_non_stream() -> None:
    async with running() as (base, _sim, s):
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": make_prompt(20)}]
        prompt_tokens = count_tokens(render_chat(messages))
        body = {"messages": messages, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
        async with s.post(f"{base}/v1/chat/completions", json=body, headers={"X-Request-Id": "c1"}) as r:
            assert r.headers["X-Request-Id"] == "c1"
            events = sse_events(await r.text())
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert all(c["id"] == "chatcmpl-c1" and c["object"] == "chat.completion.chunk" for c in chunks)
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        content = chunks[1:-1]
        assert [c["choices"][0]["delta"]["content"] for c in content] == [" tok"] * 4
        assert [c["choices"][0]["finish_reason"] for c in content] == [None, None, None, "length"]
        assert chunks[-1]["usage"] == {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + 4,
                                       "completion_tokens": 4}  # fmt: skip
        async with s.post(f"{base}/v1/chat/completions", json={"messages": messages, "max_tokens": 3}) as r:
            data = await r.json()
        assert data["object"] == "chat.completion"
        assert data["choices"][0]["message"]["content"] == " tok" * 3
        assert data["choices"][0]["finish_reason"] == "length"
        assert data["usage"]["prompt_tokens"] == prompt_tokens and data["usage"]["completion_tokens"] == 3


async def test_health_models_metrics() -> None:
    async with running(block_size=16, num_gpu_blocks=512) as (base, _sim, s):
        async with s.get(f"{base}/health") as r:
            assert r.status == 200 and await r.read() == b""
        async with s.get(f"{base}/v1/models") as r:
            models = await r.json()
        assert models["object"] == "list"
        (card,) = models["data"]
        assert (card["id"], card["object"], card["owned_by"], card["max_model_len"]) == (MODEL, "model", "vllm", 1024)
        async with s.post(f"{base}/v1/completions", json={"prompt": make_prompt(30), "max_tokens": 4}) as r:
            assert r.status == 200
        m = await scrape(s, base)
        for name in (
            "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "vllm:num_preemptions_total", "vllm:time_to_first_token_seconds_count",
            "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_count",
        ):  # fmt: skip
            assert name in m, name
        labels = f'{{engine="0",model_name="{MODEL}"}}'
        assert m[f"vllm:prompt_tokens_total{labels}"] == 30
        assert m[f"vllm:generation_tokens_total{labels}"] == 4
        assert m[f'vllm:request_success_total{{engine="0",finished_reason="length",model_name="{MODEL}"}}'] == 1
        assert m["vllm:time_to_first_token_seconds_count"] == 1
        assert m["vllm:inter_token_latency_seconds_count"] == 3
        assert 0.0 <= m["vllm:kv_cache_usage_perc"] <= 1.0
        info = [k for k in m if k.startswith("vllm:cache_config_info{")]
        assert info and 'block_size="16"' in info[0] and 'num_gpu_blocks="512"' in info[0]
        # TTFT in simulated seconds: at least one step of a + b * 30 (~12 ms for llama-3-8b-a100).
        assert 0.005 < m["vllm:time_to_first_token_seconds_sum"] < 1.0


async def test_prefix_cache_metrics_count_a_repeated_prompt() -> None:
    # A 100-token prompt (400 bytes) twice: block 16 -> 6 full blocks; the repeat hits
    # min(6, 99 // 16 = 6) blocks = 96 tokens. Queries count whole prompts: 200 tokens.
    async with running(block_size=16, num_gpu_blocks=512) as (base, _sim, s):
        prompt = make_prompt(100)
        for _ in range(2):
            async with s.post(f"{base}/v1/completions", json={"prompt": prompt, "max_tokens": 2}) as r:
                assert r.status == 200
        m = await scrape(s, base)
        labels = f'{{engine="0",model_name="{MODEL}"}}'
        assert m[f"vllm:prefix_cache_queries_total{labels}"] == 200
        assert m[f"vllm:prefix_cache_hits_total{labels}"] == 96
        info = [k for k in m if k.startswith("vllm:cache_config_info{")]
        assert 'enable_prefix_caching="True"' in info[0]


async def test_kv_pressure_preempts_and_everyone_finishes() -> None:
    # 32 blocks * 16 = 512 KV tokens; 8 requests of 100 + 60 tokens need up to 8 * 10 = 80 blocks.
    async with running(num_gpu_blocks=32) as (base, sim, s):

        async def one(i: int) -> dict[str, Any]:
            async with s.post(f"{base}/v1/completions", json={"prompt": make_prompt(100, i), "max_tokens": 60}) as r:
                return await r.json()

        results = await asyncio.gather(*(one(i) for i in range(8)))
        assert all(d["usage"]["completion_tokens"] == 60 and d["usage"]["prompt_tokens"] == 100 for d in results)
        assert sim.engine.counters.num_preemptions > 0
        m = await scrape(s, base)
        assert m["vllm:num_preemptions_total"] == sim.engine.counters.num_preemptions
        assert m["vllm:kv_cache_usage_perc"] == 0.0 and m["vllm:num_requests_running"] == 0


async def test_stream_client_disconnect_aborts() -> None:
    async with running() as (base, sim, s):
        body = {"prompt": make_prompt(10), "max_tokens": 1000, "stream": True}
        r = await s.post(f"{base}/v1/completions", json=body)
        for _ in range(3):
            line = await r.content.readline()
            assert line.startswith(b"data: ")
            await r.content.readline()
        assert sim.engine.num_running == 1 and sim.engine.kv.used_blocks > 0
        r.close()  # drop the connection mid-stream
        await wait_for(lambda: sim.engine.num_running == 0 and not sim.engine.requests)
        assert sim.engine.kv.used_blocks == 0 and sim.engine.counters.num_aborted == 1
        gen = sim.engine.counters.generation_tokens
        assert gen < 1000
        await asyncio.sleep(0.1)
        m = await scrape(s, base)
        assert m["vllm:generation_tokens_total"] == gen and m["vllm:num_requests_running"] == 0
        assert m["vllm:prompt_tokens_total"] == 10 and m["vllm:kv_cache_usage_perc"] == 0.0


async def test_non_stream_client_disconnect_aborts() -> None:
    async with running() as (base, sim, s):
        body = {"prompt": make_prompt(10), "max_tokens": 1000}
        task = asyncio.create_task(s.post(f"{base}/v1/completions", json=body))
        await wait_for(lambda: sim.engine.counters.generation_tokens >= 3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_for(lambda: sim.engine.num_running == 0 and not sim.engine.requests)
        assert sim.engine.kv.used_blocks == 0
        gen = sim.engine.counters.generation_tokens
        await asyncio.sleep(0.1)
        assert sim.engine.counters.generation_tokens == gen < 1000


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/v1/completions", b"{not json", 400, "JSON"),
        ("/v1/completions", b"[1, 2]", 400, "object"),
        ("/v1/completions", b'{"max_tokens": 3}', 400, "prompt"),
        ("/v1/completions", json.dumps({"prompt": make_prompt(1024)}).encode(), 400, "maximum context length"),
        ("/v1/completions", json.dumps({"prompt": make_prompt(1000), "max_tokens": 30}).encode(), 400, "too large"),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": "x"}', 400, "max_tokens"),
        ("/v1/completions", b'{"prompt": ["a", "b"]}', 400, "prompt"),
        ("/v1/completions", b'{"prompt": ""}', 400, "empty"),
        ("/v1/completions", b'{"prompt": "hi", "model": "other"}', 404, "does not exist"),
        ("/v1/chat/completions", b'{"max_tokens": 3}', 400, "messages"),
        ("/v1/chat/completions", b'{"messages": [{"content": "no role"}]}', 400, "role"),
    ],
)
async def test_bad_requests(path: str, body: bytes, status: int, needle: str) -> None:
    async with running() as (base, sim, s):
        async with s.post(f"{base}{path}", data=body, headers={"Content-Type": "application/json"}) as r:
            assert r.status == status
            err = (await r.json())["error"]
        assert needle in err["message"]
        assert err["code"] == status and set(err) == {"message", "type", "param", "code"}
        assert not sim.engine.has_work()


def test_cli_subprocess_serves(tmp_path: Path) -> None:
    import json
    import urllib.request

    def get(port: int, path: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.read().decode()

    for attempt in range(3):
        port = free_port()
        argv = [sys.executable, "-m", "loadgen.sim.server", "--port", str(port), "--time-scale", "0.05",
                "--num-gpu-blocks", "100", "--served-model-name", "m", "--log-level", "WARNING"]  # fmt: skip
        with ProcessGroup(tmp_path / f"try{attempt}") as group:
            child = group.start("sim", argv)
            group.wait_http_ok(child, f"http://127.0.0.1:{port}/health", timeout_s=20)
            # another process (a parallel make test's server) may have taken the port between free_port()
            # and the bind: then the answers are not this server's, and it is tried again on a new port
            if [m["id"] for m in json.loads(get(port, "/v1/models"))["data"]] != ["m"]:
                continue
            text = get(port, "/metrics")
            assert 'num_gpu_blocks="100"' in text and 'model_name="m"' in text
            return
    raise AssertionError("three ports in a row were taken by other processes")


async def test_engine_loop_failure_answers_503() -> None:
    class Broken:
        name = "broken"

        def form_batch(self, state: Any) -> Any:
            raise RuntimeError("policy bug")

    async with running() as (base, sim, s):
        sim.engine.policy = Broken()
        async with s.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as r:
            assert r.status == 503
        async with s.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as r:
            assert r.status == 503 and "engine loop failed" in (await r.json())["error"]["message"]


async def test_request_larger_than_kv_cache_is_400_with_request_id() -> None:
    # 8 blocks * 16 = 128 KV tokens; 200 + 10 - 1 = 209 tokens could never be held.
    async with running(num_gpu_blocks=8) as (base, sim, s):
        body = {"prompt": make_prompt(200), "max_tokens": 10}
        async with s.post(f"{base}/v1/completions", json=body, headers={"X-Request-Id": "big"}) as r:
            assert r.status == 400 and r.headers["X-Request-Id"] == "big"
            assert "KV" in (await r.json())["error"]["message"]
        assert not sim.engine.has_work()


def test_engine_defaults_are_vllm_serve_defaults_of_the_profile_gpu() -> None:
    # vLLM 0.32.0 get_batch_defaults: A100 (80 GB included) 2048 / 256, H100 8192 / 1024
    a100 = SimServer(SimServerConfig(profile="llama-3-8b-a100")).engine.config
    assert (a100.max_num_batched_tokens, a100.max_num_seqs) == (2048, 256)
    h100 = SimServer(SimServerConfig(profile="llama-2-70b-h100-tp4")).engine.config
    assert (h100.max_num_batched_tokens, h100.max_num_seqs) == (8192, 1024)
    # flags win over the defaults
    tuned = SimServer(SimServerConfig(profile="llama-3-8b-a100", max_num_batched_tokens=8192, max_num_seqs=128))
    assert (tuned.engine.config.max_num_batched_tokens, tuned.engine.config.max_num_seqs) == (8192, 128)


async def test_step_log_is_readable_while_the_engine_runs(tmp_path: Path) -> None:
    # `fairbatch-agent calibrate LOG` on a running engine: every finished step is in the file at once
    from replica_agent.calibrate import read_step_log

    log_path = tmp_path / "steps.jsonl"
    async with running(step_log=str(log_path)) as (base, _sim, s):
        body = {"model": MODEL, "prompt": make_prompt(37), "max_tokens": 5}
        async with s.post(f"{base}/v1/completions", json=body) as r:
            assert r.status == 200
        new_tokens, _context, measured_ms = read_step_log(log_path)  # the engine is still up
        # one prefill step of the 37 prompt tokens (it also yields token 1), then 4 one-token decode steps
        assert new_tokens == [37, 1, 1, 1, 1]
        assert all(ms > 0 for ms in measured_ms)
