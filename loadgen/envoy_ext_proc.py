"""An ext_proc client that plays Envoy's part of the Endpoint Picker Protocol, for tests and benchmarks.

Built from the ``xds-protos`` stubs (``envoy.service.ext_proc.v3``). :class:`EnvoyStream` is one
``ExternalProcessor/Process`` stream sending the messages Envoy sends for one HTTP request, in
Envoy's order: ``request_headers`` (with ``protocol_config`` and, optionally, the subset hint in
``metadata_context``: GIE ``docs/proposals/004-endpoint-picker-protocol`` "Endpoint Subset"), then,
once the upstream answered, ``response_headers`` (with ``x-gateway-destination-endpoint-served`` in
the ``envoy.lb`` metadata: "Destination Endpoint Served"), response body chunks or
``response_trailers``, then the close of the stream. A response that only extends the message
timeout (``override_message_timeout``, sent while the picker holds a queued request) is recorded and
read past, as Envoy does.

:func:`parse_pick` and :func:`immediate_of` read the picker's answers; :func:`upstream_headers`
applies a pick's header mutation as Envoy would before forwarding; :func:`gateway_request` runs a
whole request through a picker and the picked agents (Envoy's override-host load balancing: down the
endpoint list on a connect error or a retriable status).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import struct_pb2

DESTINATION = "x-gateway-destination-endpoint"
LB = "envoy.lb"
SUBSET_NS = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"

NONE = processing_mode_pb2.ProcessingMode.NONE
FULL_DUPLEX_STREAMED = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


def header_map_of(headers: Mapping[str, str] | Iterable[tuple[str, str]]) -> base_pb2.HeaderMap:
    """A ``HeaderMap`` with ``raw_value`` bytes, as Envoy sends headers."""
    items = headers.items() if isinstance(headers, Mapping) else headers
    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k.lower(), raw_value=v.encode()) for k, v in items])


def served_metadata(endpoint: str) -> base_pb2.Metadata:
    """``metadata_context`` naming the endpoint that served (004 "Destination Endpoint Served")."""
    md = base_pb2.Metadata()
    md.filter_metadata[LB].fields[SERVED_KEY].string_value = endpoint
    return md


def subset_metadata(endpoints: Sequence[str]) -> base_pb2.Metadata:
    """``metadata_context`` with the subset hint (004 "Endpoint Subset"): a list of ``ip:port``."""
    md = base_pb2.Metadata()
    lst = md.filter_metadata[SUBSET_NS].fields[SUBSET_KEY].list_value
    for e in endpoints:
        lst.values.append(struct_pb2.Value(string_value=e))
    return md


@dataclass
class EnvoyStream:
    """One ext_proc stream driven as Envoy drives it (module docstring).

    Attributes:
        call: the gRPC stream-stream call.
        extensions: the ``override_message_timeout`` values (seconds) the picker sent, in order.
    """

    call: Any
    extensions: list[float] = field(default_factory=list)

    @classmethod
    def open(cls, channel: grpc.aio.Channel, timeout_s: float | None = None) -> EnvoyStream:
        return cls(ep_grpc.ExternalProcessorStub(channel).Process(timeout=timeout_s))

    async def _exchange(self, msg: ep.ProcessingRequest) -> ep.ProcessingResponse:
        await self.call.write(msg)
        while True:
            resp = await self.call.read()
            if resp is grpc.aio.EOF:
                raise ConnectionError("the picker closed the stream without an answer")
            if resp.WhichOneof("response") is None and resp.HasField("override_message_timeout"):
                self.extensions.append(resp.override_message_timeout.ToNanoseconds() / 1e9)
                continue
            return resp

    async def request_headers(self, headers: Mapping[str, str] | Iterable[tuple[str, str]], *,
                              end_of_stream: bool = False, subset: Sequence[str] | None = None,
                              body_mode: int = NONE) -> ep.ProcessingResponse:  # fmt: skip
        """Send the request headers (the first message: with ``protocol_config``); the answer."""
        msg = ep.ProcessingRequest(
            request_headers=ep.HttpHeaders(headers=header_map_of(headers), end_of_stream=end_of_stream),
            protocol_config=ep.ProtocolConfiguration(request_body_mode=body_mode, response_body_mode=NONE),
        )
        if subset is not None:
            msg.metadata_context.CopyFrom(subset_metadata(subset))
        return await self._exchange(msg)

    async def request_body(self, chunk: bytes, end_of_stream: bool) -> ep.ProcessingResponse:
        return await self._exchange(ep.ProcessingRequest(request_body=ep.HttpBody(body=chunk,
                                                                                  end_of_stream=end_of_stream)))

    async def response_headers(self, status: int, headers: Mapping[str, str] | None = None, *,
                               served: str | None = None, end_of_stream: bool = False) -> ep.ProcessingResponse:
        """Send the upstream's response headers (``:status`` first) with the served endpoint."""
        items = [(":status", str(status)), *((headers or {}).items())]
        msg = ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=header_map_of(items),
                                                                   end_of_stream=end_of_stream))
        if served is not None:
            msg.metadata_context.CopyFrom(served_metadata(served))
        return await self._exchange(msg)

    async def response_trailers(self) -> ep.ProcessingResponse:
        return await self._exchange(ep.ProcessingRequest(response_trailers=ep.HttpTrailers()))

    async def close(self) -> None:
        """Half-close (the HTTP stream is over) and wait for the picker to end the stream."""
        await self.call.done_writing()
        while await self.call.read() is not grpc.aio.EOF:
            pass

    def cancel(self) -> None:
        """Reset the stream (the downstream client went away, or Envoy gave up)."""
        self.call.cancel()


