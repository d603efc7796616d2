"""The Endpoint Picker Protocol as pure functions: ext_proc messages in, the picker's values out, and back.

The picker mode (router/ext_proc.py) implements Envoy's ``envoy.service.ext_proc.v3.ExternalProcessor``
as the Gateway API Inference Extension's endpoint picker (EPP). The protocol is GIE's
``docs/proposals/004-endpoint-picker-protocol`` (version v1.0.0, "Implemented"); this module holds its
keys, with the section of the proposal that defines each, and the mapping both ways:

- request headers -> :class:`PickInput` (:func:`pick_input`): the headers lower-cased, the subset
  hint, the request's size (:func:`price_prompt`), the tenant and class hints;
- a grant -> the headers response that names the endpoints (:func:`pick_response`): the
  ``x-gateway-destination-endpoint`` header and the ``envoy.lb`` dynamic metadata, one string for both;
- a refusal (router/answers.py) -> an ``ImmediateResponse`` (:func:`answer_response`) with the
  OpenAI-format error JSON, ``Retry-After`` and ``x-fairbatch-reason``;
- the response headers -> the relay outcome kind of router/admission.py ``after_relay``
  (:func:`response_outcome`) and the endpoint that served (:func:`served_endpoint`).

Nothing here does I/O, reads a body or keeps state. Header values are never logged by the picker
(they can hold keys); the body is never seen (the answer is given at ``request_headers``).

Pricing (the body is not read): a prompt is priced from, in order,

1. ``x-fairbatch-prompt-tokens`` (:data:`PROMPT_TOKENS_HEADER`), a token count set by a trusted
   gateway (believed only from a peer in ``auth.trusted_networks``, as the tenant headers are): exact,
   so a count over every replica's context is refused (400 ``context_length_exceeded``);
2. ``content-length``: ``ceil(content_length / admission.bytes_per_token)`` tokens, the HTTP router's
   estimate on the whole body instead of the prompt text (the JSON around the prompt, about 60 bytes
   for a completion and 30 per chat message, is priced too: an overcount of a few to a few dozen
   tokens, on the safe side); an estimate, so capped at the largest context and refused only past
   ``admission.estimate_refuse_factor`` times it (router/admission.py ``prompt_decision``); a
   ``content-length`` over ``http.max_body_bytes`` is refused 413 as the HTTP router refuses it;
3. neither (a chunked body): priced as the largest prompt any replica takes (the book's
   ``max_prompt_tokens``; ``http.max_body_bytes / bytes_per_token`` when no replica reports one), so
   a request of unknown size is never placed where a large one would not fit.

``max_tokens`` is unknown at the headers: the fair queue charges ``fairness.default_max_tokens``
(router/charges.py), as for a request that gives none.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any
from urllib.parse import urlsplit

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import duration_pb2, struct_pb2

from fairbatch_common.openai_errors import error_body
from router.answers import Answer
from router.relay import ADMIT_REFUSED_STATUS, RETRYABLE_STATUSES

# ---------------------------------------------------------------------- protocol keys (004-endpoint-picker-protocol)

DESTINATION_ENDPOINT = "x-gateway-destination-endpoint"
"""004, "Destination Endpoint": the EPP MUST name the picked endpoints both as this HTTP header and as
this key of the ``envoy.lb`` dynamic metadata namespace; one endpoint ``<ip:port>`` or several
``<ip:port>,<ip:port>,...`` (the first valid one is used; with retries configured the proxy goes down
the list in order), and the two MUST NOT differ."""

DESTINATION_NAMESPACE = "envoy.lb"
"""004, "Destination Endpoint" and "Destination Endpoint Served": the metadata namespace (default
``envoy.lb``) of the picked endpoints (in ``ProcessingResponse.dynamic_metadata``) and of the served
endpoint (in ``ProcessingRequest.metadata_context.filter_metadata``)."""

SUBSET_NAMESPACE = "envoy.lb.subset_hint"
"""004, "Endpoint Subset": the ``filter_metadata`` namespace (default ``envoy.lb.subset_hint``) of the
request's subset list."""

SUBSET_KEY = "x-gateway-destination-endpoint-subset"
"""004, "Endpoint Subset": when set, the EPP MUST pick only from this list of ``<ip:port>``; an empty
list, or one with no eligible endpoint, MUST be answered with an ``ImmediateResponse`` 503. Unset: the
whole ``InferencePool``."""

