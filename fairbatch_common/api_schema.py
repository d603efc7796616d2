"""Validation of OpenAI request bodies, shared by the router and the agent. PURE (no I/O).

One place decides what a request may hold before any of our code uses it; everything it refuses
is the client's error and becomes a 4xx in OpenAI's error format (:class:`ApiError`):

- the body: a JSON object (orjson, else ``json.loads`` of the raw bytes for UTF-16/32 by BOM and
  for the exact message of a refusal; :func:`decode_json_object`), no
  ``NaN``/``Infinity``, numbers finite, nested at most :data:`MAX_JSON_DEPTH` containers deep
  (deeper nesting, which makes ``json.loads`` raise ``RecursionError``, is refused as well), every
  string and key valid Unicode that encodes to UTF-8 (a JSON ``"\\ud800"`` escape decodes to a lone
  surrogate, which cannot be encoded, and is refused);
- the fields our code reads, one pydantic model per endpoint (:class:`CompletionRequest`,
  :class:`ChatCompletionRequest`; other fields are kept and left to the engine): ``model`` a
  non-empty string; ``prompt`` a string, a list of strings, a list of token ids or a list of
  token-id lists (token ids in ``[0, 2**32 - 1]``); ``messages`` a non-empty list of objects with a
  string ``role`` and a ``content`` that is a string, a list of parts or null; ``stream`` a boolean;
  ``n`` and ``best_of`` in ``[1, MAX_N]``; ``max_tokens`` / ``max_completion_tokens`` integers in
  ``[1, MAX_OUTPUT_TOKENS]`` (fits the ``int64`` of proto/admission.proto and the engine's
  ``uint32``), and at most the replica's context length when it is known.

Every bound is a module constant; the refusal names the field (``param``) as OpenAI does
(``messages[0].content``).

Cost (issue 30, item 8): a token-id prompt is checked with C-level passes over the list (the set of
its element types, ``min``/``max``, in slices of :data:`_SLICE` ids, a ``time.sleep(0)`` after each so
that a worker thread running the check hands the GIL to the waiting event loop at once instead of after
the 5 ms switch interval), never per element in Python or pydantic: 200,000 ids were 274-460 ms before
on the router's loop. The module stays pure: ``sleep(0)`` only yields the GIL. Bodies over a size are checked off the loop
(fairbatch_common/http_guard.py ``parse_request``).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Annotated, Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

MAX_JSON_DEPTH = 32          # nested objects/arrays; OpenAI bodies need 5 (messages -> content -> part -> ...)
MAX_N = 128                  # choices per request (n, best_of)
UINT32_MAX = 2**32 - 1
MAX_OUTPUT_TOKENS = UINT32_MAX  # below int64 (proto ReserveRequest.max_tokens) and the engine's uint32
MAX_MODEL_NAME = 256


class ApiError(Exception):
    """A request refused as the client's error.

    Attributes:
        status: HTTP status (4xx).
        message: human-readable reason (never quotes the prompt).
        param: the offending field as OpenAI names it (``max_tokens``, ``messages[0].content``) or None.
        code: machine-readable code (``invalid_json``, ``invalid_value``, ``context_length_exceeded``, ...).
        err_type: OpenAI error type (``invalid_request_error``).
    """

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None,
        err_type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.err_type = err_type

    def to_json(self) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.code}}


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:32]} is out of range")
    return value


def _param(path: list[str | int]) -> str | None:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else ("." if out else "") + str(part)
    return out or None


def check_tree(obj: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Walk a decoded JSON value (iteratively, no recursion): depth <= ``max_depth`` containers and
    every string and key encodable as UTF-8.

    Raises:
        ApiError: 400 ``invalid_json`` naming the deepest field path reached or the bad string's field.
    """
    stack: list[tuple[Any, int, list[str | int]]] = [(obj, 0, [])]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, dict | list):
            if depth >= max_depth:
                raise ApiError(400, f"The JSON body is nested more than {max_depth} levels deep.", _param(path),
                               "invalid_json")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, child in items:
                if isinstance(key, str):
                    _check_text(key, path)
                if isinstance(child, dict | list | str):
                    stack.append((child, depth + 1, [*path, key] if len(path) < 8 else path))
        elif isinstance(value, str):
            _check_text(value, path)


