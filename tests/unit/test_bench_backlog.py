"""scripts/bench_backlog.py: the service a request delivered inside a window (``delivered_in``), by hand."""

from __future__ import annotations

import pytest

from tests.scripts import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_backlog")


def test_delivered_in_the_window_by_hand(bench) -> None:
    R = bench.Result
    # window [2, 25] s; VTC weights 1 (prompt) and 2 (completion)
    inside = R("A", 200, sent_s=3.0, first_s=4.0, end_s=14.0, prompt_tokens=4000, completion_tokens=100)
    assert bench.delivered_in(inside, 2.0, 25.0, 1.0, 2.0) == pytest.approx(4000 + 200)
    # in flight at the end: first token at 20 s, ends at 30 s -> prompt + half of the 100 tokens (5 of 10 s)
    tail = R("A", 200, sent_s=19.0, first_s=20.0, end_s=30.0, prompt_tokens=4000, completion_tokens=100)
    assert bench.delivered_in(tail, 2.0, 25.0, 1.0, 2.0) == pytest.approx(4000 + 2 * 50)
    # first token before the window: no prompt; tokens 1.0-3.0 s, one of 2 s inside -> 50 tokens
    head = R("B", 200, sent_s=0.0, first_s=1.0, end_s=3.0, prompt_tokens=500, completion_tokens=100)
    assert bench.delivered_in(head, 2.0, 25.0, 1.0, 1.0) == pytest.approx(50.0)
    # after the window, refused, or no first token: nothing
    assert bench.delivered_in(R("B", 200, first_s=26.0, end_s=27.0, prompt_tokens=5, completion_tokens=5),
                              2.0, 25.0, 1.0, 2.0) == 0.0  # fmt: skip
    assert bench.delivered_in(R("B", 429), 2.0, 25.0, 1.0, 2.0) == 0.0
    # every token in one instant (first token = end) inside the window: all of it
    burst = R("B", 200, first_s=5.0, end_s=5.0, prompt_tokens=10, completion_tokens=1)
    assert bench.delivered_in(burst, 2.0, 25.0, 1.0, 2.0) == pytest.approx(12.0)
