"""loadgen.traces: real rows of the embedded traces, windowing and rate scaling, format errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadgen.traces import (
    arrival_granularity_ms,
    spread_arrivals,
    EMBEDDED_TRACES,
    TraceFormatError,
    TraceRequest,
    embedded_trace,
    load_trace,
    resolve_trace,
    select,
)

AZURE_HEADER = b"TIMESTAMP,ContextTokens,GeneratedTokens\n"


def test_embedded_traces_exist_with_sources() -> None:
    for name in EMBEDDED_TRACES:
        assert embedded_trace(name).is_file()
    assert (embedded_trace("azure-conv").parent / "SOURCES.md").is_file()
    with pytest.raises(KeyError, match="azure-conv"):
        embedded_trace("nope")


def test_azure_conv_first_rows() -> None:
    reqs = load_trace(embedded_trace("azure-conv"))
    assert len(reqs) == 10_108
    assert reqs[0] == TraceRequest(0.0, 374, 44)
    # 18:15:50.9951690 - 18:15:46.6805900 = 4.314579 s
    assert reqs[1].arrival_ms == pytest.approx(4314.579, abs=1e-9)
    assert (reqs[1].prompt_tokens, reqs[1].output_tokens) == (396, 109)
    assert all(a.arrival_ms <= b.arrival_ms for a, b in zip(reqs, reqs[1:]))
    assert reqs[-1].arrival_ms < 1_800_000.0


def test_azure_code_whole_file() -> None:
    reqs = load_trace(embedded_trace("azure-code"))
    assert len(reqs) == 8_819
    assert reqs[0] == TraceRequest(0.0, 4808, 10)
    assert reqs[1].arrival_ms == pytest.approx(52.0)


def test_mooncake_first_rows() -> None:
    reqs = load_trace(embedded_trace("mooncake-conv"))
    assert len(reqs) == 12_031
    # the file's first two lines (hash_ids: 14 and 15 ids of 512-token blocks, both starting at 0)
    assert reqs[0] == TraceRequest(0.0, 6758, 500, tuple(range(14)))
    assert reqs[1] == TraceRequest(0.0, 7322, 490, (0, *range(14, 28)))
    assert reqs[-1].arrival_ms == 3_536_999.0


def test_mooncake_synthetic_and_bad_hash_ids(tmp_path: Path) -> None:
    reqs = load_trace(embedded_trace("mooncake-syn"))
    assert len(reqs) == 3_993
    assert reqs[0] == TraceRequest(0.0, 40160, 6, tuple(range(79)))  # first line of the file
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 5, "input_length": 3, "output_length": 2, "hash_ids": [1, "x"]}\n')
    with pytest.raises(TraceFormatError, match="t.jsonl:1: hash_ids"):
        load_trace(p)


def test_resolve_trace_name_or_path(tmp_path: Path) -> None:
    assert resolve_trace("azure-code") == embedded_trace("azure-code")
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 5, "input_length": 3, "output_length": 2}\n')
    assert resolve_trace(str(p)) == p
    with pytest.raises(FileNotFoundError):
        resolve_trace(str(tmp_path / "missing.csv"))


def test_arrivals_relative_to_first_and_sorted(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text(
        '{"timestamp": 3000, "input_length": 10, "output_length": 1}\n'
        "\n"
        '{"timestamp": 1000, "input_length": 20, "output_length": 2, "hash_ids": [1]}\n'
    )
    assert load_trace(p) == [TraceRequest(0.0, 20, 2, (1,)), TraceRequest(2000.0, 10, 1)]


def test_azure_crlf_and_fraction_digits(tmp_path: Path) -> None:
    p = tmp_path / "t.csv"
    p.write_bytes(
        b"TIMESTAMP,ContextTokens,GeneratedTokens\r\n"
        b"2023-11-16 23:59:59.9999999,5,6\r\n"
        b"2023-11-17 00:00:01,7,8\r\n"
    )
    reqs = load_trace(p)
    assert reqs[0] == TraceRequest(0.0, 5, 6)
    assert reqs[1].arrival_ms == pytest.approx(1000.0001, abs=1e-9)


def test_select_window_and_rate_scale() -> None:
    reqs = [TraceRequest(t, 1, 1) for t in (0.0, 1000.0, 2500.0, 4000.0, 6000.0)]
    assert [r.arrival_ms for r in select(reqs, None, 2.0)] == [0.0, 500.0, 1250.0, 2000.0, 3000.0]
    win = select(reqs, duration_s=3.0, rate_scale=1.0, start_s=1.0)
    assert [r.arrival_ms for r in win] == [0.0, 1500.0]  # 1000 and 2500, re-based to 1 s; 4000 excluded
    assert [r.arrival_ms for r in select(reqs, 5.0, 4.0)] == [0.0, 250.0, 625.0, 1000.0]
    with pytest.raises(ValueError):
        select(reqs, 1.0, 0.0)
    with pytest.raises(ValueError):
        select(reqs, 0.0, 1.0)


def test_rate_scale_halves_gaps_on_real_trace() -> None:
    reqs = load_trace(embedded_trace("azure-conv"))
    one = select(reqs, 60.0, 1.0)
    two = select(reqs, 60.0, 2.0)
    assert len(one) == len(two) > 10
    for a, b in zip(one, two):
        assert b.arrival_ms == pytest.approx(a.arrival_ms / 2)


@pytest.mark.parametrize(
    ("content", "line", "match"),
    [
        (AZURE_HEADER + b"2023-11-16 18:15:46.6805900,374,44\r\n2023-11-16 18:15:50,x,3\r\n", 3, "ContextTokens"),
        (AZURE_HEADER + b"2023-11-16 18:15:46.6805900,374\n", 2, "3 comma-separated"),
        (AZURE_HEADER + b"2023/11/16 18:15:46,1,2\n", 2, "TIMESTAMP"),
        (AZURE_HEADER + b"2023-11-16 18:15:46,1,-2\n", 2, ">= 0"),
        (b'{"timestamp": 0, "input_length": 1, "output_length": 1}\n{"timestamp": 3, "input_length": 1}\n', 2,
         "output_length"),
        (b'{"timestamp": 0, "input_length": 1, "output_length": 1}\n\n{"timestamp": 3, \n', 3, "not valid JSON"),
        (b'{"timestamp": "a", "input_length": 1, "output_length": 1}\n', 1, "timestamp"),
    ],
)
def test_bad_rows_name_file_and_line(tmp_path: Path, content: bytes, line: int, match: str) -> None:
    p = tmp_path / "bad.trace"
    p.write_bytes(content)
    with pytest.raises(TraceFormatError, match=match) as ei:
        load_trace(p)
    assert f"{p}:{line}:" in str(ei.value)


def test_unknown_format_and_empty(tmp_path: Path) -> None:
    p = tmp_path / "x.csv"
    p.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(TraceFormatError, match="unknown trace format"):
        load_trace(p)
    e = tmp_path / "e.csv"
    e.write_text("\n\n")
    with pytest.raises(TraceFormatError, match="empty"):
        load_trace(e)
    h = tmp_path / "h.csv"
    h.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    with pytest.raises(TraceFormatError, match="no requests"):
        load_trace(h)


def test_spread_arrivals_moves_each_arrival_inside_its_step() -> None:
    reqs = [TraceRequest(0.0, 10, 1), TraceRequest(0.0, 20, 2), TraceRequest(3000.0, 30, 3), TraceRequest(3000.0, 40, 4)]
    out = spread_arrivals(reqs, 3000.0, seed=7)
    assert [r.arrival_ms for r in out] == sorted(r.arrival_ms for r in out)
    # each request stays inside [t, t + 3000) of its own step, lengths travel with it
    by_len = {r.prompt_tokens: r for r in out}
    for r in reqs:
        moved = by_len[r.prompt_tokens]
        assert r.arrival_ms <= moved.arrival_ms < r.arrival_ms + 3000.0
        assert moved.output_tokens == r.output_tokens
    assert len({r.arrival_ms for r in out}) == 4  # the simultaneous pairs are split
    assert spread_arrivals(reqs, 3000.0, seed=7) == out  # seeded
    assert spread_arrivals(reqs, 0.0) == reqs  # g = 0: unchanged (already sorted)
    with pytest.raises(ValueError, match="granularity_ms"):
        spread_arrivals(reqs, -1.0)


def test_mooncake_granularity_is_known_and_spreading_breaks_its_bursts() -> None:
    assert arrival_granularity_ms("mooncake-conv") == 3000.0
    assert arrival_granularity_ms("azure-conv") == 0.0
    trace = load_trace(resolve_trace("mooncake-conv"))
    # the logged timestamps: 10 requests share t = 0 (first rows of the file)
    assert sum(1 for r in trace if r.arrival_ms == 0.0) == 10
    spread = spread_arrivals(trace, 3000.0)
    assert len(spread) == len(trace)
    assert len({r.arrival_ms for r in spread}) == len(spread)
    assert max(r.arrival_ms for r in spread) < trace[-1].arrival_ms + 3000.0
