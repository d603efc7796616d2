"""Synthesise a multi-tenant request trace from ServeGen's per-client statistics (sans-IO).

ServeGen (alibaba/ServeGen, Apache-2.0; Xiang et al., "ServeGen: Workload Characterization and
Generation of Large Language Model Serving in Production", arXiv 2505.09999) publishes Alibaba Cloud
Model Studio traffic as statistics, not requests: per client (an anonymised tenant) and per 600-s
window, the mean request rate and a fitted inter-arrival-time (IAT) law (Gamma or Weibull, scipy
parameters); per client and per 6-h window, the distribution of prompt and output lengths (ServeGen
ships full PMFs; loadgen/traces holds only their summary: mean, p10, p50, p90, p99, max). This
module turns those statistics into requests the way ServeGen's generator
(``servegen/construct.py`` ``generate_workload``) does, re-implemented here:

Arrivals, per client and per rate window of length W with rate r (times ``rate_scale``, ServeGen's
``get_scaled_rate_fn`` factor, which thins every client alike and keeps the mix):

1. n requests, n = floor(r W) or floor(r W) + 1 with probability frac(r W), so E[n] = r W.
2. n + 1 gaps drawn from the window's fitted law: numpy ``Generator.gamma(shape, scale)`` (= scipy
   ``gamma(a=shape, scale=scale)``) or ``scale * Generator.weibull(shape)`` (= scipy
   ``weibull_min(c=shape, scale=scale)``).
3. The gaps are rescaled so their sum is W (ServeGen: "scale IATs to match target rate"): the law
   fixes the shape of the arrival process (its burstiness, CV), the window fixes the rate. The first
   n partial sums are the arrivals; the last gap runs from the last arrival to the window's end.

ServeGen draws ceil(r W) gaps, rescales them to sum W and keeps the partial sums < W, which drops
the last one (it lands on W), so it emits ceil(r W) - 1 requests, on average r W - 0.5: a client
with 6 requests per window loses ~8 % of them. Drawing one gap more (step 2) removes that bias.

Lengths, per request, from the client's length window that holds the rate window's start (the
latest length window starting at or before it, ServeGen's rule): an inverse CDF through the
quantile knots (u, Q(u)) = (0, q0), (0.1, p10), (0.5, p50), (0.9, p90), (0.99, p99), (1, max),
rounded to whole tokens (:func:`inverse_cdf`). q0, the minimum, is not published; it is the first
segment extended down to u = 0, q0 = p10 - (p50 - p10) / 4, clamped to [min(1, p10), p10].
Straight lines between the knots overstate the mean: in the embedded stretch by 10 % (prompts)
and 24 % (outputs) against the published means, mostly from the last 1 % (p99 to max, with max often
10x p99: outputs capped at 8192, a few 24k-token prompts), since real lengths crowd the lower end of
each band. So every band is a power curve, Q = q_a + (q_b - q_a) t^k on t in [0, 1], one k per
client, field and window, set so the law's mean is the published mean (:meth:`LengthStats.exponent`;
k = 1 is piecewise linear, k > 1 crowds each band's lower end).
What this loses against ServeGen's PMFs: the shape inside each quantile band (modes and spikes of
templated prompts, fixed output lengths such as 1-token classifier answers), the true minimum,
nothing finer than 10 % of the mass below p10, and the tail's shape beyond its mean. ServeGen
samples prompt and output with the *same* uniform (perfectly rank-correlated lengths, a property of its sampler, not
of the data: the PMFs are marginals); here they are independent unless ``shared_uniform``.

Clients without length statistics (ServeGen's files for the busiest clients are missing from the
snapshot this project copied from, loadgen/traces/SOURCES.md) take the pooled length mix of the
clients that have them in the same length window: each such request picks a donor client with
probability proportional to the donor's request count in the synthesised stretch, then draws from
the donor's quantiles.

Everything is seeded (one ``numpy.random.Generator``) and walks clients and windows in sorted
order, so a seed gives the same trace on every run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

RATE_WINDOW_S = 600.0
"""Length of ServeGen's rate windows (s)."""

RATE_HEADER = ("client_id", "window_start_s", "rate_rps", "iat_cv", "iat_dist", "iat_shape", "iat_scale")
LENGTH_HEADER = ("client_id", "window_start_s", "field", "mean", "p10", "p50", "p90", "p99", "max")

QUANTILE_LEVELS = (0.0, 0.1, 0.5, 0.9, 0.99, 1.0)
"""The u of the inverse CDF's knots: 0 (extrapolated minimum), then the published quantiles and max."""


