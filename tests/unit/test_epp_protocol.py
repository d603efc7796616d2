"""router/epp_protocol.py: the Endpoint Picker Protocol's keys and the pure mapping of ext_proc messages
(GIE docs/proposals/004-endpoint-picker-protocol), with values worked by hand."""

from __future__ import annotations

import json

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2

from router.answers import queue_full, tenant_over
from router.epp_protocol import (
    DESTINATION_ENDPOINT,
    DESTINATION_NAMESPACE,
    answer_response,
    continue_response,
    endpoint_of,
    extend_timeout,
    header_map,
    peer_address,
    pick_class,
    pick_response,
    price_prompt,
    refused_budget,
    response_outcome,
    served_endpoint,
    subset_hint,
)


def test_protocol_keys_are_the_proposals() -> None:
    import router.epp_protocol as p

    assert (p.DESTINATION_ENDPOINT, p.DESTINATION_NAMESPACE) == ("x-gateway-destination-endpoint", "envoy.lb")
    assert (p.SUBSET_NAMESPACE, p.SUBSET_KEY) == ("envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset")
    assert p.SERVED_KEY == "x-gateway-destination-endpoint-served"
    assert (p.FAIRNESS_ID, p.OBJECTIVE) == ("x-gateway-inference-fairness-id", "x-gateway-inference-objective")


def test_header_map_reads_raw_value_then_value_lower_cased() -> None:
    msg = ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key="Content-Length", raw_value=b"400"),
        base_pb2.HeaderValue(key="x-old", value="v"),
        base_pb2.HeaderValue(key="authorization", raw_value=b"Bearer \xff"),
    ]))
    h = header_map(msg)
    assert h["content-length"] == "400" and h.get("Content-Length") == "400" and h["x-old"] == "v"
    assert h["authorization"].encode("utf-8", "surrogateescape") == b"Bearer \xff"  # hashed as sent


def test_price_prompt_rules() -> None:
    # the trusted token count, exact
    p = price_prompt({"x-fairbatch-prompt-tokens": "1234", "content-length": "400"}, True, 4.0, 32768, 1 << 22)
    assert p is not None and (p.tokens, p.exact, p.source) == (1234, True, "header")
    # an untrusted count is ignored: content-length / bytes_per_token, rounded up: 401 / 4 = 100.25 -> 101
    p = price_prompt({"x-fairbatch-prompt-tokens": "1", "content-length": "401"}, False, 4.0, 32768, 1 << 22)
    assert (p.tokens, p.exact, p.source) == (101, False, "content-length")
    # 3 bytes per token: 400 / 3 = 133.3 -> 134
    assert price_prompt({"content-length": "400"}, False, 3.0, 0, 1 << 22).tokens == 134
    # over the body bound: None (413)
    assert price_prompt({"content-length": str((1 << 22) + 1)}, False, 4.0, 32768, 1 << 22) is None
    # neither: the largest context of the fleet, else max_body_bytes / bytes_per_token
    assert price_prompt({}, False, 4.0, 32768, 1 << 22).tokens == 32768
    assert price_prompt({"content-length": "x"}, False, 4.0, 0, 4096).tokens == 1024


def test_pick_class_only_from_a_trusted_peer_and_a_known_class() -> None:
    classes = ["interactive", "batch"]
    assert pick_class({"x-gateway-inference-objective": "batch"}, True, classes) == "batch"
    assert pick_class({"x-gateway-inference-objective": "batch"}, False, classes) is None
    assert pick_class({"x-gateway-inference-objective": "summarize", "x-fairbatch-slo-class": "batch"}, True,
                      classes) == "batch"
    assert pick_class({"x-gateway-inference-objective": "summarize"}, True, classes) is None


def _meta(ns: str, key: str, value: struct_pb2.Value) -> base_pb2.Metadata:
    md = base_pb2.Metadata()
    md.filter_metadata[ns].fields[key].CopyFrom(value)
    return md


