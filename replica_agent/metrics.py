"""The agent's own Prometheus metrics (``fairbatch_agent_*``), in a registry both components build alike.

Base units and Prometheus names: durations in seconds (the agent's clock: wall seconds in
production, simulated seconds under a time scale), shares as ``_ratio``, counters ``_total``
(added by prometheus-client). Every registry carries the process, platform (``python_info``)
and GC collectors and a ``fairbatch_build_info{version,component}`` gauge
(:func:`fairbatch_common.metrics.standard_registry`).
Labels are bounded: SLO classes from the configuration, states and outcomes from fixed vocabularies.
The time-model coefficients keep the planning model's own unit (ms and ms per token; their help
text says so): they are the coefficients of docs/architecture.md's step-time formula.
"""

from __future__ import annotations

import math

from prometheus_client import Counter, Gauge

from fairbatch_common.metrics import ReloadMetrics, standard_registry


class AgentMetrics:
    """The agent's own Prometheus metrics, in their own registry (``fairbatch_agent_*``)."""

    def __init__(self) -> None:
        self.registry = standard_registry("agent")
        r = self.registry
        self.pab = Gauge("fairbatch_agent_pab_seconds",
                         "PAB per SLO class (s), as computed; routers place nothing here while "
                         "fairbatch_agent_healthy is 0", ["slo_class"], registry=r)
        self.pab_tokens = Gauge("fairbatch_agent_pab_tokens",
                                "PAB per SLO class (tokens), as computed; routers place nothing here while "
                                "fairbatch_agent_healthy is 0", ["slo_class"], registry=r)
        self.decode_reservation = Gauge(
            "fairbatch_agent_decode_reservation_seconds", "decode reservation inside the class horizon (s)",
            ["slo_class"], registry=r,
        )
        self.inflight_reservation = Gauge(
            "fairbatch_agent_inflight_reservation_seconds", "in-flight prefill + lease reservation (s)",
            ["slo_class"], registry=r,
        )
        self.min_slack = Gauge(
            "fairbatch_agent_min_slack_seconds", "smallest slack over tracked requests (s; NaN when none)", registry=r
        )
        self.requests = Gauge("fairbatch_agent_requests", "tracked requests by state", ["state"], registry=r)
        self.leases_active = Gauge("fairbatch_agent_leases_active", "leases granted, request not arrived", registry=r)
        self.kv_usage = Gauge(
            "fairbatch_agent_engine_kv_usage_ratio", "engine KV cache usage 0..1 (last scrape)", registry=r
        )
        self.healthy = Gauge("fairbatch_agent_healthy", "1 when the engine is reachable and metrics fresh", registry=r)
        self.engine_metrics_missing = Counter(
            "fairbatch_agent_engine_metrics_missing", "engine scrapes missing a metric", ["metric"], registry=r
        )
        self.scrape_errors = Counter("fairbatch_agent_engine_scrape_errors", "failed engine /metrics scrapes", registry=r)
        self.requests_total = Counter(
            "fairbatch_agent_requests_finished",
            "finished requests by outcome (ok, client_disconnect, upstream_error, ...)",
            ["outcome"],
            registry=r,
        )
        self.reserve_total = Counter("fairbatch_agent_reserve", "Reserve calls by result", ["result"], registry=r)
        self.leases_expired = Counter("fairbatch_agent_leases_expired", "leases that lapsed", registry=r)
        self.plugin_records = Counter(
            "fairbatch_agent_plugin_records", "plugin export records read, by kind (state, step, bad)",
            ["kind"], registry=r,
        )
        self.plugin_export_stale = Gauge(
            "fairbatch_agent_plugin_export_stale",
            "1 while plugin mode falls back to proxy-mode state (no plugin record within --plugin-stale-ms "
            "while the engine is busy); 0 otherwise and in proxy mode", registry=r,
        )
        self.plugin_fallbacks = Counter(
            "fairbatch_agent_plugin_fallbacks", "times plugin mode fell back to proxy-mode state (stale export)",
            registry=r,
        )
        self.plugin_dropped = Gauge(
            "fairbatch_agent_plugin_export_dropped", "records the plugin reports it dropped (last record)", registry=r
        )
        self.time_model_coefficient = Gauge(
            "fairbatch_agent_time_model_coefficient",
            "online-fitted step-time coefficient (point model; term a: ms, b, d: ms per token, c: ms per context "
            "token, e: ms per chunk x prefix token pair, f: ms per squared prefill-chunk token; "
            "replica_agent/policy/calibration.py)", ["term"], registry=r,
        )
        self.time_model_margin = Gauge(
            "fairbatch_agent_time_model_margin_ratio",
            "factor on the point model that PAB and Reserve plan with: the learned quantile of measured / "
            "predicted step time, clamped to [1, max]", registry=r,
        )
        self.time_model_residual_quantile = Gauge(
            "fairbatch_agent_time_model_residual_ratio",
            "quantile of (measured - predicted) / predicted step time over the recent window (one step ahead)",
            ["level"], registry=r,
        )
        self.time_model_abs_error = Gauge(
            "fairbatch_agent_time_model_mean_abs_error_ratio",
            "mean |measured - predicted| / predicted step time over the recent window; NaN before any step", registry=r,
        )
        self.time_model_steps = Counter(
            "fairbatch_agent_time_model_steps", "steps the online time model learned from, by source (plugin, proxy)",
            ["source"], registry=r,
        )
        self.time_model_late_steps = Counter(
            "fairbatch_agent_time_model_late_steps",
            "steps the online time model learned from that took longer than the model PAB planned with "
            "predicted before they ran (point fit x learned margin), by source; share of late steps = this / "
            "fairbatch_agent_time_model_steps_total", ["source"], registry=r,
        )
        self.budget_snapshots = Counter(
            "fairbatch_agent_budget_snapshots",
            "budget snapshots computed for WatchBudget streams: each stream's first, then the shared feed's "
            "pushes (one computation goes to every subscribed router)", registry=r,
        )
        self.reload = ReloadMetrics(r, "agent", "slo_classes")  # the classes the agent starts with: success 1
        self.config_reloads = self.reload.reloads
        self.config_last_reload_success = self.reload.success
        self.config_last_reload_timestamp = self.reload.timestamp
        self.config_last_reload_success_timestamp = self.reload.success_timestamp
        self.time_model_abs_error.set(math.nan)

    def observe_reload(self, ok: bool, now_s: float | None = None) -> None:
        """Count one reload and set the last-reload gauges (fairbatch_common/metrics.py ``ReloadMetrics``)."""
        self.reload.observe(ok, now_s)
