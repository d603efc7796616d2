"""W3C trace context flows client -> router -> agent -> engine, with the real OTLP/gRPC exporters.

An in-test OTLP trace receiver (grpc.aio ``TraceService/Export``, the collector's own wire
contract) stores every span the router and the agent export. The simulated engine logs the
``traceparent`` it received at DEBUG level (``loadgen/sim/server.py``), read from its log file.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from loadgen.procs import free_port
from loadgen.sim.tokenizer import make_prompt
from tests.integration.conftest import start_fleet

pytestmark = pytest.mark.timeout(120)


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str  # 32 hex
    span_id: str  # 16 hex
    parent_span_id: str  # 16 hex, "" for a root span
    kind: int
    attributes: dict = field(default_factory=dict, compare=False)
    status_code: int = 0  # 0 unset, 1 ok, 2 error


def _any_value(v) -> object:
    """An OTLP AnyValue as Python (an array as a list)."""
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_any_value(x) for x in v.array_value.values]
    return getattr(v, kind)


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """Minimal OTLP/gRPC trace receiver: keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []

    async def Export(self, request, context):  # noqa: N802 - gRPC method name
        for rs in request.resource_spans:
            service = next(
                (a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), ""
            )
            for ss in rs.scope_spans:
                for s in ss.spans:
                    attrs = {a.key: _any_value(a.value) for a in s.attributes}
                    self.spans.append(ReceivedSpan(
                        service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.kind,
                        attrs, s.status.code))
        return trace_service_pb2.ExportTraceServiceResponse()

    def of_trace(self, trace_id: str) -> list[ReceivedSpan]:
        return [s for s in self.spans if s.trace_id == trace_id]

    async def wait_for(self, trace_id: str, names: set[str], timeout_s: float = 20.0) -> list[ReceivedSpan]:
        """Spans of ``trace_id`` once every name in ``names`` arrived (bounded poll: export is batched)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = self.of_trace(trace_id)
            if names <= {s.name for s in got}:
                return got
            await asyncio.sleep(0.1)
        raise AssertionError(f"spans {sorted(names)} of trace {trace_id} not all received in {timeout_s} s; "
                             f"got {[(s.service, s.name, s.trace_id) for s in self.spans]}")


def engine_traceparents(log_path: Path, request_id: str) -> list[str]:
    """``traceparent`` values the simulated engine logged for requests whose id matches the regex ``request_id``."""
    pat = re.compile(rf"request (?:cmpl|chatcmpl)-{request_id}(?:#\d+)? traceparent (\S+)")
    return [m.group(1) for m in pat.finditer(log_path.read_text(errors="replace"))]


async def complete(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> int:
    body = {"model": "llama-3-8b-a100", "prompt": make_prompt(50), "max_tokens": 4, "stream": True, "ignore_eos": True}
    async with session.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
        await resp.read()
        return resp.status


async def test_trace_context_flows_router_agent_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    collector = Collector()
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    otlp_port = free_port()
    server.add_insecure_port(f"127.0.0.1:{otlp_port}")
    await server.start()
    # Children inherit the environment: export every 200 ms instead of BatchSpanProcessor's 5 s.
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
    endpoint = f"http://127.0.0.1:{otlp_port}"
    fleet = await asyncio.to_thread(
        start_fleet, tmp_path, 1, time_scale=0.2,
        engine_args=["--log-level", "DEBUG"],
        agent_args=["--otlp-endpoint", endpoint],
        telemetry={"otlp_endpoint": endpoint, "service_name": "fairbatch-router"},
    )
    try:
        auth = {"Authorization": f"Bearer {fleet.api_keys['acme']}"}
        trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
        async with aiohttp.ClientSession() as s:
            status = await complete(s, fleet.router_url, {
                **auth, "x-request-id": "trace-1", "traceparent": f"00-{trace_id}-{client_span}-01"})
            assert status == 200
            # Without a client traceparent the router starts the trace and the agent still joins it.
            assert await complete(s, fleet.router_url, {**auth, "x-request-id": "trace-2"}) == 200

        spans = await collector.wait_for(trace_id, {"router.request", "router.relay", "agent.relay"})
        by_name = {s.name: s for s in spans}
        router_spans = [s for s in spans if s.service == "fairbatch-router"]
        assert {"router.request", "router.relay"} <= {s.name for s in router_spans}
        root = by_name["router.request"]
        assert root.parent_span_id == client_span, "router.request must be the client's child"
        assert by_name["router.relay"].parent_span_id == root.span_id
        agent_span = by_name["agent.relay"]
        assert agent_span.service == "fairbatch-agent"
        assert agent_span.parent_span_id in {s.span_id for s in router_spans}, "agent span's parent must be a router span"
        assert agent_span.parent_span_id == by_name["router.relay"].span_id
        # semantic conventions: HTTP and GenAI on the server spans, status unset on success
        for span in (root, agent_span):
            a = span.attributes
            assert a["http.request.method"] == "POST" and a["url.path"] == "/v1/completions"
            assert a["http.response.status_code"] == 200 and span.status_code == 0
            assert a["gen_ai.operation.name"] == "text_completion"
            assert a["gen_ai.request.model"] == "llama-3-8b-a100" and a["gen_ai.request.max_tokens"] == 4
        # the agent counted the tokens: make_prompt(50) is 50 tokens, ignore_eos gives all 4
        assert agent_span.attributes["gen_ai.usage.input_tokens"] == 50
        assert agent_span.attributes["gen_ai.usage.output_tokens"] == 4
        assert agent_span.attributes["gen_ai.response.finish_reasons"] == ["length"]  # 4 of max_tokens 4
        relay = by_name["router.relay"].attributes
        assert relay["http.response.status_code"] == 200 and relay["url.full"].endswith("/v1/completions")

        # The engine received a traceparent of the same trace, whose parent is the agent's span.
        log_path = fleet.children["engine0"].log_path  # type: ignore[attr-defined]
        # the engine sees the router's own request ids (the client's x-request-id is only echoed), so the
        # two requests are told apart by their order: trace-1 was sent first
        in_order = engine_traceparents(log_path, r"[0-9a-f]{32}")
        assert len(in_order) == 2, f"engine logged no traceparent for trace-1:\n{log_path.read_text()[-2000:]}"
        tps = in_order[:1]
        version, tp_trace, tp_parent, flags = tps[-1].split("-")
        assert (version, tp_trace, tp_parent, flags) == ("00", trace_id, agent_span.span_id, "01")

        # Request without a client traceparent: the router's span is a root, the rest of the chain follows it.
        tps2 = in_order[1:]
        assert tps2 and tps2[-1] != "-"
        trace2 = tps2[-1].split("-")[1]
        spans2 = await collector.wait_for(trace2, {"router.request", "router.relay", "agent.relay"})
        by_name2 = {s.name: s for s in spans2}
        assert by_name2["router.request"].parent_span_id == ""
        assert by_name2["agent.relay"].parent_span_id == by_name2["router.relay"].span_id
        assert tps2[-1].split("-")[2] == by_name2["agent.relay"].span_id
    finally:
        await asyncio.to_thread(fleet.group.stop)
        await server.stop(grace=None)
