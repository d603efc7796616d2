"""Every baseline router of the fleet benchmark, run by ``fairbatch-router`` from a ``placement:``
profile in its YAML, over loopback in front of 2 simulated engines + 2 real agents (issue 26 item 4).

Each profile (parametrized) must serve requests, spread them as the router it imitates does
(router/placement/baselines.py), and never queue, reserve or lease: a burst is forwarded at once
(the router's queue depth stays 0, nothing waits in its queue, no Reserve reaches an agent).

Engine: llama-3-8b-a100 (a = 9.86 ms, b = 0.0727 ms/token, decode steps of about 10 ms), so a
300-token stream runs about 3 s; prompts are ``make_prompt`` texts of 4 bytes per token, unique per
call unless a test repeats one on purpose.
"""

from __future__ import annotations

import asyncio
import itertools
import json

import aiohttp
import pytest

from loadgen.sim.tokenizer import make_prompt
from router.placement import BASELINE_POLICIES

pytestmark = pytest.mark.timeout(180)

_IDS = itertools.count(1)


def unique_prompt(tokens: int) -> str:
    """A prompt of ``tokens`` tokens that no other call shares (its first 4-byte token is a counter)."""
    return f"{next(_IDS) % 10**4:04d}" + make_prompt(tokens)[4:]


def auth(fleet) -> dict[str, str]:
    return {"Authorization": f"Bearer {fleet.api_keys['acme']}"}


async def post(session: aiohttp.ClientSession, fleet, prompt: str, max_tokens: int) -> tuple[int, str, dict]:
    """A non-stream completion: (status, replica, body)."""
    body = {"model": "llama-3-8b-a100", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    async with session.post(f"{fleet.router_url}/v1/completions", json=body, headers=auth(fleet)) as resp:
        return resp.status, resp.headers.get("x-fairbatch-replica", ""), await resp.json(content_type=None)


class LongStream:
    """A streamed request held open on its replica: :meth:`start` returns once its first token came."""

    def __init__(self, session: aiohttp.ClientSession, fleet, prompt: str, max_tokens: int = 300) -> None:
        self.session, self.fleet, self.prompt, self.max_tokens = session, fleet, prompt, max_tokens
        self.replica = ""
        self.first = asyncio.Event()
        self.task: asyncio.Task[int] | None = None

    async def _run(self) -> int:
        body = {"model": "llama-3-8b-a100", "prompt": self.prompt, "max_tokens": self.max_tokens, "stream": True,
                "ignore_eos": True}
        async with self.session.post(f"{self.fleet.router_url}/v1/completions", json=body,
                                     headers=auth(self.fleet)) as resp:  # fmt: skip
            self.replica = resp.headers.get("x-fairbatch-replica", "")
            tokens = 0
            async for line in resp.content:
                if line.startswith(b"data: {") and json.loads(line[6:]).get("choices"):
                    tokens += 1
                    self.first.set()
            self.first.set()
            return tokens if resp.status == 200 else -resp.status

    async def start(self) -> str:
        self.task = asyncio.create_task(self._run())
        await asyncio.wait_for(self.first.wait(), 30)
        return self.replica

    async def done(self) -> int:
        assert self.task is not None
        return await self.task


async def metric(session: aiohttp.ClientSession, url: str, name: str) -> float:
    """Sum of a metric's samples on ``url``/metrics (0 when it has none: a labelled counter never used)."""
    async with session.get(f"{url}/metrics") as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))  # fmt: skip


async def queue_depths(session: aiohttp.ClientSession, fleet, stop: asyncio.Event) -> list[int]:
    """The router's /health ``queue_depth`` every 20 ms until ``stop``."""
    seen = []
    while not stop.is_set():
        async with session.get(f"{fleet.router_url}/health") as r:
            seen.append((await r.json())["queue_depth"])
        await asyncio.sleep(0.02)
    return seen


async def burst_goes_straight_through(session: aiohttp.ClientSession, fleet, n: int = 8) -> list[str]:
    """``n`` concurrent requests: all served, the queue depth 0 throughout; the replicas that served them."""
    stop = asyncio.Event()
    watcher = asyncio.create_task(queue_depths(session, fleet, stop))
    got = await asyncio.gather(*(post(session, fleet, unique_prompt(100), 16) for _ in range(n)))
    stop.set()
    depths = await watcher
    assert [s for s, _, _ in got] == [200] * n, got
    assert depths and set(depths) == {0}
    return [rid for _, rid, _ in got]


