"""The agent's view of requests whose tokens are not ``delta.content`` (reasoning, tool calls,
n > 1) and of non-stream requests (prefill until the answer, freed on disconnect)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from loadgen.procs import free_port
from replica_agent.proxy import ProxyConfig
from replica_agent.tracker import Phase
from tests.integration.test_agent_proxy import (  # noqa: F401  (fixtures)
    agent_proxy, bare_proxy, completion_body, engine, engine_running,
)

HEAD = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "m"}


def sse(choices: list[dict], **extra: object) -> bytes:
    return b"data: " + json.dumps({**HEAD, "choices": choices, **extra}).encode() + b"\n\n"


def delta(index: int, **d: object) -> dict:
    return {"index": index, "delta": d, "logprobs": None, "finish_reason": None}


async def start_fake_engine(events: list[bytes], gap_s: float) -> tuple[web.AppRunner, str]:
    """An engine that streams ``events`` ``gap_s`` wall seconds apart (what a reasoning model on vLLM sends)."""

    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for ev in events:
            await resp.write(ev)
            await asyncio.sleep(gap_s)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def test_reasoning_and_tool_call_chunks_are_tokens() -> None:
    events = [
        sse([delta(0, role="assistant", content="")]),
        sse([delta(0, reasoning_content="Let")]),
        sse([delta(0, reasoning_content=" me")]),
        sse([delta(0, reasoning_content=" think")]),
        sse([delta(0, tool_calls=[{"id": "c1", "type": "function", "index": 0,
                                   "function": {"name": "f", "arguments": "{\""}}])]),  # fmt: skip
        sse([delta(0, tool_calls=[{"index": 0, "function": {"arguments": "a\": 1}"}}])]),
        sse([{**delta(0), "finish_reason": "tool_calls", "stop_reason": None}]),
        sse([], usage={"prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16}),
    ]
    runner, url = await start_fake_engine(events, 0.05)
    try:
        async with bare_proxy(ProxyConfig(engine_url=url), 1.0) as (agent, purl):
            phases, outs = [], []
            async with aiohttp.ClientSession() as s:
                body = {"model": "m", "messages": [{"role": "user", "content": "q"}], "stream": True}
                async with s.post(purl + "/v1/chat/completions", json=body, headers={"x-request-id": "r"}) as r:
                    async for _ in r.content.iter_any():
                        req = agent.tracker.get("r")
                        if req is not None:
                            phases.append(req.phase)
                            outs.append(req.tokens_out)
            # the role chunk leaves it in prefill; the first reasoning chunk moves it to decode
            assert phases[0] is Phase.PREFILL and Phase.DECODE in phases
            assert max(outs) == 7  # 3 reasoning + 2 tool-call chunks counted, then usage says 7
            assert 5 in outs
            assert len(agent.tracker) == 0
    finally:
        await runner.cleanup()


async def test_n2_stream_counts_both_choices() -> None:
    events = [sse([delta(i, role="assistant", content="")]) for i in range(2)]
    events += [sse([delta(i, content="x")]) for _ in range(3) for i in range(2)]
    runner, url = await start_fake_engine(events, 0.02)
    try:
        async with bare_proxy(ProxyConfig(engine_url=url), 1.0) as (agent, purl):
            seen = 0
            async with aiohttp.ClientSession() as s:
                body = {"model": "m", "messages": [{"role": "user", "content": "q"}], "stream": True, "n": 2}
                async with s.post(purl + "/v1/chat/completions", json=body, headers={"x-request-id": "r"}) as r:
                    async for _ in r.content.iter_any():
                        req = agent.tracker.get("r")
                        if req is not None:
                            seen = max(seen, req.tokens_out)
            assert seen == 6  # 3 tokens x 2 choices (index 1 used to be ignored)
    finally:
        await runner.cleanup()


async def test_non_stream_stays_prefill_and_is_freed_on_disconnect(agent_proxy, engine) -> None:  # noqa: F811
    agent, url = agent_proxy
    async with aiohttp.ClientSession() as s:
        task = asyncio.ensure_future(s.post(url + "/v1/completions", json=completion_body(20_000, False),
                                            headers={"x-request-id": "whole-gone"}))  # fmt: skip
        for _ in range(100):
            await asyncio.sleep(0.02)
            if await engine_running(s, engine) == 1:
                break
        assert await engine_running(s, engine) == 1  # decoding in the engine ...
        req = agent.tracker.get("whole-gone")
        assert req is not None and req.phase is Phase.PREFILL  # ... and held as prefill by the agent
        task.cancel()  # the client goes away before the answer
        await asyncio.gather(task, return_exceptions=True)
        for _ in range(100):
            await asyncio.sleep(0.05)
            if "whole-gone" not in agent.tracker and await engine_running(s, engine) == 0:
                break
        assert "whole-gone" not in agent.tracker
        assert await engine_running(s, engine) == 0
    assert ("whole-gone", "done:client_disconnect") in agent.events
