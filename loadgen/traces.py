"""Read real LLM-serving traces into a list of :class:`TraceRequest`.

Two formats are recognised from the file's first line:

- Azure LLM inference trace 2023 (CSV, header ``TIMESTAMP,ContextTokens,GeneratedTokens``):
  ``TIMESTAMP`` is an absolute wall-clock time ``YYYY-MM-DD HH:MM:SS.fffffff`` (7 fraction
  digits, 100 ns); ``ContextTokens`` prompt tokens; ``GeneratedTokens`` output tokens.
- Mooncake FAST'25 (JSON lines): ``timestamp`` ms relative to the trace start,
  ``input_length`` prompt tokens, ``output_length`` output tokens, ``hash_ids`` (optional) one id per
  :data:`PREFIX_BLOCK_TOKENS` prompt tokens, equal leading ids = equal prompt prefix (other keys ignored).
- ServeGen statistics (a JSON spec object with ``"format": "servegen-stats"``, naming a rate-window
  and a length-window CSV beside it, the stretch, the thinning factor and the seed): the requests
  are synthesised from per-client statistics by :func:`loadgen.servegen.synthesize`, each with its
  client id as ``tenant`` (``c<id>``).

Arrivals are returned in ms relative to the first arrival, sorted. The embedded traces (origin
and licence in ``loadgen/traces/SOURCES.md``) are named by :data:`EMBEDDED_TRACES`.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

EMBEDDED_TRACES: dict[str, str] = {
    "azure-conv": "azure_llm_2023_conv_first30min.csv",
    "azure-code": "azure_llm_2023_code.csv",
    "mooncake-conv": "mooncake_fast25_conversation.jsonl",
    "mooncake-syn": "mooncake_fast25_synthetic.jsonl",
    "servegen-m-large": "servegen_m-large_864000-867600.json",
}
"""Name -> file name inside the ``loadgen/traces`` package-data folder."""

ARRIVAL_GRANULARITY_MS: dict[str, float] = {"mooncake-conv": 3000.0}

PREFIX_BLOCK_TOKENS = 512
"""Tokens per prefix-block id of the Mooncake FAST'25 traces' ``hash_ids`` (the paper's block size)."""
"""Timestamp granularity (ms) of embedded traces whose arrivals are quantised (Mooncake FAST'25
logs arrivals in 3 s steps: ~10 requests share each timestamp). Traces not listed have sub-ms
resolution (Azure 2023: 100 ns)."""

_AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


class TraceFormatError(ValueError):
    """A trace file is of an unknown format or has a bad row (the message names file and line)."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        arrival_ms: arrival time in ms, relative to the first request of the trace (or of the
            selected window, after :func:`select`).
        prompt_tokens: prompt length (tokens).
        output_tokens: output length (tokens).
        hash_ids: prefix-block ids of the prompt, one per :data:`PREFIX_BLOCK_TOKENS` tokens (Mooncake
            traces; empty for traces without prompt structure).
        tenant: the client the trace names (ServeGen: ``c<client_id>``); empty for traces without one.
    """

    arrival_ms: float
    prompt_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()
    tenant: str = ""


def embedded_trace(name: str) -> Path:
    """Path of an embedded trace by name (``azure-conv``, ``azure-code``, ``mooncake-conv``, ``mooncake-syn``,
    ``servegen-m-large``: for ServeGen, the JSON spec the requests are synthesised from).

    Raises:
        KeyError: for an unknown name (the message lists the known ones).
    """
    try:
        file_name = EMBEDDED_TRACES[name]
    except KeyError:
        raise KeyError(f"unknown embedded trace {name!r}; known: {', '.join(sorted(EMBEDDED_TRACES))}") from None
    return Path(str(resources.files("loadgen").joinpath("traces", file_name)))


def resolve_trace(name_or_path: str) -> Path:
    """An embedded trace name, else a file path.

    Raises:
        FileNotFoundError: if it is neither an embedded name nor an existing file.
    """
    if name_or_path in EMBEDDED_TRACES:
        return embedded_trace(name_or_path)
    path = Path(name_or_path)
    if not path.is_file():
        raise FileNotFoundError(
            f"trace {name_or_path!r} is neither an embedded trace ({', '.join(sorted(EMBEDDED_TRACES))}) nor a file"
        )
    return path


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Read an Azure 2023 CSV or Mooncake JSONL trace, or synthesise one from a ServeGen spec
    (format detected from the content).

    Returns:
        Requests sorted by arrival, arrivals in ms relative to the earliest one.

    Raises:
        TraceFormatError: unknown format, or a malformed row (message: ``file:line: problem``).
        OSError: if the file cannot be read.
    """
    path = Path(path)
    with open(path, encoding="utf-8", newline="") as f:
        lines = f.read().splitlines()
    first = next((i for i, line in enumerate(lines) if line.strip()), None)
    if first is None:
        raise TraceFormatError(f"{path}: empty trace file")
    head = lines[first].lstrip("\ufeff").strip()
    spec = _servegen_spec(lines) if head.startswith("{") else None
    if spec is not None:
        reqs = _synthesize_servegen(path, spec)
    elif head.startswith("{"):
        reqs = _parse_mooncake(path, lines)
    elif tuple(c.strip() for c in head.split(",")) == _AZURE_HEADER:
        reqs = _parse_azure(path, lines, first)
    else:
        raise TraceFormatError(
            f"{path}:{first + 1}: unknown trace format (expected the Azure 2023 CSV header "
            f"{','.join(_AZURE_HEADER)!r} or Mooncake JSON lines), got {head[:80]!r}"
        )
    if not reqs:
        raise TraceFormatError(f"{path}: trace has no requests")
    reqs.sort(key=lambda r: r.arrival_ms)
    t0 = reqs[0].arrival_ms
    return [dataclasses.replace(r, arrival_ms=r.arrival_ms - t0) for r in reqs]


def _tokens(path: Path, lineno: int, field_name: str, raw: object) -> int:
    """A non-negative integer token count, or a TraceFormatError naming file and line."""
    if isinstance(raw, bool):
        raise TraceFormatError(f"{path}:{lineno}: {field_name} must be an integer, got {raw!r}")
    try:
        n = int(raw)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise TraceFormatError(f"{path}:{lineno}: {field_name} must be an integer, got {raw!r}") from None
    if isinstance(raw, float) and raw != n:
        raise TraceFormatError(f"{path}:{lineno}: {field_name} must be an integer, got {raw!r}")
    if n < 0:
        raise TraceFormatError(f"{path}:{lineno}: {field_name} must be >= 0, got {n}")
    return n


def _azure_time_ticks(path: Path, lineno: int, raw: str) -> int:
    """``YYYY-MM-DD HH:MM:SS[.fffffff]`` -> 100 ns ticks since the unix epoch (naive, exact integer)."""
    text = raw.strip()
    whole, _, frac = text.partition(".")
    try:
        base = dt.datetime.strptime(whole, "%Y-%m-%d %H:%M:%S")
        if frac and not frac.isdigit():
            raise ValueError(frac)
    except ValueError:
        raise TraceFormatError(
            f"{path}:{lineno}: TIMESTAMP must be 'YYYY-MM-DD HH:MM:SS.fffffff', got {raw!r}"
        ) from None
    if len(frac) > 7:
        raise TraceFormatError(f"{path}:{lineno}: TIMESTAMP has more than 7 fraction digits: {raw!r}")
    seconds = (base - dt.datetime(1970, 1, 1)) // dt.timedelta(seconds=1)
    return seconds * 10_000_000 + (int(frac.ljust(7, "0")) if frac else 0)


def _parse_azure(path: Path, lines: list[str], header_index: int) -> list[TraceRequest]:
    """Rows -> requests with arrivals in ms relative to the earliest row (exact: integer 100 ns ticks)."""
    rows: list[tuple[int, int, int]] = []
    for i in range(header_index + 1, len(lines)):
        line = lines[i]
        if not line.strip():
            continue
        lineno = i + 1
        cols = line.split(",")
        if len(cols) != 3:
            raise TraceFormatError(
                f"{path}:{lineno}: expected 3 comma-separated columns, got {len(cols)}: {line[:80]!r}"
            )
        rows.append(
            (
                _azure_time_ticks(path, lineno, cols[0]),
                _tokens(path, lineno, "ContextTokens", cols[1].strip()),
                _tokens(path, lineno, "GeneratedTokens", cols[2].strip()),
            )
        )
    if not rows:
        return []
    t0 = min(r[0] for r in rows)
    return [TraceRequest((ticks - t0) / 10_000.0, p, o) for ticks, p, o in rows]


def _parse_mooncake(path: Path, lines: list[str]) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        lineno = i + 1
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceFormatError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise TraceFormatError(f"{path}:{lineno}: expected a JSON object")
        missing = [k for k in ("timestamp", "input_length", "output_length") if k not in obj]
        if missing:
            raise TraceFormatError(f"{path}:{lineno}: missing field(s) {', '.join(missing)}")
        ts = obj["timestamp"]
        if isinstance(ts, bool) or not isinstance(ts, int | float) or ts < 0:
            raise TraceFormatError(f"{path}:{lineno}: timestamp must be a number of ms >= 0, got {ts!r}")
        ids = obj.get("hash_ids", [])
        if not isinstance(ids, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
            raise TraceFormatError(f"{path}:{lineno}: hash_ids must be a list of integers")
        out.append(
            TraceRequest(
                float(ts),
                _tokens(path, lineno, "input_length", obj["input_length"]),
                _tokens(path, lineno, "output_length", obj["output_length"]),
                tuple(ids),
            )
        )
    return out


SERVEGEN_FORMAT = "servegen-stats"
"""``format`` of a ServeGen spec (JSON object): ``rate_windows`` and ``length_windows`` (CSV file
names relative to the spec, loadgen/servegen.py headers), ``start_s`` / ``end_s`` (the stretch, s
of ServeGen trace time), ``rate_scale`` (thinning factor), ``seed``, optional ``shared_uniform``."""


def _servegen_spec(lines: list[str]) -> dict[str, object] | None:
    """The parsed spec when the file is one JSON object with ``format`` = :data:`SERVEGEN_FORMAT`, else None
    (a Mooncake JSONL file has an object per line, so the whole text is not one JSON value)."""
    try:
        obj = json.loads("\n".join(lines))
    except json.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) and obj.get("format") == SERVEGEN_FORMAT else None


def _synthesize_servegen(path: Path, spec: dict[str, object]) -> list[TraceRequest]:
    """A ServeGen spec -> its synthesised requests (arrivals in ms from the stretch start)."""
    from loadgen import servegen  # numpy only when a ServeGen trace is read

    try:
        rate_file = path.parent / str(spec["rate_windows"])
        length_file = path.parent / str(spec["length_windows"])
        start_s, end_s = float(spec["start_s"]), float(spec["end_s"])  # type: ignore[arg-type]
        rate_scale = float(spec.get("rate_scale", 1.0))  # type: ignore[arg-type]
        seed = int(spec.get("seed", 0))  # type: ignore[call-overload]
        shared = bool(spec.get("shared_uniform", False))
    except (KeyError, TypeError, ValueError) as e:
        raise TraceFormatError(f"{path}: bad ServeGen spec ({e!r})") from None
    try:
        with open(rate_file, encoding="utf-8") as f:
            rates = servegen.parse_rate_windows(f.read().splitlines())
        with open(length_file, encoding="utf-8") as f:
            lengths = servegen.parse_length_windows(f.read().splitlines())
        synth = servegen.synthesize(rates, lengths, start_s=start_s, end_s=end_s, rate_scale=rate_scale,
                                    seed=seed, shared_uniform=shared)  # fmt: skip
    except ValueError as e:  # ServeGenFormatError, or a stretch without requests
        raise TraceFormatError(f"{path}: {e}") from None
    return [TraceRequest(r.arrival_s * 1000.0, r.prompt_tokens, r.output_tokens, (), f"c{r.client_id}") for r in synth]


def select(
    reqs: list[TraceRequest], duration_s: float | None, rate_scale: float = 1.0, start_s: float = 0.0
) -> list[TraceRequest]:
    """A window of the trace, then compressed in time.

    Keeps requests with ``start_s <= arrival < start_s + duration_s`` (seconds of trace time;
    ``duration_s=None`` keeps everything from ``start_s``), re-bases arrivals to ``start_s`` and
    divides them by ``rate_scale`` (2 = twice the request rate, half the gaps).

    Raises:
        ValueError: if ``rate_scale`` or ``duration_s`` is not positive or ``start_s`` is negative.
    """
    if not rate_scale > 0:
        raise ValueError(f"rate_scale must be > 0, got {rate_scale}")
    if duration_s is not None and not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    if start_s < 0:
        raise ValueError(f"start_s must be >= 0, got {start_s}")
    lo_ms = start_s * 1000.0
    hi_ms = float("inf") if duration_s is None else lo_ms + duration_s * 1000.0
    return [
        dataclasses.replace(r, arrival_ms=(r.arrival_ms - lo_ms) / rate_scale)
        for r in reqs
        if lo_ms <= r.arrival_ms < hi_ms
    ]


def arrival_granularity_ms(name_or_path: str) -> float:
    """Known timestamp granularity (ms) of an embedded trace by name; 0.0 for others and for paths."""
    return ARRIVAL_GRANULARITY_MS.get(name_or_path, 0.0)


def spread_arrivals(reqs: list[TraceRequest], granularity_ms: float, seed: int = 0) -> list[TraceRequest]:
    """Undo timestamp quantisation: each arrival moves to ``arrival + U[0, granularity_ms)``.

    A trace that logs arrivals in steps of g ms (Mooncake: g = 3000) turns every step's requests
    into one simultaneous burst, and rate scaling (which divides arrival times) keeps the burst
    simultaneous however far it stretches the trace; on a single replica that alone decides
    TTFT. The true arrival inside the step is unknown; the uniform draw is the assumption that
    adds the least (maximum entropy on [t, t + g)). Seeded, so runs repeat.

    Args:
        reqs: the trace (arrival_ms relative to its start, any order).
        granularity_ms: g (ms) >= 0; 0 returns a sorted copy unchanged.
        seed: RNG seed.

    Returns:
        New list sorted by arrival; prompt and output lengths unchanged.

    Raises:
        ValueError: if ``granularity_ms`` is negative or not finite.
    """
    if not 0.0 <= granularity_ms < float("inf"):
        raise ValueError(f"granularity_ms must be finite and >= 0, got {granularity_ms}")
    if granularity_ms == 0.0:
        return sorted(reqs, key=lambda r: r.arrival_ms)
    rng = random.Random(seed)
    out = [dataclasses.replace(r, arrival_ms=r.arrival_ms + rng.random() * granularity_ms) for r in reqs]
    out.sort(key=lambda r: r.arrival_ms)
    return out
