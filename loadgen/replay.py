"""Replay a trace against an OpenAI-compatible server and timestamp every streamed token.

For each :class:`~loadgen.traces.TraceRequest`, at its arrival time (stretched by the time
scale) one streaming request is sent: ``/v1/completions`` with a prompt of exactly
``prompt_tokens`` tokens of the simulated engine's tokenizer (text, or token ids with
``prompt_format="tokens"``) or ``/v1/chat/completions`` (``endpoint="chat"``), with
``max_tokens = output_tokens``, ``ignore_eos``, ``stream`` and ``stream_options.include_usage``.

Outcomes: a 200 stream ending in ``[DONE]`` is ``ok``; HTTP 429 is ``rejected`` with its
``x-fairbatch-reason``; anything else (other HTTP status, an SSE ``error`` event, a cut stream,
a timeout, a connection error) is ``failed``. Tokens are counted per content-bearing chunk and
the final ``usage`` overrides the counts when present.

Time: wall times are taken with :func:`time.monotonic` and converted once at the end to
simulated ms (divided by ``time_scale``); inter-arrival gaps are multiplied by ``time_scale``.
The client does little per chunk (split lines, ``json.loads`` of the small chunk), keeps at
most ``max_concurrency`` requests in flight, bounds every request by a timeout and the whole
replay by ``max_wall_s``.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml

from loadgen.sim.tokenizer import count_tokens, make_prompt, render_chat
from loadgen.stats import FAILED, OK, REJECTED, RequestRecord, Slo
from loadgen.traces import TraceRequest

_PROMPT_WORDS = 12
"""make_prompt cycles through 12 four-byte words; prompts are slices of one long base text."""


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """A tenant the load is spread over.

    Attributes:
        name: tenant name (as in the router config).
        weight: relative share of the requests (> 0).
        api_key: sent as ``Authorization: Bearer <api_key>``; None sends no header.
    """

    name: str
    weight: float = 1.0
    api_key: str | None = None


@dataclass(slots=True)
class ReplayConfig:
    """How to replay.

    Attributes:
        target: base URL of the server, e.g. ``http://127.0.0.1:8000``.
        tenants: tenants to draw each request's tenant from (weighted, seeded).
        endpoint: ``completions`` or ``chat``.
        prompt_format: ``text`` (a string of exactly N tokens) or ``tokens`` (N token ids);
            completions only.
        model: ``model`` field of the requests; None asks ``GET /v1/models`` for the first id.
        seed: seed of the tenant draw.
        time_scale: wall seconds per simulated second (> 0).
        max_concurrency: requests in flight at most; later sends wait (their lag is recorded).
        request_timeout_s: limit per request, simulated seconds (scaled to wall time).
        max_wall_s: limit on the whole replay, wall seconds (None = no limit); requests not
            finished by then are ``failed`` (``wall-limit`` / ``not-sent``).
        progress: show a progress bar on stderr.
        prompt_offset: added to each request's index where its prompt is built (>= 0). Prompts of
            different indices share no KV block; a replay against an engine that served an earlier replay
            gives itself an offset past the earlier one's indices (e.g. the requests sent before), or the
            engine's prefix cache hits on the earlier replay's prompts.
    """

    target: str
    tenants: list[TenantSpec] = field(default_factory=lambda: [TenantSpec("default")])
    endpoint: str = "completions"
    prompt_format: str = "text"
    model: str | None = None
    seed: int = 0
    time_scale: float = 1.0
    max_concurrency: int = 4096
    request_timeout_s: float = 600.0
    max_wall_s: float | None = None
    progress: bool = True
    prompt_offset: int = 0

    def __post_init__(self) -> None:
        if self.prompt_offset < 0:
            raise ValueError(f"prompt_offset must be >= 0, got {self.prompt_offset}")
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint must be 'completions' or 'chat', got {self.endpoint!r}")
        if self.prompt_format not in ("text", "tokens"):
            raise ValueError(f"prompt_format must be 'text' or 'tokens', got {self.prompt_format!r}")
        if self.prompt_format == "tokens" and self.endpoint == "chat":
            raise ValueError("prompt_format 'tokens' needs endpoint 'completions'")
        if not self.time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {self.time_scale}")
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if not self.tenants:
            raise ValueError("at least one tenant is needed")
        if any(not t.weight > 0 for t in self.tenants):
            raise ValueError("tenant weights must be > 0")


@dataclass(slots=True)
class ReplayResult:
    """Records of one replay.

    Attributes:
        records: one per trace request, in trace order (times in simulated ms from the start).
        duration_s: simulated seconds from the start to the end of the last request.
        wall_s: wall seconds the replay took.
        time_scale: the scale used.
        model: the ``model`` sent.
        error_samples: error label -> one example message (for diagnosis).
        run_id: the replay's id: request i was sent with ``x-request-id: lg-<run_id>-<i>`` (vLLM takes
            it into its own request id).
        start_monotonic_s: ``time.monotonic()`` at the replay's time 0 (records' ms count from it, times
            the time scale), so another process of the machine can set its own times beside them.
    """

    records: list[RequestRecord]
    duration_s: float
    wall_s: float
    time_scale: float
    model: str | None
    error_samples: dict[str, str] = field(default_factory=dict)
    run_id: str = ""
    start_monotonic_s: float = 0.0


# ----------------------------------------------------------------------------- argument helpers


def parse_tenants(spec: str) -> list[tuple[str, float]]:
    """``"acme:3,beta:1"`` -> ``[("acme", 3.0), ("beta", 1.0)]`` (weight defaults to 1).

    Raises:
        ValueError: on an empty name, a bad or non-positive weight, or a repeated name.
    """
    out: list[tuple[str, float]] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        name, _, w = part.partition(":")
        name = name.strip()
        if not name:
            raise ValueError(f"empty tenant name in {spec!r}")
        try:
            weight = float(w) if w.strip() else 1.0
        except ValueError:
            raise ValueError(f"bad weight {w!r} for tenant {name!r}") from None
        if not weight > 0:
            raise ValueError(f"weight of tenant {name!r} must be > 0, got {weight}")
        if any(n == name for n, _ in out):
            raise ValueError(f"tenant {name!r} given twice")
        out.append((name, weight))
    if not out:
        raise ValueError(f"no tenants in {spec!r}")
    return out


def parse_api_keys(items: Sequence[str]) -> dict[str, str]:
    """``["acme=KEY", ...]`` -> ``{"acme": "KEY"}``.

    Raises:
        ValueError: when an item is not ``TENANT=KEY``.
    """
    keys: dict[str, str] = {}
    for item in items:
        tenant, sep, key = item.partition("=")
        if not sep or not tenant.strip() or not key:
            raise ValueError(f"--api-key wants TENANT=KEY, got {item!r}")
        keys[tenant.strip()] = key
    return keys


def tenants_from_config(path: str | Path) -> tuple[dict[str, float], dict[str, Slo]]:
    """Tenant weights and per-tenant SLOs from a router YAML (``tenants`` -> ``slo_class`` ->
    ``slo_classes``'s ``ttft_ms``/``tpot_ms``).

    Raises:
        ValueError: when the file lacks those sections or a tenant names an unknown class.
    """
    path = Path(path)
    with open(path, encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a YAML mapping")
    classes = doc.get("slo_classes") or {}
    tenants = doc.get("tenants") or {}
    if not isinstance(classes, dict) or not isinstance(tenants, dict) or not tenants:
        raise ValueError(f"{path}: needs 'slo_classes' and 'tenants' mappings")
    weights: dict[str, float] = {}
    slos: dict[str, Slo] = {}
    for name, t in tenants.items():
        if not isinstance(t, dict) or "slo_class" not in t:
            raise ValueError(f"{path}: tenants.{name} needs an slo_class")
        cls = classes.get(t["slo_class"])
        if not isinstance(cls, dict) or "ttft_ms" not in cls or "tpot_ms" not in cls:
            raise ValueError(
                f"{path}: tenants.{name}.slo_class {t['slo_class']!r} is not in slo_classes with ttft_ms/tpot_ms"
            )
        weights[str(name)] = float(t.get("weight", 1.0))
        slos[str(name)] = Slo(float(cls["ttft_ms"]), float(cls["tpot_ms"]))
    return weights, slos


# ----------------------------------------------------------------------------- request bodies


_TAG_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"


def _tag(index: int) -> str:
    """Four base-36 ASCII characters (one simulated token) naming request ``index`` (mod 36**4)."""
    n = index % 36**4
    out = ""
    for _ in range(4):
        n, d = divmod(n, 36)
        out = _TAG_DIGITS[d] + out
    return out


@dataclass(slots=True)
class _BodyMaker:
    """Builds request bodies cheaply: prompt texts are slices of one long base text."""

    endpoint: str
    prompt_format: str
    model: str | None
    base_text: str = ""
    chat_overhead_tokens: int = 0

    def prompt_text(self, n_tokens: int, seed: int) -> str:
        """Exactly ``n_tokens`` tokens: ``make_prompt(n_tokens, seed % 12)`` with its first 4-byte word
        replaced by :func:`_tag` ``(seed)``, so prompts of different requests share no KV block and an
        engine's prefix cache does not hit across them (a trace's requests share nothing it does not say)."""
        need = (n_tokens + _PROMPT_WORDS) * 4
        if len(self.base_text) < need:
            self.base_text = make_prompt(max(n_tokens * 2, 1024) + _PROMPT_WORDS)
        s = (seed % _PROMPT_WORDS) * 4
        if n_tokens <= 0:
            return ""
        return _tag(seed) + self.base_text[s + 4 : s + n_tokens * 4]

    def body(self, req: TraceRequest, index: int) -> bytes:
        """JSON body for ``req`` (max_tokens >= 1)."""
        payload: dict[str, object] = {}
        if self.model is not None:
            payload["model"] = self.model
        if self.endpoint == "chat":
            content_tokens = max(0, req.prompt_tokens - self.chat_overhead_tokens)
            payload["messages"] = [{"role": "user", "content": self.prompt_text(content_tokens, index)}]
        elif self.prompt_format == "tokens":
            payload["prompt"] = [1000 + (index + i) % 20000 for i in range(max(1, req.prompt_tokens))]
        else:
            payload["prompt"] = self.prompt_text(req.prompt_tokens, index)
        payload["max_tokens"] = max(1, req.output_tokens)
        payload["ignore_eos"] = True
        payload["stream"] = True
        payload["stream_options"] = {"include_usage": True}
        return json.dumps(payload, separators=(",", ":")).encode()


# ----------------------------------------------------------------------------- one request


@dataclass(slots=True)
class _Raw:
    """Wall-clock (monotonic s) state of one request while it runs."""

    tenant: str
    sched_s: float
    prompt_tokens: int
    expected_output_tokens: int
    sent_s: float | None = None
    end_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    usage_completion: int | None = None
    usage_prompt: int | None = None
    outcome: str | None = None
    reason: str | None = None
    replica: str | None = None


def _short(text: str, n: int = 300) -> str:
    text = text.strip().replace("\n", " ")
    return text if len(text) <= n else text[:n] + "..."


async def _stream(resp: aiohttp.ClientResponse, raw: _Raw) -> tuple[bool, str | None]:
    """Read an SSE body, timestamp content-bearing chunks. Returns (saw [DONE], error message)."""
    times = raw.token_times_s
    buf = b""
    loads = json.loads
    monotonic = time.monotonic
    async for data in resp.content.iter_any():
        now = monotonic()
        buf += data
        if b"\n" not in data:
            continue
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return True, None
            if not payload:
                continue
            try:
                obj = loads(payload)
            except ValueError:
                return False, f"bad SSE JSON: {_short(payload.decode(errors='replace'))}"
            if not isinstance(obj, dict):
                continue
            if "error" in obj:  # vLLM: data: {"error": {...}}
                return False, _short(json.dumps(obj["error"]))
            if obj.get("object") == "error":  # older vLLM: data: {"object": "error", "message": ...}
                return False, _short(str(obj.get("message")))
            choices = obj.get("choices")
            if choices:
                c = choices[0]
                text = c.get("text")
                if text is None:
                    delta = c.get("delta")
                    text = delta.get("content") if isinstance(delta, dict) else None
                if text:
                    times.append(now)
            usage = obj.get("usage")
            if usage:
                raw.usage_completion = usage.get("completion_tokens")
                raw.usage_prompt = usage.get("prompt_tokens")
    return False, "stream ended without [DONE]"


async def _send(
    session: aiohttp.ClientSession,
    url: str,
    headers: Mapping[str, str],
    body: bytes,
    raw: _Raw,
    timeout_wall_s: float,
    errors: dict[str, str],
) -> None:
    """Send one request and fill ``raw`` (never raises except CancelledError)."""
    raw.sent_s = time.monotonic()
    try:
        async with asyncio.timeout(timeout_wall_s):
            async with session.post(url, data=body, headers=headers) as resp:
                raw.replica = resp.headers.get("x-fairbatch-replica")
                if resp.status == 429:
                    raw.outcome, raw.reason = REJECTED, resp.headers.get("x-fairbatch-reason") or "unknown"
                    await resp.read()
                elif resp.status != 200:
                    raw.outcome, raw.reason = FAILED, f"http-{resp.status}"
                    errors.setdefault(raw.reason, _short(await resp.text(errors="replace")))
                else:
                    done, err = await _stream(resp, raw)
                    if err is not None:
                        raw.outcome = FAILED
                        raw.reason = "incomplete-stream" if err.startswith("stream ended") else "sse-error"
                        errors.setdefault(raw.reason, err)
                    else:
                        raw.outcome = OK if done else FAILED
    except TimeoutError:
        raw.outcome, raw.reason = FAILED, "timeout"
    except aiohttp.ClientError as e:
        raw.outcome, raw.reason = FAILED, f"client-{type(e).__name__}"
        errors.setdefault(raw.reason, _short(str(e)))
    except OSError as e:
        raw.outcome, raw.reason = FAILED, f"os-{type(e).__name__}"
        errors.setdefault(raw.reason, _short(str(e)))
    finally:
        raw.end_s = time.monotonic()


# ----------------------------------------------------------------------------- the replay


async def discover_model(session: aiohttp.ClientSession, target: str, headers: Mapping[str, str]) -> str | None:
    """First model id of ``GET /v1/models``, None when it cannot be read."""
    try:
        async with asyncio.timeout(10):
            async with session.get(f"{target}/v1/models", headers=headers) as resp:
                if resp.status != 200:
                    return None
                doc = await resp.json(content_type=None)
        data = doc.get("data") or []
        return str(data[0]["id"]) if data else None
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _to_record(raw: _Raw, t0: float, scale: float) -> RequestRecord:
    """Wall state -> record in simulated ms since ``t0``."""
    k = 1000.0 / scale
    sent = raw.sent_s if raw.sent_s is not None else raw.sched_s
    n_chunks = len(raw.token_times_s)
    out_tokens = raw.usage_completion if raw.usage_completion is not None else n_chunks
    return RequestRecord(
        tenant=raw.tenant,
        arrival_ms=(sent - t0) * k,
        prompt_tokens=raw.usage_prompt if raw.usage_prompt is not None else raw.prompt_tokens,
        output_tokens=int(out_tokens),
        token_times_ms=[(t - t0) * k for t in raw.token_times_s],
        outcome=raw.outcome or FAILED,
        reason=raw.reason,
        replica=raw.replica,
        expected_output_tokens=raw.expected_output_tokens,
        send_lag_ms=max(0.0, (sent - raw.sched_s) * k),
    )


class _Progress:
    """A tqdm bar on stderr with ok/rejected/failed counts (no-op when disabled)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.counts = {OK: 0, REJECTED: 0, FAILED: 0}
        self._bar = None
        self._last = 0.0
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True, mininterval=0.5)

    def done(self, outcome: str | None) -> None:
        self.counts[outcome or FAILED] = self.counts.get(outcome or FAILED, 0) + 1
        if self._bar is not None:
            self._bar.update(1)
            now = time.monotonic()
            if now - self._last > 0.5:
                self._last = now
                self._bar.set_postfix_str(self._postfix(), refresh=False)

    def _postfix(self) -> str:
        return f"ok {self.counts[OK]}, rejected {self.counts[REJECTED]}, failed {self.counts[FAILED]}"

    def close(self) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix(), refresh=False)
            self._bar.close()


