"""The delivery delay of a real engine's tokens: from the engine making a token to the client reading it.

A token's engine time is the start of ``update_from_output()`` of the step that made it (the plugin's
``FAIRBATCH_REQUEST_LOG``, replica_agent/vllm_plugin.py); its client time is when the replay read the SSE
chunk that carried it (loadgen/replay.py). Both are on the monotonic clock that every process of a
machine shares, so for request r::

    d_first(r) = client first token - engine first token      (ms)
    d_last(r)  = client last token  - engine last token       (ms)

The path between (vLLM's engine core -> API server IPC, detokenization, SSE streaming, the client's
event loop) is the same for every token, but its delay varies from token to token on a loaded machine.
The TPOT the client measures is the engine's plus ``(d_last - d_first) / (n - 1)``: a scheduler that
paces decodes to their deadline (FairBatching) misses TPOT at the client whenever ``d_last > d_first``
by more than the slack it kept (docs/vllm.md, "2026-12-07, a second machine").

The simulated engine delivers every token at the end of its step. :func:`shift_token_times` gives a
simulated request a measured pair, centred on the mean ``d_first`` (the simulator already adds the
mean front, which holds the mean first-token delay, to every request's TTFT).

Pure functions; ``make bench-vllm`` (loadgen/vllm_bench.py) measures and uses them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

_KEY = re.compile(r"lg-[0-9a-f]+-\d+(?=-|$)")


def request_key(request_id: str) -> str | None:
    """The replay's ``lg-<run_id>-<i>`` inside an engine's request id (vLLM makes
    ``cmpl-lg-<run_id>-<i>-0-<random>`` of the ``x-request-id`` header), None when there is none."""
    m = _KEY.search(request_id)
    return m.group(0) if m else None


def delivery_pairs(client: Iterable[Mapping[str, Any]], engine: Iterable[Mapping[str, Any]]) -> list[tuple[float, float]]:
    """``(d_first, d_last)`` in ms (module docstring) of every request found on both sides.

    Args:
        client: rows ``{"key": "lg-<run>-<i>", "first_mono_ms", "last_mono_ms"}`` (the client's reads).
        engine: rows ``{"rid", "first_mono_ms", "last_mono_ms"}`` (``FAIRBATCH_REQUEST_LOG`` lines).

    Returns:
        One pair per matched request, in the client's order (a request the engine logged twice, e.g. a
        retry, keeps its last line).
    """
    made = {}
    for e in engine:
        key = request_key(str(e.get("rid", "")))
        if key is not None:
            made[key] = (float(e["first_mono_ms"]), float(e["last_mono_ms"]))
    out = []
    for c in client:
        got = made.get(str(c["key"]))
        if got is not None:
            out.append((float(c["first_mono_ms"]) - got[0], float(c["last_mono_ms"]) - got[1]))
    return out


def centred_pairs(pairs: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The pairs less the mean ``d_first``: what :func:`shift_token_times` adds to a simulated request."""
    if not pairs:
        return []
    mean_first = float(np.mean([p[0] for p in pairs]))
    return [(round(f - mean_first, 3), round(last - mean_first, 3)) for f, last in pairs]


def summarize_delivery(pairs: Sequence[tuple[float, float]], max_samples: int = 2000,
                       seed: int = 0) -> dict[str, Any]:  # fmt: skip
    """Quantiles of ``d_first``, ``d_last`` and ``d_last - d_first`` (ms), and up to ``max_samples`` of
    the :func:`centred_pairs` (a seeded subsample when there are more) for the simulator.

    Returns:
        ``{"requests": n}`` alone when ``pairs`` is empty.
    """
    if not pairs:
        return {"requests": 0}
    a = np.asarray(pairs, dtype=float)
    spread = a[:, 1] - a[:, 0]

    def q(x: np.ndarray) -> dict[str, float]:
        return {"mean": round(float(x.mean()), 2), "p10": round(float(np.quantile(x, 0.1)), 2),
                "p50": round(float(np.quantile(x, 0.5)), 2), "p90": round(float(np.quantile(x, 0.9)), 2),
                "p99": round(float(np.quantile(x, 0.99)), 2)}  # fmt: skip

    centred = centred_pairs(pairs)
    if len(centred) > max_samples:
        idx = np.sort(np.random.default_rng(seed).choice(len(centred), max_samples, replace=False))
        centred = [centred[i] for i in idx]
    return {"requests": len(pairs), "d_first_ms": q(a[:, 0]), "d_last_ms": q(a[:, 1]), "d_last_minus_first_ms": q(spread),
            "centred_pairs_ms": [list(p) for p in centred]}  # fmt: skip


def shift_token_times(times_ms: Sequence[float], pair: tuple[float, float]) -> list[float]:
    """A simulated request's client token times: its first token later by ``pair[0]``, its last by
    ``pair[1]``, the ones between by the straight line between the two shifts (so the times stay in
    order when the shifts differ by less than the gaps), each no earlier than the token before it.

    Args:
        times_ms: the engine's token times of one request (ms, ascending).
        pair: a :func:`centred_pairs` entry (ms).
    """
    n = len(times_ms)
    if n == 0:
        return []
    if n == 1:
        return [times_ms[0] + pair[0]]
    out = []
    prev = -np.inf
    for j, t in enumerate(times_ms):
        v = max(prev, t + pair[0] + (pair[1] - pair[0]) * j / (n - 1))
        out.append(v)
        prev = v
    return out
