"""A stream survives its replica (issue 29): 2 simulated engines + 2 real agents + the router, all
real processes on loopback; one engine or one agent is killed (SIGKILL) mid-stream.

The simulated engine decodes greedily without a ``seed`` (loadgen/sim/sampling.py: every token is
``" tok"``), so an unbroken run's text is known and a continuation of prompt + text is exact: the
migrated stream must carry exactly ``max_tokens`` tokens, the unbroken run's text, one response id,
finish_reason ``length`` and the usage of the original request. Time scale 1 (simulated ms = wall
ms): a decode step of llama-3-8b-a100 is ~10 ms, so a 300-token stream lasts ~3 s and the kill
lands mid-stream.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import openai
import pytest

from loadgen.sim.tokenizer import make_prompt

pytestmark = pytest.mark.timeout(180)

MODEL = "llama-3-8b-a100"
PROMPT_TOKENS = 200
MAX_TOKENS = 300


def auth(fleet) -> dict[str, str]:
    return {"Authorization": f"Bearer {fleet.api_keys['acme']}"}


def prompt(i: int) -> str:
    """A 200-token prompt, its first 4-byte token unique per ``i`` (no prefix-cache hits across requests)."""
    return f"{i:04d}" + make_prompt(PROMPT_TOKENS)[4:]


def kill(fleet, name: str) -> None:
    """SIGKILL one child (its own process group: the sim engine or the agent, nothing else)."""
    os.killpg(fleet.children[name].popen.pid, signal.SIGKILL)


async def read_stream(resp: aiohttp.ClientResponse, on_event=None) -> dict:
    """Every SSE event of ``resp``: texts, ids, finish reasons, usage, error, [DONE] seen."""
    out = {"texts": [], "ids": set(), "finish": [], "usage": None, "error": None, "done": False,
           "replica": resp.headers.get("x-fairbatch-replica")}
    async for line in resp.content:
        if not line.startswith(b"data: "):
            continue
        payload = line[6:].strip()
        if payload == b"[DONE]":
            out["done"] = True
            continue
        ev = json.loads(payload)
        if "error" in ev:
            out["error"] = ev["error"]
            continue
        out["ids"].add(ev["id"])
        for ch in ev.get("choices") or ():
            if ch.get("text"):
                out["texts"].append(ch["text"])
            if ch.get("finish_reason") is not None:
                out["finish"].append(ch["finish_reason"])
        if ev.get("usage"):
            out["usage"] = ev["usage"]
        if on_event is not None:
            on_event(out)
    return out


async def stream(session: aiohttp.ClientSession, fleet, i: int, on_event=None, **extra) -> dict:
    body = {"model": MODEL, "prompt": prompt(i), "max_tokens": MAX_TOKENS, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    async with session.post(f"{fleet.router_url}/v1/completions", json=body, headers=auth(fleet)) as resp:
        assert resp.status == 200
        return await read_stream(resp, on_event)


async def router_metrics(session: aiohttp.ClientSession, fleet) -> str:
    async with session.get(f"{fleet.router_url}/metrics") as r:
        return await r.text()


def assert_whole(res: dict, unbroken: str) -> None:
    assert res["error"] is None and res["done"]
    assert len(res["texts"]) == MAX_TOKENS and "".join(res["texts"]) == unbroken
    assert len(res["ids"]) == 1  # the first attempt's id throughout
    assert res["finish"] == ["length"]
    usage = res["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
        PROMPT_TOKENS, MAX_TOKENS, PROMPT_TOKENS + MAX_TOKENS)


@pytest.mark.parametrize("victim", ["engine", "agent"])
async def test_streams_survive_a_killed_replica(fleet_factory, victim: str) -> None:
    """4 concurrent streams; once one of them has 20 tokens, its replica's engine (or agent) is killed
    with SIGKILL. Every stream ends whole: no client-visible error, exactly max_tokens tokens, the
    unbroken run's text, finish_reason length, the original usage; the router counts a migration."""
    fleet = fleet_factory(2, time_scale=1.0)
    async with aiohttp.ClientSession() as s:
        t_ref = time.monotonic()
        unbroken = await stream(s, fleet, 9000)  # before any failure: the reference run
        ref_s = time.monotonic() - t_ref  # ~3 s on an idle machine: this machine's speed, measured now
        assert unbroken["error"] is None and len(unbroken["texts"]) == MAX_TOKENS
        killed: list[str] = []

        def maybe_kill(out: dict) -> None:
            if not killed and len(out["texts"]) >= 20:
                rid = out["replica"]
                killed.append(rid)
                kill(fleet, f"{victim}{rid[1:]}")

        t0 = time.monotonic()
        results = await asyncio.gather(*(stream(s, fleet, i, maybe_kill) for i in range(4)))
        assert killed, "no stream reached 20 tokens"
        for res in results:
            assert_whole(res, "".join(unbroken["texts"]))
        # no stream waited on a long timer (the router's silence limit is 11 s, the pool's 600 s): 60 s on an
        # idle machine, or 10 reference runs where the machine runs slower than that
        assert time.monotonic() - t0 < max(60.0, 10 * ref_s)
        metrics = await router_metrics(s, fleet)
    cause = "error_event" if victim == "engine" else "disconnect"
    resumed = [line for line in metrics.splitlines()
               if line.startswith("fairbatch_router_stream_migrations_total") and 'outcome="resumed"' in line]
    assert resumed and all(f'cause="{cause}"' in line for line in resumed), resumed
    assert sum(float(line.rsplit(" ", 1)[1]) for line in resumed) >= 1
    assert 'outcome="upstream_error"' not in metrics