EXPONENT_MIN = 0.05
EXPONENT_MAX = 20.0
"""Bounds of the bands' exponent (:meth:`LengthStats.exponent`): 0.05 puts each band's mass near its
upper knot, 20 near its lower one."""


class ServeGenFormatError(ValueError):
    """A ServeGen statistics table has a bad header or row (the message names the line)."""


@dataclass(frozen=True, slots=True)
class RateWindow:
    """One client's arrival statistics in one rate window.

    Attributes:
        client_id: ServeGen's anonymised client (tenant) id.
        start_s: window start, s from the ServeGen trace start.
        rate_rps: the client's mean request rate in the window (req/s).
        iat_dist: ``"Gamma"``, ``"Weibull"``, or ``""`` (no requests).
        shape: fitted shape (scipy ``a`` / ``c``).
        scale: fitted scale (s).
        duration_s: window length (s).
    """

    client_id: int
    start_s: float
    rate_rps: float
    iat_dist: str
    shape: float
    scale: float
    duration_s: float = RATE_WINDOW_S


@dataclass(frozen=True, slots=True)
class LengthStats:
    """Summary of one client's token-count distribution in one length window (tokens)."""

    mean: float
    p10: float
    p50: float
    p90: float
    p99: float
    max: float

    def knots(self) -> np.ndarray:
        """Q at :data:`QUANTILE_LEVELS`: the extrapolated minimum q0, p10, p50, p90, p99, max."""
        q0 = self.p10 - (self.p50 - self.p10) / 4.0
        q0 = min(self.p10, max(min(1.0, self.p10), q0))
        return np.array([q0, self.p10, self.p50, self.p90, self.p99, self.max], dtype=float)

    def exponent(self) -> float:
        """k of the bands Q(u) = q_a + (q_b - q_a) * t**k, t = (u - u_a) / (u_b - u_a), one k for all
        five bands, chosen so the law's mean equals ``mean``. A band averages q_a + (q_b - q_a) / (k + 1),
        so the law's mean is A + S / (k + 1) with A = sum du * q_a, S = sum du * (q_b - q_a), and
        k = S / (mean - A) - 1. Any distribution with these quantiles has A <= mean <= A + S (its
        values in a band lie between the band's knots), so k exists unless the extrapolated q0 is
        above the true minimum or the quantiles are rounded; then k is clamped to
        [:data:`EXPONENT_MIN`, :data:`EXPONENT_MAX`]. 1 (piecewise linear) when all knots are equal."""
        a, s = self._band_sums()
        if s <= 0:
            return 1.0
        if self.mean <= a:
            return EXPONENT_MAX
        return min(EXPONENT_MAX, max(EXPONENT_MIN, s / (self.mean - a) - 1.0))

    def _band_sums(self) -> tuple[float, float]:
        q = self.knots()
        du = np.diff(QUANTILE_LEVELS)
        return float(np.sum(du * q[:-1])), float(np.sum(du * np.diff(q)))

    def law_mean(self) -> float:
        """Mean of the law :func:`inverse_cdf` draws from (equals ``mean`` unless the exponent is clamped)."""
        a, s = self._band_sums()
        return a + s / (self.exponent() + 1.0)


@dataclass(frozen=True, slots=True)
class SynthRequest:
    """A synthesised request: arrival (s from the stretch start), client id, prompt and output tokens."""

    arrival_s: float
    client_id: int
    prompt_tokens: int
    output_tokens: int


def _rows(lines: Iterable[str], header: tuple[str, ...], what: str) -> Iterable[tuple[int, list[str]]]:
    it = iter(enumerate(lines, start=1))
    for lineno, line in it:
        if line.strip():
            got = tuple(c.strip() for c in line.lstrip("\ufeff").split(","))
            if got != header:
                raise ServeGenFormatError(
                    f"line {lineno}: expected the {what} header {','.join(header)!r}, got {line[:80]!r}"
                )
            break
    else:
        raise ServeGenFormatError(f"empty {what} table")
    for lineno, line in it:
        if not line.strip():
            continue
        cols = [c.strip() for c in line.split(",")]
        if len(cols) != len(header):
            raise ServeGenFormatError(f"line {lineno}: expected {len(header)} columns, got {len(cols)}")
        yield lineno, cols


