"""Process entry helpers for the async servers: uvloop where available, clean shutdown on signals."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Coroutine
from typing import Any


def run(main: Coroutine[Any, Any, Any]) -> Any:
    """Run ``main`` to completion on uvloop when installed, else on the default asyncio loop.

    ``FAIRBATCH_EVENT_LOOP=asyncio`` in the environment forces the default loop (a diagnostic knob).
    """
    if os.environ.get("FAIRBATCH_EVENT_LOOP", "").lower() == "asyncio":
        return asyncio.run(main)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a pinned dependency on Linux
        return asyncio.run(main)
    return uvloop.run(main)


def hold_grpc_aio() -> None:
    """Hold one process-wide reference to grpc.aio's runtime (call once, before serving; a second call only adds a reference).

    grpc.aio runs one completion-queue poller thread per process and shuts it down when the last aio
    channel or server is freed; that shutdown joins the poller thread in a loop, from a destructor,
    and can wait forever when the poller is blocked writing its wake-up byte to a socket that no event
    loop reads any more (grpc/grpc PR #40989; issue #22365 recommends initialising from the main
    thread). Holding a reference keeps the poller alive until the process exits (it is a daemon
    thread), so neither a server's shutdown nor a test's closed loop can reach that join.
    """
    from grpc.experimental import aio as grpc_aio

    grpc_aio.init_grpc_aio()


def setup_logging(level: str = "INFO") -> None:
    """Plain structured-ish log lines on stderr, through the secret-redacting filter
    (:mod:`fairbatch_common.log_redact`; no prompt text or key is ever logged, aiohttp's lines included)."""
    from fairbatch_common import log_redact

    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    log_redact.install()
