"""router/charges.py: the decode estimate and its correction from a non-stream answer's usage."""

from __future__ import annotations

from router.charges import decode_correction, decode_estimate


def test_decode_estimate_is_max_tokens_else_the_default() -> None:
    assert decode_estimate(16, 256) == 16
    assert decode_estimate(0, 256) == 256


def test_decode_correction_from_usage() -> None:
    body = b'{"id":"cmpl-1","choices":[{"text":"hi"}],"usage":{"prompt_tokens":5,"completion_tokens":7}}'
    assert decode_correction(body, 16) == 7 - 16
    assert decode_correction(body, 7) == 0
    assert decode_correction(body, 2) == 5


def test_no_usable_usage_corrects_nothing() -> None:
    assert decode_correction(b'{"choices":[]}', 16) == 0  # no usage
    assert decode_correction(b'{"usage":null}', 16) == 0
    assert decode_correction(b'{"usage":{"prompt_tokens":5}}', 16) == 0
    assert decode_correction(b'{"usage":{"completion_tokens":"many"}}', 16) == 0
    assert decode_correction(b'{"usage": oops', 16) == 0  # not JSON
    assert decode_correction(b'["usage"]', 16) == 0  # JSON, not an object
    assert decode_correction(None, 16) == 0  # a streamed payload has no body bytes
