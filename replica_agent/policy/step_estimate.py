"""Proxy mode's step-time observations, read from the token gaps it relays (pure).

A proxy sees no engine step, only when each stream's tokens arrive. In a step that holds no prefill,
every running decode gets one token (vLLM schedules its running requests first, and a batch of
decodes alone never exhausts the token budget), so the gap between two tokens of one stream is one
decode-only step: its features are the decodes tracked at that time (``num_decodes`` sequences of
one new token each, reading their summed context), and its time is the gap. The proxy takes a
sample only when no request was in prefill anywhere in the gap (a prefill chunk would ride in the
same steps and its size is unknown here), and gives each of the ``k`` streams' samples of a step
weight ``1/k``, so a step counts once. :class:`StepStride` then keeps one sample per step's worth of
that weight (weight 1): the k samples of a decode-only step time the same step, so teaching the model
one of them costs 1/k of teaching all k and tells it the same thing.

What it cannot see: a decode the engine left out of a step (a FairBatching plugin's non-urgent
decode, a preempted request) makes a gap of two steps; such a sample over-states the step time, so
the learned model errs on the slow, conservative side. Replicas with the plugin use plugin mode,
which reads the engine's own step times instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from replica_agent.policy.time_model import StepFeatures


def decode_step_gap(
    prev_token_ms: float | None,
    now_ms: float,
    tokens: int,
    num_decodes: int,
    prefill_idle_since_ms: float | None,
) -> float | None:
    """The time of one decode-only step read from a stream's token gap (ms), or None when the gap is
    not one: before the stream's first token, without a decode, while or since a prefill ran in it.

    Args:
        prev_token_ms: time of the stream's previous token (ms), None before its first.
        now_ms: time of this chunk (ms).
        tokens: tokens the chunk carries (>= 1; a chunk of k tokens spans k steps).
        num_decodes: decodes tracked now (this stream included).
        prefill_idle_since_ms: since when no tracked request has been in prefill (ms); None while one is.

    Returns:
        ``(now_ms - prev_token_ms) / tokens`` (ms, > 0) or None.
    """
    if prev_token_ms is None or tokens < 1 or num_decodes < 1 or prefill_idle_since_ms is None:
        return None
    if prefill_idle_since_ms > prev_token_ms:  # a prefill ran during part of the gap
        return None
    gap = now_ms - prev_token_ms
    if not gap > 0:
        return None
    return gap / tokens


def decode_step_features(num_decodes: int, decode_context_tokens: int) -> StepFeatures:
    """The features of a decode-only step over ``num_decodes`` decodes reading
    ``decode_context_tokens`` tokens of context in all: one new token each."""
    ctx = max(0, decode_context_tokens)
    return StepFeatures(num_decodes, ctx, ctx, num_decodes, num_decodes, 0, num_decodes)


@dataclass(slots=True)
class StepStride:
    """Keeps one proxy sample per step's worth of sample weight.

    :meth:`take` adds a sample's weight (``1/k`` for one of k decoding streams' :func:`decode_step_gap`)
    to what is owed and answers True, keep this one (at weight 1), each time the owed weight reaches 1: with k streams
    decoding, one token event in k is kept, so the online model sees each step once, as a weight-1
    observation, instead of k times at weight 1/k. The rest of the weight carries over to the next
    step (k may change between steps).

    Attributes:
        owed: weight seen since the last kept sample, in [0, 1).
    """

    owed: float = 0.0

    def take(self, weight: float) -> bool:
        """Add ``weight`` (in (0, 1]); True when this sample is to be kept."""
        self.owed += weight
        if self.owed >= 1.0 - 1e-9:  # k additions of 1/k may fall short of 1 by a rounding
            self.owed = max(0.0, self.owed - 1.0)
            return True
        return False
