"""Fidelity: the same request straight to the simulated engine, through one agent, and through
router + agent gives the same answer (non-stream: equal JSON but for ids and timestamps; stream:
the same sequence of chunks). One simulated engine + agent + router, real processes on loopback.

Each sampling parameter the engine implements (loadgen/sim/sampling.py) is sent on both endpoints
where it exists, streamed and not; part of the suite drives the official ``openai`` client, as a
user would. Besides equality, a few answers are checked against values worked out by hand.
"""

from __future__ import annotations

import json
import math
from typing import Any

import aiohttp
import openai
import pytest

from tests.integration.conftest import start_fleet

pytestmark = pytest.mark.timeout(180)

MODEL = "llama-3-8b-a100"
PROMPT = "the and for was you are"  # 23 bytes -> 6 tokens
CHAT = [{"role": "user", "content": "hello"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]},
                                     "days": {"type": "integer"}}, "required": ["city"]}}}  # fmt: skip
FORCE_WEATHER = {"type": "function", "function": {"name": "get_weather"}}

# (case, endpoint, body without model/stream); each runs streamed and not
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("n", "completions", {"prompt": PROMPT, "n": 3, "max_tokens": 4, "seed": 1}),
    ("n", "chat", {"messages": CHAT, "n": 2, "max_tokens": 4, "seed": 1}),
    ("logprobs_k", "completions", {"prompt": PROMPT, "n": 2, "logprobs": 2, "max_tokens": 3, "seed": 5}),
    ("logprobs", "chat", {"messages": CHAT, "logprobs": True, "max_tokens": 3, "seed": 5}),
    ("top_logprobs", "chat", {"messages": CHAT, "logprobs": True, "top_logprobs": 3, "max_tokens": 3, "seed": 5}),
    ("stop", "completions", {"prompt": PROMPT, "stop": ["k t"], "max_tokens": 8}),
    ("stop", "chat", {"messages": CHAT, "stop": "k t", "max_tokens": 8, "include_stop_str_in_output": True}),
    ("stop_token_ids", "completions", {"prompt": PROMPT, "stop_token_ids": [100], "min_tokens": 2, "max_tokens": 6}),
    ("stop_token_ids", "chat", {"messages": CHAT, "stop_token_ids": [101, 102], "max_tokens": 40, "seed": 9}),
    ("max_tokens", "completions", {"prompt": PROMPT, "max_tokens": 5, "seed": 2}),
    ("max_completion_tokens", "chat", {"messages": CHAT, "max_completion_tokens": 5, "max_tokens": 9, "seed": 2}),
    ("min_tokens", "completions", {"prompt": PROMPT, "stop": " tok", "min_tokens": 3, "max_tokens": 8}),
    ("min_tokens", "chat", {"messages": CHAT, "min_tokens": 6, "max_tokens": 30, "seed": 4,
                            "response_format": {"type": "json_object"}}),
    ("ignore_eos", "completions", {"prompt": PROMPT, "ignore_eos": True, "max_tokens": 30, "seed": 3}),
    ("ignore_eos", "chat", {"messages": CHAT, "ignore_eos": True, "max_tokens": 16,
                            "response_format": {"type": "json_object"}}),
    ("seed", "completions", {"prompt": PROMPT, "seed": 1234, "temperature": 0.8, "max_tokens": 12}),
    ("seed", "chat", {"messages": CHAT, "seed": 1234, "max_tokens": 12}),
    ("response_format", "chat", {"messages": CHAT, "max_tokens": 40, "seed": 6, "response_format": {
        "type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER["function"]["parameters"]}}}),
    ("response_format", "completions", {"prompt": PROMPT, "max_tokens": 40, "response_format": {"type": "json_object"}}),
    ("tools", "chat", {"messages": CHAT, "max_tokens": 40, "seed": 8, "tools": [WEATHER], "tool_choice": FORCE_WEATHER}),
    ("tools", "chat", {"messages": CHAT, "max_tokens": 40, "n": 2, "seed": 8, "logprobs": True,
                       "tools": [WEATHER], "tool_choice": FORCE_WEATHER}),
]  # fmt: skip
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = start_fleet(tmp_path_factory.mktemp("fidelity"), 1, time_scale=0.1)
    try:
        yield f
    finally:
        f.group.stop()


def targets(fleet) -> dict[str, tuple[str, dict[str, str]]]:
    return {
        "engine": (fleet.engine_urls[0], {}),
        "agent": (fleet.agent_urls[0], {}),
        "router": (fleet.router_url, {"Authorization": f"Bearer {fleet.api_keys['acme']}"}),
    }


def normalise(obj: Any) -> Any:
    """Drop what differs between two answers to one request: ids (response, tool call) and timestamps."""
    if isinstance(obj, dict):
        return {k: normalise(v) for k, v in obj.items() if k not in ("id", "created")}
    if isinstance(obj, list):
        return [normalise(v) for v in obj]
    return obj


def sse_events(raw: bytes) -> list[Any]:
    out: list[Any] = []
    for block in raw.split(b"\n\n"):
        if block.startswith(b"data: "):
            payload = block[6:]
            out.append("[DONE]" if payload == b"[DONE]" else normalise(json.loads(payload)))
    return out


async def ask(session: aiohttp.ClientSession, url: str, headers: dict[str, str], path: str, body: dict) -> Any:
    async with session.post(url + path, json=body, headers=headers) as r:
        raw = await r.read()
        assert r.status == 200, raw
    return sse_events(raw) if body.get("stream") else normalise(json.loads(raw))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(("case", "endpoint", "body"), CASES, ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(CASES)])
async def test_same_answer_direct_via_agent_via_router(fleet, case, endpoint, body, stream) -> None:
    req = {"model": MODEL, **body, "stream": stream}
    if stream:
        req["stream_options"] = {"include_usage": True}
    async with aiohttp.ClientSession() as s:
        answers = {name: await ask(s, url, h, PATHS[endpoint], req) for name, (url, h) in targets(fleet).items()}
    assert answers["agent"] == answers["engine"]
    assert answers["router"] == answers["engine"]
    direct = answers["engine"]
    n = body.get("n", 1)
    if stream:
        assert direct[-1] == "[DONE]"
        indexes = {c["index"] for ev in direct[:-2] for c in ev["choices"]}
        assert indexes == set(range(n))
        assert direct[-2]["choices"] == [] and direct[-2]["usage"]["completion_tokens"] >= n
    else:
        assert [c["index"] for c in direct["choices"]] == list(range(n))


async def test_hand_worked_answers(fleet) -> None:
    """Values from the sampling rules, through router + agent."""
    url, h = targets(fleet)["router"]
    async with aiohttp.ClientSession() as s:
        # stop "k t": " tok tok" has it at index 3 -> " to", 2 tokens, stop_reason the string
        out = await ask(s, url, h, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "stop": ["k t"], "max_tokens": 8})
        c = out["choices"][0]
        assert (c["text"], c["finish_reason"], c["stop_reason"]) == (" to", "stop", "k t")
        assert out["usage"] == {"prompt_tokens": 6, "total_tokens": 8, "completion_tokens": 2, "prompt_tokens_details": None}
        # min_tokens 2 masks id 100 (" tok"): greedy writes " the the", then " tok" = 100 stops
        out = await ask(s, url, h, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "stop_token_ids": [100],
                                                       "min_tokens": 2, "max_tokens": 6})  # fmt: skip
        c = out["choices"][0]
        assert (c["text"], c["finish_reason"], c["stop_reason"]) == (" the the tok", "stop", 100)
        # forced tool, n=1: JSON arguments, content "", finish_reason "stop" (vLLM's non-stream named tool choice)
        out = await ask(s, url, h, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 40,
                                                            "tools": [WEATHER], "tool_choice": FORCE_WEATHER})  # fmt: skip
        msg = out["choices"][0]["message"]
        assert msg["content"] == "" and msg["tool_calls"][0]["function"]["name"] == "get_weather"
        args = json.loads(msg["tool_calls"][0]["function"]["arguments"])
        assert set(args) == {"city", "unit", "days"} and args["unit"] in ("c", "f") and isinstance(args["days"], int)
        assert out["choices"][0]["finish_reason"] == "stop"
        # greedy stream with logprobs=1: one chunk per token, offsets 0, 4, 8; top-1 = " tok" = ln p(rank 0)
        events = await ask(s, url, h, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 3,
                                                          "logprobs": 1, "stream": True})  # fmt: skip
        chunks = [e["choices"][0] for e in events[:-1]]
        assert [c["logprobs"]["text_offset"] for c in chunks] == [[0], [4], [8]]
        assert [c["text"] for c in chunks] == [" tok"] * 3 and chunks[-1]["finish_reason"] == "length"
        p0 = 0.99 * 1 / sum(0.9**r for r in range(64))
        assert chunks[0]["logprobs"]["top_logprobs"] == [{" tok": pytest.approx(math.log(p0))}]


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)


