"""fairbatch_common/log_redact.py: keys, bearer tokens and aiohttp's quoted header lines never reach a log line."""

from __future__ import annotations

import io
import logging

from aiohttp.http_exceptions import BadHttpMessage

from fairbatch_common.log_redact import RedactingFilter, install, redact


def test_redact_values() -> None:
    assert redact("Authorization: Bearer sk-abc123") == "Authorization: <redacted>"
    assert redact("b'Authorization Bearer sk-secret-1'") == "b'Authorization <redacted>'"
    assert redact("headers {'authorization': 'Basic dXNlcjpwdw=='}") == "headers {'authorization': '<redacted>'}"
    assert redact("token=Bearer abc.def;x") == "token=Bearer <redacted>;x"
    assert redact("key sk-live-XYZ_987 in text") == "key sk-<redacted> in text"
    assert redact("X-Api-Key: k1\nnext line") == "X-Api-Key: <redacted>\nnext line"
    assert redact("request 9f3e: queued 12 ms") == "request 9f3e: queued 12 ms"  # nothing to hide: unchanged


def _capture() -> tuple[logging.Logger, io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
    install([handler])
    install([handler])  # idempotent: one filter per handler
    assert sum(isinstance(f, RedactingFilter) for f in handler.filters) == 1
    logger = logging.getLogger("aiohttp.server.test-redact")
    logger.propagate = False
    logger.handlers = [handler]
    logger.setLevel(logging.DEBUG)
    return logger, stream


def test_aiohttp_malformed_header_line_logged_without_the_line_or_traceback() -> None:
    logger, stream = _capture()
    try:
        raise BadHttpMessage("Invalid header value char:\n\n  b'Authorization: Bearer sk-secret-2\\x01'")
    except BadHttpMessage as exc:
        logger.error("Error handling request from %s", "127.0.0.1", exc_info=exc)
    out = stream.getvalue()
    assert out == ("INFO aiohttp.server.test-redact Error handling request from 127.0.0.1: malformed HTTP from the "
                   "client (BadHttpMessage; its text is not logged)\n")


def test_other_tracebacks_are_kept_but_redacted() -> None:
    logger, stream = _capture()
    try:
        raise RuntimeError("upstream said: Authorization: Bearer sk-inner-key")
    except RuntimeError:
        logger.exception("failed for key %s", "sk-arg-key")
    out = stream.getvalue()
    assert "Traceback (most recent call last)" in out and "RuntimeError: upstream said: Authorization: <redacted>" in out
    assert "sk-inner-key" not in out and "sk-arg-key" not in out
    assert out.startswith("ERROR aiohttp.server.test-redact failed for key sk-<redacted>\n")