async def replay(trace: Sequence[TraceRequest], cfg: ReplayConfig) -> ReplayResult:
    """Send every request of ``trace`` at ``arrival_ms * time_scale`` wall ms after the start.

    Returns:
        One record per trace request (in trace order) and the measured duration.

    Raises:
        ValueError: if the trace is empty.
    """
    if not trace:
        raise ValueError("empty trace: nothing to replay")
    scale = cfg.time_scale
    target = cfg.target.rstrip("/")
    url = f"{target}/v1/chat/completions" if cfg.endpoint == "chat" else f"{target}/v1/completions"
    rng = random.Random(cfg.seed)
    chosen = rng.choices(cfg.tenants, weights=[t.weight for t in cfg.tenants], k=len(trace))
    run_id = uuid.uuid4().hex[:8]
    base_headers = {
        t.name: {"Content-Type": "application/json", **({"Authorization": f"Bearer {t.api_key}"} if t.api_key else {})}
        for t in cfg.tenants
    }
    timeout_wall_s = cfg.request_timeout_s * scale
    errors: dict[str, str] = {}
    connector = aiohttp.TCPConnector(limit=cfg.max_concurrency, limit_per_host=0, force_close=False)
    session_timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0)
    raws: list[_Raw] = []
    progress = _Progress(len(trace), cfg.progress)
    wall_start = time.monotonic()
    async with aiohttp.ClientSession(connector=connector, timeout=session_timeout, auto_decompress=False) as session:
        model = cfg.model
        if model is None:
            model = await discover_model(session, target, base_headers[cfg.tenants[0].name])
        maker = _BodyMaker(cfg.endpoint, cfg.prompt_format, model)
        maker.chat_overhead_tokens = count_tokens(render_chat([{"role": "user", "content": ""}]))
        sem = asyncio.Semaphore(cfg.max_concurrency)
        tasks: set[asyncio.Task[None]] = set()

        async def one(i: int, req: TraceRequest, raw: _Raw) -> None:
            try:
                headers = {**base_headers[raw.tenant], "x-request-id": f"lg-{run_id}-{i}"}
                await _send(session, url, headers, maker.body(req, i + cfg.prompt_offset), raw, timeout_wall_s, errors)
            except Exception as e:  # a bug here must not pass for a wall-limit cut
                raw.outcome, raw.reason = FAILED, f"client-{type(e).__name__}"
                errors.setdefault(raw.reason, _short(repr(e)))
            finally:
                sem.release()
                progress.done(raw.outcome)

        async def dispatch() -> None:
            for i, (req, tenant) in enumerate(zip(trace, chosen, strict=True)):
                sched = t0 + req.arrival_ms * scale / 1000.0
                raw = _Raw(tenant.name, sched, req.prompt_tokens, max(1, req.output_tokens))
                raws.append(raw)
                delay = sched - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                await sem.acquire()
                task = asyncio.create_task(one(i, req, raw))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            while tasks:
                await asyncio.gather(*list(tasks), return_exceptions=True)

        t0 = time.monotonic()
        try:
            async with asyncio.timeout(cfg.max_wall_s):
                await dispatch()
        except TimeoutError:
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(*list(tasks), return_exceptions=True)
        progress.close()
    wall_s = time.monotonic() - wall_start
    # requests the wall limit cut off: started -> wall-limit, never started -> not-sent
    for i, req in enumerate(trace):
        if i >= len(raws):
            sched = t0 + req.arrival_ms * scale / 1000.0
            raws.append(_Raw(chosen[i].name, sched, req.prompt_tokens, max(1, req.output_tokens)))
        raw = raws[i]
        if raw.outcome is None:
            raw.outcome = FAILED
            raw.reason = "wall-limit" if raw.sent_s is not None else "not-sent"
    records = [_to_record(r, t0, scale) for r in raws]
    ends = [r.end_s for r in raws if r.end_s is not None]
    last_s = max(ends) if ends else time.monotonic()
    duration_s = max((last_s - t0) / scale, max(r.arrival_ms for r in trace) / 1000.0, 1e-3)
    return ReplayResult(records, duration_s, wall_s, scale, model, errors, run_id, t0)


