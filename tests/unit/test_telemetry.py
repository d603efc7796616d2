"""make_tracer: a no-op tracer without an exporter (context still passed on), sampling with one."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from replica_agent.telemetry import extract_context, inject_context, is_recording, make_tracer

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
