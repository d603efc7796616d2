"""OpenTelemetry tracing set-up shared by the router and the agent.

Spans follow one request router -> agent -> engine; W3C trace context (``traceparent``) travels in
HTTP headers. Without an OTLP endpoint the tracer is OpenTelemetry's no-op tracer: no span object
is recorded, no id is drawn, and a ``traceparent`` that came in is passed on unchanged (the no-op
span carries its parent's context). With an endpoint, spans are sampled ``ParentBased(TraceIdRatio
(sample_ratio))``: a request whose caller sampled it (or did not) keeps that decision, a root
request is sampled with probability ``sample_ratio``.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagators.textmap import Getter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()


def make_tracer(
    service_name: str, otlp_endpoint: str | None = None, sample_ratio: float = 1.0, exporter: SpanExporter | None = None
) -> trace.Tracer:
    """Build a tracer for ``service_name`` with its own provider (no global state is changed).

    Args:
        service_name: e.g. ``fairbatch-router``.
        otlp_endpoint: OTLP/gRPC collector address; None or empty: :class:`opentelemetry.trace.NoOpTracer`
            (nothing recorded, trace context still propagated).
        sample_ratio: share of root traces sampled when exporting, in [0, 1] (children follow their parent).
        exporter: export there instead of OTLP (tests: an in-memory exporter); counts as configured.

    Raises:
        ValueError: ``sample_ratio`` outside [0, 1].
    """
    if not 0.0 <= sample_ratio <= 1.0:
        raise ValueError(f"sample_ratio must be in [0, 1], got {sample_ratio}")
    if exporter is None:
        if not otlp_endpoint:
            return trace.NoOpTracer()
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=otlp_endpoint, insecure=True)
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}),
                              sampler=ParentBasedTraceIdRatio(sample_ratio))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider.get_tracer("fairbatch")


def is_recording(tracer: trace.Tracer) -> bool:
    """False for the no-op tracer of :func:`make_tracer` (callers skip per-request tracing work then)."""
    return not isinstance(tracer, trace.NoOpTracer)


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