@dataclass(frozen=True)
class Pick:
    """A picker's answer to ``request_headers`` that names endpoints.

    Attributes:
        header: the ``x-gateway-destination-endpoint`` header value.
        metadata: the same key in the ``envoy.lb`` dynamic metadata.
        set_headers: every header the mutation sets (the destination included).
        remove_headers: the headers it removes.
    """

    header: str
    metadata: str
    set_headers: dict[str, str]
    remove_headers: tuple[str, ...]

    @property
    def endpoints(self) -> list[str]:
        return self.header.split(",")


def parse_pick(resp: ep.ProcessingResponse) -> Pick | None:
    """The :class:`Pick` of a ``request_headers`` answer, None for anything else."""
    if resp.WhichOneof("response") != "request_headers":
        return None
    mutation = resp.request_headers.response.header_mutation
    sets = {h.header.key: (h.header.raw_value.decode() if h.header.raw_value else h.header.value)
            for h in mutation.set_headers}
    lb = resp.dynamic_metadata.fields.get(LB)
    meta = lb.struct_value.fields[DESTINATION].string_value if lb is not None and DESTINATION in lb.struct_value.fields else ""
    if DESTINATION not in sets:
        return None
    return Pick(sets[DESTINATION], meta, sets, tuple(mutation.remove_headers))


@dataclass(frozen=True)
class Immediate:
    """An ``ImmediateResponse``: status, headers (lower-case names), body parsed as JSON (None if not)."""

    status: int
    headers: dict[str, str]
    body: Any
    details: str


def immediate_of(resp: ep.ProcessingResponse) -> Immediate | None:
    """The :class:`Immediate` of an answer, None when it is not an immediate response."""
    if resp.WhichOneof("response") != "immediate_response":
        return None
    im = resp.immediate_response
    headers = {h.header.key.lower(): (h.header.raw_value.decode() if h.header.raw_value else h.header.value)
               for h in im.headers.set_headers}
    try:
        body = json.loads(im.body)
    except ValueError:
        body = None
    return Immediate(int(im.status.code), headers, body, im.details)