def test_openai_client_n2_logprobs2_completion_and_forced_tool_equal_direct(fleet) -> None:
    """The official client (non-stream, its default): router + agent answers == the engine's."""
    direct = _client(fleet.engine_urls[0], "unused")
    routed = _client(fleet.router_url, fleet.api_keys["acme"])

    def comp(c: openai.OpenAI) -> dict:
        return normalise(c.completions.create(model=MODEL, prompt=PROMPT, n=2, logprobs=2, max_tokens=4,
                                              seed=21).model_dump())  # fmt: skip

    a, b = comp(direct), comp(routed)
    assert a == b
    assert len(a["choices"]) == 2 and a["choices"][0]["text"] != a["choices"][1]["text"]
    for ch in a["choices"]:
        lp = ch["logprobs"]
        assert len(lp["tokens"]) == 4 and lp["text_offset"] == [0, 4, 8, 12]
        assert all(2 <= len(t) <= 3 for t in lp["top_logprobs"])  # top 2 + the sampled token
    assert a["usage"]["completion_tokens"] == 8

    def tool(c: openai.OpenAI) -> dict:
        return normalise(c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, seed=3,
                                                   tools=[WEATHER], tool_choice=FORCE_WEATHER).model_dump())  # fmt: skip

    a, b = tool(direct), tool(routed)
    assert a == b
    call = a["choices"][0]["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["unit"] in ("c", "f")


def test_openai_client_stream_deltas_equal_direct(fleet) -> None:
    """Streamed through the client: the same chunks (reasoning-free chat, n=2 with logprobs)."""

    def chunks(c: openai.OpenAI) -> list:
        s = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, n=2, seed=77, logprobs=True,
                                      top_logprobs=2, stream=True, stream_options={"include_usage": True})  # fmt: skip
        return [normalise(ch.model_dump()) for ch in s]

    a = chunks(_client(fleet.engine_urls[0], "unused"))
    b = chunks(_client(fleet.router_url, fleet.api_keys["acme"]))
    assert a == b
    texts = ["", ""]
    for ch in a[:-1]:
        for c in ch["choices"]:
            texts[c["index"]] += c["delta"]["content"] or ""
    assert all(len(t) == 20 for t in texts) and texts[0] != texts[1]  # 5 tokens of 4 bytes each
    assert a[-1]["usage"]["completion_tokens"] == 10
