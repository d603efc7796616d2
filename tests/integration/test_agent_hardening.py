"""The agent's proxy under hostile input, abandoned requests and a frozen engine (issue 14), against the
real simulated engine process on loopback.

- bad bodies: 4xx in OpenAI's error JSON, nothing tracked;
- a client leaving during prefill: the engine stops the request at once (the agent's server runs with
  handler cancellation, fairbatch_common/http_guard.make_runner), where it used to run the whole prefill;
- a frozen engine (SIGSTOP): a stream ends with the SSE error event within the stall timeout, a
  non-stream request gets 502 (retryable at the router: nothing was sent), the agent is unhealthy until
  the engine answers again (SIGCONT).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest

from loadgen.procs import Child, ProcessGroup, free_port
from loadgen.sim.tokenizer import make_prompt
from replica_agent.agent import Agent, AgentConfig
from fairbatch_common.clock import Clock
from replica_agent.engine_metrics import MetricsScraper, parse_engine_metrics
from fairbatch_common.http_guard import make_runner
from replica_agent.policy.pab import SloClass
from replica_agent.policy.profiles import load_profile
from replica_agent.proxy import Proxy, ProxyConfig, make_session
from fairbatch_common.stall import default_stall_ms
from fairbatch_common.telemetry import make_tracer
from tests.integration.test_router_hardening import BAD_BODIES, post_bytes, raw_http, status_and_json
from tests.timing import LoopLag

MODEL = "llama-3-8b-a100"


@dataclass
class Setup:
    agent: Agent
    url: str
    engine_url: str
    engine: Child


async def start(tmp_path, scale: float, stall_timeout_s: float | None = None,
                engine_args: tuple[str, ...] = (), max_num_seqs: int | None = None) -> AsyncIterator[Setup]:
    with ProcessGroup(tmp_path / "logs") as group:
        port = free_port()
        engine = group.start("sim-engine", [sys.executable, "-m", "loadgen.sim.server", "--port", str(port),
                                            "--time-scale", str(scale), "--profile", MODEL, *engine_args])
        engine_url = f"http://127.0.0.1:{port}"
        group.wait_http_ok(engine, engine_url + "/health", timeout_s=30)
        profile = load_profile(MODEL)
        cfg = AgentConfig(
            replica_id="r0", time_model=profile.time_model,
            slo_classes=(SloClass("interactive", 500.0, 50.0),), default_slo_class="interactive",
            profile_kv_capacity_tokens=profile.kv_capacity_tokens, metrics_interval_ms=50.0,
            max_num_seqs=max_num_seqs,
        )
        clock = Clock(scale)
        agent = Agent(cfg, clock, lease_id_prefix="t")
        pcfg = ProxyConfig(engine_url=engine_url, stall_timeout_s=stall_timeout_s)
        session = make_session(pcfg)
        proxy = Proxy(agent, pcfg, session, make_tracer("t"))
        runner = make_runner(proxy.app())
        await runner.setup()
        aport = free_port()
        from aiohttp import web

        await web.TCPSite(runner, "127.0.0.1", aport).start()
        scraper = asyncio.create_task(MetricsScraper(
            proxy.pool, engine_url, clock, cfg.metrics_interval_ms, agent.on_engine_metrics, timeout_s=0.3).run())
        try:
            yield Setup(agent, f"http://127.0.0.1:{aport}", engine_url, engine)
        finally:
            if engine.popen.poll() is None:
                os.kill(engine.popen.pid, signal.SIGCONT)
            scraper.cancel()
            await asyncio.gather(scraper, return_exceptions=True)
            await runner.cleanup()
            await session.close()


@pytest.fixture
async def fast(tmp_path):
    async for s in start(tmp_path, 0.05):
        yield s


async def engine_load(s: aiohttp.ClientSession, engine_url: str) -> int:
    async with s.get(engine_url + "/metrics") as resp:
        m, _ = parse_engine_metrics(await resp.text())
    return m.num_running + m.num_waiting


async def engine_prompt_tokens(s: aiohttp.ClientSession, engine_url: str) -> float:
    """The engine's ``vllm:prompt_tokens_total``: prompt tokens of requests whose prefill completed
    (loadgen/sim/engine.py ``EngineCounters``)."""
    async with s.get(engine_url + "/metrics") as resp:
        text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prompt_tokens_total"))


async def test_bad_bodies_are_4xx_json_and_nothing_is_tracked(fast: Setup) -> None:
    for name, body in BAD_BODIES.items():
        if name == "max-tokens-over-context" and not fast.agent.max_prompt_tokens:
            continue  # the agent learns the context length from the engine's /v1/models (the CLI does)
        path = b"/v1/chat/completions" if "chat" in name else b"/v1/completions"
        status, doc = status_and_json(await raw_http(fast.url, post_bytes(body, path=path)))
        assert status == 400, name
        assert set(doc["error"]) == {"message", "type", "param", "code"}, name
    status, doc = status_and_json(await raw_http(fast.url, post_bytes(b'{"model": "m", "prompt": "x"}',
                                                                     extra=b"Content-Encoding: gzip\r\n")))
    assert status == 415
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50000000\r\n\r\n"
    status, doc = status_and_json(await raw_http(fast.url, head))
    assert status == 413 and doc["error"]["code"] == "body_too_large"
    assert len(fast.agent.tracker) == 0


@pytest.mark.parametrize("stream", [True, False])
async def test_client_leaving_in_prefill_stops_the_engine_at_once(tmp_path, stream: bool) -> None:
    # a 16,000-token prompt takes the engine 8 chunked steps of 2,048 tokens, about 1 s of simulated prefill,
    # 8 s of wall time at time scale 8; the client leaves 100 ms in. Before handler cancellation the engine ran
    # the whole prefill. "At once" is told by the engine, not a stopwatch: it empties with no prefill
    # completed (vllm:prompt_tokens_total 0), so the abort came within the 7.9 s of prefill left, however
    # loaded the machine; on an idle machine the engine is empty ~30 ms after the client left, not 8 s.
    scale = 8.0
    async for setup in start(tmp_path, scale):
        body = {"model": MODEL, "prompt": make_prompt(16_000), "max_tokens": 8, "stream": stream}
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession() as s:
            # no answer yet for either: the agent sends a stream's headers with its first chunk (the engine's
            # first token, after the prefill), a non-stream answer at the end. The client leaves by cancelling
            # the wait, which closes its connection. (Awaiting a stream's headers first, as this test once
            # did, waited out the whole prefill: the client then left in the decode.)
            task = asyncio.create_task(s.post(setup.url + "/v1/completions", json=body))
            end = loop.time() + 10.0
            while await engine_load(s, setup.engine_url) == 0 and loop.time() < end:
                await asyncio.sleep(0.005)
            assert await engine_load(s, setup.engine_url) == 1  # in prefill (no first token for ~8 s)
            await asyncio.sleep(0.1)
            assert not task.done()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            t0 = loop.time()
            while await engine_load(s, setup.engine_url) and loop.time() < t0 + 1.5 * scale:
                await asyncio.sleep(0.005)
            stopped_s = loop.time() - t0
            assert await engine_load(s, setup.engine_url) == 0
            assert await engine_prompt_tokens(s, setup.engine_url) == 0  # stopped in its prefill
            assert len(setup.agent.tracker) == 0
        print(f"prefill abort ({'stream' if stream else 'non-stream'}): engine empty {stopped_s * 1000:.0f} ms "
              f"after the client left 100 ms into a ~{scale:.0f} s prefill (wall)")


async def test_a_request_queued_in_a_busy_engine_is_not_a_stall(tmp_path) -> None:
    """An engine that runs one sequence at a time (``--max-num-seqs 1``) keeps a second stream in its
    queue while the first decodes 1,500 tokens: about 8 s simulated at the 8B-on-A100 decode step,
    0.4 s wall at time scale 0.05, beyond the 0.15 s stall timeout. The engine works all along (its
    inter-token count moves), so the queued stream is not a stall: it completes with every token, and
    the agent stays healthy. Before the rule (replica_agent/proxy.py ``StallWatch``, held while
    ``Agent.engine_queue_moving``) it ended with "engine stalled: no byte for 0.15 s" (the real-vLLM CI
    failure: requests re-routed to a survivor busy with continued streams)."""
    async for setup in start(tmp_path, 0.05, stall_timeout_s=0.15, engine_args=("--max-num-seqs", "1")):
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession() as s:
            end = loop.time() + 10.0
            while not setup.agent.health(setup.agent.clock.now_ms())[0] and loop.time() < end:
                await asyncio.sleep(0.02)

            async def stream(tokens: int, seed: int) -> list[bytes]:
                body = {"model": MODEL, "prompt": make_prompt(20, seed), "max_tokens": tokens, "ignore_eos": True,
                        "stream": True, "stream_options": {"include_usage": True}}
                async with s.post(setup.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    return [e for e in (await resp.read()).split(b"\n\n") if e]

            first = asyncio.create_task(stream(1500, 1))
            while await engine_load(s, setup.engine_url) == 0:
                await asyncio.sleep(0.005)
            t0 = loop.time()
            queued = await stream(8, 2)
            waited_s = loop.time() - t0
            done_first = await first
        for events in (queued, done_first):
            assert events[-1] == b"data: [DONE]"
            assert not [e for e in events if b'"error"' in e], events[-2:]
        usage = json.loads(queued[-2][len(b"data: "):])["usage"]
        assert usage["completion_tokens"] == 8
        assert waited_s > 2 * 0.15, waited_s  # it did wait in the engine's queue past the stall timeout
        assert setup.agent.health(setup.agent.clock.now_ms())[0]


async def test_an_engine_at_its_sequence_cap_opens_no_budget_until_a_request_ends(tmp_path) -> None:
    """replica_agent/policy/pab.py "Sequence slots", agent and engine both at ``max_num_seqs`` 1: while a
    1,500-token stream runs, a new prompt would wait for it in the engine's queue, so PAB opens nothing:
    the slot wait is that stream's last-token deadline, (1500 - out - 1) x 50 ms after its next one,
    tens of seconds past the 450 ms horizon, and a Reserve is refused; when it ends the whole horizon
    (nothing reserved) is back."""
    async for setup in start(tmp_path, 0.05, engine_args=("--max-num-seqs", "1"), max_num_seqs=1):
        loop = asyncio.get_running_loop()
        agent = setup.agent
        async with aiohttp.ClientSession() as s:
            end = loop.time() + 10.0
            while not agent.health(agent.clock.now_ms())[0] and loop.time() < end:
                await asyncio.sleep(0.02)
            idle = agent.compute_budget(agent.clock.now_ms()).classes["interactive"]
            assert (idle.slot_wait_ms, idle.pab_ms) == (0.0, pytest.approx(450.0))
            body = {"model": MODEL, "prompt": make_prompt(20, 3), "max_tokens": 1500, "ignore_eos": True,
                    "stream": True}
            async with s.post(setup.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                got = b""
                while got.count(b"data: ") < 5:  # decoding
                    got += await resp.content.readany()
                now = agent.clock.now_ms()
                (d,) = agent.replica_state(now).decodes
                full = agent.compute_budget(now).classes["interactive"]
                # the k = 1 + 0 - 1 + 1 = 1st finish: this decode's last token deadline
                assert full.slot_wait_ms == pytest.approx(d.next_deadline_ms + (1500 - d.tokens_out - 1) * 50.0 - now)
                assert full.slot_wait_ms > 10_000.0 and (full.pab_ms, full.pab_tokens) == (0.0, 0)
                refused = agent.reserve("interactive", 100, 10, "q-slot", now)
                assert not refused.granted
                await resp.read()
            end = loop.time() + 10.0
            while agent.replica_state(agent.clock.now_ms()).decodes and loop.time() < end:
                await asyncio.sleep(0.02)
            after = agent.compute_budget(agent.clock.now_ms()).classes["interactive"]
            assert (after.slot_wait_ms, after.pab_ms) == (0.0, pytest.approx(450.0))


async def test_frozen_engine_ends_streams_within_the_stall_timeout_and_marks_the_agent_unhealthy(tmp_path) -> None:
    assert default_stall_ms(500.0, 50.0) == 3000.0 and default_stall_ms(100.0, 10.0) == 1000.0
    async for setup in start(tmp_path, 0.05, stall_timeout_s=0.5):
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession() as s:
            end = loop.time() + 10.0
            while not setup.agent.health(setup.agent.clock.now_ms())[0] and loop.time() < end:
                await asyncio.sleep(0.02)
            assert setup.agent.health(setup.agent.clock.now_ms())[0]
            resp = await s.post(setup.url + "/v1/completions",
                                json={"model": MODEL, "prompt": make_prompt(20), "max_tokens": 30_000, "stream": True})
            assert resp.status == 200
            got = b""
            while got.count(b"data: ") < 3:
                got += await resp.content.readany()
            os.kill(setup.engine.popen.pid, signal.SIGSTOP)  # frozen, connections open
            async with LoopLag() as lag:  # the stall watch runs in this loop (the proxy is in-process)
                t0 = loop.time()
                rest = await asyncio.wait_for(resp.read(), 30.0)
                ended_s = loop.time() - t0
                events = [e for e in (got + rest).split(b"\n\n") if e]
                assert events[-1] == b"data: [DONE]"
                err = json.loads(events[-2][len(b"data: "):])["error"]
                assert err["message"] == "engine stalled: no byte for 0.5 s"
                assert 0.4 <= ended_s <= lag.bound_s(0.5), (ended_s, lag.worst_s)
                healthy, detail = setup.agent.health(setup.agent.clock.now_ms())
                assert not healthy
                # a non-stream request: no byte sent, so 502 (the router retries it on another replica)
                t1 = loop.time()
                async with s.post(setup.url + "/v1/completions",
                                  json={"model": MODEL, "prompt": make_prompt(20), "max_tokens": 4}) as r:
                    assert r.status == 502
                    # relayed whole, the engine sends nothing until done: the stall is its /metrics silent > 0.5 s
                    assert (await r.json())["error"]["message"] == "engine stalled: no answer to /metrics for 0.5 s"
                nonstream_s = loop.time() - t1
            assert nonstream_s <= lag.bound_s(0.5), (nonstream_s, lag.worst_s)  # at most one more stall timeout
            assert len(setup.agent.tracker) == 0
            os.kill(setup.engine.popen.pid, signal.SIGCONT)
            end = loop.time() + 10.0
            while not setup.agent.health(setup.agent.clock.now_ms())[0] and loop.time() < end:
                await asyncio.sleep(0.02)
            assert setup.agent.health(setup.agent.clock.now_ms())[0]  # healthy again once the engine answers
        print(f"frozen engine, stall timeout 0.5 s: stream ended in {ended_s * 1000:.0f} ms, non-stream answered "
              f"502 in {nonstream_s * 1000:.0f} ms, unhealthy until SIGCONT")


async def test_engine_frozen_before_its_answer_is_a_502_stall_within_the_timeout(tmp_path) -> None:
    # the stall rule on the wait for the engine's response headers (proxy.py _open_upstream)
    async for setup in start(tmp_path, 0.05, stall_timeout_s=0.5):
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession() as s:
            os.kill(setup.engine.popen.pid, signal.SIGSTOP)  # takes the connection, never answers
            try:
                async with LoopLag() as lag:  # the proxy's timer runs in this loop
                    t0 = loop.time()
                    async with s.post(setup.url + "/v1/completions",
                                      json={"model": MODEL, "prompt": make_prompt(20), "max_tokens": 4,
                                            "stream": True}) as r:
                        assert r.status == 502
                        assert (await r.json())["error"]["message"] == "engine stalled: no response within 0.5 s"
                    waited_s = loop.time() - t0
            finally:
                os.kill(setup.engine.popen.pid, signal.SIGCONT)
            assert 0.4 <= waited_s <= lag.bound_s(0.5), (waited_s, lag.worst_s)
            assert len(setup.agent.tracker) == 0


def test_stall_timeouts_per_class_come_from_the_router_yaml(tmp_path) -> None:
    from replica_agent.cli import load_stall_timeouts
    from router.config import ConfigError, parse_config

    text = ("slo_classes:\n  interactive: {ttft_ms: 500, tpot_ms: 50, stall_timeout_ms: 1500}\n"
            "  batch: {ttft_ms: 20000, tpot_ms: 200}\n"
            "replicas: [{id: r0, http_url: 'http://127.0.0.1:1', grpc_target: '127.0.0.1:2'}]\n")
    path = tmp_path / "fairbatch.yaml"
    path.write_text(text)
    assert parse_config(text).slo_classes["interactive"].stall_timeout_ms == 1500  # the router accepts the field
    assert load_stall_timeouts(path) == {"interactive": 1500.0}  # batch: the default, max(1000, 80000 + 4000)
    path.write_text(text.replace("1500", "-1"))
    # the router's own model refuses it, with the same file:line message
    with pytest.raises(ConfigError, match=r"^fairbatch.yaml:2: slo_classes.interactive.stall_timeout_ms: Input should be "
                                          r"greater than 0$"):  # fmt: skip
        load_stall_timeouts(path)
