"""Batch-time model: predicted iteration time = a + b * new_tokens + c * context_tokens + e * chunk_prefix_tokens
+ f * chunk_sq_tokens (+ d per decode).

Source: FairBatching (arXiv 2510.14392, section 4, "batch time model"); the coefficients
shipped in ``replica_agent/data/fitted_coefficients.csv`` were fitted on Vidur/Splitwise GPU
profiles (see ``replica_agent/data/SOURCES.md``).

- ``new_tokens``: tokens computed in this iteration (1 per decode, plus every prefill-chunk token).
- ``context_tokens``: sum over the batch of tokens already in the KV cache before the iteration
  (decode: its context length; prefill chunk: the prefix already computed, 0 for a fresh prompt).
- ``chunk_prefix_tokens``: sum over the batch's prefill chunks of ``chunk_i * prefix_i`` (``chunk_i`` =
  tokens computed for sequence i in this iteration, ``prefix_i`` = its tokens already in the KV cache).
  A prefill chunk's attention over its prefix grows as chunk x prefix (the surrogate in
  ``docs/engine-time-model.md``: ``1.134e-7 * chunk * kv`` ms per layer), which the linear
  ``c * context`` charges only once. ``e`` defaults to 0 (the linear model of the profiles).
- ``chunk_sq_tokens``: sum over the batch's prefill chunks of ``chunk_i^2``: the causal attention inside
  a chunk (the surrogate's ``1.198e-7 * chunk^2`` ms per layer) and the GEMMs' cost per token growing with
  the chunk (memory-bound below 64-256 tokens, compute-bound above). A linear ``b`` charges every chunk
  at the chunk size it was fitted on: small chunks over-priced, large ones under-priced (issue 27 item 7,
  docs/evaluation.md "Online time model"). ``f`` defaults to 0 (the profiles' linear fits).

Prompts are priced before their chunks are known (PAB, the router, the in-flight reservations): a
prompt of P tokens is priced as if prefilled in chunks of ``chunk_tokens`` = K tokens. With ``f > 0``
their chunk^2 sum is K * P, so each of its tokens costs ``prompt_ms_per_token = b + f * K``. K is what
the online model learned: the mean chunk length its prefill tokens ran in, so prompts cost what the
purely linear fit charged them (its ``b`` absorbed ``f * K``) while each step is predicted from its
own chunks. :meth:`TimeModel.linearized` is that pricing as a model without f, what routers receive
(a, b', c, e and K).

A prompt's own chunks also read each other: chunk j attends over the chunks before it, so with ``e > 0``
the rest R of a prompt costs ``e * (R * computed + cross(R))`` for its chunk x prefix pairs, where
``cross(R) = sum_j chunk_j * (tokens of the chunks before j) = (R^2 - sum_j chunk_j^2) / 2`` over R split
into chunks of K (:func:`chunk_cross_tokens`; 0 when R <= K or K = 0, a prompt in one
chunk). It grows as R^2 / 2: for the 8B A100 engine (e about 3.3e-6 ms, K about 900 tokens learned
online under FairBatching) a 7,400-token prompt's cross term is about 80 ms, 16 % of its linear price,
and a 20,000-token one's about 630 ms, 48 % (issue 27: without it PAB under-priced long prompts and
admitted them to run late). The matching context term, ``c`` times the prefix each chunk reads, is
left out: ``c * K * n(n-1)/2`` for n chunks, about ``c / (e K)`` (3 % for the 8B) of the cross term.

:class:`StepFeatures` is the one description of an iteration that the engines (simulated and vLLM),
the time models and the online calibrator (``replica_agent/policy/calibration.py``) share.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class StepFeatures:
    """Token counts of one engine iteration, the inputs of every step-time model.

    Attributes:
        new_tokens: sum over the batch of tokens computed this iteration (tokens).
        context_tokens: sum over the batch of tokens already in the KV cache before it (tokens).
        chunk_prefix_tokens: sum over the batch of chunk_i * prefix_i (tokens^2).
        chunk_sq_tokens: sum over the batch of chunk_i^2 (tokens^2).
        num_seqs: sequences in the batch.
        prefill_chunk_prefix_tokens: the same sum as ``chunk_prefix_tokens`` over prefill chunks
            only (chunk_i > 1), the feature of :class:`TimeModel`'s ``e`` (tokens^2). A decode's
            product is its context, already in ``context_tokens``: keeping decodes out makes ``e``
            the attention of chunks over their prefixes alone, so a replica that only decodes
            says nothing about ``e`` (replica_agent/policy/calibration.py).
        num_decodes: sequences with a chunk of 1 token (decodes), the feature of :class:`TimeModel`'s ``d``.
        prefill_chunk_sq_tokens: sum of chunk_i^2 over prefill chunks only (chunk_i > 1), the feature of
            :class:`TimeModel`'s ``f`` (tokens^2); ``chunk_sq_tokens - num_decodes`` for a batch built by
            :meth:`from_items`. A producer that cannot tell (proxy mode, an older plugin) leaves it 0.
    """

    new_tokens: int
    context_tokens: int
    chunk_prefix_tokens: int
    chunk_sq_tokens: int
    num_seqs: int
    prefill_chunk_prefix_tokens: int = 0
    num_decodes: int = 0
    prefill_chunk_sq_tokens: int = 0

    @classmethod
    def from_items(cls, items: Iterable[tuple[int, int]]) -> StepFeatures:
        """Features of a batch given as ``(chunk_i, prefix_i)`` pairs (new tokens, tokens already computed).

        Raises:
            ValueError: on a negative count.
        """
        new = ctx = cross = sq = n = pcross = dec = psq = 0
        for chunk, prefix in items:
            if chunk < 0 or prefix < 0:
                raise ValueError(f"chunk and prefix must be >= 0, got {chunk}, {prefix}")
            new += chunk
            ctx += prefix
            cross += chunk * prefix
            sq += chunk * chunk
            n += 1
            if chunk > 1:
                pcross += chunk * prefix
                psq += chunk * chunk
            elif chunk == 1:
                dec += 1
        return cls(new, ctx, cross, sq, n, pcross, dec, psq)


def chunk_cross_tokens(remaining_tokens: int | float, chunk_tokens: float) -> float:
    """``cross(R)`` of the module docstring: the (new token, earlier token) pairs between the chunks of R
    tokens cut into chunks of K = ``chunk_tokens`` (q full ones and a last of r = R - q K), so
    ``(R^2 - q K^2 - r^2) / 2`` (tokens^2); 0 when K < 1 (no chunk length known) or R <= K (one chunk). E.g. R = 2,500, K = 1,000:
    chunks 1,000 / 1,000 / 500, pairs 1,000 x 1,000 + 500 x 2,000 = 2,000,000."""
    r_all = float(remaining_tokens)
    if not chunk_tokens >= 1.0 or r_all <= chunk_tokens:  # also NaN; a chunk under 1 token means none known
        return 0.0
    q = math.floor(r_all / chunk_tokens)
    rest = r_all - q * chunk_tokens
    return max(0.0, (r_all * r_all - q * chunk_tokens * chunk_tokens - rest * rest) / 2.0)


@dataclass(frozen=True, slots=True)
class TimeModel:
    """Coefficients of the batch-time model.

    Attributes:
        a_ms: fixed cost of one iteration (ms).
        b_ms_per_new_token: cost of each token computed in the iteration (ms/token).
        c_ms_per_context_token: cost of each token already in the KV cache that the batch reads (ms/token).
        e_ms_per_chunk_prefix: cost of each (new token, prefix token) pair of a prefill chunk
            (ms/token^2; :attr:`StepFeatures.prefill_chunk_prefix_tokens`); 0 in the profiles' linear fits.
        d_ms_per_decode: cost of a decode beyond ``b`` (ms per decode sequence; > -b, so a decode's
            own token costs ``b + d`` > 0). A decode's GEMM rows run memory-bound, a prefill's
            compute-bound (shared profiles: the decode-only fit's b is 0.043 against 0.073 over all
            batches for Llama-3-8B A100), so one ``b`` cannot price both; 0 in the profiles' fits.
            A caller that does not pass ``num_decodes`` prices decodes at ``b``.
        f_ms_per_chunk_sq: cost of each squared new token of a prefill chunk (ms/token^2;
            :attr:`StepFeatures.prefill_chunk_sq_tokens`); 0 in the profiles' linear fits.
        chunk_tokens: K, the chunk length prompts are priced at (tokens, >= 0; module docstring): a
            prompt token costs :attr:`prompt_ms_per_token` = ``b + f * K``, and the prompt's chunks read
            each other at ``e`` (:func:`chunk_cross_tokens`). Not a cost: :meth:`scaled` keeps it. The
            online model sets it to the mean chunk length it saw; 0 (the profiles): a prompt in one chunk.
    """

    a_ms: float
    b_ms_per_new_token: float
    c_ms_per_context_token: float
    e_ms_per_chunk_prefix: float = 0.0
    d_ms_per_decode: float = 0.0
    f_ms_per_chunk_sq: float = 0.0
    chunk_tokens: float = 0.0

    def __post_init__(self) -> None:
        if (self.a_ms < 0 or self.b_ms_per_new_token <= 0 or self.c_ms_per_context_token < 0
                or self.e_ms_per_chunk_prefix < 0 or not self.b_ms_per_new_token + self.d_ms_per_decode > 0
                or not self.f_ms_per_chunk_sq >= 0 or not self.chunk_tokens >= 0):  # fmt: skip
            raise ValueError(
                f"time model needs a >= 0, b > 0, c >= 0, e >= 0, b + d > 0, f >= 0, chunk_tokens >= 0; got "
                f"a={self.a_ms}, b={self.b_ms_per_new_token}, c={self.c_ms_per_context_token}, "
                f"e={self.e_ms_per_chunk_prefix}, d={self.d_ms_per_decode}, f={self.f_ms_per_chunk_sq}, "
                f"chunk_tokens={self.chunk_tokens}"
            )

    def batch_ms(self, new_tokens: int | float, context_tokens: int | float, chunk_prefix_tokens: int | float = 0,
                 num_decodes: int | float = 0, chunk_sq_tokens: int | float = 0) -> float:
        """Predicted time (ms) of one iteration with these token counts (``chunk_prefix_tokens`` = sum of
        chunk_i * prefix_i and ``chunk_sq_tokens`` = sum of chunk_i^2 over its prefill chunks;
        ``num_decodes`` of the ``new_tokens`` are decodes)."""
        return (self.a_ms + self.b_ms_per_new_token * new_tokens + self.c_ms_per_context_token * context_tokens
                + self.e_ms_per_chunk_prefix * chunk_prefix_tokens + self.d_ms_per_decode * num_decodes
                + self.f_ms_per_chunk_sq * chunk_sq_tokens)  # fmt: skip

    def step_ms(self, f: StepFeatures) -> float:
        """Predicted time (ms) of the iteration ``f`` describes."""
        return self.batch_ms(f.new_tokens, f.context_tokens, f.prefill_chunk_prefix_tokens, f.num_decodes,
                             f.prefill_chunk_sq_tokens)  # fmt: skip

    def scaled(self, k: float) -> TimeModel:
        """Every cost coefficient times ``k`` (> 0): the same model, ``k`` times slower (``chunk_tokens`` kept)."""
        return TimeModel(self.a_ms * k, self.b_ms_per_new_token * k, self.c_ms_per_context_token * k,
                         self.e_ms_per_chunk_prefix * k, self.d_ms_per_decode * k, self.f_ms_per_chunk_sq * k,
                         self.chunk_tokens)  # fmt: skip

    @property
    def prompt_ms_per_token(self) -> float:
        """What one prompt token costs when its chunks are not known: ``b + f * chunk_tokens`` (ms/token;
        module docstring). ``b`` when f = 0."""
        return self.b_ms_per_new_token + self.f_ms_per_chunk_sq * self.chunk_tokens

    def linearized(self) -> TimeModel:
        """The same prompt pricing as a model without f: ``b`` replaced by :attr:`prompt_ms_per_token`, f 0,
        K kept for the cross term (``self`` when f is already 0). :meth:`prefill_ms`, :meth:`tokens_within_ms`
        and the in-flight terms of pab.py give the same values on both; it is what the agent sends to
        routers (proto TimeModelCoefficients: a, b', c, e, K), so the router prices prompts as the agent does."""
        if self.f_ms_per_chunk_sq == 0.0:
            return self
        return TimeModel(self.a_ms, self.prompt_ms_per_token, self.c_ms_per_context_token, self.e_ms_per_chunk_prefix,
                         self.d_ms_per_decode - self.f_ms_per_chunk_sq * self.chunk_tokens, 0.0,
                         self.chunk_tokens)  # fmt: skip

    @property
    def cross_chunk_from(self) -> float:
        """Prompts longer than this many tokens pay the cross-chunk term: K (:attr:`chunk_tokens`) when
        e > 0 and K >= 1, else inf (a linear model; a prompt in one chunk)."""
        k = self.chunk_tokens
        return k if self.e_ms_per_chunk_prefix > 0.0 and k >= 1.0 else math.inf

    def prompt_body_ms(self, tokens: int | float) -> float:
        """A fresh prompt's price without the step's fixed cost: ``b' P + e cross(P)`` (ms; module
        docstring). It is what the prompt adds to steps that pay ``a`` anyway (pab.py's in-flight
        reservation) and, with ``a``, its :meth:`prefill_ms`. ``b' P`` exactly (the same float) when e = 0,
        K < 1 or P <= K, so a linear model prices as it always did (router/placement/fused.py computes
        the same expression, operation for operation)."""
        body = self.prompt_ms_per_token * tokens
        if tokens > self.cross_chunk_from:
            body = body + self.e_ms_per_chunk_prefix * chunk_cross_tokens(tokens, self.chunk_tokens)
        return body

    def prefill_ms(self, prompt_tokens: int | float, computed_tokens: int | float = 0) -> float:
        """Predicted time (ms) to prefill the rest of a prompt, as if it paid one iteration's ``a`` and
        priced at :attr:`prompt_ms_per_token` (module docstring; ``b`` when f = 0):
        ``a + b' R + e cross(R) + c C + e R C`` with R = ``prompt_tokens - computed_tokens`` (>= 0);
        ``a + prompt_body_ms(P)`` for a fresh prompt.

        ``computed_tokens`` C of the prompt are already in the KV cache (chunked prefill); every
        remaining token reads them (``R * C``) and the chunks before its own (``cross(R)``,
        :func:`chunk_cross_tokens`).
        """
        computed = float(computed_tokens)
        remaining = max(0.0, float(prompt_tokens) - computed)
        price = self.a_ms + self.prompt_body_ms(remaining)
        if computed:
            price = price + self.c_ms_per_context_token * computed + self.e_ms_per_chunk_prefix * remaining * computed
        return price

    def tokens_within_ms(self, budget_ms: float) -> int:
        """Largest fresh prompt P (tokens) whose prefill :meth:`prefill_ms` fits ``budget_ms`` (>= 0):
        ``floor((budget - a) / prompt_ms_per_token)`` without the cross term (e = 0, K < 1 or that P <= K).

        With it, the price is piecewise linear in P: over the chunk count q = floor(P / K),
        ``cross(P) = q K P - K^2 q (q + 1) / 2``, slope ``b' + e q K``. The last q whose first prompt
        ``q K`` fits solves ``e K^2 q (q - 1) / 2 + b' K q <= B - a`` (a quadratic); the P inside its
        chunk follows from the slope; a final check against :meth:`prefill_ms` (at most a few steps,
        for rounding) makes the answer exact: ``prefill_ms(P) <= B`` and ``prefill_ms(P + 1) > B``
        (within 1e-9 of B)."""
        if budget_ms <= self.a_ms:
            return 0
        bp = self.prompt_ms_per_token
        linear = max(0, math.floor((budget_ms - self.a_ms) / bp + 1e-9))
        if linear <= self.cross_chunk_from:
            return linear
        k, e = self.chunk_tokens, self.e_ms_per_chunk_prefix
        room = budget_ms - self.a_ms
        qa, qb = e * k * k / 2.0, bp * k - e * k * k / 2.0  # price(qK) - a = qa q^2 + qb q
        q = max(1, math.floor((-qb + math.sqrt(qb * qb + 4.0 * qa * room)) / (2.0 * qa)))
        p = math.floor((room + e * k * k * q * (q + 1) / 2.0) / (bp + e * q * k))
        p = max(0, min(p, linear))
        limit = budget_ms + 1e-9 * max(1.0, budget_ms)
        while p > 0 and self.prefill_ms(p) > limit:
            p -= 1
        while p < linear and self.prefill_ms(p + 1) <= limit:
            p += 1
        return p


@dataclass(frozen=True, slots=True)
class FitResult:
    """Least-squares fit of the time model with its quality figures.

    Attributes:
        model: fitted coefficients.
        r2: coefficient of determination on the fitted points.
        max_rel_err: max |predicted - measured| / measured (fraction).
        mean_rel_err: mean of the same (fraction).
        n: number of points.
    """

    model: TimeModel
    r2: float
    max_rel_err: float
    mean_rel_err: float
    n: int


def fit_time_model(
    new_tokens: Sequence[float], context_tokens: Sequence[float], measured_ms: Sequence[float]
) -> FitResult:
    """Fit a, b, c by ordinary least squares (numpy.linalg.lstsq) on per-iteration samples.

    Args:
        new_tokens: tokens computed per iteration, shape (n,).
        context_tokens: context tokens read per iteration, shape (n,).
        measured_ms: measured iteration time (ms), shape (n,), all > 0.

    Raises:
        ValueError: on mismatched lengths, fewer than 3 points, non-positive times, or a
            degenerate design (e.g. all new_tokens equal), or a fit with b <= 0.
    """
    x_new = np.asarray(new_tokens, dtype=float)
    x_ctx = np.asarray(context_tokens, dtype=float)
    y = np.asarray(measured_ms, dtype=float)
    if not (x_new.shape == x_ctx.shape == y.shape) or x_new.ndim != 1:
        raise ValueError("new_tokens, context_tokens and measured_ms must be 1-D of equal length")
    if y.size < 3:
        raise ValueError(f"need at least 3 samples to fit a, b, c; got {y.size}")
    if np.any(y <= 0):
        raise ValueError("measured_ms must be > 0")
    design = np.column_stack([np.ones_like(y), x_new, x_ctx])
    if np.linalg.matrix_rank(design) < 3:
        raise ValueError("samples do not vary enough in new_tokens and context_tokens to fit a, b, c")
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    a, b, c = (float(v) for v in coef)
    model = TimeModel(max(0.0, a), b, max(0.0, c))
    pred = design @ np.array([model.a_ms, model.b_ms_per_new_token, model.c_ms_per_context_token])
    ss_res = float(np.sum((y - pred) ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    rel = np.abs(pred - y) / y
    return FitResult(
        model=model,
        r2=1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0,
        max_rel_err=float(rel.max()),
        mean_rel_err=float(rel.mean()),
        n=int(y.size),
    )
