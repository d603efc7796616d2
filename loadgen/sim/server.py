"""HTTP shell of the simulated engine: vLLM's OpenAI-compatible API and /metrics over aiohttp.

The pure core (:mod:`loadgen.sim.engine`) decides batches and step times; this module owns time
and I/O. One engine-loop task runs while work exists: take a step at the simulated time ``t``,
sleep until ``t + duration_ms`` (simulated ms, via :class:`fairbatch_common.clock.Clock`), then
deliver the step's tokens to per-request mailboxes; with no work it waits on an event.

Steps are laid end to end on a simulated timeline (the next step starts where the previous one
ended), so sleep overshoot does not add up, and a step's tokens are not delivered before its
end on that timeline (within 0.1 ms of wall time). The engine may catch up on lost time, but only
by a little: when the clock runs more than min(2 wall ms, a / 2) simulated ms ahead of the
timeline (``_MAX_LAG_WALL_S``, a from the profile), the timeline jumps to the
present instead of bursting steps back to back. So a client never sees inter-token gaps shorter
than the model's by more than that, and an overloaded process (or a time scale so small that a
step lasts less than the ~1 ms timer granularity) runs slower than the model, never faster.

Each request's mailbox is bounded by construction: a count of tokens not yet written plus a
finished flag and an :class:`asyncio.Event`. The engine loop never blocks on a slow client; the
client's handler writes every pending token at once (one SSE event per token, as vLLM does
unless it is overloaded). Client disconnect (a failed write, the handler cancelled by aiohttp, or
the transport gone) aborts the request in the engine, which frees its KV blocks at once.

Sampling parameters (``n``, ``seed``, ``stop``, ``stop_token_ids``, ``min_tokens``, ``ignore_eos``,
``logprobs``/``top_logprobs``, ``response_format``, a forced function in ``tool_choice``) are
decided by :mod:`loadgen.sim.sampling` when the request arrives: each choice is one engine sequence
exactly as long as its output. A request without any of them keeps the legacy fast path
(``" tok"`` per token, pre-encoded chunk templates).

Formats follow vLLM 0.x's OpenAI server (``vllm/entrypoints/openai/serving_completion.py``,
``serving_chat.py``); metric names follow vLLM 0.32 (see docs/architecture.md).

Run: ``python -m loadgen.sim.server --port 8000 --profile llama-3-8b-a100 --time-scale 1``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import signal
import sys
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from loadgen.sim.engine import EngineConfig, SimEngine, StepResult
from loadgen.sim.engine_time import POLICY, engine_label, load_engine_time_model
from loadgen.sim.step_log import write_step
from loadgen.sim.sampling import (EOS_ID, VOCAB, VOCAB_ID_BASE, ChoiceOutput, Sampling, SamplingError,
                                  chat_logprob_entry, completion_logprobs, generate, parse_sampling, token_id)
from loadgen.sim.prefix_cache import block_hashes_from_bytes, block_hashes_from_tokens
from loadgen.sim.tokenizer import BYTES_PER_TOKEN, OUTPUT_TOKEN_TEXT, count_tokens, render_chat
from fairbatch_common.aio import stop_task, wait_event
from fairbatch_common.clock import Clock
from replica_agent.policy.batching import POLICIES, PolicyConfig, make_policy
from replica_agent.policy.profiles import DEFAULT_PROFILE, DEFAULT_VARIANT, load_profile, vllm_serve_batch_defaults
from fairbatch_common.runtime import run, setup_logging

log = logging.getLogger("loadgen.sim.server")

DEFAULT_COMPLETION_MAX_TOKENS = 16
DEFAULT_CHAT_MAX_TOKENS = 256
_MAX_LAG_WALL_S = 0.002
_MIN_SLEEP_WALL_S = 0.001  # shorter sleeps return at once on uvloop: sleep this long instead
_NEGLIGIBLE_WALL_S = 0.0001
_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
_DONE = b"data: [DONE]\n\n"

# vLLM's histogram buckets (vllm/v1/metrics/loggers.py), in seconds.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)  # fmt: skip
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


@dataclass(slots=True)
class SimServerConfig:
    """Settings of one simulated engine (the CLI flags of docs/architecture.md).

    Attributes:
        host, port: listen address.
        profile, variant: GPU profile (time model and default KV capacity), see replica_agent.policy.profiles.
        time_scale: wall seconds per simulated second (> 0).
        max_num_batched_tokens: token cap of one iteration (tokens); None -> what ``vllm serve``
            uses on the profile's GPU (``replica_agent.policy.profiles.vllm_serve_batch_defaults``:
            A100 2048, H100/H200 8192).
        max_num_seqs: cap on running requests; None -> ``vllm serve``'s default on the GPU (A100
            256, H100/H200 1024).
        block_size: tokens per KV block.
        num_gpu_blocks: KV blocks; None -> profile kv_capacity_tokens // block_size.
        max_model_len: cap on prompt + output tokens (tokens).
        served_model_name: model name in responses; None -> the profile name.
        policy: batching policy name (see replica_agent.policy.batching.POLICIES).
        seed: seeds the generator of request ids (when no X-Request-Id is given).
        log_level: logging level name.
        default_ttft_ms, default_tpot_ms: SLO (ms) of requests without ``x-fairbatch-ttft-ms`` /
            ``x-fairbatch-tpot-ms`` headers (the replica agent sets them from the request's class).
        step_log: path of a per-step JSONL log (loadgen/sim/step_log.py), None = off.
        decode_guard_ms: FairBatching's decode guard (ms >= 0; ``PolicyConfig.decode_guard_ms``, the
            plugin's ``FAIRBATCH_DECODE_GUARD_MS``); 0 = none.
        engine_time_model: the engine's own step time (loadgen/sim/engine_time.py): a JSON file, a
            shipped profile name, ``policy`` (step time = the profile's time model, the default here), or
            None = the profile's shipped file (``policy`` when it has none).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    profile: str = DEFAULT_PROFILE
    variant: str = DEFAULT_VARIANT
    time_scale: float = 1.0
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    block_size: int = 16
    num_gpu_blocks: int | None = None
    max_model_len: int = 32768
    served_model_name: str | None = None
    policy: str = "vllm-default"
    seed: int = 0
    log_level: str = "INFO"
    default_ttft_ms: float = 1000.0
    default_tpot_ms: float = 100.0
    step_log: str | None = None
    engine_time_model: str | None = POLICY
    decode_guard_ms: float = 0.0


class RequestError(Exception):
    """A client error answered as OpenAI error JSON.

    Attributes:
        status: HTTP status (400 or 404).
        message: human-readable reason.
        param: offending request field, if any.
    """

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_response(
    message: str, status: int = 400, param: str | None = None, request_id: str | None = None
) -> web.Response:
    """OpenAI error JSON as vLLM sends it: ``{"error": {"message", "type", "param", "code"}}``.

    ``request_id`` (the client's X-Request-Id) is echoed in the response header when given.
    """
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    headers = {"X-Request-Id": request_id} if request_id else None
    return web.Response(status=status, text=_JSON.encode(body), content_type="application/json", headers=headers)


@dataclass(slots=True)
class _Mailbox:
    """Tokens of one request handed from the engine loop to its handler (bounded: a counter)."""

    event: asyncio.Event = field(default_factory=asyncio.Event)
    pending: int = 0
    finished: bool = False
    error: str | None = None


@dataclass(slots=True)
class _Parsed:
    """A validated generation request."""

    prompt_tokens: int
    max_tokens: int
    stream: bool
    include_usage: bool
    ttft_ms: float | None = None  # from vllm_xargs.fairbatch_ttft_ms (as the vLLM plugin reads it)
    tpot_ms: float | None = None
    sampling: Sampling = field(default_factory=Sampling)  # n, seed, stop, logprobs, ... (loadgen/sim/sampling.py)
    block_hashes: list[int] = field(default_factory=list)  # the prompt's full-block hashes (prefix caching)


class _EngineCollector:
    """Prometheus collector reading the engine's gauges and counters at scrape time (no per-token cost)."""

    def __init__(self, sim: SimServer) -> None:
        self._sim = sim

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        sim = self._sim
        eng = sim.engine
        names = ["model_name", "engine"]
        values = [sim.model_name, "0"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, value)
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", eng.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", eng.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", eng.kv_usage)
        info_labels = ["engine", "block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching"]
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=info_labels)
        info.add_metric(["0", str(eng.config.block_size), str(eng.config.num_gpu_blocks), "auto",
                         str(eng.config.enable_prefix_caching)], 1.0)  # fmt: skip
        yield info
        cnt = eng.counters
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", cnt.num_preemptions)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", cnt.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", cnt.generation_tokens)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      eng.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      eng.prefix_cache_hits)
        ok = CounterMetricFamily(
            "vllm:request_success", "Count of successfully processed requests.", labels=[*names, "finished_reason"]
        )
        ok.add_metric([*values, "length"], cnt.request_success)
        yield ok


class SimServer:
    """State of one simulated engine process: engine, clock, mailboxes, metrics, engine loop.

    Args:
        config: server settings.

    Raises:
        KeyError: unknown profile or policy.
        ValueError: invalid engine settings.
    """

    def __init__(self, config: SimServerConfig) -> None:
        self.config = config
        profile = load_profile(config.profile, config.variant)
        num_blocks = config.num_gpu_blocks
        if num_blocks is None:
            num_blocks = profile.kv_capacity_tokens // config.block_size
        self.model_name = config.served_model_name or profile.name
        batch = vllm_serve_batch_defaults(profile.gpu).resolve(config.max_num_batched_tokens, config.max_num_seqs)
        self.clock = Clock(config.time_scale)
        self.engine_time = load_engine_time_model(config.engine_time_model, profile.name)
        self.engine = SimEngine(
            EngineConfig(
                time_model=profile.time_model,
                num_gpu_blocks=num_blocks,
                block_size=config.block_size,
                max_num_batched_tokens=batch.max_num_batched_tokens,
                max_num_seqs=batch.max_num_seqs,
                max_model_len=config.max_model_len,
                engine_time=self.engine_time,
            ),
            make_policy(config.policy, PolicyConfig(config.default_ttft_ms, config.default_tpot_ms,
                                                    decode_guard_ms=config.decode_guard_ms)),
            noise_stream=config.seed,
        )
        self._step_log: TextIO | None = None
        self._rng = random.Random(config.seed)
        self._boxes: dict[str, _Mailbox] = {}
        self._wake = asyncio.Event()
        self._created_s = self.clock.unix_ms() // 1000
        self._dup_seq = 0
        self.failed: str | None = None
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(self))
        labels = ("model_name", "engine")
        self._ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            labels, buckets=_TTFT_BUCKETS, registry=self.registry,
        ).labels(self.model_name, "0")  # fmt: skip
        self._itl = Histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            labels, buckets=_ITL_BUCKETS, registry=self.registry,
        ).labels(self.model_name, "0")  # fmt: skip
        self._e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
            labels, buckets=_E2E_BUCKETS, registry=self.registry,
        ).labels(self.model_name, "0")  # fmt: skip

    # ---- engine loop ----------------------------------------------------------------------------

    async def engine_loop(self) -> None:
        """Step the engine while work exists; sleep the predicted step time; deliver tokens.

        If a step raises (a policy bug), every waiting client gets an error and later requests
        are answered 503, instead of hanging.
        """
        try:
            await self._engine_loop()
        except Exception:
            log.exception("engine loop failed; answering 503 from now on")
            self.failed = "engine loop failed"
            for box in self._boxes.values():
                box.error = self.failed
                box.event.set()
            raise

    async def _engine_loop(self) -> None:
        engine, clock = self.engine, self.clock
        max_lag_ms = min(clock.to_sim_ms(_MAX_LAG_WALL_S), engine.config.time_model.a_ms / 2)
        sim_now = clock.now_ms()
        while True:
            if not engine.has_work():
                self._wake.clear()
                await self._wake.wait()
                sim_now = clock.now_ms()
                continue
            now = clock.now_ms()
            lag_ms = 0.0
            if now > sim_now + max_lag_ms:
                lag_ms = now - sim_now  # time lost: the process fell behind its timeline
                sim_now = now
            result = engine.step(sim_now)
            if not result.batch.items:
                # Nothing schedulable (cannot happen with the shipped policy); do not spin.
                self._wake.clear()
                await wait_event(self._wake, 0.01)
                sim_now = clock.now_ms()
                continue
            delay_s = clock.to_wall_s(result.end_ms - clock.now_ms())
            if delay_s > _NEGLIGIBLE_WALL_S:
                await asyncio.sleep(max(delay_s, _MIN_SLEEP_WALL_S))
            else:
                await asyncio.sleep(0)  # let handlers run
            sim_now = result.end_ms
            if self._step_log is not None:
                write_step(self._step_log, result, lag_ms)
            self._deliver(result)

    def _deliver(self, result: StepResult) -> None:
        boxes = self._boxes
        for out in result.outputs:
            if out.ttft_ms is not None:
                self._ttft.observe(max(0.0, out.ttft_ms) / 1000.0)
            elif out.itl_ms is not None:
                self._itl.observe(out.itl_ms / 1000.0)
            if out.e2e_ms is not None:
                self._e2e.observe(out.e2e_ms / 1000.0)
            box = boxes.get(out.request_id)
            if box is None:
                continue
            box.pending += 1
            if out.finished:
                box.finished = True
            box.event.set()

    async def _lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        if self.config.step_log:
            # line-buffered: `fairbatch-agent calibrate` can read the log while the engine runs
            self._step_log = open(self.config.step_log, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
        task = asyncio.create_task(self.engine_loop(), name="sim-engine-loop")
        log.info(
            "sim engine up: model=%s blocks=%d block_size=%d max_num_batched_tokens=%d max_num_seqs=%d "
            "time_scale=%g policy=%s engine step time: %s",
            self.model_name, self.engine.config.num_gpu_blocks, self.engine.config.block_size,
            self.engine.config.max_num_batched_tokens, self.engine.config.max_num_seqs,
            self.config.time_scale, self.config.policy, engine_label(self.engine_time),
        )  # fmt: skip
        try:
            yield
        finally:
            await stop_task(task)  # an engine-loop failure was already logged
            for box in self._boxes.values():
                box.error = "engine shutting down"
                box.event.set()
            if self._step_log is not None:
                self._step_log.close()
                self._step_log = None

    # ---- requests -------------------------------------------------------------------------------

    def _new_id(self) -> str:
        return f"{self._rng.getrandbits(128):032x}"

    def _engine_id(self, response_id: str) -> str:
        """Engine-unique id: the response id, suffixed when a client reuses an X-Request-Id."""
        if response_id not in self._boxes and response_id not in self.engine.requests:
            return response_id
        self._dup_seq += 1
        return f"{response_id}#{self._dup_seq}"

    @staticmethod
    async def _read_json(request: web.Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.read())
        except (ValueError, UnicodeDecodeError) as e:
            raise RequestError(f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise RequestError("request body must be a JSON object")
        return body

    def _check_common(self, body: dict[str, Any], prompt_tokens: int, default_max: int, chat: bool) -> _Parsed:
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise RequestError(f"The model `{model}` does not exist.", status=404, param="model")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestError("'stream' must be a boolean", param="stream")
        opts = body.get("stream_options")
        if opts is not None and not isinstance(opts, dict):
            raise RequestError("'stream_options' must be an object", param="stream_options")
        include_usage = bool(opts.get("include_usage", False)) if opts else False
        limit = self.config.max_model_len
        if prompt_tokens < 1:
            raise RequestError("the prompt is empty", param="prompt")
        if prompt_tokens >= limit:
            raise RequestError(
                f"This model's maximum context length is {limit} tokens. However, your request has "
                f"{prompt_tokens} input tokens. Please reduce the length of the input messages.",
                param="messages" if chat else "prompt",
            )
        key = "max_tokens"
        max_tokens = body.get("max_tokens")
        if chat and body.get("max_completion_tokens") is not None:  # vLLM: max_completion_tokens wins
            key, max_tokens = "max_completion_tokens", body["max_completion_tokens"]
        if max_tokens is None:
            max_tokens = min(default_max, limit - prompt_tokens)
        elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
            raise RequestError(f"'{key}' must be an integer, got {max_tokens!r}", param=key)
        elif max_tokens < 1:
            raise RequestError(f"'{key}' must be at least 1, got {max_tokens}", param=key)
        elif prompt_tokens + max_tokens > limit:
            raise RequestError(
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum "
                f"context length is {limit} tokens and your request has {prompt_tokens} input tokens "
                f"({max_tokens} > {limit} - {prompt_tokens}).",
                param=key,
            )
        xargs = body.get("vllm_xargs")
        xargs = xargs if isinstance(xargs, dict) else {}
        try:
            sampling = parse_sampling(body, chat, max_tokens)
        except SamplingError as e:
            raise RequestError(str(e), param=e.param) from None
        return _Parsed(prompt_tokens, max_tokens, stream, include_usage,
                       _positive_ms(xargs.get("fairbatch_ttft_ms")), _positive_ms(xargs.get("fairbatch_tpot_ms")),
                       sampling)

    def _block_hashes(self, prompt: Any) -> list[int]:
        """The prompt's full-block hashes for the prefix cache (loadgen/sim/prefix_cache.py): text
        hashed per block of ``block_size`` 4-byte tokens, token ids per block of ids; [] when the
        engine runs without prefix caching. Call after the prompt was validated."""
        cfg = self.engine.config
        if not cfg.enable_prefix_caching:
            return []
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return block_hashes_from_bytes(prompt.encode("utf-8"), BYTES_PER_TOKEN, cfg.block_size)
        return block_hashes_from_tokens(prompt, cfg.block_size)

    @staticmethod
    def _prompt_tokens(prompt: Any) -> int:
        """Tokens of a completions ``prompt``: string, [string], token ids, or [token ids]."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return count_tokens(prompt)
        if isinstance(prompt, list) and prompt:
            for t in prompt:
                if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                    raise RequestError(
                        "'prompt' must be a string, a list with one string, a list of token ids (ints >= 0) "
                        "or a list with one list of token ids; batched prompts are not supported",
                        param="prompt",
                    )
            return len(prompt)
        if prompt is None:
            raise RequestError("'prompt' is required", param="prompt")
        raise RequestError("'prompt' must be a non-empty string or token-id list", param="prompt")

    async def handle_completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions."""
        try:
            body = await self._read_json(request)
            parsed = self._check_common(
                body, self._prompt_tokens(body.get("prompt")), DEFAULT_COMPLETION_MAX_TOKENS, chat=False
            )
            parsed.block_hashes = self._block_hashes(body.get("prompt"))
        except RequestError as e:
            return error_response(e.message, e.status, e.param, request.headers.get("X-Request-Id"))
        return await self._generate(request, parsed, chat=False)

    async def handle_chat(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions."""
        try:
            body = await self._read_json(request)
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise RequestError("'messages' must be a non-empty list", param="messages")
            cont = bool(body.get("continue_final_message", False))
            if cont and body.get("add_generation_prompt", True):  # vLLM's own check
                raise RequestError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                                   param="continue_final_message")
            try:
                text = render_chat(messages, continue_final_message=cont)
            except (ValueError, AttributeError) as e:
                raise RequestError(f"invalid 'messages': {e}", param="messages") from None
            parsed = self._check_common(body, count_tokens(text), DEFAULT_CHAT_MAX_TOKENS, chat=True)
            parsed.block_hashes = self._block_hashes(text)
        except RequestError as e:
            return error_response(e.message, e.status, e.param, request.headers.get("X-Request-Id"))
        return await self._generate(request, parsed, chat=True)

    async def _generate(self, request: web.Request, parsed: _Parsed, chat: bool) -> web.StreamResponse:
        header_id = request.headers.get("X-Request-Id")
        base_id = header_id or self._new_id()
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{base_id}"
        engine_id = self._engine_id(response_id)
        if self.failed is not None:
            return error_response(self.failed, 503, request_id=header_id)
        ttft_ms = _header_ms(request, "x-fairbatch-ttft-ms") or parsed.ttft_ms
        tpot_ms = _header_ms(request, "x-fairbatch-tpot-ms") or parsed.tpot_ms
        if log.isEnabledFor(logging.DEBUG):  # lets tests see the trace context and SLO that reached the engine
            log.debug("request %s traceparent %s slo %s/%s", engine_id, request.headers.get("traceparent", "-"),
                      ttft_ms, tpot_ms)
        if not parsed.sampling.plain:
            return await self._generate_sampled(request, parsed, chat, engine_id, response_id, base_id,
                                                header_id, ttft_ms, tpot_ms)  # fmt: skip
        try:
            self.engine.add_request(
                engine_id, parsed.prompt_tokens, parsed.max_tokens, self.clock.now_ms(), ttft_ms, tpot_ms,
                parsed.block_hashes,
            )
        except ValueError as e:
            return error_response(str(e), 400, request_id=header_id)
        box = _Mailbox()
        self._boxes[engine_id] = box
        self._wake.set()
        headers = {"X-Request-Id": base_id}
        try:
            if parsed.stream:
                return await self._stream(request, box, parsed, response_id, headers, chat)
            return await self._whole(request, box, parsed, response_id, headers, chat)
        finally:
            self._boxes.pop(engine_id, None)
            if not box.finished and self.engine.abort(engine_id):
                log.info("aborted %s (client gone)", engine_id)

    async def _whole(
        self, request: web.Request, box: _Mailbox, parsed: _Parsed, response_id: str,
        headers: dict[str, str], chat: bool,
    ) -> web.StreamResponse:  # fmt: skip
        while not box.finished:
            await box.event.wait()
            box.event.clear()
            if box.error is not None:
                return error_response(box.error, 503)
            if request.transport is None:
                log.debug("client gone while waiting for %s", response_id)
                return web.Response(status=499)  # never sent; the caller aborts the request
        n = parsed.max_tokens
        text = OUTPUT_TOKEN_TEXT * n
        usage = {"prompt_tokens": parsed.prompt_tokens, "total_tokens": parsed.prompt_tokens + n,
                 "completion_tokens": n, "prompt_tokens_details": None}  # fmt: skip
        created = self.clock.unix_ms() // 1000
        body: dict[str, Any]
        if chat:
            body = {
                "id": response_id, "object": "chat.completion", "created": created, "model": self.model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []},
                             "logprobs": None, "finish_reason": "length", "stop_reason": None}],
                "usage": usage, "prompt_logprobs": None,
            }  # fmt: skip
        else:
            body = {
                "id": response_id, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length",
                             "stop_reason": None, "prompt_logprobs": None}],
                "usage": usage,
            }  # fmt: skip
        return web.Response(text=_JSON.encode(body), content_type="application/json", headers=headers)

    async def _stream(
        self, request: web.Request, box: _Mailbox, parsed: _Parsed, response_id: str,
        headers: dict[str, str], chat: bool,
    ) -> web.StreamResponse:  # fmt: skip
        created = self.clock.unix_ms() // 1000
        head = {"id": response_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": self.model_name}  # fmt: skip

        def event(obj: dict[str, Any]) -> bytes:
            return b"data: " + _JSON.encode(obj).encode() + b"\n\n"

        if chat:
            first = event({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]})  # fmt: skip
            mid = event({**head, "choices": [{"index": 0, "delta": {"content": OUTPUT_TOKEN_TEXT},
                                              "logprobs": None, "finish_reason": None}]})  # fmt: skip
            last = event({**head, "choices": [{"index": 0, "delta": {"content": OUTPUT_TOKEN_TEXT},
                                               "logprobs": None, "finish_reason": "length",
                                               "stop_reason": None}]})  # fmt: skip
        else:
            first = b""
            mid = event({**head, "choices": [{"index": 0, "text": OUTPUT_TOKEN_TEXT, "logprobs": None,
                                              "finish_reason": None, "stop_reason": None}]})  # fmt: skip
            last = event({**head, "choices": [{"index": 0, "text": OUTPUT_TOKEN_TEXT, "logprobs": None,
                                               "finish_reason": "length", "stop_reason": None}]})  # fmt: skip
        resp = web.StreamResponse(
            headers={**headers, "Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        try:
            return await self._stream_tokens(request, resp, box, parsed, head, (first, mid, last))
        except ConnectionError:
            log.debug("client gone during the stream of %s", response_id)
            return resp  # the caller aborts the request; nothing more can be written

    async def _stream_tokens(
        self, request: web.Request, resp: web.StreamResponse, box: _Mailbox, parsed: _Parsed,
        head: dict[str, Any], templates: tuple[bytes, bytes, bytes],
    ) -> web.StreamResponse:  # fmt: skip
        """Write each token as one pre-encoded SSE event as it arrives, then usage and [DONE]."""
        first, mid, last = templates

        def event(obj: dict[str, Any]) -> bytes:
            return b"data: " + _JSON.encode(obj).encode() + b"\n\n"

        sent = 0
        while True:
            await box.event.wait()
            box.event.clear()
            if box.error is not None:
                with contextlib.suppress(ConnectionError):
                    await resp.write(event({"error": {"message": box.error, "type": "InternalServerError",
                                                      "param": None, "code": 503}}))  # fmt: skip
                return resp
            n = box.pending
            box.pending = 0
            if n:
                if request.transport is None:
                    raise ConnectionResetError("client disconnected")
                data = first if sent == 0 else b""
                data += mid * (n - 1) + last if box.finished else mid * n
                sent += n
                await resp.write(data)  # ConnectionResetError when the client is gone -> abort
            if box.finished:
                break
        tail = _DONE
        if parsed.include_usage:
            usage = {"prompt_tokens": parsed.prompt_tokens, "total_tokens": parsed.prompt_tokens + sent,
                     "completion_tokens": sent}  # fmt: skip
            tail = event({**head, "choices": [], "usage": usage}) + _DONE
        await resp.write(tail)
        await resp.write_eof()
        return resp

    # ---- requests with sampling parameters (n, seed, stop, logprobs, structured output, tools) ----

    async def _generate_sampled(
        self, request: web.Request, parsed: _Parsed, chat: bool, engine_id: str, response_id: str, base_id: str,
        header_id: str | None, ttft_ms: float | None, tpot_ms: float | None,
    ) -> web.StreamResponse:  # fmt: skip
        """One engine sequence per choice, each as long as that choice's output (vLLM fans ``n``
        out to n child requests the same way; with prefix caching each child looks the
        prompt up when it is added, before any is scheduled, so only blocks of earlier requests hit). The handler waits on one event shared by the children's mailboxes."""
        sp = parsed.sampling
        outputs = generate(sp)
        event = asyncio.Event()
        ids = [engine_id if i == 0 else f"{engine_id}#c{i}" for i in range(sp.n)]
        boxes = [_Mailbox(event=event) for _ in range(sp.n)]
        added: list[str] = []
        try:
            for eid, out in zip(ids, outputs, strict=True):
                self.engine.add_request(eid, parsed.prompt_tokens, len(out.tokens), self.clock.now_ms(), ttft_ms, tpot_ms,
                                        parsed.block_hashes)  # fmt: skip
                added.append(eid)
        except ValueError as e:
            for eid in added:
                self.engine.abort(eid)
            return error_response(str(e), 400, request_id=header_id)
        for eid, box in zip(ids, boxes, strict=True):
            self._boxes[eid] = box
        self._wake.set()
        headers = {"X-Request-Id": base_id}
        tool_ids = [f"chatcmpl-tool-{self._new_id()}" for _ in range(sp.n)] if sp.tool_name else []
        try:
            if parsed.stream:
                return await self._stream_sampled(request, boxes, event, parsed, outputs, response_id, headers,
                                                  chat, tool_ids)  # fmt: skip
            return await self._whole_sampled(request, boxes, event, parsed, outputs, response_id, headers, chat,
                                             tool_ids)  # fmt: skip
        finally:
            for eid, box in zip(ids, boxes, strict=True):
                self._boxes.pop(eid, None)
                if not box.finished and self.engine.abort(eid):
                    log.info("aborted %s (client gone)", eid)

    @staticmethod
    def _usage(parsed: _Parsed, outputs: list[ChoiceOutput]) -> dict[str, int]:
        """vLLM's usage: the prompt once, the completion tokens of every choice (EOS and stop tokens included)."""
        n = sum(len(o.tokens) for o in outputs)
        return {"prompt_tokens": parsed.prompt_tokens, "total_tokens": parsed.prompt_tokens + n, "completion_tokens": n}

    async def _whole_sampled(
        self, request: web.Request, boxes: list[_Mailbox], event: asyncio.Event, parsed: _Parsed,
        outputs: list[ChoiceOutput], response_id: str, headers: dict[str, str], chat: bool, tool_ids: list[str],
    ) -> web.StreamResponse:  # fmt: skip
        """vLLM's non-stream answer (serving_chat / serving_completion full generators)."""
        sp = parsed.sampling
        while not all(b.finished for b in boxes):
            await event.wait()
            event.clear()
            if any(b.error is not None for b in boxes):
                return error_response(next(b.error for b in boxes if b.error is not None), 503)
            if request.transport is None:
                return web.Response(status=499)
        choices: list[dict[str, Any]] = []
        for out in outputs:
            if chat:
                if sp.tool_name:
                    message: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": [
                        {"id": tool_ids[out.index], "type": "function",
                         "function": {"name": sp.tool_name, "arguments": out.text}}]}  # fmt: skip
                else:
                    message = {"role": "assistant", "content": out.text, "tool_calls": []}
                logprobs = None if sp.logprobs is None else {
                    "content": [chat_logprob_entry(t, sp.logprobs) for t in out.tokens]}  # fmt: skip
                choices.append({"index": out.index, "message": message, "logprobs": logprobs,
                                "finish_reason": out.finish_reason, "stop_reason": out.stop_reason})  # fmt: skip
            else:
                logprobs = None if sp.logprobs is None else completion_logprobs(out.tokens, sp.logprobs, 0)
                choices.append({"index": out.index, "text": out.text, "logprobs": logprobs,
                                "finish_reason": out.finish_reason, "stop_reason": out.stop_reason,
                                "prompt_logprobs": None})  # fmt: skip
        usage = {**self._usage(parsed, outputs), "prompt_tokens_details": None}
        created = self.clock.unix_ms() // 1000
        if chat:
            body = {"id": response_id, "object": "chat.completion", "created": created, "model": self.model_name,
                    "choices": choices, "usage": usage, "prompt_logprobs": None}  # fmt: skip
        else:
            body = {"id": response_id, "object": "text_completion", "created": created, "model": self.model_name,
                    "choices": choices, "usage": usage}  # fmt: skip
        return web.Response(text=_JSON.encode(body), content_type="application/json", headers=headers)

    def _sampled_chunk(
        self, head: dict[str, Any], sp: Sampling, out: ChoiceOutput, j: int, chat: bool, tool_ids: list[str],
        offset: int = 0,
    ) -> dict[str, Any]:  # fmt: skip
        """The stream chunk of token ``j`` of choice ``out`` (vLLM: one choice per chunk); ``offset`` =
        characters of the choice's tokens before j (completions ``logprobs.text_offset``)."""
        tok = out.tokens[j]
        delta_text = out.deltas[j]
        last = j == len(out.tokens) - 1
        if chat:
            if sp.tool_name:
                fn: dict[str, Any] = {"arguments": delta_text}
                call: dict[str, Any] = {"index": out.index, "function": fn}
                if j == 0:
                    call = {"id": tool_ids[out.index], "type": "function", "index": out.index,
                            "function": {"name": sp.tool_name, "arguments": delta_text}}  # fmt: skip
                delta: dict[str, Any] = {"tool_calls": [call]}
            else:
                delta = {"content": delta_text}
            logprobs = None if sp.logprobs is None else {"content": [chat_logprob_entry(tok, sp.logprobs)]}
            choice: dict[str, Any] = {"index": out.index, "delta": delta, "logprobs": logprobs, "finish_reason": None}
            if last:
                choice["finish_reason"] = "tool_calls" if sp.tool_name else out.finish_reason
                choice["stop_reason"] = out.stop_reason
        else:
            logprobs = None if sp.logprobs is None else completion_logprobs([tok], sp.logprobs, offset)
            choice = {"index": out.index, "text": delta_text, "logprobs": logprobs,
                      "finish_reason": out.finish_reason if last else None,
                      "stop_reason": out.stop_reason if last else None}  # fmt: skip
        return {**head, "choices": [choice]}

    async def _stream_sampled(
        self, request: web.Request, boxes: list[_Mailbox], event: asyncio.Event, parsed: _Parsed,
        outputs: list[ChoiceOutput], response_id: str, headers: dict[str, str], chat: bool, tool_ids: list[str],
    ) -> web.StreamResponse:  # fmt: skip
        """vLLM's stream: chat first sends a role chunk per choice; then each token of each choice is
        one chunk (index = the choice) as the engine samples it; the last carries finish_reason and
        stop_reason; then the usage chunk (``include_usage``) and ``[DONE]``."""
        sp = parsed.sampling
        created = self.clock.unix_ms() // 1000
        head = {"id": response_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": self.model_name}  # fmt: skip

        def enc(obj: dict[str, Any]) -> bytes:
            return b"data: " + _JSON.encode(obj).encode() + b"\n\n"

        resp = web.StreamResponse(
            headers={**headers, "Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        sent = [0] * sp.n
        offsets = [0] * sp.n
        started = False
        try:
            while True:
                await event.wait()
                event.clear()
                err = next((b.error for b in boxes if b.error is not None), None)
                if err is not None:
                    with contextlib.suppress(ConnectionError):
                        await resp.write(enc({"error": {"message": err, "type": "InternalServerError",
                                                        "param": None, "code": 503}}))  # fmt: skip
                    return resp
                data = bytearray()
                for i, box in enumerate(boxes):
                    k, box.pending = box.pending, 0
                    if k and not started and chat:
                        for c in range(sp.n):
                            data += enc({**head, "choices": [{"index": c, "delta": {"role": "assistant", "content": ""},
                                                              "logprobs": None, "finish_reason": None}]})  # fmt: skip
                    started = started or k > 0
                    for j in range(sent[i], min(sent[i] + k, len(outputs[i].tokens))):
                        data += enc(self._sampled_chunk(head, sp, outputs[i], j, chat, tool_ids, offsets[i]))
                        offsets[i] += len(outputs[i].tokens[j].text)
                    sent[i] += k
                if data:
                    if request.transport is None:
                        raise ConnectionResetError("client disconnected")
                    await resp.write(bytes(data))
                if all(b.finished for b in boxes):
                    break
            tail = _DONE
            if parsed.include_usage:
                tail = enc({**head, "choices": [], "usage": self._usage(parsed, outputs)}) + _DONE
            await resp.write(tail)
            await resp.write_eof()
        except ConnectionError:
            log.debug("client gone during the stream of %s", response_id)
        return resp

    async def handle_health(self, request: web.Request) -> web.Response:
        """GET /health: 200, empty body."""
        return web.Response(status=200)

    async def handle_models(self, request: web.Request) -> web.Response:
        """GET /v1/models in vLLM's shape."""
        card = {"id": self.model_name, "object": "model", "created": self._created_s, "owned_by": "vllm",
                "root": self.config.profile, "parent": None, "max_model_len": self.config.max_model_len,
                "permission": []}  # fmt: skip
        return web.Response(text=_JSON.encode({"object": "list", "data": [card]}), content_type="application/json")

    async def handle_tokenize(self, request: web.Request) -> web.Response:
        """POST /tokenize in vLLM's shape: ``{"count", "max_model_len", "tokens", "token_strs"}``; the
        text (``prompt``, or ``messages`` rendered as for chat) cut in 4-byte pieces (sampling.token_id)."""
        try:
            body = await self._read_json(request)
            if isinstance(body.get("messages"), list):
                try:
                    text = render_chat(body["messages"])
                except (ValueError, AttributeError) as e:
                    raise RequestError(f"invalid 'messages': {e}", param="messages") from None
            elif isinstance(body.get("prompt"), str):
                text = body["prompt"]
            else:
                raise RequestError("'prompt' (a string) or 'messages' is required", param="prompt")
        except RequestError as e:
            return error_response(e.message, e.status, e.param)
        data = text.encode("utf-8")
        ids = [token_id(data[i : i + 4].decode("utf-8", errors="replace")) for i in range(0, len(data), 4)]
        out = {"count": len(ids), "max_model_len": self.config.max_model_len, "tokens": ids, "token_strs": None}
        return web.Response(text=_JSON.encode(out), content_type="application/json")

    async def handle_detokenize(self, request: web.Request) -> web.Response:
        """POST /detokenize: ``{"prompt": text}`` of vocabulary ids (sampling.VOCAB; EOS = "");
        other ids are 400 (the sim's piece ids are hashes, not invertible)."""
        try:
            body = await self._read_json(request)
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
                raise RequestError("'tokens' must be a list of integers", param="tokens")
            pieces = []
            for t in tokens:
                if t == EOS_ID:
                    pieces.append("")
                elif VOCAB_ID_BASE <= t < VOCAB_ID_BASE + len(VOCAB):
                    pieces.append(VOCAB[t - VOCAB_ID_BASE])
                else:
                    raise RequestError(f"token id {t} is out of vocabulary", param="tokens")
        except RequestError as e:
            return error_response(e.message, e.status, e.param)
        return web.Response(text=_JSON.encode({"prompt": "".join(pieces)}), content_type="application/json")

    async def handle_metrics(self, request: web.Request) -> web.Response:
        """GET /metrics: Prometheus text from this server's own registry."""
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


def _positive_ms(raw: object) -> float | None:
    """A positive finite ms value, or None when absent or malformed (the policy default applies)."""
    if raw is None or isinstance(raw, bool):
        return None
    try:
        v = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return v if 0 < v < float("inf") else None


def _header_ms(request: web.Request, name: str) -> float | None:
    """A positive finite ms value from header ``name``; None when absent or malformed (policy default applies)."""
    return _positive_ms(request.headers.get(name))


SIM_SERVER = web.AppKey("sim_server", SimServer)
"""App key under which :func:`build_app` stores the :class:`SimServer` (tests read the engine through it)."""


def build_app(config: SimServerConfig) -> web.Application:
    """The aiohttp application of one simulated engine; the engine loop runs while the app runs.

    Run it with ``web.AppRunner(app, handler_cancellation=True)`` so a disconnecting client's
    handler is cancelled at once (see :func:`serve`); without it disconnects are still noticed at
    the next token.

    Raises:
        KeyError: unknown profile or policy.
        ValueError: invalid engine settings.
    """
    sim = SimServer(config)
    app = web.Application()
    app[SIM_SERVER] = sim
    app.cleanup_ctx.append(sim._lifecycle)
    app.router.add_post("/v1/completions", sim.handle_completions)
    app.router.add_post("/v1/chat/completions", sim.handle_chat)
    app.router.add_get("/health", sim.handle_health)
    app.router.add_get("/v1/models", sim.handle_models)
    app.router.add_post("/tokenize", sim.handle_tokenize)
    app.router.add_post("/detokenize", sim.handle_detokenize)
    app.router.add_get("/metrics", sim.handle_metrics)
    return app


async def start_server(config: SimServerConfig) -> web.AppRunner:
    """Build the app and listen on ``config.host:config.port``; the caller ends it with ``runner.cleanup()``."""
    runner = web.AppRunner(build_app(config), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    log.info("listening on http://%s:%d", config.host, config.port)
    return runner


async def serve(config: SimServerConfig) -> None:
    """Serve until SIGINT or SIGTERM, then shut down cleanly."""
    runner = await start_server(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the sim-engine flags (docs/architecture.md) to ``parser`` (also used by ``fairbatch-loadgen sim-engine``)."""
    d = SimServerConfig()
    parser.add_argument("--host", default=d.host, help="listen address (default: %(default)s)")
    parser.add_argument("--port", type=int, default=d.port, help="listen port (default: %(default)s)")
    parser.add_argument("--profile", default=d.profile, help="GPU profile: time model a, b, c and KV capacity (default: %(default)s)")
    parser.add_argument("--variant", default=d.variant, help="fit variant of the profile")
    parser.add_argument("--time-scale", type=float, default=d.time_scale,
                        help="wall seconds per simulated second; 4 = four times slower than a GPU (default: %(default)s)")  # fmt: skip
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="token cap of one step, as vLLM's (default: vllm serve's on the profile's GPU: "
                             "A100 2048, H100/H200 8192)")  # fmt: skip
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="requests in one step at most (default: vllm serve's on the GPU: A100 256, H100/H200 1024)")
    parser.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    parser.add_argument("--num-gpu-blocks", type=int, default=None,
                        help="KV blocks (default: profile kv_capacity_tokens // block_size)")  # fmt: skip
    parser.add_argument("--max-model-len", type=int, default=d.max_model_len,
                        help="prompt + output tokens at most (default: %(default)s)")
    parser.add_argument("--served-model-name", default=None, help="default: the profile name")
    parser.add_argument("--policy", default=d.policy, choices=sorted(POLICIES),
                        help="batch-formation policy (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=d.seed,
                        help="seed of generated request ids, and the noise stream of --engine-time-model (default: %(default)s)")
    parser.add_argument("--log-level", default=d.log_level, help="DEBUG logs each request's trace context and SLO (default: %(default)s)")
    parser.add_argument("--default-ttft-ms", type=float, default=d.default_ttft_ms,
                        help="TTFT target of requests without an x-fairbatch-ttft-ms header")  # fmt: skip
    parser.add_argument("--default-tpot-ms", type=float, default=d.default_tpot_ms,
                        help="TPOT target of requests without an x-fairbatch-tpot-ms header")  # fmt: skip
    parser.add_argument("--decode-guard-ms", type=float, default=d.decode_guard_ms,
                        help="FairBatching plans each decode's deadline this many ms early, as the vLLM plugin's "
                             "FAIRBATCH_DECODE_GUARD_MS (default: %(default)s)")  # fmt: skip
    parser.add_argument("--step-log", default=None,
                        help="append one JSON line per step here: its features and measured time (for calibrate)")
    parser.add_argument("--engine-time-model", default=d.engine_time_model, metavar="FILE|policy",
                        help="the engine's own step time: a JSON file (docs/engine-time-model.md), a shipped profile "
                             "name (loadgen/data/engine_time/), or 'policy' = the profile's time model, which the "
                             "policies also plan with (default: %(default)s)")  # fmt: skip


def config_from_args(args: argparse.Namespace) -> SimServerConfig:
    """Turn parsed flags (from :func:`add_arguments`) into a config."""
    return SimServerConfig(
        host=args.host,
        port=args.port,
        profile=args.profile,
        variant=args.variant,
        time_scale=args.time_scale,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        max_model_len=args.max_model_len,
        served_model_name=args.served_model_name,
        policy=args.policy,
        seed=args.seed,
        log_level=args.log_level,
        default_ttft_ms=args.default_ttft_ms,
        default_tpot_ms=args.default_tpot_ms,
        step_log=args.step_log,
        engine_time_model=args.engine_time_model,
        decode_guard_ms=args.decode_guard_ms,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse flags, check the configuration, serve until a signal. Returns the exit code."""
    parser = argparse.ArgumentParser(prog="fairbatch-loadgen sim-engine", description="vLLM-compatible simulated engine")
    add_arguments(parser)
    args = parser.parse_args(argv)
    config = config_from_args(args)
    setup_logging(config.log_level)
    try:
        SimServer(config)  # fail fast on a bad profile or setting, before binding the port
    except (KeyError, ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
