"""Token-deadline latency envelope and slack (FairBatching, arXiv 2510.14392, section 3; docs/design.md section 2).

A request that arrives at ``arrival_ms`` with SLO (``ttft_ms``, ``tpot_ms``) must emit its token j
(j = 0 is the first output token) no later than::

    deadline(j) = arrival_ms + ttft_ms + j * tpot_ms

Slack is the time left before the *next* token's deadline: ``slack = deadline(next_j) - now``;
negative slack means the request is behind its envelope. Judging a request against the envelope
(rather than against every inter-token gap) lets a request bank time by running ahead and spend it
later: tokens at 50, 60 and 150 ms with TTFT 300 / TPOT 50 meet deadlines 300, 350, 400 although
one gap is 90 ms.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Envelope:
    """The latency contract of one request.

    Attributes:
        arrival_ms: arrival time (ms, any fixed origin shared with ``now_ms`` arguments).
        ttft_ms: time-to-first-token target (ms), > 0.
        tpot_ms: time-per-output-token target (ms), > 0.
    """

    arrival_ms: float
    ttft_ms: float
    tpot_ms: float

    def deadline_ms(self, j: int) -> float:
        """Deadline of output token ``j`` (0-based; j = 0 is the first token), in ms.

        Raises:
            ValueError: if ``j`` is negative.
        """
        if j < 0:
            raise ValueError(f"token index must be >= 0, got {j}")
        return self.arrival_ms + self.ttft_ms + j * self.tpot_ms

    def slack_ms(self, tokens_out: int, now_ms: float) -> float:
        """Slack (ms) of the next token, given ``tokens_out`` tokens already emitted."""
        return self.deadline_ms(tokens_out) - now_ms

    def first_violation(self, token_times_ms: Sequence[float]) -> int | None:
        """Index of the first token emitted after its deadline, or None if all met the envelope."""
        for j, t in enumerate(token_times_ms):
            if t > self.deadline_ms(j):
                return j
        return None


def ttft_ms(arrival_ms: float, token_times_ms: Sequence[float]) -> float | None:
    """Time to first token (ms), or None when no token was emitted."""
    return token_times_ms[0] - arrival_ms if token_times_ms else None


def tpot_ms(token_times_ms: Sequence[float]) -> float | None:
    """TPOT = (last token time - first token time) / (tokens - 1), in ms; None with < 2 tokens.

    Source: docs/design.md section 2 (the usual definition, as in vLLM's benchmarks).
    """
    if len(token_times_ms) < 2:
        return None
    return (token_times_ms[-1] - token_times_ms[0]) / (len(token_times_ms) - 1)