def parse_rate_windows(lines: Iterable[str], window_s: float = RATE_WINDOW_S) -> list[RateWindow]:
    """Rows of a ``*_client_rate_windows.csv`` table (header :data:`RATE_HEADER`).

    Raises:
        ServeGenFormatError: bad header, column count, number, or IAT family.
    """
    out: list[RateWindow] = []
    for lineno, c in _rows(lines, RATE_HEADER, "ServeGen rate-window"):
        try:
            w = RateWindow(int(c[0]), float(c[1]), float(c[2]), c[4], float(c[5]), float(c[6]), window_s)
        except ValueError:
            raise ServeGenFormatError(f"line {lineno}: not a number in {','.join(c)!r}") from None
        if w.iat_dist not in ("", "Gamma", "Weibull"):
            raise ServeGenFormatError(f"line {lineno}: iat_dist must be Gamma, Weibull or empty, got {w.iat_dist!r}")
        if not w.rate_rps >= 0 or (w.iat_dist and not (w.shape > 0 and w.scale > 0)):
            raise ServeGenFormatError(f"line {lineno}: rate must be >= 0 and a fitted law's shape and scale > 0")
        out.append(w)
    return out


def parse_length_windows(lines: Iterable[str]) -> dict[tuple[int, float, str], LengthStats]:
    """Rows of a ``*_client_length_windows.csv`` table -> {(client_id, window_start_s, field): stats}.

    Raises:
        ServeGenFormatError: bad header, column count, number, or quantiles out of order.
    """
    out: dict[tuple[int, float, str], LengthStats] = {}
    for lineno, c in _rows(lines, LENGTH_HEADER, "ServeGen length-window"):
        try:
            key = (int(c[0]), float(c[1]), c[2])
            s = LengthStats(*(float(x) for x in c[3:]))
        except ValueError:
            raise ServeGenFormatError(f"line {lineno}: not a number in {','.join(c)!r}") from None
        if not 0 <= s.p10 <= s.p50 <= s.p90 <= s.p99 <= s.max:
            raise ServeGenFormatError(f"line {lineno}: quantiles must satisfy 0 <= p10 <= p50 <= p90 <= p99 <= max")
        out[key] = s
    return out


def inverse_cdf(stats: LengthStats, u: np.ndarray | float) -> np.ndarray:
    """The quantile function Q(u) (float, not rounded): between consecutive knots (u_a, q_a), (u_b, q_b)
    Q = q_a + (q_b - q_a) * t**k, t = (u - u_a) / (u_b - u_a), k = :meth:`LengthStats.exponent`
    (k = 1: piecewise linear). Q hits every knot exactly and is non-decreasing."""
    levels = np.asarray(QUANTILE_LEVELS)
    q = stats.knots()
    x = np.clip(np.asarray(u, dtype=float), 0.0, 1.0)
    band = np.clip(np.searchsorted(levels, x, side="right") - 1, 0, len(levels) - 2)
    t = (x - levels[band]) / (levels[band + 1] - levels[band])
    return q[band] + (q[band + 1] - q[band]) * t ** stats.exponent()


def sample_lengths(stats: LengthStats, u: np.ndarray) -> np.ndarray:
    """Token counts for uniforms ``u`` in [0, 1): Q(u) rounded to the nearest integer."""
    return np.rint(inverse_cdf(stats, u)).astype(np.int64)


