"""Plugin mode of the agent: PAB from the vLLM scheduler plugin's exported engine state.

``fairbatch-agent serve --plugin-export unix:PATH`` binds the UNIX datagram socket PATH; the
FairBatching scheduler plugin (replica_agent/vllm_plugin.py, ``FAIRBATCH_PLUGIN_EXPORT=unix:PATH``)
sends one record per ``schedule()`` (the engine state) and one per executed step (its measured
time); format: replica_agent/plugin_export.py.

Pure parts (no I/O, time passed in):

- :func:`parse_record`: one datagram -> a record dict (None when malformed or of another version);
- :func:`replica_state_from_record`: the exact PAB inputs of a state record:

  * decodes = requests with ``ph == "d"`` (running, first token out, one token per step):
    ``DecodeState(next_deadline_ms=dl, tpot_ms=tpot, context_tokens=ctx, tokens_out=o, max_tokens=mt)``;
  * prefills = every other request, running (a chunked prefill in flight, or a preempted request
    recomputing) or waiting: ``PendingPrefill(prompt_tokens=ctx, computed_tokens=c)`` (``ctx`` =
    prompt + tokens out: what the engine must have computed before the next token);
  * plus one ``PendingPrefill(prompt_tokens)`` per active lease (Reserve) whose request is not in
    the record yet;
  * ``kv_free_tokens = kv_free_blocks * block_size`` (the block pool's free blocks; exact, where
    proxy mode estimates ``(1 - kv_usage) * capacity`` from /metrics);
  * ``now_ms`` is on the plugin's clock (unix wall-clock ms, same host), so deadlines age between
    records. The counts are as of the start of the record's step (conservative: the tokens that
    step computes are still counted as to do).

- :func:`export_mode`: the staleness rule (below); :func:`lease_matches`: whether a vLLM request
  id belongs to the router request id a lease was granted for.

Staleness (``--plugin-stale-ms`` N). vLLM's engine loop calls ``schedule()`` only while it has
requests, so an idle engine exports nothing. Without a state record in the last N ms the agent
asks the /metrics scrape: engine idle (0 running, 0 waiting) -> mode ``idle``, proxy-mode state
(its own request tracking and the scrape; an idle engine has nothing to track), no alarm; engine
busy or no scrape -> mode ``stale``: the plugin stopped exporting (an engine restarted without
``FAIRBATCH_PLUGIN_EXPORT``, a wedged engine core, a socket problem). Then the agent falls back to
its proxy-mode state, says so in ``status_detail`` ("plugin export stale ..."), sets the gauge
``fairbatch_agent_plugin_export_stale`` to 1 and counts the transition in
``fairbatch_agent_plugin_fallbacks``. With ``--no-proxy`` the agent tracks no request itself, so a
stale export also makes it unhealthy (routers stop sending it work).

Online time model (replica_agent/policy/calibration.py): each step record (new tokens, context
tokens, chunk x prefix, decodes, ``measured_ms``) teaches the agent's
:class:`~replica_agent.policy.calibration.OnlineTimeModel`; PAB (agent and router, through the
snapshot's coefficients) plans with its conservative model, the fit times the learned margin.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import stat
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from replica_agent.plugin_export import RECORD_VERSION
from replica_agent.policy.pab import DecodeState, PendingPrefill, ReplicaState
from replica_agent.policy.time_model import TimeModel

log = logging.getLogger(__name__)

def parse_record(data: bytes | str) -> dict[str, Any] | None:
    """One export datagram -> record dict; None when not JSON, not an object, or not ``"v": 1``."""
    try:
        rec = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(rec, dict) or rec.get("v") != RECORD_VERSION:
        return None
    return rec


def record_kind(rec: Mapping[str, Any]) -> str:
    """``state`` or ``step`` (a record without ``kind`` is a state record)."""
    return str(rec.get("kind") or "state")


def lease_matches(engine_request_id: str, router_request_id: str) -> bool:
    """Whether vLLM's id (``cmpl-<rid>-<n>-<suffix>``, ``chatcmpl-<rid>...``) carries ``router_request_id``."""
    if not router_request_id:
        return False
    return engine_request_id == router_request_id or f"-{router_request_id}-" in f"-{engine_request_id}-"


def _int(v: Any, default: int = 0) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


def record_decodes_prefills(rec: Mapping[str, Any]) -> tuple[tuple[DecodeState, ...], tuple[PendingPrefill, ...]]:
    """Decodes and prefills of a state record (conversion: module docstring).

    Raises:
        KeyError, TypeError, ValueError: on a request entry without the fields a decode needs.
    """
    decodes: list[DecodeState] = []
    prefills: list[PendingPrefill] = []
    for q in rec.get("reqs") or ():
        ctx = _int(q.get("ctx"), _int(q.get("p")) + _int(q.get("o")))
        if q.get("ph") == "d":
            mt = q.get("mt")
            decodes.append(DecodeState(
                next_deadline_ms=float(q["dl"]), tpot_ms=float(q["tpot"]), context_tokens=ctx,
                tokens_out=_int(q.get("o")), max_tokens=None if mt is None else _int(mt),
            ))
        else:
            prefills.append(PendingPrefill(prompt_tokens=ctx, computed_tokens=min(ctx, _int(q.get("c")))))
    return tuple(decodes), tuple(prefills)