def upstream_headers(request: Mapping[str, str], pick: Pick) -> dict[str, str]:
    """The headers Envoy forwards upstream after the pick's mutation (pseudo-headers dropped)."""
    out = {k.lower(): v for k, v in request.items() if not k.startswith(":")}
    for k in pick.remove_headers:
        out.pop(k.lower(), None)
    out.update({k.lower(): v for k, v in pick.set_headers.items()})
    return out


RETRY_ON = frozenset({409, 502, 503, 504})
"""Statuses on which the gateway goes down the endpoint list (a retry policy with these retriable
status codes; 409: an agent refusing the inline admission, docs/deploy.md)."""


@dataclass
class GatewayResult:
    """One request through :func:`gateway_request`.

    Attributes:
        status: the status the client got (the picker's immediate one, or the upstream's).
        body: the client's body.
        headers: the response headers the client got (the picker's additions included).
        pick: the pick (None when refused at the headers).
        served: the endpoint that served (None when refused).
        tried: the endpoints tried, in order.
    """

    status: int
    body: bytes
    headers: dict[str, str]
    pick: Pick | None
    served: str | None
    tried: list[str]


async def gateway_request(channel: grpc.aio.Channel, session: aiohttp.ClientSession, path: str,
                          headers: Mapping[str, str], body: bytes, *, retry_on: frozenset[int] = RETRY_ON,
                          use_trailers: bool = True, timeout_s: float = 60.0) -> GatewayResult:  # fmt: skip
    """Send one request through the picker as Envoy with an override-host cluster would: ask the
    picker at the request headers (``content-length`` added), forward to the picked endpoints in order
    (the next on a connect error or a ``retry_on`` status, while the list lasts), then tell the picker
    the response headers with the served endpoint, then ``response_trailers`` (``use_trailers``) and
    close the stream."""
    stream = EnvoyStream.open(channel, timeout_s)
    req = {":method": "POST", ":path": path, ":authority": "gateway", **headers, "content-length": str(len(body))}
    try:
        resp = await stream.request_headers(req)
        im = immediate_of(resp)
        if im is not None:
            await stream.close()
            return GatewayResult(im.status, json.dumps(im.body).encode(), im.headers, None, None, [])
        pick = parse_pick(resp)
        assert pick is not None and pick.header == pick.metadata, resp
        forward = upstream_headers(req, pick)
        forward.pop(DESTINATION, None)
        tried: list[str] = []
        for i, endpoint in enumerate(pick.endpoints):
            tried.append(endpoint)
            last = i == len(pick.endpoints) - 1
            try:
                async with session.post(f"http://{endpoint}{path}", data=body, headers=forward) as up:
                    if up.status in retry_on and not last:
                        await up.read()
                        continue
                    # the upstream's headers are in: the picker hears them (with the served endpoint)
                    # before the body flows, as Envoy sends them
                    resp_headers = {k.lower(): v for k, v in up.headers.items()}
                    answer = await stream.response_headers(up.status, resp_headers, served=endpoint)
                    im = immediate_of(answer)
                    if im is not None:  # the picker replaced the response
                        await stream.close()
                        return GatewayResult(im.status, json.dumps(im.body).encode(), im.headers, pick, endpoint,
                                             tried)
                    for h in answer.response_headers.response.header_mutation.set_headers:
                        resp_headers[h.header.key] = h.header.raw_value.decode()
                    payload = await up.read()
                    if use_trailers:
                        await stream.response_trailers()
                    await stream.close()
                    return GatewayResult(up.status, payload, resp_headers, pick, endpoint, tried)
            except aiohttp.ClientConnectionError:
                if not last:
                    continue
                # Envoy's own 503 when no endpoint of the list could be reached
                await stream.response_headers(503, {"content-type": "text/plain"}, served=endpoint)
                await stream.close()
                return GatewayResult(503, b"upstream connect error", {}, pick, endpoint, tried)
        raise AssertionError("unreachable: the last endpoint always answers")
    except BaseException:
        stream.cancel()
        raise
