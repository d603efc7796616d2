"""OpenTelemetry tracing set-up shared by the router and the agent.

Spans follow one request router -> agent -> engine; W3C trace context (``traceparent``) travels in
HTTP headers. Spans carry the OpenTelemetry semantic conventions for HTTP (``http.request.method``,
``url.path``, ``http.response.status_code``, ``error.type``) and GenAI (``gen_ai.operation.name``,
``gen_ai.request.model``, ``gen_ai.request.max_tokens``, ``gen_ai.usage.input_tokens`` /
``output_tokens``) beside fairbatch's own ``fairbatch.*`` keys; a server span whose answer is a 5xx,
or whose relay failed, has status ERROR (:func:`set_http_status`).

Export (:func:`export_settings`): the endpoint of ``--otlp-endpoint`` (router and agent; the
router's YAML ``telemetry.otlp_endpoint``), else the standard variables
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``; the protocol from
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL`` (``grpc``, the default, or
``http/protobuf``); ``OTEL_TRACES_EXPORTER=none`` turns export off unless an endpoint is given
explicitly. Headers (``OTEL_EXPORTER_OTLP_HEADERS``, ``..._TRACES_HEADERS``), TLS
(``OTEL_EXPORTER_OTLP_INSECURE``; else by the endpoint's scheme: ``http://`` plain, ``https://`` TLS),
timeouts and compression are read by the OTLP exporters themselves.

Without an endpoint the tracer is OpenTelemetry's no-op tracer: no span object is recorded, no id
is drawn, and a ``traceparent`` that came in is passed on unchanged (the no-op span carries its
parent's context). With one, spans are sampled ``ParentBased(TraceIdRatio(sample_ratio))``: a
request whose caller sampled it (or did not) keeps that decision, a root request is sampled with
probability ``sample_ratio``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagators.textmap import Getter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio
from opentelemetry.trace import Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()
PROTOCOLS = ("grpc", "http/protobuf")


@dataclass(frozen=True, slots=True)
class ExportSettings:
    """Where spans go.

    Attributes:
        endpoint: the exporter's endpoint (gRPC: ``scheme://host:port``; HTTP: the full ``.../v1/traces`` URL).
        protocol: ``grpc`` or ``http/protobuf``.
    """

    endpoint: str
    protocol: str


def export_settings(endpoint: str | None, env: Mapping[str, str]) -> ExportSettings | None:
    """The exporter to use (module docstring), None for no export.

    Args:
        endpoint: an explicit endpoint (flag or YAML); None or "" = from ``env``.
        env: the environment (``os.environ``).

    Raises:
        ValueError: an unknown OTLP protocol.
    """
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    protocol = protocol.strip()
    if protocol not in PROTOCOLS:
        raise ValueError(f"OTLP protocol {protocol!r} is not supported (use one of {', '.join(PROTOCOLS)})")
    if endpoint:
        base, signal_specific = endpoint, False
    elif env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return None
    elif env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        base, signal_specific = env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"], True
    elif env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        base, signal_specific = env["OTEL_EXPORTER_OTLP_ENDPOINT"], False
    else:
        return None
    if protocol == "http/protobuf" and not signal_specific and urlsplit(base).path in ("", "/"):
        base = base.rstrip("/") + "/v1/traces"  # the spec's rule for the non-signal endpoint
    return ExportSettings(base, protocol)


def make_exporter(settings: ExportSettings) -> SpanExporter:
    """The OTLP span exporter of ``settings`` (gRPC or HTTP/protobuf)."""
    if settings.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=settings.endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter(endpoint=settings.endpoint)


def make_tracer_provider(
    service_name: str,
    otlp_endpoint: str | None = None,
    sample_ratio: float = 1.0,
    exporter: SpanExporter | None = None,
    env: Mapping[str, str] | None = None,
) -> TracerProvider | None:
    """The provider of :func:`make_tracer` (None: no export configured; no global state is changed).

    Args:
        service_name: e.g. ``fairbatch-router``.
        otlp_endpoint: OTLP collector endpoint; None or empty = from the ``OTEL_*`` variables of ``env``
            (:func:`export_settings`).
        sample_ratio: share of root traces sampled, in [0, 1] (children follow their parent).
        exporter: export there instead of OTLP (tests: an in-memory exporter); counts as configured.
        env: the environment (default ``os.environ``).

    Raises:
        ValueError: ``sample_ratio`` outside [0, 1], or an unknown OTLP protocol in ``env``.
    """
    if not 0.0 <= sample_ratio <= 1.0:
        raise ValueError(f"sample_ratio must be in [0, 1], got {sample_ratio}")
    if exporter is None:
        settings = export_settings(otlp_endpoint, os.environ if env is None else env)
        if settings is None:
            return None
        exporter = make_exporter(settings)
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}),
                              sampler=ParentBasedTraceIdRatio(sample_ratio))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


class _NoSpan:
    """A shared do-nothing ``with`` target: yields the invalid span (every call on it is a no-op)."""

    __slots__ = ()

    def __enter__(self) -> trace.Span:
        return trace.INVALID_SPAN

    def __exit__(self, *exc: object) -> bool:
        return False


_NO_SPAN = _NoSpan()


class PassOnTracer(trace.NoOpTracer):
    """The tracer when nothing is exported: no span is recorded, a trace context is still passed on.

    A request that arrived with a trace context (the ``context`` argument, or the current one) gets
    OpenTelemetry's non-recording span carrying it, so the next hop's ``traceparent`` is the caller's.
    One without gets a shared do-nothing context manager: no span object, no context attached.
    OpenTelemetry's own no-op path built and attached one per span, 8-10 % of the router's CPU per
    short request (py-spy; docs/bench/router_overhead.md, fifth pass).
    """

    def start_as_current_span(self, name: str, context: otel_context.Context | None = None,  # type: ignore[override]
                              *args: object, **kwargs: object) -> Any:
        if not trace.get_current_span(context).get_span_context().is_valid:
            return _NO_SPAN
        return super().start_as_current_span(name, context, *args, **kwargs)  # type: ignore[arg-type]


def make_tracer(
    service_name: str,
    otlp_endpoint: str | None = None,
    sample_ratio: float = 1.0,
    exporter: SpanExporter | None = None,
    env: Mapping[str, str] | None = None,
) -> trace.Tracer:
    """A tracer for ``service_name`` (:func:`make_tracer_provider`'s arguments); without export
    configured, a :class:`PassOnTracer` (an ``opentelemetry.trace.NoOpTracer``: nothing recorded,
    trace context still propagated).

    Raises:
        ValueError: ``sample_ratio`` outside [0, 1], or an unknown OTLP protocol in ``env``.
    """
    provider = make_tracer_provider(service_name, otlp_endpoint, sample_ratio, exporter, env)
    return PassOnTracer() if provider is None else provider.get_tracer("fairbatch")


def is_recording(tracer: trace.Tracer) -> bool:
    """False for the no-op tracer of :func:`make_tracer` (callers skip per-request tracing work then)."""
    return not isinstance(tracer, trace.NoOpTracer)


def genai_request_attributes(span: trace.Span, chat: bool, body: Mapping[str, object], max_tokens: int | None) -> None:
    """GenAI request attributes of a completion request (OpenTelemetry GenAI semantic conventions)."""
    span.set_attribute("gen_ai.operation.name", "chat" if chat else "text_completion")
    model = body.get("model")
    if isinstance(model, str):
        span.set_attribute("gen_ai.request.model", model)
    if max_tokens is not None:
        span.set_attribute("gen_ai.request.max_tokens", max_tokens)


def set_http_status(span: trace.Span, status_code: int | None, error_type: str | None = None) -> None:
    """``http.response.status_code`` (None: no answer came), and status ERROR with ``error.type`` for a
    5xx or a given ``error_type`` (a failure the status code does not show, e.g. a stream that broke
    after its 200); a 4xx leaves a server span's status unset (the client's error), as the HTTP
    conventions say."""
    if status_code:
        span.set_attribute("http.response.status_code", status_code)
    if error_type is None and status_code is not None and status_code >= 500:
        error_type = str(status_code)
    if error_type is not None:
        span.set_attribute("error.type", error_type)
        span.set_status(Status(StatusCode.ERROR, error_type))


class _HeaderGetter(Getter[Mapping[str, str]]):
    def get(self, carrier: Mapping[str, str], key: str) -> list[str] | None:
        value = carrier.get(key)
        return [value] if value is not None else None

    def keys(self, carrier: Mapping[str, str]) -> list[str]:
        return list(carrier.keys())


def extract_context(headers: Mapping[str, str]) -> otel_context.Context:
    """Parent context from incoming HTTP headers (``traceparent``/``tracestate``)."""
    return _PROPAGATOR.extract(headers, getter=_HeaderGetter())


def inject_context(headers: MutableMapping[str, str], ctx: otel_context.Context | None = None) -> None:
    """Write ``traceparent`` (and ``tracestate``) for ``ctx`` (default: current) into ``headers``."""
    _PROPAGATOR.inject(headers, context=ctx)
