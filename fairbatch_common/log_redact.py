"""A logging filter that keeps secrets and request content out of every log line (aiohttp's included).

Installed on the log handlers by :func:`fairbatch_common.runtime.setup_logging` (both servers), so it sees
every record that reaches a handler, whatever logger it came from. Per record it:

1. replaces a client's malformed HTTP (aiohttp's "Error handling request" with a parser exception,
   whose text quotes the raw header line, API key included) by one line naming the exception class
   only, without its traceback, at INFO: the client's error, not the server's;
2. formats any other traceback once and redacts it like the message;
3. redacts the message: the value after ``Authorization``/``Proxy-Authorization``/``X-Api-Key``/
   ``Api-Key``/``Cookie`` up to the end of the line or quote, ``Bearer <token>`` and ``Basic
   <token>`` anywhere, and OpenAI-style ``sk-...`` keys anywhere.

The record's ``msg`` becomes the redacted text and ``args`` is cleared, so every handler that runs
after the filter sees the redacted record.
"""

from __future__ import annotations

import logging
import re
import traceback

from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

REDACTED = "<redacted>"
_HEADER = re.compile(r"(?i)\b(authorization|proxy-authorization|x-api-key|api[-_]key|cookie|x-fairbatch-token)"
                     r"([^\w\r\n]{1,4})[^\r\n'\"]*")
_SCHEME = re.compile(r"(?i)\b(bearer|basic)(\s+)[^\s'\"\\,;]+")
_SK = re.compile(r"\bsk-[A-Za-z0-9_\-]{3,}")
_CLIENT_PROTOCOL_ERRORS = (HttpProcessingError, RequestPayloadError)


def redact(text: str) -> str:
    """``text`` with header values, bearer/basic tokens and ``sk-`` keys replaced by ``<redacted>``."""
    text = _HEADER.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)
    text = _SCHEME.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)
    return _SK.sub("sk-" + REDACTED, text)


class RedactingFilter(logging.Filter):
    """See the module docstring. Never drops a record (``filter`` always returns True)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "_fairbatch_redacted", False):
            return True
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string must not lose the line
            message = str(record.msg)
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and record.name.startswith("aiohttp") and isinstance(exc, _CLIENT_PROTOCOL_ERRORS):
            message = f"{message}: malformed HTTP from the client ({type(exc).__name__}; its text is not logged)"
            record.exc_info = None
            record.exc_text = None
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
        elif record.exc_info:
            record.exc_text = redact("".join(traceback.format_exception(*record.exc_info)).rstrip("\n"))
            record.exc_info = None
        elif record.exc_text:
            record.exc_text = redact(record.exc_text)
        record.msg = redact(message)
        record.args = None
        record._fairbatch_redacted = True  # noqa: SLF001 - marks the record done for the next handler
        return True


def install(handlers: list[logging.Handler] | None = None) -> RedactingFilter:
    """Add one :class:`RedactingFilter` to ``handlers`` (default: the root logger's), once per handler.

    Returns:
        the filter (the existing one when a handler already had one).
    """
    targets = logging.getLogger().handlers if handlers is None else handlers
    found = None
    for h in targets:
        for f in h.filters:
            if isinstance(f, RedactingFilter):
                found = f
    flt = found or RedactingFilter()
    for h in targets:
        if flt not in h.filters and not any(isinstance(f, RedactingFilter) for f in h.filters):
            h.addFilter(flt)
    return flt
