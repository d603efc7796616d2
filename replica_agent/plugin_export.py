"""vLLM-free helpers of the FairBatching scheduler plugin (replica_agent/vllm_plugin.py).

Kept apart so that they import in both venvs (the plugin runs in the vLLM venv, which has numpy but
not the agent's dependencies; the unit tests run in the main venv, which has no vLLM):

- :func:`time_model_from_env`: ``FAIRBATCH_COEFFICIENTS="a,b,c"`` or ``FAIRBATCH_PROFILE``;
- :func:`request_slo`: per-request SLO from ``sampling_params.extra_args`` (OpenAI ``vllm_xargs``);
- :class:`PluginExporter`: the non-blocking per-step sink of plugin mode (``unix:PATH`` datagram
  socket, or a file of JSON lines);
- :func:`step_deadline`: deadline and slack of a request's next token (same formula as
  :class:`~replica_agent.policy.batching.FairBatchingPolicy`).
"""

from __future__ import annotations

import json
import math
import os
import socket
import stat
from collections.abc import Mapping
from typing import IO, Any

from replica_agent.policy.time_model import TimeModel

XARG_TTFT = "fairbatch_ttft_ms"
"""Key of a request's TTFT target (ms) in ``vllm_xargs`` / ``SamplingParams.extra_args``."""
XARG_TPOT = "fairbatch_tpot_ms"
"""Key of a request's TPOT target (ms) in ``vllm_xargs`` / ``SamplingParams.extra_args``."""


def positive_float(value: Any) -> float | None:
    """``float(value)`` when it is a finite number > 0, else None."""
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    return f if f > 0 and math.isfinite(f) else None


def time_model_from_env(env: Mapping[str, str] | None = None) -> tuple[TimeModel, str]:
    """Time model from ``FAIRBATCH_COEFFICIENTS`` ("a,b,c", ms) or ``FAIRBATCH_PROFILE``; returns (model, source).

    Neither set: profile ``llama-3-8b-a100`` (replica_agent.profiles.DEFAULT_PROFILE).

    Raises:
        ValueError: malformed coefficients (or a, b, c out of range); KeyError: unknown profile.
    """
    env = os.environ if env is None else env
    coef = (env.get("FAIRBATCH_COEFFICIENTS") or "").strip()
    if coef:
        parts = [p.strip() for p in coef.split(",")]
        if len(parts) != 3:
            raise ValueError(f"FAIRBATCH_COEFFICIENTS must be 'a,b,c', got {coef!r}")
        a, b, c = (float(p) for p in parts)
        return TimeModel(a, b, c), f"coefficients {a:g},{b:g},{c:g}"
    from replica_agent.profiles import DEFAULT_PROFILE, load_profile

    name = (env.get("FAIRBATCH_PROFILE") or "").strip() or DEFAULT_PROFILE
    return load_profile(name).time_model, f"profile {name}"


def request_slo(request: Any) -> tuple[float | None, float | None]:
    """(ttft_ms, tpot_ms) from ``request.sampling_params.extra_args`` (None where absent or invalid)."""
    sp = getattr(request, "sampling_params", None)
    extra = getattr(sp, "extra_args", None) if sp is not None else None
    if not extra or not isinstance(extra, Mapping):
        return None, None
    return positive_float(extra.get(XARG_TTFT)), positive_float(extra.get(XARG_TPOT))


def step_deadline(
    now_ms: float, arrival_ms: float, tokens_out: int, ttft_ms: float, tpot_ms: float,
    first_token_ms: float | None,
) -> tuple[float, float]:
    """(deadline_ms, slack_ms) of the next token: arrival + ttft + tpot * out, and first + tpot * out once known."""
    deadline = arrival_ms + ttft_ms + tpot_ms * tokens_out
    if first_token_ms is not None:
        deadline = min(deadline, first_token_ms + tpot_ms * tokens_out)
    return deadline, deadline - now_ms


class PluginExporter:
    """Non-blocking per-step JSON sink of plugin mode.

    ``target``: ``unix:PATH`` (or a PATH that is a socket) sends one datagram per record to the UNIX
    datagram socket PATH with a non-blocking socket: a record is dropped (counted in ``dropped``)
    when the reader's buffer is full, no reader is bound, or it is too large for one datagram. Any
    other value appends one JSON line per record to that file (line-buffered).

    Attributes:
        sent: records handed to the socket or written.
        dropped: records dropped.
    """

    def __init__(self, target: str) -> None:
        self.target = target
        self.sent = 0
        self.dropped = 0
        self._sock: socket.socket | None = None
        self._addr = ""
        self._file: IO[str] | None = None
        is_sock = target.startswith("unix:")
        path = target[5:] if is_sock else target
        if not is_sock:
            try:
                is_sock = stat.S_ISSOCK(os.stat(path).st_mode)
            except OSError:
                is_sock = False
        if is_sock:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)
            self._addr = path
        else:
            self._file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - closed in close()

    @property
    def is_socket(self) -> bool:
        """True in datagram mode."""
        return self._sock is not None

    def send(self, record: Mapping[str, Any]) -> bool:
        """Send or write one record; False when it was dropped."""
        line = json.dumps(record, separators=(",", ":"))
        try:
            if self._sock is not None:
                self._sock.sendto(line.encode(), self._addr)
            elif self._file is not None:
                self._file.write(line + "\n")
            else:
                raise OSError("exporter closed")
        except OSError:  # EAGAIN (reader slow), ENOENT/ECONNREFUSED (no reader), EMSGSIZE (too large)
            self.dropped += 1
            return False
        self.sent += 1
        return True

    def close(self) -> None:
        """Close the socket or file (later sends are dropped)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._file is not None:
            self._file.close()
            self._file = None
