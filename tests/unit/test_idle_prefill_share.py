"""scripts/idle_prefill_share.py: a prompt's prefill on an idle replica, chunk by chunk (hand-worked)."""

from __future__ import annotations

import pytest

from loadgen.sim.engine_time import EngineTimeModel
from tests.scripts import load_script

mod = load_script("idle_prefill_share")


def test_chunks_of_the_batch_cap_over_their_prefixes() -> None:
    # 5,000 tokens at 2,048 per step: chunks 2048 (prefix 0), 2048 (2048), 904 (4096).
    # a = 10, b = 0.1, c = 0.001: 3 x 10 + 0.1 x 5000 + 0.001 x (0 + 2048 + 4096) = 536.144 ms
    e = EngineTimeModel(a_ms=10.0, b_ms=0.1, c_ms=0.001)
    assert mod.idle_prefill_ms(e, 5000, 2048) == pytest.approx(536.144)
    # e (chunk x prefix): + 1e-6 x (2048 x 2048 + 904 x 4096) = 7.897...
    e2 = EngineTimeModel(a_ms=10.0, b_ms=0.1, c_ms=0.001, e_ms=1e-6)
    assert mod.idle_prefill_ms(e2, 5000, 2048) == pytest.approx(536.144 + 1e-6 * (2048 * 2048 + 904 * 4096))
    assert mod.idle_prefill_ms(e, 100, 2048) == pytest.approx(10.0 + 10.0)  # one step: a + b x 100
    with pytest.raises(ValueError, match="chunk_tokens"):
        mod.idle_prefill_ms(e, 10, 0)