def window_arrivals(win: RateWindow, rate_rps: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival offsets (s from the window start, sorted, in [0, duration)) of one client window.

    ``rate_rps`` is the target rate (the window's rate times the thinning factor); steps 1-3 of the
    module docstring. Empty for a window without a fitted law or with rate 0.
    """
    if not win.iat_dist or rate_rps <= 0:
        return np.empty(0)
    expected = rate_rps * win.duration_s
    n = math.floor(expected)
    if rng.random() < expected - n:
        n += 1
    if n == 0:
        return np.empty(0)
    if win.iat_dist == "Gamma":
        gaps = rng.gamma(win.shape, win.scale, n + 1)
    else:
        gaps = win.scale * rng.weibull(win.shape, n + 1)
    total = float(gaps.sum())
    if not total > 0 or not math.isfinite(total):  # every gap underflowed to 0 (tiny shapes): even spacing
        gaps = np.ones(n + 1)
        total = float(n + 1)
    times = np.cumsum(gaps[:n]) * (win.duration_s / total)
    return np.minimum(times, np.nextafter(win.duration_s, 0.0))


def _length_window(starts: Sequence[float], t: float) -> float | None:
    """The latest length-window start <= t (ServeGen's rule), None when none."""
    best = None
    for s in starts:
        if s <= t and (best is None or s > best):
            best = s
    return best


def synthesize(
    rate_windows: Sequence[RateWindow],
    lengths: Mapping[tuple[int, float, str], LengthStats],
    *,
    start_s: float,
    end_s: float,
    rate_scale: float = 1.0,
    seed: int = 0,
    shared_uniform: bool = False,
    prompt_field: str = "input_tokens",
    output_field: str = "output_tokens",
) -> list[SynthRequest]:
    """Requests of every client over the rate windows that start in [start_s, end_s).

    Args:
        rate_windows: parsed rate windows (any order; others outside the stretch are ignored).
        lengths: parsed length windows.
        start_s, end_s: the stretch (s of ServeGen trace time); arrivals are returned relative to start_s.
        rate_scale: every client's rate times this (thinning; 1 = the published rates).
        seed: numpy Generator seed.
        shared_uniform: draw prompt and output from the same uniform, as ServeGen's sampler does.

    Returns:
        Requests sorted by (arrival, client).

    Raises:
        ValueError: if ``rate_scale`` is not positive, the stretch is empty, or no client in it has
            length statistics to draw from.
    """
    if not rate_scale > 0:
        raise ValueError(f"rate_scale must be > 0, got {rate_scale}")
    wins = sorted((w for w in rate_windows if start_s <= w.start_s < end_s), key=lambda w: (w.client_id, w.start_s))
    if not wins:
        raise ValueError(f"no rate windows start in [{start_s}, {end_s})")
    len_starts = sorted({k[1] for k in lengths})
    rng = np.random.default_rng(seed)

    # pass 1: arrivals, each window with its length window
    drawn: list[tuple[RateWindow, float | None, np.ndarray]] = []
    for w in wins:
        t = window_arrivals(w, w.rate_rps * rate_scale, rng)
        if t.size:
            drawn.append((w, _length_window(len_starts, w.start_s), t))

    # donors per length window: clients with both fields there, weighted by their request count
    donors: dict[float | None, tuple[list[int], np.ndarray]] = {}
    for lw in {lw for _, lw, _ in drawn}:
        counts: dict[int, int] = {}
        for w, lw2, t in drawn:
            if lw2 == lw and _has(lengths, w.client_id, lw, prompt_field, output_field):
                counts[w.client_id] = counts.get(w.client_id, 0) + t.size
        ids = sorted(counts)
        if ids:
            p = np.array([counts[c] for c in ids], dtype=float)
            donors[lw] = (ids, p / p.sum())

    out: list[SynthRequest] = []
    for w, lw, t in drawn:
        n = t.size
        if _has(lengths, w.client_id, lw, prompt_field, output_field):
            who = np.full(n, w.client_id)
        else:
            if lw not in donors:
                raise ValueError(f"client {w.client_id} at {w.start_s:g} s has no length statistics and no donor")
            ids, p = donors[lw]
            who = np.asarray(ids)[rng.choice(len(ids), size=n, p=p)]
        u_in = rng.random(n)
        u_out = u_in if shared_uniform else rng.random(n)
        prompt = np.empty(n, dtype=np.int64)
        output = np.empty(n, dtype=np.int64)
        for c in np.unique(who):
            m = who == c
            prompt[m] = sample_lengths(lengths[(int(c), lw, prompt_field)], u_in[m])  # type: ignore[index]
            output[m] = sample_lengths(lengths[(int(c), lw, output_field)], u_out[m])  # type: ignore[index]
        base = w.start_s - start_s
        out.extend(SynthRequest(base + float(a), w.client_id, int(p_), int(o_))
                   for a, p_, o_ in zip(t, prompt, output, strict=True))  # fmt: skip
    out.sort(key=lambda r: (r.arrival_s, r.client_id))
    return out


def _has(lengths: Mapping[tuple[int, float, str], LengthStats], client: int, lw: float | None,
         prompt_field: str, output_field: str) -> bool:  # fmt: skip
    return lw is not None and (client, lw, prompt_field) in lengths and (client, lw, output_field) in lengths


def expected_requests(rate_windows: Sequence[RateWindow], start_s: float, end_s: float,
                      rate_scale: float = 1.0) -> dict[int, float]:  # fmt: skip
    """Per client, the expected request count of :func:`synthesize` over the stretch (sum of r W x scale)."""
    out: dict[int, float] = {}
    for w in rate_windows:
        if start_s <= w.start_s < end_s and w.iat_dist:
            out[w.client_id] = out.get(w.client_id, 0.0) + w.rate_rps * rate_scale * w.duration_s
    return out


def peak_to_mean(arrivals_s: Sequence[float], bin_s: float = 10.0, span_s: float | None = None) -> float:
    """Burstiness: the busiest ``bin_s`` bin's rate over the mean rate across ``span_s`` (default: last arrival)."""
    a = np.asarray(arrivals_s, dtype=float)
    if a.size == 0:
        return 0.0
    span = float(a.max()) if span_s is None else span_s
    bins = max(1, math.ceil(span / bin_s))
    counts = np.bincount(np.minimum((a / bin_s).astype(np.int64), bins - 1), minlength=bins)
    return float(counts.max() / bin_s) / (a.size / (bins * bin_s))