SERVED_KEY = "x-gateway-destination-endpoint-served"
"""004, "Destination Endpoint Served" (v1.0.0): for each response the data plane MUST tell the EPP the
endpoint that served the request, as this key of the ``envoy.lb`` namespace of
``ProcessingRequest.metadata_context`` (it may be a fallback of the list, after retries)."""

FAIRNESS_ID = "x-gateway-inference-fairness-id"
"""GIE's flow-control fairness key, a request header set by the gateway: here a tenant name of the
config, believed only from a trusted peer (``auth.trusted_networks``, router/auth.py)."""

OBJECTIVE = "x-gateway-inference-objective"
"""GIE's ``InferenceObjective`` name, a request header set by the gateway: here an SLO class name of
the config, believed only from a trusted peer; otherwise the tenant's class."""

CLASS_HEADER = "x-fairbatch-slo-class"
"""fairbatch's own class header (what the router sends its agents), read like :data:`OBJECTIVE`
when that is absent."""

PROMPT_TOKENS_HEADER = "x-fairbatch-prompt-tokens"
"""The request's prompt token count set by a trusted gateway (module docstring, "Pricing")."""

REQUEST_ID_HEADER = "x-request-id"
"""The request id header: the picker sends its own id upstream under it, as the HTTP router does."""

REFUSED_HEADER = "x-fairbatch-refused"
"""The agent's refusal of an inline admission on arrival (409, replica_agent/proxy.py)."""

BODY_MODES_ECHOED = frozenset({4})  # ProcessingMode.FULL_DUPLEX_STREAMED: the processor returns every chunk
"""Request/response body modes in which the processor must send each body chunk back
(``BodyMutation.streamed_response``); in the other modes a chunk is answered CONTINUE."""


# ---------------------------------------------------------------------- request side


