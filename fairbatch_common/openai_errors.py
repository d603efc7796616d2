"""One error vocabulary in OpenAI's shape, whoever detects the error (router, agent or engine).

Shape: ``{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}``.
Codes used across fairbatch:

| code | HTTP | type | when |
| --- | --- | --- | --- |
| ``context_length_exceeded`` | 400 | ``invalid_request_error`` | prompt (+ max_tokens) over the model's context |
| ``model_not_found`` | 404 | ``invalid_request_error`` | ``model`` is not served by any replica |
| ``None`` | 400 | ``invalid_request_error`` | any other invalid field; ``param`` names it |

:func:`map_engine_error` rewrites an engine's (vLLM's) error answer onto these: vLLM sends
``{"error": {"message", "type": "BadRequestError", "param", "code": 400}}`` (older versions the
same fields at the top level with ``"object": "error"``), with the context-length condition told
only by its message. The message and ``param`` are kept; 5xx answers keep their status and get
type ``server_error``.
"""

from __future__ import annotations

import json
import re
from typing import Any

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
MODEL_NOT_FOUND = "model_not_found"
INVALID_REQUEST = "invalid_request_error"

# vLLM's messages for an over-long request (serving_engine.py, v1 processor, the simulated engine)
_CONTEXT_RE = re.compile(r"maximum context length|maximum model length|longer than the maximum model length", re.I)
_MODEL_RE = re.compile(r"model .* does not exist|does not exist\.?$|model not found", re.I)


def error_body(message: str, err_type: str = INVALID_REQUEST, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """The OpenAI error object (a dict, ready for ``json.dumps``)."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def sse_error_event(message: str, code: int = 502, err_type: str = "upstream_error") -> bytes:
    """The SSE events that end a stream whose upstream failed after its first byte: an error event in
    OpenAI's shape (``type`` ``err_type``, by default ``upstream_error``; ``replica_draining`` for a
    draining agent's hand-over; ``param`` null, ``code`` the HTTP-like status), then ``data: [DONE]``
    (what vLLM's server sends when a stream fails, so clients stop reading)."""
    payload = {"error": {"message": message, "type": err_type, "param": None, "code": code}}
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\ndata: [DONE]\n\n"


def classify(status: int, message: str, param: str | None) -> tuple[str, str | None, str | None]:
    """(type, code, param) of an error with ``status`` and ``message`` in the vocabulary above."""
    if status >= 500:
        return "server_error", None, param
    if _CONTEXT_RE.search(message):
        return INVALID_REQUEST, CONTEXT_LENGTH_EXCEEDED, param
    if status == 404 and (param == "model" or _MODEL_RE.search(message)):
        return INVALID_REQUEST, MODEL_NOT_FOUND, "model"
    return INVALID_REQUEST, None, param


def map_engine_error(status: int, body: bytes) -> bytes:
    """An engine's error body rewritten in the vocabulary (the message kept); a body that is not
    an error object comes back unchanged."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return body
    if not isinstance(obj, dict):
        return body
    err = obj.get("error") if isinstance(obj.get("error"), dict) else (obj if obj.get("object") == "error" else None)
    if not isinstance(err, dict) or not isinstance(err.get("message"), str):
        return body
    param = err.get("param") if isinstance(err.get("param"), str) else None
    err_type, code, param = classify(status, err["message"], param)
    return json.dumps(error_body(err["message"], err_type, code, param)).encode()
