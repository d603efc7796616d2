"""Parser of the engine's Prometheus text (replica_agent/engine_metrics.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from replica_agent.engine_metrics import (
    CACHE_CONFIG,
    ITL,
    KV_USAGE,
    PREFIX_HITS,
    PREFIX_QUERIES,
    PREEMPTIONS,
    RUNNING,
    WAITING,
    EngineMetrics,
    parse_engine_metrics,
    wanted_lines,
)

# Shape of vLLM 0.32.0's /metrics (trimmed), new names.
VLLM_032 = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny-llama"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny-llama"} 2.0
# HELP vllm:num_requests_waiting_by_reason Number of requests waiting, by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny-llama",reason="capacity"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.4375
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",cache_dtype="auto",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="16",num_gpu_blocks_override="16",prefix_caching_hash_algo="sha256"} 1.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="tiny-llama"} 7.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="tiny-llama"} 1234.0
# HELP vllm:inter_token_latency_seconds Histogram of inter-token latency in seconds.
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01",model_name="tiny-llama"} 10.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="tiny-llama"} 40.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="tiny-llama"} 40.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="tiny-llama"} 0.8
"""

# Older vLLM: gpu_cache_usage_perc and time_per_output_token_seconds.
VLLM_OLD = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 0.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.25
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="1000"} 1.0
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{model_name="m"} 0.0
# TYPE vllm:time_per_output_token_seconds histogram
vllm:time_per_output_token_seconds_bucket{le="+Inf",model_name="m"} 4.0
vllm:time_per_output_token_seconds_count{model_name="m"} 4.0
vllm:time_per_output_token_seconds_sum{model_name="m"} 0.2
"""


def test_new_names():
    m, missing = parse_engine_metrics(VLLM_032)
    assert missing == []
    assert m.num_running == 3 and m.num_waiting == 2
    assert m.kv_usage == 0.4375
    assert m.block_size == 128 and m.num_gpu_blocks == 16
    assert m.kv_capacity_tokens == 2048
    assert m.preemptions == 7.0
    assert m.itl_count == 40.0 and m.itl_sum_s == pytest.approx(0.8)


def test_old_names():
    m, missing = parse_engine_metrics(VLLM_OLD)
    assert missing == []
    assert m.kv_usage == 0.25
    assert m.kv_capacity_tokens == 16_000
    assert m.itl_count == 4.0 and m.itl_sum_s == pytest.approx(0.2)


def test_new_name_wins_when_both_present():
    text = VLLM_032 + "# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc 0.9\n"
    m, _ = parse_engine_metrics(text)
    assert m.kv_usage == 0.4375


def test_several_engines_sum_counts_and_take_max_kv():
    text = VLLM_032.replace('engine="0"', 'engine="1"') + "\n".join(
        line for line in VLLM_032.splitlines() if not line.startswith("#")
    )
    m, missing = parse_engine_metrics(text)
    assert m.num_running == 6 and m.num_waiting == 4 and m.kv_usage == 0.4375


def test_missing_metrics_are_reported_and_conservative():
    m, missing = parse_engine_metrics("# TYPE something_else gauge\nsomething_else 1.0\n")
    assert missing == [RUNNING, WAITING, KV_USAGE, CACHE_CONFIG, PREEMPTIONS, ITL]
    assert m.kv_usage == 1.0  # missing KV usage = full, never an empty replica
    assert m.kv_capacity_tokens is None
    assert m.num_running == 0


def test_missing_kv_only():
    text = "\n".join(line for line in VLLM_032.splitlines() if "kv_cache_usage" not in line) + "\n"
    m, missing = parse_engine_metrics(text)
    assert missing == [KV_USAGE]
    assert m.kv_usage == 1.0


def test_empty_text():
    m, missing = parse_engine_metrics("")
    assert KV_USAGE in missing and m.kv_usage == 1.0


def test_garbage_raises_value_error():
    with pytest.raises(ValueError):
        parse_engine_metrics("vllm:num_requests_running{engine= 3 3 3\n")


REAL_PAGE = (Path(__file__).parents[1] / "data" / "vllm-0.32.0-cpu-metrics.txt").read_text()
"""GET /metrics of a real vLLM 0.32.0 (CPU build, tiny model) after 3 requests: 624 lines, 53 KB."""


def _loaded(page: str) -> str:
    """The real page with the values of a loaded replica typed in by hand."""
    for name, value in (("num_requests_running", "3.0"), ("num_requests_waiting", "29.0"),
                        ("kv_cache_usage_perc", "0.9375"), ("num_preemptions_total", "7.0")):
        old = f'vllm:{name}{{engine="0",model_name="tiny-llama"}} 0.0'
        assert old in page
        page = page.replace(old, old[:-3] + value)
    return page


def test_real_vllm_page_parsed_from_the_wanted_lines_only() -> None:
    page = _loaded(REAL_PAGE)
    kept = wanted_lines(page).splitlines()
    # running, waiting (not waiting_by_reason), KV usage, preemptions, ITL sum and count, cache config,
    # prefix-cache queries and hits (not their _created gauges)
    assert len(kept) == 9 and not any("waiting_by_reason" in line or "_created" in line for line in kept)
    m, missing = parse_engine_metrics(page)
    assert missing == []
    assert m == EngineMetrics(num_running=3, num_waiting=29, kv_usage=0.9375, preemptions=7.0, block_size=128,
                              num_gpu_blocks=4096, itl_sum_s=0.13563743601116585, itl_count=57.0,
                              prefix_queries=12.0, prefix_hits=0.0)  # fmt: skip
    # reference: prometheus_client over the whole page
    ref = {s.name: s.value for f in text_string_to_metric_families(page) for s in f.samples
           if s.name in (RUNNING, WAITING, KV_USAGE, PREEMPTIONS, ITL + "_sum", ITL + "_count", PREFIX_QUERIES,
                         PREFIX_HITS)}  # fmt: skip
    assert ref == {RUNNING: m.num_running, WAITING: m.num_waiting, KV_USAGE: m.kv_usage, PREEMPTIONS: m.preemptions,
                   ITL + "_sum": m.itl_sum_s, ITL + "_count": m.itl_count, PREFIX_QUERIES: m.prefix_queries,
                   PREFIX_HITS: m.prefix_hits}  # fmt: skip


def test_a_page_without_the_wanted_metrics_is_parsed_whole() -> None:
    assert wanted_lines("# TYPE other gauge\nother 1.0\n") == ""
    with pytest.raises(ValueError):  # not Prometheus text at all: still an error, not "all missing"
        parse_engine_metrics("<html><body>502 Bad Gateway</body></html>\n")


def test_prefix_cache_counters_are_read_and_optional() -> None:
    text = VLLM_032 + (
        "# TYPE vllm:prefix_cache_queries counter\n"
        'vllm:prefix_cache_queries_total{engine="0",model_name="tiny-llama"} 3000.0\n'
        "# TYPE vllm:prefix_cache_hits counter\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="tiny-llama"} 1200.0\n'
    )
    m, missing = parse_engine_metrics(text)
    assert missing == [] and (m.prefix_queries, m.prefix_hits) == (3000.0, 1200.0)
    assert PREFIX_QUERIES in wanted_lines(text) and PREFIX_HITS in wanted_lines(text)
    m, missing = parse_engine_metrics(VLLM_032)  # an engine without them: unknown, not missing
    assert missing == [] and (m.prefix_queries, m.prefix_hits) == (None, None)


def test_prefix_hit_window() -> None:
    from replica_agent.engine_metrics import PrefixHitWindow

    w = PrefixHitWindow(window_ms=60.0)
    assert w.delta() == (0, 0)
    w.add(0.0, 100.0, 10.0)
    assert w.delta() == (0, 0)  # one sample: no window yet
    w.add(10.0, None, None)  # an engine without the counters: ignored
    for t in range(10, 80, 10):  # 100 queried and 50 hit per 10 ms from t = 10 on
        w.add(float(t), 100.0 + 10 * t, 10.0 + 5 * t)
    # newest t = 70; the oldest kept is the last sample at or before 70 - 60 = 10: 60 ms of traffic
    assert w.delta() == (600, 300)
    w.add(80.0, 50.0, 0.0)  # counters went down: the engine restarted, the window starts afresh
    assert w.delta() == (0, 0)
    w.add(90.0, 150.0, 20.0)
    assert w.delta() == (100, 20)
    with pytest.raises(ValueError):
        PrefixHitWindow(window_ms=0.0)


def test_the_scrapers_line_memo_reparses_only_the_lines_that_moved(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a memo (the scraper's), a wanted line equal to one of the last page is not parsed again,
    a line that moved is, and the result is the memo-less parse's: values typed in by hand."""
    import replica_agent.engine_metrics as em

    parsed: list[str] = []
    real = em.text_string_to_metric_families

    def spy(text: str):
        parsed.append(text)
        return real(text)

    monkeypatch.setattr(em, "text_string_to_metric_families", spy)
    memo: em.LineMemo = {}
    first = parse_engine_metrics(VLLM_032, memo)
    assert first == parse_engine_metrics(VLLM_032)  # same as without a memo
    assert first[0].num_running == 3 and first[0].kv_usage == 0.4375
    assert len(memo) == 7 and len(parsed) == 7 + 1  # each wanted line once, then the memo-less whole parse
    parsed.clear()
    page2 = VLLM_032.replace('model_name="tiny-llama"} 3.0', 'model_name="tiny-llama"} 5.0').replace(
        "0.4375", "0.5").replace('_count{engine="0",model_name="tiny-llama"} 40.0',
                                 '_count{engine="0",model_name="tiny-llama"} 41.0')
    m, missing = parse_engine_metrics(page2, memo)
    # running, KV usage and the ITL count moved: 3 lines parsed, 4 taken from the memo
    assert len(parsed) == 3 and all("running" in p or "kv_cache" in p or "_count" in p for p in parsed)
    assert missing == [] and (m.num_running, m.kv_usage, m.itl_count) == (5, 0.5, 41.0)
    assert (m.num_waiting, m.preemptions, m.block_size, m.num_gpu_blocks, m.itl_sum_s) == (2, 7.0, 128, 16, 0.8)
    assert (m, missing) == parse_engine_metrics(page2)
    assert len(memo) == 7 and 'vllm:num_requests_running{engine="0",model_name="tiny-llama"} 3.0' not in memo
    parsed.clear()
    assert parse_engine_metrics(VLLM_032, memo) == first  # back: the old lines are parsed again
    assert len(parsed) == 3
    with pytest.raises(ValueError):  # a malformed line is never taken from the memo
        parse_engine_metrics("vllm:num_requests_running{engine= 3 3 3\n", memo)