def _check_text(text: str, path: list[str | int]) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, "A string of the JSON body is not valid Unicode (a lone surrogate escape such as "
                            "\\ud800).", _param(path), "invalid_json") from None


class _Reparse(Exception):
    """orjson's value differs from what ``json.loads`` would give (an integer beyond 64 bits read as a float)."""


_BIG = float(2**63)
_LEAF_TYPES = frozenset({int, float, bool, str, type(None)})
_SLICE = 32_768  # list elements per C-level pass (~2 ms idle); a long list's check gives the GIL back between passes


def _kinds(value: list[Any]) -> set[type]:
    """The set of element types of ``value``, in passes of :data:`_SLICE` elements."""
    if len(value) <= _SLICE:
        return set(map(type, value))
    out: set[type] = set()
    for i in range(0, len(value), _SLICE):
        out.update(map(type, value[i:i + _SLICE]))
        time.sleep(0)  # hand the GIL over now: the event loop waiting for it runs at once, not after 5 ms
    return out


def _check_fast_tree(obj: Any, memo: dict[int, set[type]], max_depth: int = MAX_JSON_DEPTH) -> None:
    """:func:`check_tree` for a value orjson decoded (its strings are valid UTF-8 already): depth only,
    and no list is walked element by element unless it holds containers. The element types of the
    lists longer than 16 go into ``memo`` (by ``id``), so the prompt check does not take them again.

    Raises:
        ApiError: 400 ``invalid_json`` (too deep).
        _Reparse: a float that may be an integer beyond 64 bits (orjson reads those as floats).
    """
    stack: list[tuple[Any, int, list[str | int]]] = [(obj, 0, [])]
    while stack:
        value, depth, path = stack.pop()
        if depth >= max_depth:
            raise ApiError(400, f"The JSON body is nested more than {max_depth} levels deep.", _param(path),
                           "invalid_json")
        if isinstance(value, dict):
            items: Any = value.items()
        else:
            kinds = _kinds(value)
            if len(value) > 16:
                memo[id(value)] = kinds
            if float in kinds and any(type(x) is float and abs(x) >= _BIG for x in value):
                raise _Reparse
            if kinds <= _LEAF_TYPES:
                continue
            items = enumerate(value)
        for key, child in items:
            if isinstance(child, dict | list):
                stack.append((child, depth + 1, [*path, key] if len(path) < 8 else path))
            elif type(child) is float and abs(child) >= _BIG:
                raise _Reparse