class Headers(dict[str, str]):
    """Request or response headers, keys lower-cased (HTTP/2 names are; HTTP/1 ones are lower-cased
    by Envoy), looked up case-insensitively."""

    __slots__ = ()

    def get(self, key: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return dict.get(self, key.lower(), default)


def header_map(headers: ep.HttpHeaders) -> Headers:
    """The headers of an ext_proc ``HttpHeaders`` message (``raw_value`` bytes when set, else
    ``value``; a repeated header keeps its last value). Bytes that are not UTF-8 are kept as lone
    surrogates (``surrogateescape``), as aiohttp keeps them, so an API key hashes as sent."""
    out = Headers()
    for h in headers.headers.headers:
        raw = h.raw_value
        out[h.key.lower()] = raw.decode("utf-8", "surrogateescape") if raw else h.value
    return out


def _metadata_field(metadata: base_pb2.Metadata, namespace: str, key: str) -> struct_pb2.Value | None:
    ns = metadata.filter_metadata.get(namespace)
    if ns is None or key not in ns.fields:
        return None
    return ns.fields[key]


def subset_hint(metadata: base_pb2.Metadata) -> frozenset[str] | None:
    """The endpoints of :data:`SUBSET_KEY` in :data:`SUBSET_NAMESPACE` (a list of strings; a single
    string or a comma-separated one is accepted too), None when the key is not set."""
    value = _metadata_field(metadata, SUBSET_NAMESPACE, SUBSET_KEY)
    if value is None:
        return None
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        items: Iterable[str] = (v.string_value for v in value.list_value.values)
    elif kind == "string_value":
        items = value.string_value.split(",")
    else:
        items = ()
    return frozenset(s.strip() for s in items if s.strip())


def served_endpoint(metadata: base_pb2.Metadata) -> str | None:
    """The endpoint the data plane says served the request (:data:`SERVED_KEY`), None when absent."""
    value = _metadata_field(metadata, DESTINATION_NAMESPACE, SERVED_KEY)
    if value is None or value.WhichOneof("kind") != "string_value":
        return None
    return value.string_value.strip() or None


@lru_cache(maxsize=4096)
def endpoint_of(http_url: str) -> str:
    """``<ip:port>`` of a replica's agent URL (IPv6 in brackets, as Envoy writes it; the scheme's
    default port when the URL has none)."""
    parts = urlsplit(http_url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True, slots=True)
class PromptSize:
    """How a request is priced (module docstring, "Pricing").

    Attributes:
        tokens: prompt tokens.
        exact: a token count (the trusted header), not an estimate.
        source: ``header``, ``content-length`` or ``unknown``.
    """

    tokens: int
    exact: bool
    source: str


def price_prompt(headers: Mapping[str, str], trusted: bool, bytes_per_token: float,
                 largest_context: int, max_body_bytes: int) -> PromptSize | None:
    """The request's size by the rule of the module docstring; None when ``content-length`` exceeds
    ``max_body_bytes`` (413). A malformed token header or ``content-length`` counts as absent."""
    if trusted:
        count = headers.get(PROMPT_TOKENS_HEADER)
        if count is not None and count.strip().isdigit():
            return PromptSize(int(count), True, "header")
    length = headers.get("content-length")
    if length is not None and length.strip().isdigit():
        n = int(length)
        if n > max_body_bytes:
            return None
        return PromptSize(math.ceil(n / bytes_per_token), False, "content-length")
    fallback = largest_context if largest_context > 0 else math.ceil(max_body_bytes / bytes_per_token)
    return PromptSize(fallback, False, "unknown")


def pick_class(headers: Mapping[str, str], trusted: bool, classes: Iterable[str]) -> str | None:
    """The SLO class a trusted gateway names (:data:`OBJECTIVE`, else :data:`CLASS_HEADER`) when it is
    a class of the config; None otherwise (the tenant's class applies)."""
    if not trusted:
        return None
    known = set(classes)
    for header in (OBJECTIVE, CLASS_HEADER):
        name = (headers.get(header) or "").strip()
        if name in known:
            return name
    return None


@lru_cache(maxsize=1024)  # one peer string per proxy connection, many streams each
def peer_address(peer: str) -> str | None:
    """The IP address of a gRPC peer string (``ipv4:10.0.0.1:5000``, ``ipv6:[::1]:5000``, percent-
    escaped forms too); None for a Unix socket or anything else."""
    kind, _, rest = peer.partition(":")
    rest = rest.replace("%5B", "[").replace("%5D", "]").replace("%3A", ":")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    if kind == "ipv6":
        host = rest.rsplit(":", 1)[0] if rest.startswith("[") else rest
        return host.strip("[]")
    return None


# ---------------------------------------------------------------------- responses


_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def _set(options: Any, items: Iterable[tuple[str, str]]) -> None:
    """Append ``items`` to a repeated ``HeaderValueOption`` field, overwriting on the proxy's side
    (built in place: a message built apart and copied in costs about three times as much)."""
    for key, value in items:
        o = options.add()
        o.header.key = key
        o.header.raw_value = value.encode("utf-8", "surrogateescape")
        o.append_action = _OVERWRITE


def destination(endpoints: Sequence[str]) -> str:
    """The one string the header and the metadata both carry (004, "Destination Endpoint"):
    ``primary,fallback,...``."""
    return ",".join(endpoints)


def pick_response(endpoints: Sequence[str], set_headers: Mapping[str, str],
                  remove_headers: Sequence[str] = ()) -> ep.ProcessingResponse:
    """The answer to ``request_headers`` for a pick: ``endpoints`` (primary first) as the
    :data:`DESTINATION_ENDPOINT` header and the same string under :data:`DESTINATION_NAMESPACE` in the
    dynamic metadata; ``set_headers`` set (overwriting) and ``remove_headers`` removed on the request
    that goes upstream; the route cache cleared (the proxy routes again with the new header)."""
    value = destination(endpoints)
    resp = ep.ProcessingResponse()
    common = resp.request_headers.response
    common.clear_route_cache = True
    mutation = common.header_mutation
    _set(mutation.set_headers, ((DESTINATION_ENDPOINT, value),))
    _set(mutation.set_headers, set_headers.items())
    mutation.remove_headers.extend(remove_headers)
    resp.dynamic_metadata.fields[DESTINATION_NAMESPACE].struct_value.fields[DESTINATION_ENDPOINT].string_value = value
    return resp


def immediate(status: int, body: bytes, headers: Mapping[str, str], details: str) -> ep.ProcessingResponse:
    """An ``ImmediateResponse``: the proxy answers the client with ``status``, ``headers`` and ``body``
    and sends nothing upstream; ``details`` goes to the proxy's access log (no prompt, no key)."""
    resp = ep.ProcessingResponse()
    im = resp.immediate_response
    im.status.code = status  # type: ignore[assignment]
    _set(im.headers.set_headers, headers.items())
    im.body = body
    im.details = details
    return resp


def openai_immediate(status: int, message: str, err_type: str, code: str | None,
                     param: str | None = None, headers: Mapping[str, str] | None = None) -> ep.ProcessingResponse:
    """An ``ImmediateResponse`` whose body is the OpenAI-format error
    ``{"error": {"message", "type", "param", "code"}}`` (fairbatch_common/openai_errors.py)."""
    body = json.dumps(error_body(message, err_type, code, param)).encode()
    return immediate(status, body, {"content-type": "application/json", **(headers or {})},
                     f"fairbatch_{code or status}")


def answer_response(answer: Answer) -> ep.ProcessingResponse:
    """One of the router's refusals (router/answers.py) as an ``ImmediateResponse``: its status, the
    OpenAI-format error body, ``Retry-After`` (whole seconds) and ``x-fairbatch-reason`` (its code), as
    the HTTP router answers it (router/endpoints.py ``answer_response``)."""
    return openai_immediate(answer.status, answer.message, answer.err_type, answer.code,
                            headers={"retry-after": str(answer.retry_after_s), "x-fairbatch-reason": answer.code})


def continue_response(kind: str, set_headers: Mapping[str, str] | None = None) -> ep.ProcessingResponse:
    """CONTINUE for a message of ``kind`` (``request_headers``, ``response_headers``,
    ``request_body``, ``response_body``, ``request_trailers``, ``response_trailers``), with headers
    set on it (headers kinds only)."""
    resp = ep.ProcessingResponse()
    if kind.endswith("trailers"):
        getattr(resp, kind).SetInParent()
    elif kind.endswith("headers"):
        common = getattr(resp, kind).response
        common.SetInParent()
        if set_headers:
            _set(common.header_mutation.set_headers, set_headers.items())
    else:
        getattr(resp, kind).response.SetInParent()
    return resp


def echo_body(kind: str, body: ep.HttpBody) -> ep.ProcessingResponse:
    """A body chunk sent back as it came (``FULL_DUPLEX_STREAMED``: the proxy forwards only what the
    processor returns); nothing is kept."""
    mutation = ep.BodyMutation(streamed_response=ep.StreamedBodyResponse(body=body.body,
                                                                          end_of_stream=body.end_of_stream))
    return ep.ProcessingResponse(**{kind: ep.BodyResponse(response=ep.CommonResponse(body_mutation=mutation))})


def extend_timeout(seconds: float) -> ep.ProcessingResponse:
    """``override_message_timeout``: asks the proxy to wait up to ``seconds`` more for the answer to
    the current message (while the request waits in the queue; the proxy caps it at its
    ``max_message_timeout`` and ignores it when that is unset)."""
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(max(0.0, seconds) * 1e9))
    return ep.ProcessingResponse(override_message_timeout=d)