def replica_state_from_record(
    rec: Mapping[str, Any], now_ms: float, time_model: TimeModel, margin_frac: float,
    lease_prompts: Iterable[int] = (),
    max_seqs: int | None = None,
    margin_cap_tpots: float = 1.0,
) -> ReplicaState:
    """PAB inputs from a state record (module docstring).

    Args:
        rec: a state record.
        now_ms: now on the plugin's clock (unix ms).
        time_model: the model PAB uses (the agent's online fit x its margin).
        margin_frac, margin_cap_tpots: the horizon margin (replica_agent/policy/pab.py ``planning_horizon_ms``).
        lease_prompts: prompt tokens of active leases whose request the record does not list.
        max_seqs: the engine's sequence cap when the record has none (its ``max_seqs``, the
            scheduler's own figure, wins); None = no cap known.

    Raises:
        KeyError, TypeError, ValueError: on a malformed record.
    """
    decodes, prefills = record_decodes_prefills(rec)
    prefills += tuple(PendingPrefill(int(p)) for p in lease_prompts)
    kv_free = _int(rec["kv_free_blocks"]) * _int(rec["block_size"])
    rec_seqs = _int(rec.get("max_seqs"), 0)
    return ReplicaState(
        now_ms=now_ms, decodes=decodes, prefills=prefills, kv_free_tokens=max(0, kv_free),
        time_model=time_model, margin_frac=margin_frac, max_seqs=rec_seqs if rec_seqs >= 1 else max_seqs,
        margin_cap_tpots=margin_cap_tpots,
    )


UNLISTED_LOOKBACK_MS = 50.0
"""How far before a state record's arrival (agent ms) a tracked request may have reached the engine and
still be missing from it (:func:`unlisted_prefills`): the hop from vLLM's API server to its engine core
and the record's own delivery take a few ms."""


def unlisted_prefills(rec: Mapping[str, Any], recent: Iterable[tuple[str, PendingPrefill]]) -> tuple[PendingPrefill, ...]:
    """The pending prefills of tracked requests the record does not list.

    In plugin mode with the proxy, a request's lease is consumed when the proxy forwards it, but the
    plugin's record lists it only from the next ``schedule()``: while a step runs (up to a second for a
    long prefill) it would be counted nowhere and PAB would offer its prefill time again. The agent passes
    the requests still in prefill that reached the engine since shortly before the record arrived
    (``Tracker.recent_prefills``, :data:`UNLISTED_LOOKBACK_MS`); those whose key (the router's request id,
    before any ``#n`` suffix the proxy adds to a repeated id) no vLLM id of the record carries
    (:func:`lease_matches`) are still to do.

    Args:
        rec: the state record.
        recent: (tracker key, PAB input) of the recent tracked prefills.
    """
    out: list[PendingPrefill] = []
    ids: list[str] | None = None  # the record's ids, read only when a recent request needs them
    for key, pending in recent:
        if ids is None:
            ids = [str(q.get("id") or "") for q in rec.get("reqs") or ()]
        base = key.split("#", 1)[0]
        if not any(lease_matches(i, base) for i in ids):
            out.append(pending)
    return tuple(out)


PLUGIN, IDLE, STALE = "plugin", "idle", "stale"
"""Where the agent's PAB inputs come from (:func:`export_mode`)."""


def export_mode(age_ms: float | None, stale_ms: float, engine_busy: bool | None) -> str:
    """The staleness rule (module docstring): ``plugin``, ``idle`` or ``stale``.

    Args:
        age_ms: agent ms since the last state record arrived, None before the first.
        stale_ms: N: a busy engine must export a record at least this often.
        engine_busy: the /metrics scrape reports running or waiting requests (None: no scrape).

    Returns:
        ``plugin``: the last record is fresh, PAB uses it. ``idle``: no fresh record but the engine
        reports no request (vLLM does not step, so exports nothing, while idle): proxy-mode state,
        not an anomaly. ``stale``: no fresh record while the engine is busy or unknown: proxy-mode
        state, flagged.
    """
    if age_ms is not None and age_ms <= stale_ms:
        return PLUGIN
    return IDLE if engine_busy is False else STALE


def parse_export_target(target: str) -> str:
    """``unix:PATH`` -> PATH.

    Raises:
        ValueError: for anything else (the agent reads only the datagram socket).
    """
    if not target.startswith("unix:") or len(target) <= 5:
        raise ValueError(f"--plugin-export must be unix:PATH, got {target!r}")
    return target[5:]


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, on_datagram: Callable[[bytes], None]) -> None:
        self._on = on_datagram

    def datagram_received(self, data: bytes, addr: Any) -> None:
        try:
            self._on(data)
        except Exception:  # never let one record kill the reader
            log.exception("plugin export record handling failed")

    def error_received(self, exc: Exception) -> None:
        log.warning("plugin export socket error: %s", exc)


class PluginExportReader:
    """Binds the UNIX datagram socket and hands every datagram to ``on_datagram`` (non-blocking).

    Bounded: each datagram is handled as it arrives on the event loop (no queue of our own); when
    the agent falls behind, the kernel's receive buffer fills and the plugin drops records (its
    ``dropped`` count travels in every record).

    Args:
        path: socket path; an existing socket file there is replaced (a stale one from a killed agent).
        on_datagram: called with each datagram's bytes.
    """

    def __init__(self, path: str, on_datagram: Callable[[bytes], None]) -> None:
        self.path = path
        self._on = on_datagram
        self._transport: asyncio.DatagramTransport | None = None

    async def start(self) -> None:
        """Bind and start reading.

        Raises:
            OSError: when PATH exists and is not a socket, or cannot be bound.
        """
        try:
            if stat.S_ISSOCK(os.stat(self.path).st_mode):
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.bind(self.path)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        loop = asyncio.get_running_loop()
        self._transport, _ = await loop.create_datagram_endpoint(lambda: _Protocol(self._on), sock=sock)

    def close(self) -> None:
        """Stop reading and remove the socket file."""
        if self._transport is not None:
            self._transport.close()
            self._transport = None
            try:
                os.unlink(self.path)
            except OSError:
                pass