def decode_json_object(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body, checked by :func:`check_tree` (:func:`_decode`)."""
    return _decode(raw, {})


def _decode(raw: bytes, memo: dict[int, set[type]]) -> dict[str, Any]:
    """The JSON object of a request body, checked by :func:`check_tree`; ``memo`` gets the element
    types of its long lists when orjson decoded it (:func:`_check_fast_tree`).

    orjson decodes it when it can (UTF-8, valid JSON, integers within 64 bits); otherwise, and for the
    refusal's message, ``json.loads`` decides, so the answer is the same either way.

    Args:
        raw: the body bytes (any size the caller accepted).

    Raises:
        ApiError: 400 ``invalid_json`` for bytes that are not JSON (or not UTF-8/16/32), a body that is
            not an object, ``NaN``/``Infinity``/out-of-range numbers, too many digits in an integer,
            nesting deeper than :data:`MAX_JSON_DEPTH` or a string that is not valid Unicode.
    """
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass  # json.loads below: UTF-16/32 bodies, and the message of a refusal
    else:
        if not isinstance(body, dict):
            raise ApiError(400, "The JSON body must be an object.", None, "invalid_json")
        try:
            _check_fast_tree(body, memo)
            return body
        except _Reparse:
            memo.clear()
    try:
        body = json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise ApiError(400, f"The JSON body is nested more than {MAX_JSON_DEPTH} levels deep.", None,
                       "invalid_json") from None
    except UnicodeDecodeError:
        raise ApiError(400, "Malformed JSON body: not UTF-8 text.", None, "invalid_json") from None
    except ValueError as exc:  # json.JSONDecodeError, int digit limit, the hooks above
        raise ApiError(400, f"Malformed JSON body: {str(exc)[:200]}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "The JSON body must be an object.", None, "invalid_json")
    check_tree(body)
    return body


TokenId = Annotated[StrictInt, Field(ge=0, le=UINT32_MAX)]
OutputTokens = Annotated[StrictInt, Field(ge=1, le=MAX_OUTPUT_TOKENS)]
Choices = Annotated[StrictInt, Field(ge=1, le=MAX_N)]


class _Body(BaseModel):
    """Fields every generation endpoint reads; unknown fields are kept for the engine."""

    model_config = ConfigDict(extra="allow", frozen=True)

    model: Annotated[StrictStr, Field(min_length=1, max_length=MAX_MODEL_NAME)]
    stream: StrictBool | None = None
    max_tokens: OutputTokens | None = None
    max_completion_tokens: OutputTokens | None = None
    n: Choices | None = None
    best_of: Choices | None = None
    stream_options: dict[str, Any] | None = None


def is_token_ids(value: list[Any], memo: dict[int, set[type]] | None = None) -> bool:
    """Every element of ``value`` is a JSON integer (``int``, not ``bool``); True for ``[]``. C-level
    passes (:func:`_kinds`), not a Python loop per element; ``memo``: element types already taken."""
    if len(value) <= 16:
        return all(type(x) is int for x in value)
    kinds = memo.get(id(value)) if memo else None
    return (kinds if kinds is not None else _kinds(value)) == {int}


def _ids_in_range(ids: list[int]) -> bool:
    if len(ids) <= _SLICE:
        return min(ids) >= 0 and max(ids) <= UINT32_MAX
    for i in range(0, len(ids), _SLICE):
        part = ids[i:i + _SLICE]
        if min(part) < 0 or max(part) > UINT32_MAX:
            return False
        time.sleep(0)  # as in _kinds
    return True


_PROMPT_SHAPES = "must be a string, a list of strings, a list of token ids or a list of token-id lists"


def _check_ids(ids: list[int], where: str) -> None:
    if ids and not _ids_in_range(ids):
        j = next(j for j, t in enumerate(ids) if not 0 <= t <= UINT32_MAX)
        raise _PromptInvalid(f"token id {where}[{j}] is outside [0, {UINT32_MAX}]")


class _PromptInvalid(ValueError):
    pass


def check_prompt(prompt: Any, memo: dict[int, set[type]] | None = None, max_context: int = 0) -> int | None:
    """Check a ``/v1/completions`` ``prompt``: a string, a list of strings, a non-empty list of token
    ids or a list whose items are strings or non-empty token-id lists (ids in ``[0, 2**32 - 1]``).

    ``memo``: the element types of the body's long lists (:func:`_decode`). ``max_context`` > 0: a
    prompt of token ids only that is longer than this is not range-checked (its exact count already
    says it cannot be served: the caller refuses it, 400 ``context_length_exceeded``).

    Returns:
        the exact prompt tokens when the prompt is token ids only (``[1, 2]`` or ``[[1, 2], [3]]``),
        else None (text: the caller estimates it).

    Raises:
        ApiError: 400 ``invalid_value`` (``param: "prompt"``), as pydantic's refusal read before.
    """
    try:
        if isinstance(prompt, str):
            return None
        if isinstance(prompt, list) and prompt:
            if is_token_ids(prompt, memo):
                if not 0 < max_context < len(prompt):
                    _check_ids(prompt, "prompt")
                return len(prompt)
            exact = 0
            id_lists: list[tuple[int, list[int]]] = []
            for i, item in enumerate(prompt):
                if isinstance(item, str):
                    exact = -1
                    continue
                if isinstance(item, list) and item and is_token_ids(item, memo):
                    id_lists.append((i, item))
                    if exact >= 0:
                        exact += len(item)
                    continue
                raise _PromptInvalid(_PROMPT_SHAPES)
            if exact < 0 or not 0 < max_context < exact:
                for i, item in id_lists:
                    _check_ids(item, f"prompt[{i}]")
            return exact if exact >= 0 else None
        raise _PromptInvalid(_PROMPT_SHAPES)
    except _PromptInvalid as exc:
        raise ApiError(400, f"'prompt' {exc}.", "prompt", "invalid_value") from None


class CompletionRequest(_Body):
    """``POST /v1/completions``: ``prompt`` is a string, strings, token ids or token-id lists (checked by
    :func:`check_prompt` after the model, without a per-element pass in pydantic)."""

    prompt: Any


class ChatMessage(BaseModel):
    """One chat message: ``role`` and ``content`` (string, list of parts, or null); other keys kept."""

    model_config = ConfigDict(extra="allow", frozen=True)

    role: Annotated[StrictStr, Field(min_length=1, max_length=64)]
    content: StrictStr | list[dict[str, Any] | StrictStr] | None = None


class ChatCompletionRequest(_Body):
    """``POST /v1/chat/completions``: ``messages`` is a non-empty list of :class:`ChatMessage`."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]


@dataclass(frozen=True, slots=True)
class ValidRequest:
    """A validated generation request.

    Attributes:
        body: the decoded JSON object (unchanged; the raw bytes are what is relayed).
        model: ``model``.
        stream: ``stream`` (False when absent).
        max_tokens: ``max_completion_tokens``, else ``max_tokens``; None when neither is given.
        n: ``n`` (1 when absent).
        prompt_ids: a completion prompt of token ids only: its exact token count; None for text, chat
            or a mix (:func:`check_prompt`).
    """

    body: dict[str, Any]
    model: str
    stream: bool
    max_tokens: int | None
    n: int
    prompt_ids: int | None = None


def _first_error(exc: ValidationError) -> ApiError:
    err = exc.errors()[0]
    loc = [p for p in err["loc"] if isinstance(p, int) or p in _FIELD_NAMES]
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if err["type"] == "missing":
        msg = "is required"
    param = _param(loc)
    return ApiError(400, f"'{param}' {msg}." if param else f"{msg}.", param, "invalid_value")


_FIELD_NAMES = frozenset(
    {"model", "stream", "max_tokens", "max_completion_tokens", "n", "best_of", "stream_options", "prompt",
     "messages", "role", "content"}
)


def validate_body(body: dict[str, Any], chat: bool, max_context: int = 0,
                  _memo: dict[int, set[type]] | None = None) -> ValidRequest:
    """Validate a decoded body against its endpoint's model.

    Args:
        body: output of :func:`decode_json_object`.
        chat: True for ``/v1/chat/completions``.
        max_context: the replica's (or largest replica's) context length in tokens; 0 = unknown. An
            output length above it can never be served and is refused.

    Raises:
        ApiError: 400 ``invalid_value`` naming the field.
    """
    model = ChatCompletionRequest if chat else CompletionRequest
    try:
        req = model.model_validate(body)
    except ValidationError as exc:
        raise _first_error(exc) from None
    prompt_ids = None if chat else check_prompt(body["prompt"], _memo, max_context)  # pydantic's field order: prompt was last
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is not None and max_context > 0 and max_tokens > max_context:
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        raise ApiError(400, f"'{field}' ({max_tokens}) is larger than the model's context length ({max_context} "
                            "tokens).", field, "invalid_value")
    return ValidRequest(body, req.model, bool(req.stream), max_tokens, req.n or 1, prompt_ids)


def validate_request(raw: bytes, chat: bool, max_context: int = 0) -> ValidRequest:
    """:func:`decode_json_object` then :func:`validate_body`.

    Raises:
        ApiError: the first problem found (400).
    """
    memo: dict[int, set[type]] = {}
    return validate_body(_decode(raw, memo), chat, max_context, memo)
