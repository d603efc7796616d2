"""SSE event counting in the relay (router/relay.py ``count_events``), for the router's TPOT metric."""

from __future__ import annotations

from router.relay import count_events

STREAM = (b'data: {"choices":[{"text":"data: not an event"}]}\n\n'
          b'data: {"choices":[{"text":"b"}]}\n\n'
          b'data: {"choices":[],"usage":{}}\n\n'
          b"data: [DONE]\n\n")  # fmt: skip


def count_split(parts: list[bytes]) -> int:
    events, tail = 0, b"\n"
    for p in parts:
        events += count_events(p, tail)
        tail = (tail + p)[-16:]
    return events


def test_whole_stream_counts_each_line_start_once() -> None:
    # 4 data lines; the "data:" inside a JSON string is not at a line start
    assert count_split([STREAM]) == 4


def test_every_split_into_three_chunks_gives_the_same_count() -> None:
    n = len(STREAM)
    for i in range(n + 1):
        for j in range(i, n + 1, 3):
            parts = [p for p in (STREAM[:i], STREAM[i:j], STREAM[j:]) if p]
            assert count_split(parts) == 4, (i, j)
