"""fairbatch_common/telemetry.py: export settings, a no-op tracer without an exporter (context still passed on),
sampling with one, and the HTTP/GenAI span conventions."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry import trace
from opentelemetry.trace import StatusCode

from loadgen.procs import free_port
from fairbatch_common.telemetry import (
    ExportSettings,
    export_settings,
    extract_context,
    genai_request_attributes,
    inject_context,
    is_recording,
    make_tracer,
    make_tracer_provider,
    set_http_status,
)

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"  # sampled flag 01
PARENT_UNSAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"


def test_no_exporter_is_the_noop_tracer_and_passes_traceparent_on() -> None:
    tracer = make_tracer("svc", None)
    assert isinstance(tracer, trace.NoOpTracer)
    assert not is_recording(tracer)
    with tracer.start_as_current_span("x", context=extract_context({"traceparent": PARENT})) as span:
        assert not span.is_recording()
        headers: dict[str, str] = {}
        inject_context(headers)
    assert headers == {"traceparent": PARENT}  # the caller's context unchanged: same trace, same parent
    with tracer.start_as_current_span("root"):
        headers = {}
        inject_context(headers)
    assert headers == {}  # nothing to propagate for a root request
    with tracer.start_as_current_span("root") as root, tracer.start_as_current_span("child") as child:
        assert root is child is trace.INVALID_SPAN  # no span object per request, no context attached
        assert trace.get_current_span() is trace.INVALID_SPAN


def test_sampling_ratio_follows_the_parent_and_samples_roots() -> None:
    tracer = make_tracer("svc", sample_ratio=0.0, exporter=InMemorySpanExporter())
    assert is_recording(tracer)
    with tracer.start_as_current_span("root") as span:
        assert not span.is_recording()  # ratio 0: no root trace sampled
    with tracer.start_as_current_span("child", context=extract_context({"traceparent": PARENT})) as span:
        assert span.is_recording()  # the caller sampled it: ParentBased keeps that
        assert format(span.get_span_context().trace_id, "032x") == PARENT.split("-")[1]
    all_on = make_tracer("svc", sample_ratio=1.0, exporter=InMemorySpanExporter())
    with all_on.start_as_current_span("child", context=extract_context({"traceparent": PARENT_UNSAMPLED})) as span:
        assert not span.is_recording()  # the caller did not sample it
    with all_on.start_as_current_span("root") as span:
        assert span.is_recording()


@pytest.mark.parametrize("ratio", [-0.1, 1.5])
def test_sample_ratio_out_of_range(ratio: float) -> None:
    with pytest.raises(ValueError, match="sample_ratio"):
        make_tracer("svc", "http://127.0.0.1:9", sample_ratio=ratio)


@pytest.mark.parametrize(
    ("endpoint", "env", "expected"),
    [
        (None, {}, None),
        ("http://c:4317", {}, ExportSettings("http://c:4317", "grpc")),
        (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, ExportSettings("http://c:4317", "grpc")),
        # http/protobuf: the generic endpoint gets /v1/traces, the traces one is taken as it is
        (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},
         ExportSettings("http://c:4318/v1/traces", "http/protobuf")),
        (None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/custom", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:1",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
         ExportSettings("http://c:4318/custom", "http/protobuf")),
        ("http://flag:4317", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://env:4317"}, ExportSettings("http://flag:4317", "grpc")),
        (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_TRACES_EXPORTER": "none"}, None),
        ("http://flag:4317", {"OTEL_TRACES_EXPORTER": "none"}, ExportSettings("http://flag:4317", "grpc")),
    ],
)
def test_export_settings(endpoint: str | None, env: dict[str, str], expected: ExportSettings | None) -> None:
    assert export_settings(endpoint, env) == expected


def test_unknown_protocol_is_refused() -> None:
    with pytest.raises(ValueError, match="http/json"):
        export_settings("http://c:4318", {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


def spans_of(fn) -> list:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("t").start_as_current_span("s") as span:
        fn(span)
    return list(exporter.get_finished_spans())


def test_http_status_conventions() -> None:
    (ok,) = spans_of(lambda s: set_http_status(s, 200))
    assert ok.attributes["http.response.status_code"] == 200 and ok.status.status_code == StatusCode.UNSET
    (client_err,) = spans_of(lambda s: set_http_status(s, 429))
    assert client_err.status.status_code == StatusCode.UNSET  # a server span: the client's error
    (server_err,) = spans_of(lambda s: set_http_status(s, 503))
    assert server_err.status.status_code == StatusCode.ERROR and server_err.attributes["error.type"] == "503"
    (broken,) = spans_of(lambda s: set_http_status(s, 200, "upstream_error"))
    assert broken.status.status_code == StatusCode.ERROR and broken.attributes["error.type"] == "upstream_error"
    (no_answer,) = spans_of(lambda s: set_http_status(s, None, "retryable"))
    assert "http.response.status_code" not in no_answer.attributes and no_answer.status.status_code == StatusCode.ERROR


def test_genai_request_attributes() -> None:
    (span,) = spans_of(lambda s: genai_request_attributes(s, True, {"model": "m", "messages": []}, 16))
    assert span.attributes["gen_ai.operation.name"] == "chat"
    assert span.attributes["gen_ai.request.model"] == "m" and span.attributes["gen_ai.request.max_tokens"] == 16


async def test_http_protobuf_export_from_the_standard_variables_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """OTEL_EXPORTER_OTLP_ENDPOINT + OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf + OTEL_EXPORTER_OTLP_HEADERS,
    no flag: the span reaches an OTLP/HTTP receiver (POST /v1/traces, protobuf body) with the header."""
    got: list[tuple[trace_service_pb2.ExportTraceServiceRequest, str | None]] = []

    async def receive(request: web.Request) -> web.Response:
        msg = trace_service_pb2.ExportTraceServiceRequest.FromString(await request.read())
        got.append((msg, request.headers.get("x-team")))
        return web.Response(body=trace_service_pb2.ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")  # fmt: skip

    app = web.Application()
    app.router.add_post("/v1/traces", receive)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-team=infra")
        provider = make_tracer_provider("svc")
        assert provider is not None
        with provider.get_tracer("t").start_as_current_span("hello") as span:
            genai_request_attributes(span, False, {"model": "m"}, 4)
        assert await asyncio.to_thread(provider.force_flush, 10_000)
        await asyncio.to_thread(provider.shutdown)
    finally:
        await runner.cleanup()
    assert len(got) == 1
    msg, header = got[0]
    assert header == "infra"
    (rs,) = msg.resource_spans
    assert {a.key: a.value.string_value for a in rs.resource.attributes}["service.name"] == "svc"
    (s,) = rs.scope_spans[0].spans
    attrs = {a.key: a.value for a in s.attributes}
    assert s.name == "hello" and attrs["gen_ai.operation.name"].string_value == "text_completion"
    assert attrs["gen_ai.request.max_tokens"].int_value == 4
