"""OpenTelemetry tracing set-up shared by the router and the agent.

Spans follow one request router -> agent -> engine; W3C trace context (``traceparent``) travels in
HTTP headers. The exporter is off by default (spans are created but dropped cheaply); set an OTLP
gRPC endpoint (e.g. ``http://otel-collector:4317``) to export them.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagators.textmap import Getter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()


def make_tracer(service_name: str, otlp_endpoint: str | None = None) -> trace.Tracer:
    """Build a tracer for ``service_name`` with its own provider (no global state is changed).

    Args:
        service_name: e.g. ``fairbatch-router``.
        otlp_endpoint: OTLP/gRPC collector address; None or empty disables export.
    """
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint, insecure=True)))
    return provider.get_tracer("fairbatch")


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
