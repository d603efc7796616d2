"""The replica agent's core object: tracker + lease table + engine metrics + PAB + clock.

The proxy feeds request events, the scraper feeds engine metrics, the gRPC server reads budgets and
grants leases; every structural change (arrival, first token, finish, lease grant/consume/release/
expiry, a material metrics change) wakes the WatchBudget streams through :meth:`Agent.change_event`.
Everything runs on one event loop, so no locks are needed; nothing here blocks.

Plugin mode (``plugin_mode=True``; replica_agent/plugin_mode.py): the vLLM scheduler plugin's
per-step records replace the tracker and the KV estimate as PAB's inputs while they are fresh
(:meth:`Agent.on_plugin_record`).

Time model: an :class:`~replica_agent.policy.calibration.OnlineTimeModel` starts from the
configured coefficients and learns from every step it is shown; PAB, Reserve and the snapshots
plan with its conservative model (point model x learned margin, always on; :meth:`Agent.time_model`).
Plugin mode shows it the engine's own step times (step records); proxy mode shows it the
decode-only steps it can time from the token gaps it relays
(replica_agent/policy/step_estimate.py, :meth:`Agent.request_tokens`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from dataclasses import dataclass, field, replace
from typing import Any

from fairbatch_common.clock import Clock
from replica_agent.engine_metrics import EngineMetrics, PrefixHitWindow
from replica_agent.metrics import AgentMetrics
from replica_agent.policy.leases import Lease, LeaseTable, LeaseTableFull
from replica_agent.plugin_mode import PLUGIN, STALE, export_mode, lease_matches, parse_record, record_kind
from replica_agent.plugin_mode import UNLISTED_LOOKBACK_MS, replica_state_from_record, unlisted_prefills
from replica_agent.policy.pab import ClassBudget, PendingPrefill, ReplicaState, SloClass, compute_budgets
from replica_agent.policy.prefill_eta import inflight_schedule, prefill_completions_ms
from replica_agent.policy.reserve import reserve_decision
from replica_agent.policy.preemption import account_preempted
from replica_agent.policy.calibration import TERMS, CalibratorConfig, OnlineTimeModel
from replica_agent.policy.step_estimate import StepStride, decode_step_features, decode_step_gap
from replica_agent.policy.time_model import StepFeatures, TimeModel
from replica_agent.tracker import FinishedRequest, Phase, Tracker, TrackedRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """Settings of one agent (CLI flags; all times in simulated ms).

    Attributes:
        replica_id: id reported in snapshots.
        time_model: a, b, c (ms).
        slo_classes: classes budgets are computed for (non-empty).
        default_slo_class: class of requests without ``x-fairbatch-slo-class``.
        margin_frac: the PAB horizon margin as a share of the TTFT (replica_agent/policy/pab.py
            ``planning_horizon_ms``: H = ttft - min(margin_frac * ttft, margin_cap_tpots * tpot)).
        margin_cap_tpots: the margin is at most this many TPOTs of the class (> 0; inf = no cap).
        kv_capacity_tokens: KV capacity from the flag, None to use the engine's, then the profile's.
        profile_kv_capacity_tokens: last-resort KV capacity (tokens).
        push_interval_ms: WatchBudget pushes at least this often.
        min_push_interval_ms: and at most this often on changes: changes within this long of the
            last snapshot coalesce into one, sent this long after it (0 = a snapshot per change).
        ttl_ms: snapshot TTL for routers.
        lease_ttl_ms: a lease whose request never arrives lapses after this.
        metrics_interval_ms: engine /metrics scrape period.
        metrics_stale_ms: metrics older than this make the agent unhealthy (None: max(5 * interval, ttl)).
        max_leases, max_requests: bounds of the lease table and the tracker.
        plugin_mode: PAB from the scheduler plugin's export (``--plugin-export``).
        plugin_stale_ms: N of the staleness rule (replica_agent/plugin_mode.py).
        proxy_tracking: the agent relays HTTP and tracks requests (False: ``--no-proxy``).
        calibration: settings of the online time model (replica_agent/policy/calibration.py).
        proxy_step_estimates: in proxy mode, learn from the decode-only steps timed from token gaps.
        max_num_batched_tokens: the engine's token budget per step (vLLM's flag; the default of
            ``vllm serve`` on the profile's GPU, replica_agent/policy/profiles.py), for the predicted end
            of each in-flight prefill (replica_agent/policy/prefill_eta.py); plugin mode uses the
            scheduler's own figure.
        max_num_seqs: the engine's cap on running requests (vLLM's ``--max-num-seqs``; the default of
            ``vllm serve`` on the profile's GPU), for PAB's sequence-slot rule (replica_agent/policy/pab.py
            "Sequence slots"); None = no cap known, the rule is off. Plugin mode uses the scheduler's own figure.
    """

    replica_id: str
    time_model: TimeModel
    slo_classes: tuple[SloClass, ...]
    default_slo_class: str
    margin_frac: float = 0.1
    kv_capacity_tokens: int | None = None
    profile_kv_capacity_tokens: int = 0
    push_interval_ms: float = 100.0
    min_push_interval_ms: float = 5.0
    ttl_ms: float = 1000.0
    lease_ttl_ms: float = 5000.0
    metrics_interval_ms: float = 50.0
    metrics_stale_ms: float | None = None
    max_leases: int = 4096
    max_requests: int = 65536
    plugin_mode: bool = False
    plugin_stale_ms: float = 500.0
    proxy_tracking: bool = True
    calibration: CalibratorConfig = field(default_factory=CalibratorConfig)
    proxy_step_estimates: bool = True
    max_num_batched_tokens: int = 8192
    max_num_seqs: int | None = None
    margin_cap_tpots: float = 1.0

    def __post_init__(self) -> None:
        if not self.slo_classes:
            raise ValueError("at least one SLO class is needed")
        names = [c.name for c in self.slo_classes]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate SLO class names: {names}")
        if self.default_slo_class not in names:
            raise ValueError(f"default SLO class {self.default_slo_class!r} is not one of {names}")
        if not self.proxy_tracking and not self.plugin_mode:
            raise ValueError("--no-proxy needs plugin mode (--plugin-export): nothing else tracks requests")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1 or None, got {self.max_num_seqs}")
        if not 0.0 <= self.margin_frac < 1.0:
            raise ValueError(f"margin_frac must be in [0, 1), got {self.margin_frac}")
        if not self.margin_cap_tpots > 0.0:  # also NaN
            raise ValueError(f"margin_cap_tpots must be > 0, got {self.margin_cap_tpots}")
        for name in ("push_interval_ms", "ttl_ms", "lease_ttl_ms", "metrics_interval_ms", "plugin_stale_ms"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if not 0.0 <= self.min_push_interval_ms <= self.push_interval_ms:
            raise ValueError("min_push_interval_ms must be in [0, push_interval_ms]")

    @property
    def stale_after_ms(self) -> float:
        """Age (ms) after which engine metrics count as stale."""
        if self.metrics_stale_ms is not None:
            return self.metrics_stale_ms
        return max(5.0 * self.metrics_interval_ms, self.ttl_ms)


@dataclass(frozen=True, slots=True)
class BudgetView:
    """The agent's state at one instant, as a snapshot reports it.

    Attributes:
        now_ms: simulated ms of the computation.
        classes: PAB per class name.
        healthy: engine reachable and metrics fresh.
        status_detail: why unhealthy or degraded ("" when fine).
        num_running, num_waiting, kv_usage: from the engine's last scrape (0, 0, 1.0 when none).
        kv_capacity_tokens: capacity used for kv_free (tokens).
        active_leases: leases granted, not arrived.
        max_prompt_tokens: engine max model length (0 = unknown).
        inflight_prefill_ms: the in-flight reservation per prefill, in engine order (ms; pab.py
            ``inflight_lumps``).
        inflight_prefill_done_ms: when each of those ends, ms after ``now_ms`` (same length;
            replica_agent/policy/prefill_eta.py).
        prefix_queries_tokens, prefix_hits_tokens: the engine's prefix cache over the agent's recent
            window (:class:`~replica_agent.engine_metrics.PrefixHitWindow`): prompt tokens looked up
            and found cached (0, 0 = unknown).
        draining: the agent is draining (:meth:`Agent.start_drain`): every class budget is zero.
    """

    now_ms: float
    classes: dict[str, ClassBudget]
    healthy: bool
    status_detail: str
    num_running: int
    num_waiting: int
    kv_usage: float
    kv_capacity_tokens: int
    active_leases: int
    max_prompt_tokens: int
    inflight_prefill_ms: tuple[float, ...] = ()
    inflight_prefill_done_ms: tuple[float, ...] = ()
    prefix_queries_tokens: int = 0
    prefix_hits_tokens: int = 0
    draining: bool = False


@dataclass(frozen=True, slots=True)
class ReserveResult:
    """Answer to a Reserve.

    Attributes:
        granted: whether a lease was granted.
        lease_id: the lease ("" when refused).
        reason: refusal reason: ``unhealthy``, ``unknown-class``, ``no-budget``, ``kv-full``,
            ``prompt-too-long``, ``too-many-leases`` ("" when granted).
        budget: the class's budget after the decision (None for an unknown class).
        expires_unix_ms: unix ms when the lease lapses (0 when refused).
    """

    granted: bool
    lease_id: str
    reason: str
    budget: ClassBudget | None
    expires_unix_ms: int


@dataclass(slots=True)
class _PluginView:
    record: dict | None = None  # last state record
    recv_ms: float | None = None  # agent ms it arrived
    mode: str = STALE  # last mode computed (plugin / idle / stale)


@dataclass(slots=True)
class _EngineView:
    metrics: EngineMetrics | None = None
    ok_ms: float | None = None
    progress_ms: float | None = None  # last scrape whose token counters moved (:meth:`Agent.engine_queue_moving`)
    error: str = "engine metrics not scraped yet"
    missing: tuple[str, ...] = ()
    logged_missing: set[str] = field(default_factory=set)


class Agent:
    """Wires tracker, leases, engine metrics and PAB (see module docstring).

    Args:
        config: settings.
        clock: the process clock (simulated ms).
        lease_id_prefix: prefix of lease ids, unique per agent process.
    """

    def __init__(self, config: AgentConfig, clock: Clock, lease_id_prefix: str = "lease") -> None:
        self.config = config
        self.clock = clock
        self.tracker = Tracker(max_requests=config.max_requests)
        self.leases = LeaseTable(max_leases=config.max_leases, id_prefix=lease_id_prefix)
        self.metrics = AgentMetrics()
        self.classes = {c.name: c for c in config.slo_classes}
        self.max_prompt_tokens = 0
        self.draining = False  # told to drain (start_drain): zero budget, new work refused
        self._engine = _EngineView()
        self.prefix_window = PrefixHitWindow()  # the engine's recent prefix-cache hit ratio (snapshots)
        self._plugin = _PluginView()
        self.calibrator = OnlineTimeModel(config.time_model, config.calibration)
        self._step_counters: dict[str, Any] = {}  # time_model_steps' child per source (never removed)
        self._stride = StepStride()  # proxy mode: one token-gap sample kept per step's worth
        self._export_time_model()
        self._seq = itertools.count(1)
        self._changed = asyncio.Event()
        for c in config.slo_classes:  # export every class from the start
            self.metrics.pab.labels(c.name)
            self.metrics.pab_tokens.labels(c.name)

    def set_slo_classes(self, classes: tuple[SloClass, ...], default_slo_class: str | None = None) -> None:
        """Swap the SLO classes while serving (a config reload): new Reserves and budgets use them at
        once, tracked requests keep the envelope they arrived with; the budget is pushed.

        Args:
            classes: the new classes (non-empty, distinct names).
            default_slo_class: class of requests without one; None keeps the current one.

        Raises:
            ValueError: as :class:`AgentConfig` (empty, duplicates, default not among them); nothing changed.
        """
        config = replace(self.config, slo_classes=tuple(classes),
                         default_slo_class=default_slo_class or self.config.default_slo_class)  # fmt: skip
        gone = set(self.classes) - {c.name for c in classes}
        self.config = config
        self.classes = {c.name: c for c in config.slo_classes}
        m = self.metrics
        for name in gone:
            for gauge in (m.pab, m.pab_tokens, m.decode_reservation, m.inflight_reservation):
                try:
                    gauge.remove(name)
                except KeyError:
                    pass
        for c in config.slo_classes:
            m.pab.labels(c.name)
            m.pab_tokens.labels(c.name)
        self.notify()

    # ---- change notification -------------------------------------------------------------
    @property
    def change_event(self) -> asyncio.Event:
        """Event set at the next change; take it *before* computing, then wait on it."""
        return self._changed

    def notify(self) -> None:
        """Wake every waiter of the current change event."""
        self._changed.set()
        self._changed = asyncio.Event()

    def start_drain(self) -> bool:
        """Stop taking new work (replica_agent/policy/drain.py): from now on every class budget is
        zero, a Reserve is refused ``draining``, and a snapshot goes out at once with ``draining``
        set. Returns False when the agent was draining already."""
        if self.draining:
            return False
        self.draining = True
        log.warning("agent %s draining: no new work; in-flight requests: %d", self.config.replica_id, len(self.tracker))
        self.notify()
        return True

    def next_seq(self) -> int:
        """Strictly increasing sequence number (snapshots and Reserve answers)."""
        return next(self._seq)

    # ---- engine metrics ------------------------------------------------------------------
    def on_engine_metrics(
        self, metrics: EngineMetrics | None, missing: list[str], error: str, now_ms: float | None = None
    ) -> None:
        """Record a scrape result (scraper callback): metrics and missing names, or an error."""
        now = self.clock.now_ms() if now_ms is None else now_ms
        ev = self._engine
        was_healthy = self._healthy(now)
        if metrics is None:
            answering = ev.ok_ms is not None and not ev.error  # no failure since its last good scrape
            ev.error = error or "engine metrics unavailable"
            self.metrics.scrape_errors.inc()
            if answering:
                # its going is logged as its coming back is (below): the router places nothing here meanwhile.
                # Not only when this failure flips the health: a scrape that times out (after stale_after_ms,
                # the scrape timeout) finds the agent already stale, and that going was never logged
                log.warning("%s; agent unhealthy until the engine answers", ev.error)
            if was_healthy:
                self.notify()
            return
        for name in missing:
            self.metrics.engine_metrics_missing.labels(name).inc()
            if name not in ev.logged_missing:
                ev.logged_missing.add(name)
                log.warning("engine /metrics lacks %s; treated conservatively", name)
        old = ev.metrics
        if old is not None and not was_healthy:  # unhealthy since an earlier good scrape: it is back (logged,
            # as its going was; the first scrape after start-up is not a recovery)
            log.warning("engine answers again (%s); agent healthy", ev.error or "metrics were stale")
        ev.metrics, ev.ok_ms, ev.error, ev.missing = metrics, now, "", tuple(missing)
        if old is not None and (old.itl_count != metrics.itl_count or old.prefix_queries != metrics.prefix_queries):
            ev.progress_ms = now
        self.prefix_window.add(now, metrics.prefix_queries, metrics.prefix_hits)
        material = (
            old is None
            or not was_healthy
            or abs(old.kv_usage - metrics.kv_usage) >= 0.01
            or old.num_running != metrics.num_running
            or old.num_waiting != metrics.num_waiting
        )
        if material:
            self.notify()

    def engine_stalled(self, detail: str) -> None:
        """The proxy saw the engine stall (no byte within the stall timeout): unhealthy from now until the
        next successful /metrics scrape (:meth:`on_engine_metrics` clears it); the budget is pushed at once."""
        was_healthy = self._healthy(self.clock.now_ms())
        self._engine.error = detail
        if was_healthy:
            self.notify()

    def engine_silent_ms(self, now_ms: float | None = None) -> float | None:
        """Simulated ms since the engine last answered a /metrics scrape (None before the first answer)."""
        ok = self._engine.ok_ms
        if ok is None:
            return None
        return (self.clock.now_ms() if now_ms is None else now_ms) - ok

    def engine_queue_moving(self, within_ms: float, now_ms: float | None = None) -> bool:
        """Whether requests wait in the engine's queue while it works: the last scrape shows waiting
        requests, and the engine produced or scheduled tokens within the last ``within_ms`` simulated
        ms (a scrape's inter-token count, decode tokens, or prefix-cache query count, prompt tokens
        scheduled, moved since the scrape before). False before two scrapes, and always False for
        an engine that exports neither counter.

        Used by the stall rule (replica_agent/proxy.py ``StallWatch``): a request silent then may be
        one of the waiting (a full KV cache, a preemption); it is not a stall. A request silent while
        nothing waits is stuck and still ends at the stall timeout, and a frozen engine core moves
        neither counter, even while its API server answers."""
        at, m = self._engine.progress_ms, self._engine.metrics
        if at is None or m is None or m.num_waiting <= 0:
            return False
        return (self.clock.now_ms() if now_ms is None else now_ms) - at <= within_ms

    def _healthy(self, now_ms: float) -> bool:
        ev = self._engine
        return ev.ok_ms is not None and not ev.error and now_ms - ev.ok_ms <= self.config.stale_after_ms

    def health(self, now_ms: float) -> tuple[bool, str]:
        """(healthy, status_detail) at ``now_ms``; in plugin mode the detail says where PAB's inputs come from."""
        healthy, detail = self._scrape_health(now_ms)
        if not self.config.plugin_mode or not healthy:
            return healthy, detail
        mode = self.plugin_mode_now(now_ms)
        if mode == STALE:
            age = self._plugin_age_ms(now_ms)
            what = "no plugin record yet" if age is None else f"plugin export stale ({age:.0f} ms old)"
            if not self.config.proxy_tracking:
                return False, f"{what}; --no-proxy: no request tracking to fall back to"
            return True, "; ".join(x for x in (f"{what}; proxy-mode state", detail) if x)
        return True, detail

    def _scrape_health(self, now_ms: float) -> tuple[bool, str]:
        ev = self._engine
        if ev.ok_ms is None:
            return False, ev.error or "engine metrics not scraped yet"
        if ev.error:
            return False, ev.error
        age = now_ms - ev.ok_ms
        if age > self.config.stale_after_ms:
            return False, f"engine metrics stale ({age:.0f} ms old)"
        if ev.missing:
            return True, "missing engine metrics: " + ", ".join(ev.missing)
        return True, ""

    # ---- plugin mode ---------------------------------------------------------------------
    def _plugin_age_ms(self, now_ms: float) -> float | None:
        pv = self._plugin
        return None if pv.recv_ms is None else now_ms - pv.recv_ms

    def plugin_mode_now(self, now_ms: float) -> str:
        """``plugin``, ``idle`` or ``stale`` (replica_agent/plugin_mode.py :func:`export_mode`); updates
        the stale gauge and counts a fallback on the transition into ``stale``."""
        m = self._engine.metrics
        busy = None if m is None or not self._scrape_health(now_ms)[0] else (m.num_running + m.num_waiting > 0)
        mode = export_mode(self._plugin_age_ms(now_ms), self.config.plugin_stale_ms, busy)
        pv = self._plugin
        if mode != pv.mode:
            if mode == STALE and pv.recv_ms is not None:
                self.metrics.plugin_fallbacks.inc()
                log.warning("plugin export stale: falling back to proxy-mode state")
            elif pv.mode == STALE and pv.recv_ms is not None:
                log.info("plugin export back (%s)", mode)
            pv.mode = mode
        self.metrics.plugin_export_stale.set(1.0 if mode == STALE else 0.0)
        return mode

    def on_plugin_datagram(self, data: bytes, now_ms: float | None = None) -> None:
        """One datagram from the plugin's export socket (PluginExportReader callback)."""
        rec = parse_record(data)
        if rec is None:
            self.metrics.plugin_records.labels("bad").inc()
            return
        self.on_plugin_record(rec, self.clock.now_ms() if now_ms is None else now_ms)

    def on_plugin_record(self, rec: dict, now_ms: float) -> None:
        """A parsed record: a state record replaces PAB's inputs, a step record teaches the online time model."""
        if record_kind(rec) == "step":
            self.metrics.plugin_records.labels("step").inc()
            self._on_step_record(rec)
            return
        try:
            n_blocks = int(rec["kv_free_blocks"]) * int(rec["block_size"])
            ids = [str(q["id"]) for q in rec.get("reqs") or ()]
        except (KeyError, TypeError, ValueError):
            self.metrics.plugin_records.labels("bad").inc()
            return
        self.metrics.plugin_records.labels("state").inc()
        self.metrics.plugin_dropped.set(float(rec.get("dropped") or 0))
        pv = self._plugin
        old = pv.record
        was = pv.mode
        pv.record, pv.recv_ms = rec, now_ms
        consumed = False
        if ids:  # --no-proxy: a lease is used up once its request shows up in the engine
            for lease in self.leases.active():
                if lease.request_id and any(lease_matches(i, lease.request_id) for i in ids):
                    self.leases.consume(lease.lease_id)
                    consumed = True
        material = consumed or old is None or was != self.plugin_mode_now(now_ms)
        if not material:
            total = max(1, int(rec.get("kv_total_blocks") or 0))
            old_phases = sorted(q.get("ph", "") for q in old.get("reqs") or ())
            new_phases = sorted(q.get("ph", "") for q in rec.get("reqs") or ())
            old_free = int(old.get("kv_free_blocks") or 0) * int(old.get("block_size") or 0)
            material = old_phases != new_phases or abs(old_free - n_blocks) * 100 >= total * int(
                rec.get("block_size") or 1
            )
        if material:
            self.notify()

    def _on_step_record(self, rec: dict) -> None:
        try:
            new = int(rec["new_tokens"])
            ctx = int(rec["context_tokens"])
            measured = float(rec["measured_ms"])
            n = int(rec.get("batch_size") or 0)
            pcross = int(rec.get("prefill_chunk_prefix_tokens") or 0)
            dec = int(rec.get("num_decodes") or 0)
            psq = int(rec.get("prefill_chunk_sq_tokens") or 0)  # absent from an older plugin's records: 0
        except (KeyError, TypeError, ValueError):
            return
        if new <= 0 or not measured > 0 or not math.isfinite(measured) or not 0 <= dec <= new:
            return
        # the record carries what the policy model reads (prefill chunk x prefix and chunk^2, decodes); the
        # all-items cross and chunk^2 sums are the engine's own and not needed here
        self.observe_step(StepFeatures(new, ctx, pcross, 0, n, pcross, dec, max(0, psq)), measured, "plugin")

    def observe_step(self, features: StepFeatures, measured_ms: float, source: str, weight: float = 1.0) -> None:
        """Teach the online time model one executed step (``source``: ``plugin`` or ``proxy``)."""
        before = self.calibrator.margin()
        ratio = self.calibrator.observe(features, measured_ms, weight)
        if ratio is None:
            return
        counter = self._step_counters.get(source)  # labels() per token: a lock and a label check each
        if counter is None:
            counter = self._step_counters[source] = self.metrics.time_model_steps.labels(source)
        counter.inc()  # the model's gauges are set at each scrape
        if ratio > before:  # measured > point prediction x the margin planned with before the step: late
            self.metrics.time_model_late_steps.labels(source).inc()
        if abs(self.calibrator.margin() - before) >= 0.01:
            self.notify()

    def _export_time_model(self) -> None:
        cal = self.calibrator
        m = cal.model()
        values = dict(zip(TERMS, (m.a_ms, m.b_ms_per_new_token, m.d_ms_per_decode, m.c_ms_per_context_token,
                                  m.e_ms_per_chunk_prefix, m.f_ms_per_chunk_sq), strict=True))  # fmt: skip
        g = self.metrics
        for term, v in values.items():
            g.time_model_coefficient.labels(term).set(v)
        g.time_model_margin.set(cal.margin())
        for q, v in cal.residual_quantiles().items():
            g.time_model_residual_quantile.labels(f"{q:g}").set(v)
        g.time_model_abs_error.set(cal.mean_abs_rel_error())

    def time_model(self) -> TimeModel:
        """The model PAB, Reserve and snapshots plan with: the online fit x its learned margin."""
        return self.calibrator.conservative()

    def kv_capacity_tokens(self) -> int:
        """KV capacity (tokens): the flag, else the engine's cache_config_info, else the profile."""
        if self.config.kv_capacity_tokens is not None:
            return self.config.kv_capacity_tokens
        m = self._engine.metrics
        if m is not None and m.kv_capacity_tokens:
            return m.kv_capacity_tokens
        return self.config.profile_kv_capacity_tokens

    # ---- PAB -----------------------------------------------------------------------------
    def replica_state(self, now_ms: float) -> ReplicaState:
        """PAB inputs now: the plugin's last record while fresh (plugin mode), else tracked decodes,
        in-flight prefills + leases and the free KV estimated from the scrape (proxy mode)."""
        pv = self._plugin
        if self.config.plugin_mode and pv.record is not None and self.plugin_mode_now(now_ms) == PLUGIN:
            rec = pv.record
            # the record's clock (unix ms at the start of its step) advanced by the agent ms since it arrived
            plugin_now = float(rec.get("t_ms") or 0.0) + (now_ms - pv.recv_ms)
            state = replica_state_from_record(
                rec, plugin_now, self.time_model(), self.config.margin_frac,
                [lease.prompt_tokens for lease in self.leases.active()], self.config.max_num_seqs,
                self.config.margin_cap_tpots,
            )
            # requests the proxy forwarded that the record does not list yet (their leases are consumed)
            unlisted = unlisted_prefills(rec, self.tracker.recent_prefills(pv.recv_ms - UNLISTED_LOOKBACK_MS))
            return replace(state, prefills=(*state.prefills, *unlisted),
                           finish_rate_per_s=self.tracker.finish_rate_per_s(now_ms))
        m = self._engine.metrics
        kv_usage = 1.0 if m is None else m.kv_usage
        kv_free = math.floor((1.0 - kv_usage) * self.kv_capacity_tokens())
        # requests the engine preempted (waiting again, KV freed) must recompute before a new prompt
        decodes, prefills, _ = account_preempted(
            self.tracker.decodes(), self.tracker.prefills(), None if m is None else m.num_waiting)
        prefills += tuple(PendingPrefill(lease.prompt_tokens) for lease in self.leases.active())
        return ReplicaState(
            now_ms=now_ms,
            decodes=decodes,
            prefills=prefills,
            kv_free_tokens=max(0, kv_free),
            time_model=self.time_model(),
            margin_frac=self.config.margin_frac,
            margin_cap_tpots=self.config.margin_cap_tpots,
            max_seqs=self.config.max_num_seqs,
            finish_rate_per_s=self.tracker.finish_rate_per_s(now_ms),
        )

    def compute_budget(self, now_ms: float, state: ReplicaState | None = None) -> BudgetView:
        """PAB of every class plus the replica figures a snapshot carries.

        ``state``: the PAB inputs when the caller already built them (``replica_state(now_ms)``).
        """
        if state is None:
            state = self.replica_state(now_ms)
        classes = compute_budgets(state, self.config.slo_classes)
        if self.draining:  # no new prefill here: routers place elsewhere (the reservations stay as they are)
            classes = {name: replace(b, pab_ms=0.0, pab_tokens=0) for name, b in classes.items()}
        lumps, done = self._inflight_schedule(state, now_ms)
        healthy, detail = self.health(now_ms)
        m = self._engine.metrics
        running = 0 if m is None else m.num_running
        waiting = 0 if m is None else m.num_waiting
        kv_usage = 1.0 if m is None else m.kv_usage
        capacity = self.kv_capacity_tokens()
        queried, hit = self.prefix_window.delta()
        rec = self._plugin.record
        if self.config.plugin_mode and rec is not None and self._plugin.mode == PLUGIN:
            reqs = rec.get("reqs") or ()  # the engine's own figures, as of the record's step
            running = sum(1 for q in reqs if q.get("q") == "r")
            waiting = len(reqs) - running
            total = int(rec.get("kv_total_blocks") or 0)
            if total > 0:
                kv_usage = 1.0 - int(rec.get("kv_free_blocks") or 0) / total
                capacity = total * int(rec.get("block_size") or 0)
        return BudgetView(
            now_ms=now_ms,
            classes=classes,
            healthy=healthy,
            status_detail=detail,
            num_running=running,
            num_waiting=waiting,
            kv_usage=kv_usage,
            kv_capacity_tokens=capacity,
            active_leases=len(self.leases),
            max_prompt_tokens=self.max_prompt_tokens,
            inflight_prefill_ms=lumps,
            inflight_prefill_done_ms=done,
            prefix_queries_tokens=queried,
            prefix_hits_tokens=hit,
            draining=self.draining,
        )

    def _inflight_schedule(self, state: ReplicaState, now_ms: float) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """The in-flight prefills' lumps and predicted ends (prefill_eta.py ``inflight_schedule``).
        In proxy mode the head prompt has been served since the previous prefill ended (or since
        it reached an idle replica); plugin mode's computed tokens already count its progress, and
        the scheduler's record gives its token budget per step."""
        if not state.prefills:
            return (), ()
        step_tokens = self.config.max_num_batched_tokens
        rec = self._plugin.record
        if self.config.plugin_mode and rec is not None and self._plugin.mode == PLUGIN:
            return inflight_schedule(state, int(rec.get("token_cap") or step_tokens), 0.0)
        since = self.tracker.prefill_head_since_ms
        return inflight_schedule(state, step_tokens, 0.0 if since is None else max(0.0, now_ms - since))

    def predicted_prefill_ms(self, key: str, now_ms: float) -> float:
        """Simulated ms from ``now_ms`` until the prefill of tracked request ``key`` is predicted to end
        (its first token): replica_agent/policy/prefill_eta.py ``prefill_completions_ms`` on the
        replica's state, the request at its place among the in-flight prefills (arrival order); 0 when
        it is not in prefill. The proxy starts the request's stall timer there (issue 30)."""
        rec = self.tracker.get(key)
        if rec is None or rec.phase is not Phase.PREFILL:
            return 0.0
        state = self.replica_state(now_ms)
        if not state.prefills:
            return 0.0
        place = sum(1 for _ in itertools.takewhile(lambda k: k != key, self.tracker.prefill_keys()))
        step_tokens = self.config.max_num_batched_tokens
        since = self.tracker.prefill_head_since_ms
        done = prefill_completions_ms(state, step_tokens, 0.0 if since is None else max(0.0, now_ms - since))
        return done[min(place, len(done) - 1)] if done else 0.0

    def refresh_gauges(self, now_ms: float) -> BudgetView:
        """Set the Prometheus gauges from a fresh computation (called by GET /metrics)."""
        view = self.compute_budget(now_ms)
        self._export_time_model()
        m = self.metrics
        for name, b in view.classes.items():
            m.pab.labels(name).set(b.pab_ms / 1000.0)
            m.pab_tokens.labels(name).set(b.pab_tokens)
            m.decode_reservation.labels(name).set(b.decode_reservation_ms / 1000.0)
            m.inflight_reservation.labels(name).set(b.inflight_reservation_ms / 1000.0)
        slack = self.tracker.min_slack_ms(now_ms)
        m.min_slack.set(slack / 1000.0 if slack is not None else math.nan)
        for state, n in self.tracker.counts().items():
            m.requests.labels(state).set(n)
        m.requests.labels("lease").set(view.active_leases)
        m.leases_active.set(view.active_leases)
        m.kv_usage.set(view.kv_usage)
        m.healthy.set(1.0 if view.healthy else 0.0)
        return view

    # ---- leases --------------------------------------------------------------------------
    def reserve(
        self,
        slo_class: str,
        prompt_tokens: int,
        max_tokens: int | None,
        request_id: str,
        now_ms: float,
        waited_ms: float = 0.0,
        answer_budget: bool = True,
        on_time_only: bool = False,
    ) -> ReserveResult:
        """Grant a lease when the prompt fits the class's PAB (architecture.md "Agent", Reserve).

        ``answer_budget``: compute the budget after a grant for the answer (a Reserve RPC's answer
        carries it); False for an inline admission, whose grant needs no answer (budget None then).

        ``waited_ms``: ms the request already spent since its arrival at the router (queued or
        retried); the fit is :func:`~replica_agent.policy.pab.admits`, over the class horizon minus
        it (pab.py, "Aged requests"). The answer's budget is the fresh-arrival one (full horizon),
        what the router's view of this replica holds. ``on_time_only``: the router asks for a start
        that meets the request's TTFT (reserve.py ``reserve_decision``; refused ``not-on-time``).
        """
        budget = None
        cls = self.classes.get(slo_class)
        if cls is None:
            reason = "unknown-class"
        elif self.draining:
            reason = "draining"
            budget = self.compute_budget(now_ms).classes[slo_class]
        elif prompt_tokens < 0 or not waited_ms >= 0.0:  # negative or NaN
            reason = "bad-request"
        else:
            state = self.replica_state(now_ms)
            healthy = self.health(now_ms)[0]  # what compute_budget's view would say
            reason = reserve_decision(prompt_tokens, state, cls, waited_ms, healthy, self.max_prompt_tokens,
                                      on_time_only)[0]
            if reason:  # the refusal's answer carries the class budget before the decision
                budget = self.compute_budget(now_ms, state).classes[slo_class]
            else:
                try:
                    lease_id = self.leases.grant(
                        prompt_tokens, slo_class, max_tokens, now_ms, self.config.lease_ttl_ms, request_id
                    )
                except LeaseTableFull:
                    reason = "too-many-leases"
                    budget = self.compute_budget(now_ms, state).classes[slo_class]
                else:
                    after = self.compute_budget(now_ms).classes[slo_class] if answer_budget else None
                    self.metrics.reserve_total.labels("granted").inc()
                    self.notify()
                    expires = self.clock.unix_ms() + int(round(self.clock.to_wall_s(self.config.lease_ttl_ms) * 1000))
                    return ReserveResult(True, lease_id, "", after, expires)
        self.metrics.reserve_total.labels(reason).inc()
        return ReserveResult(False, "", reason, budget, 0)

    def release(self, lease_id: str) -> bool:
        """Give a lease back; True when it was active."""
        ok = self.leases.release(lease_id)
        if ok:
            self.notify()
        return ok

    def expire_leases(self, now_ms: float) -> list[Lease]:
        """Drop lapsed leases (periodic task); notifies when any lapsed."""
        expired = self.leases.expire(now_ms)
        if expired:
            self.metrics.leases_expired.inc(len(expired))
            for lease in expired:
                log.info("lease %s expired (request %s never arrived)", lease.lease_id, lease.request_id)
            self.notify()
        return expired

    # ---- request events (proxy) ----------------------------------------------------------
    def request_arrived(
        self,
        key: str,
        slo_class: str | None,
        prompt_tokens: int,
        max_tokens: int | None,
        now_ms: float,
        queued_ms: float = 0.0,
        lease_id: str = "",
    ) -> TrackedRequest:
        """A request reached the proxy: consume its lease (if any) and track it in prefill.

        With a valid lease, its prompt tokens and class stand in for the estimate and the missing
        header. An unknown class falls back to the default class. Arrival = now - queued_ms.

        Raises:
            TrackerFull, KeyError: from :meth:`Tracker.on_arrival`.
        """
        lease = self.leases.consume(lease_id) if lease_id else None
        if lease is not None:
            prompt_tokens = lease.prompt_tokens
            slo_class = slo_class or lease.slo_class
            if max_tokens is None:
                max_tokens = lease.max_tokens
        name = slo_class if slo_class in self.classes else self.config.default_slo_class
        cls = self.classes[name]
        req = self.tracker.on_arrival(
            key, name, cls.ttft_ms, cls.tpot_ms, now_ms - max(0.0, queued_ms), prompt_tokens, max_tokens,
            lease.lease_id if lease else "", now_ms,
        )
        self.notify()
        return req

    def request_tokens(self, key: str, now_ms: float, n: int = 1) -> None:
        """Output tokens seen; notifies on the first (prefill -> decode). In proxy mode a decode's
        token gap teaches the time model a decode-only step, one of the k streams' gaps per step
        (replica_agent/policy/step_estimate.py: :func:`decode_step_gap`, :class:`StepStride`)."""
        t = self.tracker
        if self.config.proxy_step_estimates and not self.config.plugin_mode:
            req = t.get(key)
            m = self._engine.metrics
            if req is not None and req.phase is Phase.DECODE and (m is None or m.num_waiting == 0):
                ms = decode_step_gap(req.last_token_ms, now_ms, n, t.num_decodes, t.prefill_idle_since_ms)
                # the features are built only for the one sample in k that the stride keeps
                if ms is not None and self._stride.take(1.0 / t.num_decodes):
                    self.observe_step(decode_step_features(t.num_decodes, t.decode_context_tokens), ms, "proxy")
        if t.on_token(key, now_ms, n):
            self.notify()

    def request_usage(self, key: str, prompt_tokens: int | None, completion_tokens: int | None) -> None:
        """The engine's ``usage`` corrects the counts."""
        self.tracker.on_usage(key, prompt_tokens, completion_tokens)

    def request_done(self, key: str, now_ms: float, outcome: str) -> FinishedRequest | None:
        """Finished or aborted: stop tracking, count the outcome, notify."""
        done = self.tracker.on_finish(key, now_ms, outcome)
        if done is not None:
            self.metrics.requests_total.labels(outcome).inc()
            self.notify()
        return done
