"""The router's Prometheus metrics: one registry per router, base units, Prometheus names.

Units (the Prometheus naming rules: base units, ``_seconds``, ``_ratio``, ``_total`` for counters):
every duration is in seconds. Durations of a request (TTFT, TPOT, queue wait, request duration)
are taken on the router's :class:`~fairbatch_common.clock.Clock`, so they are wall seconds in
production (time scale 1) and simulated seconds under a time scale (the demo, the tests), the
same unit the SLO targets and the load generator's report use. Placement and Reserve latency are
wall seconds of this process. PAB and budget age come from the agents in simulated ms and are
exported in seconds.

The SLO series (per SLO class and tenant, measured at the router):

- ``fairbatch_router_ttft_seconds``: request arrival at the router -> first byte relayed to the
  client (a stream's first event; a non-stream answer's whole body). Bucket edges are a fixed
  ladder plus edges around every class's ``ttft_ms`` (:func:`slo_buckets`), so a quantile near
  a target is read to within a tenth of it.
- ``fairbatch_router_tpot_seconds``: (last byte - first byte) / (output events - 1), over the
  SSE data events the relay counted (one per token and choice in vLLM's streams, divided by the
  request's ``n``); streams with fewer than two events have no TPOT (as the load generator).
- ``fairbatch_router_slo_requests_total``: requests judged against their class (every answered
  request but client errors: 400/401/404 and client disconnects); each is either
  ``fairbatch_router_slo_attained_total`` (served with TTFT <= ttft_ms and TPOT <= tpot_ms) or
  counted once in ``fairbatch_router_slo_misses_total{kind}``, ``kind`` the first that applies of
  ``rejected`` (429), ``failed`` (5xx, upstream error), ``ttft``, ``tpot``. So attainment =
  attained / requests, and the misses by kind add up to requests - attained.

Label cardinality is bounded: tenants and classes come from the configuration (the authenticator
only yields configured tenants), ``code`` is the HTTP status, ``outcome`` a fixed vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from fairbatch_common.metrics import ReloadMetrics, standard_registry

TTFT_LADDER_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
"""TTFT bucket edges kept whatever the classes (seconds)."""
TPOT_LADDER_S = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
"""TPOT bucket edges kept whatever the classes (seconds)."""
AROUND_TARGET = (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0)
"""Multiples of each class target added as bucket edges."""
DURATION_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
QUEUE_WAIT_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

ANSWER_SERIES_CACHE = 4096  # (tenant, class, outcome, status) keys whose series observe_answer keeps
SLO_EXEMPT_OUTCOMES = frozenset({"bad_request", "unauthorized", "client_disconnect"})
"""Outcomes not judged against the SLO (the client's doing)."""
REJECTED_OUTCOMES = frozenset({"queue_full", "slo_infeasible", "work_shed", "queue_timeout", "tenant_rate",
                               "tenant_concurrency", "queue_cap", "flow_control_capacity", "flow_control_shed",
                               "overloaded"})
"""Outcomes answered 429, or 529 (``overloaded``, dynamo-kv's all-busy answer), counted as
``kind="rejected"`` misses."""


def slo_buckets(targets_ms: Iterable[float], ladder_s: Iterable[float]) -> tuple[float, ...]:
    """Histogram edges: ``ladder_s`` plus :data:`AROUND_TARGET` multiples of every target.

    Args:
        targets_ms: class targets (ms, > 0).
        ladder_s: fixed edges (seconds).

    Returns:
        Sorted distinct edges in seconds, rounded to 0.1 ms (``+Inf`` is added by the client).
    """
    edges = {round(float(e), 4) for e in ladder_s}
    for t in targets_ms:
        edges.update(round(t / 1000.0 * k, 4) for k in AROUND_TARGET)
    return tuple(sorted(e for e in edges if e > 0))


class RouterMetrics:
    """The router's Prometheus metrics in their own registry (no global registry).

    Args:
        ttft_targets_ms: every class's ``ttft_ms`` at start (bucket edges; fixed for the process).
        tpot_targets_ms: every class's ``tpot_ms`` at start.
    """

    def __init__(self, ttft_targets_ms: Iterable[float] = (), tpot_targets_ms: Iterable[float] = ()) -> None:
        self.registry = standard_registry("router")
        r = self.registry
        self._answer_series: dict[tuple[str, str, str, int], tuple[Any, ...]] = {}
        self.requests = Counter(
            "fairbatch_router_requests", "Requests by tenant, SLO class and outcome",
            ["tenant", "slo_class", "outcome"], registry=r,
        )
        self.request_duration = Histogram(
            "fairbatch_router_request_duration_seconds",
            "Request arrival to the end of the answer, by SLO class and HTTP status (router clock, s)",
            ["slo_class", "code"], buckets=DURATION_BUCKETS_S, registry=r,
        )
        self.ttft = Histogram(
            "fairbatch_router_ttft_seconds",
            "Time to first token measured at the router: arrival to first byte relayed (router clock, s)",
            ["slo_class", "tenant"], buckets=slo_buckets(ttft_targets_ms, TTFT_LADDER_S), registry=r,
        )
        self.tpot = Histogram(
            "fairbatch_router_tpot_seconds",
            "Time per output token measured at the router: (last - first byte) / (events - 1) (router clock, s)",
            ["slo_class", "tenant"], buckets=slo_buckets(tpot_targets_ms, TPOT_LADDER_S), registry=r,
        )
        self.slo_requests = Counter(
            "fairbatch_router_slo_requests", "Requests judged against their SLO class (not client errors)",
            ["slo_class", "tenant"], registry=r,
        )
        self.slo_attained = Counter(
            "fairbatch_router_slo_attained", "Requests served within their class's TTFT and TPOT targets",
            ["slo_class", "tenant"], registry=r,
        )
        self.slo_misses = Counter(
            "fairbatch_router_slo_misses",
            "Requests that missed their SLO, once each, by the first kind that applies (rejected, failed, ttft, tpot)",
            ["slo_class", "tenant", "kind"], registry=r,
        )
        self.migrations = Counter(
            "fairbatch_router_stream_migrations",
            "Streamed completions whose replica failed after the first byte (router/migration.py), by cause "
            "(error_event, disconnect, silence, replica_removed, drain: the agent drained and handed it over) and outcome (resumed: continued elsewhere to its "
            "end; complete: every token was out; limit, not_continuable, context, no_replica, failed: ended with "
            "the SSE error event; client_gone)",
            ["cause", "outcome"], registry=r,
        )
        self.migration_added = Histogram(
            "fairbatch_router_stream_migration_added_seconds",
            "Wall seconds a migrated stream lost per migration: its replica's failure seen to the continuation's "
            "first event relayed",
            buckets=QUEUE_WAIT_BUCKETS_S, registry=r,
        )
        self.inflight = Gauge(
            "fairbatch_router_inflight_requests", "Generation requests being handled (queued, relayed)", registry=r
        )
        self.picks = Counter(
            "fairbatch_router_ext_proc_requests",
            "Requests seen by the ext_proc endpoint picker (router/ext_proc.py), by tenant, SLO class and outcome "
            "(picked then settled as ok / upstream_refused / upstream_error / client_disconnect / fallback_served, or "
            "refused at the headers with the HTTP router's outcome words)",
            ["tenant", "slo_class", "outcome"], registry=r,
        )
        self.pick_streams = Gauge(
            "fairbatch_router_ext_proc_streams", "Open ext_proc streams (one per request in the gateway)", registry=r
        )
        self.queue_depth = Gauge("fairbatch_router_queue_depth", "Requests waiting in the admission queue", registry=r)
        self.dispatch_stalled = Gauge(
            "fairbatch_router_dispatch_stalled_seconds",
            "How long the admission queue has not moved while the head of a band could be placed (router clock, "
            "s; 0 = not stalled; router/admission_queue.py Dispatcher.stalled_ms)", registry=r,
        )
        self.queue_wait = Histogram(
            "fairbatch_router_queue_wait_seconds", "Time spent in the admission queue (router clock, s)",
            buckets=QUEUE_WAIT_BUCKETS_S, registry=r,
        )
        self.placement_seconds = Histogram(
            "fairbatch_router_placement_seconds", "Placement decision time (wall s)",
            buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2), registry=r,
        )
        self.ledger_degraded = Gauge(
            "fairbatch_router_ledger_degraded",
            "1 while the shared (Redis) ledger is unreachable and the router serves on its local ledger",
            registry=r,
        )
        self.reload = ReloadMetrics(r, "router", "configuration")  # the configuration the router starts with: success 1
        self.config_reloads = self.reload.reloads
        self.config_last_reload_success = self.reload.success
        self.config_last_reload_timestamp = self.reload.timestamp
        self.config_last_reload_success_timestamp = self.reload.success_timestamp
        self.config_generation = Gauge(
            "fairbatch_router_config_generation", "Configurations applied since start (1 = the initial one)", registry=r,
        )
        self.tenant_vtc = Gauge(
            "fairbatch_router_tenant_vtc", "Virtual token counter per tenant (weighted tokens / weight)",
            ["tenant"], registry=r,
        )
        self.reserve_seconds = Histogram(
            "fairbatch_router_reserve_seconds", "Reserve RPC latency (wall s)",
            buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0), registry=r,
        )
        self.admit_refusals = Counter(
            "fairbatch_router_admit_refusals",
            "Inline admissions an agent refused on arrival (its budget was gone; the request was re-placed)",
            ["replica"], registry=r,
        )
        self.replica_pab = Gauge(
            "fairbatch_router_replica_pab_seconds", "Usable PAB per replica and class (s; 0 when stale or unhealthy)",
            ["replica", "slo_class"], registry=r,
        )
        self.fleet_pab = Gauge(
            "fairbatch_router_fleet_pab_seconds",
            "Spare admission capacity: sum over usable replicas of the class's PAB (s)", ["slo_class"], registry=r,
        )
        self.fleet_replicas_without_pab = Gauge(
            "fairbatch_router_fleet_replicas_without_pab",
            "Replicas with no usable PAB for the class (0, stale or unhealthy)", ["slo_class"], registry=r,
        )
        self.budget_age = Gauge(
            "fairbatch_router_budget_age_seconds", "Age of the latest budget snapshot (s; -1 = none)",
            ["replica"], registry=r,
        )
        self.replicas = Gauge("fairbatch_router_replicas", "Replicas known (static or discovered)", registry=r)
        self.replica_inflight = Gauge(
            "fairbatch_router_replica_inflight_requests",
            "Requests this router holds a lease for on the replica (granted, or being relayed), not yet ended",
            ["replica"], registry=r,
        )
        self.replica_queued = Gauge(
            "fairbatch_router_replica_queued_requests",
            "Requests waiting for the replica: its engine's waiting queue (from its budget stream) plus "
            "the router queue entry it is held for (0 or 1)",
            ["replica"], registry=r,
        )
        self.replica_changes = Counter(
            "fairbatch_router_replica_changes", "Replicas added or removed by discovery", ["change"], registry=r,
        )
        self.replica_aborts = Counter(
            "fairbatch_router_replica_aborts",
            "In-flight requests failed because their replica was removed by discovery", registry=r,
        )

    def observe_reload(self, ok: bool, now_s: float | None = None) -> None:
        """Count one reload and set the last-reload gauges (fairbatch_common/metrics.py ``ReloadMetrics``)."""
        self.reload.observe(ok, now_s)

    def forget_replica(self, replica_id: str) -> None:
        """Drop every series of a removed replica."""
        for gauge in (self.budget_age, self.replica_inflight, self.replica_queued, self.admit_refusals):
            try:
                gauge.remove(replica_id)
            except KeyError:
                pass
        for labels in [key for key in list(self.replica_pab._metrics) if key[0] == replica_id]:  # noqa: SLF001
            try:
                self.replica_pab.remove(*labels)
            except KeyError:
                pass

    def observe_answer(
        self,
        tenant: str,
        slo_class: str,
        outcome: str,
        code: int,
        duration_s: float,
        ttft_s: float | None,
        tpot_s: float | None,
        ttft_target_s: float,
        tpot_target_s: float,
    ) -> None:
        """Count one answered request: outcome, duration by status, TTFT/TPOT and the SLO verdict.

        Args:
            tenant, slo_class: the principal's (configured names).
            outcome: the router's outcome word (``ok``, ``queue_full``, ``upstream_error``, ...).
            code: HTTP status sent.
            duration_s: arrival to the end of the answer (router clock, s).
            ttft_s: arrival to the first byte (s); None when no byte of an answer was relayed.
            tpot_s: per-token time (s); None below two events or for an error.
            ttft_target_s, tpot_target_s: the class's targets (s).
        """
        key = (tenant, slo_class, outcome, code)
        series = self._answer_series.get(key)
        if series is None:
            series = self._answer_series_for(key)
        requests, duration, ttft, tpot, slo_requests, slo_attained = series
        requests.inc()
        duration.observe(duration_s)
        if outcome == "ok" and ttft_s is not None:
            ttft.observe(ttft_s)
            if tpot_s is not None:
                tpot.observe(tpot_s)
        if outcome in SLO_EXEMPT_OUTCOMES or code in (400, 401, 404, 413, 415, 408, 422):
            return
        slo_requests.inc()
        kind = miss_kind(outcome, code, ttft_s, tpot_s, ttft_target_s, tpot_target_s)
        if kind is None:
            slo_attained.inc()
        else:
            self.slo_misses.labels(slo_class, tenant, kind).inc()

    def _answer_series_for(self, key: tuple[str, str, str, int]) -> tuple[Any, ...]:
        """The labelled series :meth:`observe_answer` updates for ``(tenant, slo_class, outcome, code)``,
        looked up once and kept (``labels()`` costs a lock and a validation per call; per-tenant series
        are never removed). At most :data:`ANSWER_SERIES_CACHE` keys are kept; past that the cache restarts."""
        tenant, slo_class, outcome, code = key
        if len(self._answer_series) >= ANSWER_SERIES_CACHE:
            self._answer_series.clear()
        series = (self.requests.labels(tenant, slo_class, outcome), self.request_duration.labels(slo_class, str(code)),
                  self.ttft.labels(slo_class, tenant), self.tpot.labels(slo_class, tenant),
                  self.slo_requests.labels(slo_class, tenant), self.slo_attained.labels(slo_class, tenant))
        self._answer_series[key] = series
        return series


def miss_kind(
    outcome: str, code: int, ttft_s: float | None, tpot_s: float | None, ttft_target_s: float, tpot_target_s: float
) -> str | None:
    """The SLO verdict of one judged request: None when attained, else the first kind that applies.

    ``rejected`` (answered 429), ``failed`` (any other non-ok outcome, or no byte relayed),
    ``ttft`` (TTFT > target), ``tpot`` (TPOT > target; a request without TPOT meets that half, as
    in the load generator's attainment).
    """
    if code == 429 or outcome in REJECTED_OUTCOMES:
        return "rejected"
    if outcome != "ok" or ttft_s is None:
        return "failed"
    if ttft_s > ttft_target_s:
        return "ttft"
    if tpot_s is not None and tpot_s > tpot_target_s:
        return "tpot"
    return None