async def test_openai_client_reads_a_migrated_stream(fleet_factory) -> None:
    """The official openai SDK streams through a migration (the agent killed) without an exception."""
    fleet = fleet_factory(2, time_scale=1.0)
    client = openai.AsyncOpenAI(base_url=f"{fleet.router_url}/v1", api_key=fleet.api_keys["acme"], max_retries=0)
    try:
        texts, ids, finish, usage = [], set(), [], None
        resp = await client.with_raw_response.completions.create(
            model=MODEL, prompt=prompt(7000), max_tokens=MAX_TOKENS, stream=True,
            stream_options={"include_usage": True})  # fmt: skip
        replica = resp.headers["x-fairbatch-replica"]
        async for chunk in resp.parse():
            ids.add(chunk.id)
            for ch in chunk.choices:
                texts.append(ch.text)
                if ch.finish_reason is not None:
                    finish.append(ch.finish_reason)
            if chunk.usage is not None:
                usage = chunk.usage
            if len(texts) == 20:
                kill(fleet, f"agent{replica[1:]}")
        assert "".join(texts) == " tok" * MAX_TOKENS and len(ids) == 1 and finish == ["length"]
        assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (PROMPT_TOKENS, MAX_TOKENS)
    finally:
        await client.close()


async def test_a_stream_that_cannot_be_continued_ends_with_the_error_event(fleet_factory) -> None:
    """A token-id prompt: the simulated engine streams no token ids, so there is nothing exact to
    continue from (router/migration.py ``not-continuable``): the engine's death ends the stream with
    the SSE error event and [DONE], as before issue 29."""
    fleet = fleet_factory(2, time_scale=1.0)
    async with aiohttp.ClientSession() as s:
        killed: list[str] = []

        def maybe_kill(out: dict) -> None:
            if not killed and len(out["texts"]) >= 20:
                killed.append(out["replica"])
                kill(fleet, f"engine{out['replica'][1:]}")

        body = {"model": MODEL, "prompt": [100 + (i % 50) for i in range(PROMPT_TOKENS)], "max_tokens": MAX_TOKENS,
                "stream": True}
        async with s.post(f"{fleet.router_url}/v1/completions", json=body, headers=auth(fleet)) as resp:
            res = await read_stream(resp, maybe_kill)
        assert killed and res["done"] and res["error"] is not None and res["error"]["code"] == 502
        assert res["error"]["message"].startswith("upstream failed mid-stream: engine stream failed")  # the agent's words
        assert 20 <= len(res["texts"]) < MAX_TOKENS
        metrics = await router_metrics(s, fleet)
    assert 'fairbatch_router_stream_migrations_total{cause="error_event",outcome="not_continuable"} 1.0' in metrics


async def test_non_stream_request_is_reissued_when_its_agent_dies(fleet_factory) -> None:
    """A non-stream request carries no partial output: its agent killed before the answer, the router
    re-issues it whole on the other replica (a retryable failure, router/relay.py)."""
    fleet = fleet_factory(2, time_scale=1.0)
    async with aiohttp.ClientSession() as s:
        body = {"model": MODEL, "prompt": prompt(8000), "max_tokens": MAX_TOKENS, "stream": False}
        task = asyncio.create_task(s.post(f"{fleet.router_url}/v1/completions", json=body, headers=auth(fleet)))
        victim = None
        deadline = time.monotonic() + 15.0
        while victim is None and time.monotonic() < deadline:
            for i, url in enumerate(fleet.agent_urls):
                async with s.get(f"{url}/metrics") as r:
                    text = await r.text()
                if any(line.startswith("fairbatch_agent_requests{") and float(line.rsplit(" ", 1)[1]) > 0
                       for line in text.splitlines()):
                    victim = i
            await asyncio.sleep(0.05)
        assert victim is not None, "the request never reached an agent"
        await asyncio.sleep(0.3)  # decoding
        kill(fleet, f"agent{victim}")
        resp = await asyncio.wait_for(task, 60)
        assert resp.status == 200
        assert resp.headers["x-fairbatch-replica"] == f"r{1 - victim}"
        answer = await resp.json()
        assert answer["choices"][0]["text"] == " tok" * MAX_TOKENS
        assert answer["usage"]["completion_tokens"] == MAX_TOKENS


