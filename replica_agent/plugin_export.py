"""vLLM-free helpers of the FairBatching scheduler plugin (replica_agent/vllm_plugin.py).

Kept apart so that they import in both venvs (the plugin runs in the vLLM venv, which has numpy but
not the agent's dependencies; the unit tests run in the main venv, which has no vLLM):

- :func:`time_model_from_env`: ``FAIRBATCH_COEFFICIENTS="a,b,c"`` or ``FAIRBATCH_PROFILE``;
- :func:`request_slo`: per-request SLO from ``sampling_params.extra_args`` (OpenAI ``vllm_xargs``);
- :class:`PluginExporter`: the non-blocking per-step sink of plugin mode (``unix:PATH`` datagram
  socket, or a file of JSON lines);
- :func:`step_deadline`: deadline and slack of a request's next token (same formula as
  :class:`~replica_agent.policy.batching.FairBatchingPolicy`);
- :func:`state_record` / :func:`step_record`: the two record kinds of the export (built here so
  that the plugin, the agent's reader (replica_agent/plugin_mode.py) and the tests share one format).

Export format (one JSON object per datagram or line, ``"v": 1``):

- state record (no ``kind``, or ``"kind": "state"``), sent at the end of every ``schedule()``: the
  state the policy saw at the start of the step (``t_ms``, unix wall-clock ms) and the batch it
  scheduled; per request ``reqs[]``: ``id``, ``q`` (``r`` running / ``w`` waiting), ``ph`` (``d``
  decode / ``p`` prefill), ``p`` prompt, ``c`` computed tokens, ``o`` tokens out, ``ctx`` prompt +
  out, ``mt`` max tokens, ``arr`` arrival, ``ft`` first-token time, ``dl`` next-token deadline,
  ``sl`` slack (unix ms / ms), ``ttft``, ``tpot`` (ms), ``n`` tokens scheduled this step; KV
  ``kv_free_blocks``, ``kv_total_blocks``, ``block_size``; ``new_tokens``, ``context_tokens``,
  ``predicted_ms`` and ``tm`` (the model the plugin plans with, ``[a, b, c, e, d]``: its online fit x margin), ``dropped`` (records the exporter dropped so far);
- step record (``"kind": "step"``), sent from ``update_from_output()`` once a step has run: the
  step-log fields ``start_ms``, ``new_tokens``, ``context_tokens``, ``measured_ms``, ``batch_size``.
"""

from __future__ import annotations

import json
import math
import os
import socket
import stat
from collections.abc import Mapping
from typing import IO, Any

from replica_agent.policy.engine_state import is_decode, next_token_deadline
from replica_agent.policy.time_model import TimeModel

RECORD_VERSION = 1
"""``"v"`` of every export record."""

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

    Neither set: profile ``llama-3-8b-a100`` (replica_agent.policy.profiles.DEFAULT_PROFILE).

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
    from replica_agent.policy.profiles import DEFAULT_PROFILE, load_profile

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
    """(deadline_ms, slack_ms) of the next token (replica_agent/policy/engine_state.py next_token_deadline)."""
    deadline = next_token_deadline(arrival_ms, ttft_ms, tpot_ms, tokens_out, first_token_ms)
    return deadline, deadline - now_ms


def state_record(
    step: int, now_ms: float, reason: str | None, state: Any, batch: Any, sched: Mapping[str, int],
    new_tokens: int, ctx: int, exact: bool | None, kv_total_blocks: int, block_size: int,
    default_ttft_ms: float, default_tpot_ms: float, time_model: TimeModel, dropped: int,
) -> dict[str, Any]:
    """The per-step state record (format: module docstring).

    Args:
        step: step number; now_ms: start of ``schedule()`` (unix ms); reason: why the stock
            schedule ran (None: the policy's batch).
        state: the policy input (:class:`~replica_agent.policy.batching.SchedState`).
        batch: the policy's proposal (:class:`~replica_agent.policy.batching.Batch`) or None.
        sched: tokens scheduled per request id; new_tokens, ctx: the batch's totals.
        exact: whether the executed batch equalled the proposal (None: stock step).
    """
    reqs = []
    min_slack = math.inf
    min_tpot = math.inf
    for running, group in ((True, state.running), (False, state.waiting)):
        for r in group:
            ttft = r.ttft_ms or default_ttft_ms
            tpot = r.tpot_ms or default_tpot_ms
            deadline, slack = step_deadline(now_ms, r.arrival_ms, r.tokens_out, ttft, tpot, r.first_token_ms)
            decode = is_decode(r, running)
            if decode:
                min_slack = min(min_slack, slack)
                min_tpot = min(min_tpot, tpot)
            reqs.append({
                "id": r.request_id, "q": "r" if running else "w", "ph": "d" if decode else "p",
                "p": r.prompt_tokens, "c": r.computed_tokens, "o": r.tokens_out, "ctx": r.num_tokens,
                "mt": r.max_tokens, "arr": round(r.arrival_ms, 3),
                "ft": None if r.first_token_ms is None else round(r.first_token_ms, 3),
                "dl": round(deadline, 3), "sl": round(slack, 3), "ttft": ttft, "tpot": tpot,
                "n": sched.get(r.request_id, 0),
            })
    return {
        "v": RECORD_VERSION, "step": step, "t_ms": round(now_ms, 3),
        "mode": "fairbatching" if reason is None else "stock", "reason": reason,
        "kv_free_blocks": state.kv_free_blocks,
        "kv_total_blocks": kv_total_blocks,
        "block_size": block_size,
        "token_cap": state.max_num_batched_tokens, "max_seqs": state.max_num_seqs,
        "budget_ms": (None if min_slack == math.inf else round(max(min_slack, min_tpot), 3)),
        "proposed": batch.items if batch is not None else None,
        "scheduled": dict(sched), "exact": exact,
        "new_tokens": new_tokens, "context_tokens": ctx,
        "predicted_ms": round(time_model.batch_ms(new_tokens, ctx), 3) if new_tokens else 0.0,
        "tm": [time_model.a_ms, time_model.b_ms_per_new_token, time_model.c_ms_per_context_token,
               time_model.e_ms_per_chunk_prefix, time_model.d_ms_per_decode, time_model.f_ms_per_chunk_sq,
               time_model.chunk_tokens],
        "reqs": reqs, "dropped": dropped,
    }


def step_record(start_ms: float, new_tokens: int, context_tokens: int, measured_ms: float,
                batch_size: int, prefill_chunk_prefix_tokens: int = 0, num_decodes: int = 0,
                prefill_chunk_sq_tokens: int = 0) -> dict[str, Any]:  # fmt: skip
    """The step-log line of one executed step (``fairbatch-agent calibrate`` reads these fields).

    ``prefill_chunk_prefix_tokens``: sum of chunk x prefix over the step's prefill chunks; ``num_decodes``:
    its decodes; ``prefill_chunk_sq_tokens``: sum of chunk^2 over its prefill chunks (the online time
    model's features, replica_agent/policy/time_model.py StepFeatures).
    As an export record it also carries ``"v"`` and ``"kind": "step"`` (calibrate ignores them).
    """
    return {
        "v": RECORD_VERSION, "kind": "step", "start_ms": round(start_ms, 3), "new_tokens": new_tokens,
        "context_tokens": context_tokens, "measured_ms": round(measured_ms, 4), "batch_size": batch_size,
        "prefill_chunk_prefix_tokens": prefill_chunk_prefix_tokens, "num_decodes": num_decodes,
        "prefill_chunk_sq_tokens": prefill_chunk_sq_tokens,
    }


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