def test_subset_hint_and_served_endpoint() -> None:
    lst = struct_pb2.Value(list_value=struct_pb2.ListValue(values=[struct_pb2.Value(string_value="10.0.0.1:8001"),
                                                                   struct_pb2.Value(string_value="10.0.0.2:8001")]))
    md = _meta("envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset", lst)
    assert subset_hint(md) == {"10.0.0.1:8001", "10.0.0.2:8001"}
    assert subset_hint(base_pb2.Metadata()) is None  # not set: the whole pool
    empty = _meta("envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset",
                  struct_pb2.Value(list_value=struct_pb2.ListValue()))
    assert subset_hint(empty) == frozenset()  # set and empty: 503
    served = _meta("envoy.lb", "x-gateway-destination-endpoint-served", struct_pb2.Value(string_value="10.0.0.2:8001"))
    assert served_endpoint(served) == "10.0.0.2:8001" and served_endpoint(base_pb2.Metadata()) is None


def test_endpoint_and_peer_addresses() -> None:
    assert endpoint_of("http://10.1.2.3:8001") == "10.1.2.3:8001"
    assert endpoint_of("http://[fd00::5]:8001/") == "[fd00::5]:8001"
    assert endpoint_of("http://agent.local") == "agent.local:80"
    assert peer_address("ipv4:10.0.0.7:51234") == "10.0.0.7"
    assert peer_address("ipv6:[::1]:51234") == "::1"
    assert peer_address("ipv6:%5B::ffff:10.0.0.7%5D:5") == "::ffff:10.0.0.7"
    assert peer_address("unix:/tmp/sock") is None


def test_pick_response_header_and_metadata_agree() -> None:
    resp = pick_response(["10.0.0.2:8001", "10.0.0.1:8001"], {"x-fairbatch-admit": "100"}, ["authorization"])
    m = resp.request_headers.response.header_mutation
    sets = {h.header.key: h.header.raw_value.decode() for h in m.set_headers}
    meta = resp.dynamic_metadata.fields[DESTINATION_NAMESPACE].struct_value.fields[DESTINATION_ENDPOINT].string_value
    assert sets[DESTINATION_ENDPOINT] == meta == "10.0.0.2:8001,10.0.0.1:8001"
    assert sets["x-fairbatch-admit"] == "100" and list(m.remove_headers) == ["authorization"]
    assert all(h.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD for h in m.set_headers)


def test_answer_response_is_an_openai_error_with_retry_after() -> None:
    im = answer_response(tenant_over("tenant-rate", "acme", 2.2)).immediate_response
    assert im.status.code == 429
    hs = {h.header.key: h.header.raw_value.decode() for h in im.headers.set_headers}
    assert hs == {"content-type": "application/json", "retry-after": "3", "x-fairbatch-reason": "tenant-rate"}
    assert json.loads(im.body) == {"error": {"message": "Tenant 'acme' is over its rate limit; retry later.",
                                             "type": "rate_limit_error", "param": None, "code": "tenant-rate"}}
    assert answer_response(queue_full()).immediate_response.details == "fairbatch_queue-full"


def test_response_outcome_follows_the_http_relay() -> None:
    assert response_outcome(200, {}) == "ok"
    assert response_outcome(409, {"x-fairbatch-refused": "no-budget"}) == "lease_refused"
    assert response_outcome(409, {}) == "refused"  # a 409 of the engine's own
    assert [response_outcome(s, {}) for s in (502, 503, 504)] == ["retryable"] * 3
    assert response_outcome(400, {}) == "refused" and response_outcome(500, {}) == "refused"
    assert refused_budget({"x-fairbatch-pab-ms": "12.5", "x-fairbatch-pab-tokens": "25"}) == (12.5, 25)
    assert refused_budget({"x-fairbatch-pab-ms": "x"}) == (-1.0, -1)


def test_continue_and_timeout_messages() -> None:
    r = continue_response("response_headers", {"x-fairbatch-replica": "r1"})
    assert r.response_headers.response.header_mutation.set_headers[0].header.key == "x-fairbatch-replica"
    assert continue_response("response_trailers").HasField("response_trailers")
    assert continue_response("request_body").HasField("request_body")
    assert extend_timeout(1.3).override_message_timeout.ToNanoseconds() == 1_300_000_000
