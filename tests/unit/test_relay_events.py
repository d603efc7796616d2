"""SSE event counting in the relay (router/relay.py ``count_events``), for the router's TPOT metric, and
its error-event check (``has_error_event``), for the outcome of a stream that failed mid-way."""

from __future__ import annotations

from router.relay import count_events, has_error_event

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


ERROR = b'data: {"error": {"message": "engine stream failed", "type": "upstream_error", "param": null, "code": 502}}\n\n'


def error_split(parts: list[bytes]) -> bool:
    seen, tail = False, b"\n"
    for p in parts:
        seen = seen or has_error_event(p, tail)
        tail = (tail + p)[-16:]
    return seen


def test_error_event_seen_at_every_split_and_only_at_a_line_start() -> None:
    failed = STREAM[:-len(b"data: [DONE]\n\n")] + ERROR + b"data: [DONE]\n\n"
    n = len(failed)
    for i in range(n + 1):  # every split into two reads, the event's key split too
        assert error_split([p for p in (failed[:i], failed[i:]) if p]), i
    assert not error_split([STREAM])
    # a token-keyed logprobs object and generated text that spells an error object are not events
    assert not error_split([b'data: {"choices":[{"logprobs":{"top_logprobs":[{"error":-0.1}]}}]}\n\n'])
    assert not error_split([b'data: {"choices":[{"text":"{\\"error\\": 1}"}]}\n\n'])
    assert error_split([b'data:{"error":{}}\n\n'])  # no space after the colon (our own event's spacing varies)
