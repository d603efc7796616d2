"""Engine (vLLM) error answers mapped onto fairbatch's one error vocabulary (fairbatch_common/openai_errors.py)."""

from __future__ import annotations

import json

import pytest

from fairbatch_common.openai_errors import map_engine_error, sse_error_event


def vllm(message: str, status: int, param: str | None = None, kind: str = "BadRequestError") -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": status}}).encode()


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        # vLLM's serving_engine message for prompt + max_tokens over max_model_len
        (400, vllm("This model's maximum context length is 2048 tokens. However, you requested 3000 tokens "
                   "(2000 in the messages, 1000 in the completion).", 400),
         ("invalid_request_error", "context_length_exceeded", None)),
        # vLLM v1 processor
        (400, vllm("The decoder prompt (length 5000) is longer than the maximum model length of 4096.", 400),
         ("invalid_request_error", "context_length_exceeded", None)),
        (404, vllm("The model `gpt-4o` does not exist.", 404, kind="NotFoundError"),
         ("invalid_request_error", "model_not_found", "model")),
        (400, vllm("when using `top_logprobs`, `logprobs` must be set to true.", 400, "top_logprobs"),
         ("invalid_request_error", None, "top_logprobs")),
        # older vLLM: the fields at the top level
        (400, json.dumps({"object": "error", "message": "n must be at least 1, got 0.", "type": "BadRequestError",
                          "param": None, "code": 400}).encode(), ("invalid_request_error", None, None)),
        (500, vllm("engine dead", 500, kind="InternalServerError"), ("server_error", None, None)),
    ],
)  # fmt: skip
def test_mapped(status: int, body: bytes, expected: tuple) -> None:
    err = json.loads(map_engine_error(status, body))["error"]
    assert (err["type"], err["code"], err["param"]) == expected
    assert err["message"] == (json.loads(body).get("error") or json.loads(body))["message"]


def test_non_error_bodies_unchanged() -> None:
    for body in (b"not json", b"[1, 2]", b'{"detail": "Not Found"}', b""):
        assert map_engine_error(404, body) == body


def test_sse_error_event_is_an_openai_error_then_done():
    raw = sse_error_event("engine stream ended without [DONE]")
    first, second, rest = raw.split(b"\n\n")
    assert first.startswith(b"data: ") and second == b"data: [DONE]" and rest == b""
    assert json.loads(first[6:]) == {"error": {"message": "engine stream ended without [DONE]",
                                               "type": "upstream_error", "param": None, "code": 502}}