async def test_chat_stream_survives_a_killed_agent(fleet_factory) -> None:
    """A streamed chat completion: its agent killed after 20 tokens, the router continues it with the
    partial assistant turn (continue_final_message); the client sees one role event, one id, exactly
    max_tokens content tokens, finish_reason length and the original prompt's usage."""
    from loadgen.sim.tokenizer import count_tokens, render_chat

    fleet = fleet_factory(2, time_scale=1.0)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": prompt(6000)}]
    body = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "stream": True,
            "stream_options": {"include_usage": True}}
    roles, contents, ids, finish, usage = 0, [], set(), [], None
    async with aiohttp.ClientSession() as s, s.post(f"{fleet.router_url}/v1/chat/completions", json=body,
                                                      headers=auth(fleet)) as resp:  # fmt: skip
        assert resp.status == 200
        replica = resp.headers["x-fairbatch-replica"]
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            ev = json.loads(line[6:])
            assert "error" not in ev
            ids.add(ev["id"])
            for ch in ev.get("choices") or ():
                roles += "role" in ch["delta"]
                if ch["delta"].get("content"):
                    contents.append(ch["delta"]["content"])
                if ch.get("finish_reason") is not None:
                    finish.append(ch["finish_reason"])
            if ev.get("usage"):
                usage = ev["usage"]
            if len(contents) == 20 and not finish:
                kill(fleet, f"agent{replica[1:]}")
    assert roles == 1 and len(ids) == 1 and finish == ["length"]
    assert "".join(contents) == " tok" * MAX_TOKENS and len(contents) == MAX_TOKENS
    assert usage is not None and usage["prompt_tokens"] == count_tokens(render_chat(messages))
    assert usage["completion_tokens"] == MAX_TOKENS


STALL_CLASSES = {"interactive": {"ttft_ms": 1000, "tpot_ms": 100, "priority": 0, "sheddable": False,
                                 "max_queue_ms": 8000, "stall_timeout_ms": 1000}}


@pytest.mark.parametrize("victim", ["engine", "agent"])
async def test_a_stalled_replica_is_left_for_another(fleet_factory, victim: str) -> None:
    """SIGSTOP instead of SIGKILL: a frozen engine is a stall the agent reports after the class's
    stall_timeout_ms (1 s here) with its error event; a frozen agent goes silent and the router gives
    it up after Router.silence_s (2 x 1 s + 5 s). Either way the stream is continued elsewhere, whole."""
    fleet = fleet_factory(2, time_scale=1.0, slo_classes=STALL_CLASSES)
    stopped: list[int] = []

    def maybe_stop(out: dict) -> None:
        if not stopped and len(out["texts"]) >= 20:
            pid = fleet.children[f"{victim}{out['replica'][1:]}"].popen.pid
            stopped.append(pid)
            os.killpg(pid, signal.SIGSTOP)

    try:
        async with aiohttp.ClientSession() as s:
            t0 = time.monotonic()
            res = await stream(s, fleet, 5000, maybe_stop)
            waited = time.monotonic() - t0
            metrics = await router_metrics(s, fleet)
    finally:
        for pid in stopped:
            os.killpg(pid, signal.SIGCONT)
    assert stopped
    assert_whole(res, " tok" * MAX_TOKENS)
    cause = "error_event" if victim == "engine" else "silence"
    assert f'fairbatch_router_stream_migrations_total{{cause="{cause}",outcome="resumed"}} 1.0' in metrics
    assert waited >= (1.0 if victim == "engine" else 7.0)


async def test_a_seeded_sampled_stream_is_continued_whole(fleet_factory) -> None:
    """seed + temperature 1 (the simulated engine samples from its seeded generator; ignore_eos so the
    stream runs to max_tokens): the agent killed after 20 tokens, the stream still ends whole with
    max_tokens tokens, one id and finish_reason length. The text before the cut is the unbroken run's;
    after it the continuation's generator starts afresh (router/migration.py: not the unbroken run's)."""
    fleet = fleet_factory(2, time_scale=1.0)
    extra = {"seed": 1234, "temperature": 1.0, "ignore_eos": True}
    async with aiohttp.ClientSession() as s:
        unbroken = await stream(s, fleet, 4000, **extra)
        killed: list[int] = []

        def maybe_kill(out: dict) -> None:
            if not killed and len(out["texts"]) >= 20:
                killed.append(len(out["texts"]))
                kill(fleet, f"agent{out['replica'][1:]}")

        res = await stream(s, fleet, 4000, maybe_kill, **extra)
    assert killed and res["error"] is None and res["done"] and len(res["ids"]) == 1
    assert len(res["texts"]) == MAX_TOKENS and res["finish"] == ["length"]
    assert res["usage"]["completion_tokens"] == MAX_TOKENS and res["usage"]["prompt_tokens"] == PROMPT_TOKENS
    assert res["texts"][:killed[0]] == unbroken["texts"][:killed[0]]
