"""Process entry helpers for the async servers: uvloop where available, clean shutdown on signals."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any


def run(main: Coroutine[Any, Any, Any]) -> Any:
    """Run ``main`` to completion on uvloop when installed, else on the default asyncio loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a pinned dependency on Linux
        return asyncio.run(main)
    return uvloop.run(main)


def setup_logging(level: str = "INFO") -> None:
    """Plain structured-ish log lines on stderr (no prompt text is ever logged)."""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