async def spread_as_the_policy_says(session: aiohttp.ClientSession, fleet, profile: str) -> None:
    if profile == "round-robin":  # in turn
        order = [(await post(session, fleet, unique_prompt(100), 4))[1] for _ in range(4)]
        assert order[0] != order[1] and order == order[:2] * 2, order
        return
    if profile in ("least-outstanding", "least-outstanding-tokens", "static-queue-cap", "power-of-two",
                   "llm-d-scorer"):  # fmt: skip
        # a long request (a 6000-token prompt, 300 tokens out) holds one replica; short ones avoid it:
        # by the router's own count (least-outstanding*), or by the engine figures the agents'
        # snapshots carry (power-of-two: running 1 vs 0; llm-d-scorer: KV usage), given 0.4 s to arrive
        long = LongStream(session, fleet, unique_prompt(6000))
        busy = await long.start()
        for _ in range(3):
            await asyncio.sleep(0.4)
            status, rid, _ = await post(session, fleet, unique_prompt(100), 4)
            assert (status, rid != busy) == (200, True), (rid, busy)
        assert await long.done() == 300
        return
    if profile == "llm-d-predicted-latency":
        # before its first training every pod is predicted 10 ms (llm-d's default model): all meet the
        # SLO, and the prefix-affinity filter (0.80 after the tier filter) sends a repeated prompt home
        text = unique_prompt(1000)
        status, home, _ = await post(session, fleet, text, 4)
        assert status == 200
        for _ in range(3):
            await asyncio.sleep(0.2)
            assert (await post(session, fleet, text, 4))[:2] == (200, home)
        return
    # cache-aware: a conversation A held on one replica; B, new, goes to the other (less loaded / shorter
    # engine queue); then each repeated prompt returns to the replica that holds its prefix
    text_a, text_b = unique_prompt(1000), unique_prompt(1000)
    a = LongStream(session, fleet, text_a)
    home_a = await a.start()
    await asyncio.sleep(0.4)
    status, home_b, _ = await post(session, fleet, text_b, 4)
    assert status == 200 and home_b != home_a
    assert await a.done() == 300
    await asyncio.sleep(0.4)
    assert (await post(session, fleet, text_a, 4))[:2] == (200, home_a)
    assert (await post(session, fleet, text_b, 4))[:2] == (200, home_b)


async def refused_over_the_cap(session: aiohttp.ClientSession, fleet) -> None:
    # cap 1000 queued prompt tokens: each replica takes one 2000-token prompt while idle, then refuses the
    # next while that one is still queued (a non-stream request is in prefill until its answer); the third
    # of three concurrent requests is refused by both replicas in turn: 429 queue-cap
    before = await metric(session, fleet.router_url, "fairbatch_router_admit_refusals_total")
    got = await asyncio.gather(*(post(session, fleet, unique_prompt(2000), 60) for _ in range(3)))
    statuses = sorted(s for s, _, _ in got)
    assert statuses == [200, 200, 429], got
    refusal = next(body for s, _, body in got if s == 429)
    assert refusal["error"]["code"] == "queue-cap"
    assert {rid for s, rid, _ in got if s == 200} == {"r0", "r1"}
    assert await metric(session, fleet.router_url, "fairbatch_router_admit_refusals_total") - before == 2


@pytest.mark.parametrize("profile", BASELINE_POLICIES)
async def test_the_router_runs_a_fleet_baseline_from_its_yaml(fleet_factory, profile: str) -> None:
    params = {"queue_cap_tokens": 1000} if profile == "static-queue-cap" else {}
    fleet = fleet_factory(2, placement={"profile": profile, "seed": 7, "params": params})
    async with aiohttp.ClientSession() as session:
        served = await burst_goes_straight_through(session, fleet)
        assert set(served) <= {"r0", "r1"}
        if profile not in ("power-of-two", "llm-d-scorer", "llm-d-prefix", "llm-d-flow-control"):  # these herd on one
            # snapshot's figures (llm-d-flow-control: unsaturated here, it places as llm-d-prefix)
            assert set(served) == {"r0", "r1"}, served  # router-local counts spread a burst
        await spread_as_the_policy_says(session, fleet, profile)
        if profile == "static-queue-cap":
            await refused_over_the_cap(session, fleet)
        # no admission queue, no Reserve, no lease: the baseline admits everything and forwards it at once
        assert await metric(session, fleet.router_url, "fairbatch_router_placement_seconds_count") >= 8 + 3
        assert await metric(session, fleet.router_url, "fairbatch_router_queue_wait_seconds_count") == 0
        assert await metric(session, fleet.router_url, "fairbatch_router_reserve_seconds_count") == 0
        for url in fleet.agent_urls:
            assert await metric(session, url, "fairbatch_agent_reserve_total") == 0


async def test_llm_d_flow_control_holds_requests_while_saturated(fleet_factory) -> None:
    # kvCacheUtilThreshold 0.0001: a replica with any KV in use scores kv / 0.0001 >> 2, so one long
    # stream on one of the 2 replicas saturates the pool (mean score >= 1); a request arriving then waits
    # at the router and, with a 500 ms TTL, is answered 503 flow-control-ttl in the OpenAI error format
    fleet = fleet_factory(2, placement={"profile": "llm-d-flow-control", "seed": 7,
                                        "params": {"kv_cache_util_threshold": 0.0001, "ttl_ms": 500}})  # fmt: skip
    async with aiohttp.ClientSession() as session:
        long = LongStream(session, fleet, unique_prompt(6000))
        await long.start()
        await asyncio.sleep(0.4)  # the agents' snapshots now carry the long request's KV usage
        status, _, body = await post(session, fleet, unique_prompt(100), 4)
        assert status == 503 and body["error"]["code"] == "flow-control-ttl", body
        assert await metric(session, fleet.router_url, "fairbatch_router_queue_wait_seconds_count") == 1
        assert await long.done() == 300