# ---------------------------------------------------------------------- response side


def status_of(headers: Mapping[str, str]) -> int:
    """The ``:status`` of response headers (0 when missing or malformed)."""
    s = headers.get(":status") or ""
    return int(s) if s.isdigit() else 0


def response_outcome(status: int, headers: Mapping[str, str]) -> str:
    """The relay outcome kind (router/admission.py ``after_relay``) of a response with ``status``, by
    the HTTP relay's rule (router/relay.py): 409 with :data:`REFUSED_HEADER` is ``lease_refused`` (the
    agent's budget was gone on arrival), 502/503/504 ``retryable`` (nothing was generated), another
    status >= 400 ``refused``, else ``ok``."""
    if status == ADMIT_REFUSED_STATUS and REFUSED_HEADER in headers:
        return "lease_refused"
    if status in RETRYABLE_STATUSES:
        return "retryable"
    if status >= 400:
        return "refused"
    return "ok"


def refused_budget(headers: Mapping[str, str]) -> tuple[float, int]:
    """(pab_ms, pab_tokens) an agent's 409 refusal reported (``x-fairbatch-pab-ms``,
    ``x-fairbatch-pab-tokens``), (-1, -1) when absent or malformed."""
    try:
        return float(headers.get("x-fairbatch-pab-ms") or "-1"), int(headers.get("x-fairbatch-pab-tokens") or "-1")
    except ValueError:
        return -1.0, -1