DEFAULT_SLO = Slo(ttft_ms=500.0, tpot_ms=50.0)
"""SLO used for attainment when neither a config nor --ttft-ms/--tpot-ms gives one (simulated ms)."""


def resolve_tenants(
    tenants_spec: str | None,
    api_keys: Mapping[str, str],
    config: str | Path | None,
    ttft_ms: float | None,
    tpot_ms: float | None,
) -> tuple[list[TenantSpec], dict[str, Slo], str]:
    """Tenants (weights, keys) and their SLOs from the replay flags.

    Tenants: ``tenants_spec`` (``acme:3,beta:1``), else the config's tenants with their weights,
    else one tenant ``default``. SLOs: the config's class of each tenant, each target overridden
    by ``ttft_ms``/``tpot_ms`` when given; :data:`DEFAULT_SLO` fills what is still missing.

    Returns:
        (tenants, tenant -> Slo, a short text saying where the SLOs came from).

    Raises:
        ValueError: on a bad spec or config.
    """
    cfg_weights: dict[str, float] = {}
    cfg_slos: dict[str, Slo] = {}
    if config is not None:
        cfg_weights, cfg_slos = tenants_from_config(config)
    if tenants_spec:
        pairs = parse_tenants(tenants_spec)
    elif cfg_weights:
        pairs = list(cfg_weights.items())
    else:
        pairs = [("default", 1.0)]
    tenants = [TenantSpec(name, w, api_keys.get(name)) for name, w in pairs]
    slos: dict[str, Slo] = {}
    sources: set[str] = set()
    for t in tenants:
        base = cfg_slos.get(t.name)
        sources.add("config" if base is not None else "default")
        base = base or DEFAULT_SLO
        slos[t.name] = Slo(
            ttft_ms if ttft_ms is not None else base.ttft_ms, tpot_ms if tpot_ms is not None else base.tpot_ms
        )
    if ttft_ms is not None or tpot_ms is not None:
        sources.add("flags")
    return tenants, slos, "+".join(sorted(sources))
