"""Metric names and SLO accounting (router/metrics.py, replica_agent/metrics.py).

``promtool check metrics`` (Prometheus's own linter; the Debian package ``prometheus`` ships it,
.ci/run installs it) runs when it is on PATH. The rules it applies that our names could break are
also checked here with prometheus-client's own parser, so a machine without promtool still fails
on an abbreviated unit, a counter without ``_total`` or a missing help text.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from replica_agent.metrics import AgentMetrics
from router.metrics import AROUND_TARGET, TTFT_LADDER_S, RouterMetrics, miss_kind, slo_buckets

# promlint's abbreviated and non-base units (a name token equal to one of these is refused)
ABBREVIATED = {"ms", "us", "ns", "sec", "secs", "hr", "hrs", "kb", "mb", "gb", "pct"}
NON_BASE = {"milliseconds", "microseconds", "nanoseconds", "minutes", "hours", "days", "kilobytes", "megabytes",
            "percent"}  # fmt: skip


def exposition(component: str) -> str:
    """The /metrics text of a component with every labelled family holding at least one series."""
    if component == "router":
        m = RouterMetrics([500.0, 20_000.0], [50.0, 200.0])
        m.observe_answer("acme", "interactive", "ok", 200, 1.2, 0.3, 0.04, 0.5, 0.05)
        m.observe_answer("acme", "interactive", "slo_infeasible", 429, 0.01, None, None, 0.5, 0.05)
        m.queue_wait.observe(0.2)
        m.config_reloads.labels("ok").inc()
        m.tenant_vtc.labels("acme").set(3.0)
        m.replica_pab.labels("r0", "interactive").set(0.4)
        m.fleet_pab.labels("interactive").set(0.4)
        m.fleet_replicas_without_pab.labels("interactive").set(0)
        m.budget_age.labels("r0").set(0.05)
        m.replica_inflight.labels("r0").set(1)
        m.replica_queued.labels("r0").set(0)
        m.replica_changes.labels("added").inc()
        return generate_latest(m.registry).decode()
    a = AgentMetrics()
    a.pab.labels("interactive").set(0.4)
    a.pab_tokens.labels("interactive").set(5000)
    a.decode_reservation.labels("interactive").set(0.1)
    a.inflight_reservation.labels("interactive").set(0.0)
    a.requests.labels("running").set(2)
    a.engine_metrics_missing.labels("vllm:num_requests_waiting").inc()
    a.requests_total.labels("ok").inc()
    a.reserve_total.labels("granted").inc()
    a.plugin_records.labels("state").inc()
    a.time_model_coefficient.labels("a").set(9.8)
    a.time_model_residual_quantile.labels("0.9").set(0.05)
    a.time_model_steps.labels("proxy").inc()
    a.time_model_late_steps.labels("proxy").inc()
    return generate_latest(a.registry).decode()


@pytest.mark.parametrize("component", ["router", "agent"])
def test_promtool_check_metrics_is_clean(component: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus); the naming rules are checked below")
    out = subprocess.run([promtool, "check", "metrics"], input=exposition(component), capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == "" and out.stderr.strip() == ""


@pytest.mark.parametrize("component", ["router", "agent"])
def test_names_follow_the_prometheus_rules(component: str) -> None:
    families = list(text_string_to_metric_families(exposition(component)))
    names = {f.name for f in families}
    assert "process_cpu_seconds" in names and "python_info" in names  # the process and platform collectors
    assert "fairbatch_build_info" in names
    for fam in families:
        assert re.fullmatch(r"[a-z][a-z0-9_]*", fam.name), fam.name
        assert fam.documentation, f"{fam.name} has no help text"
        tokens = set(fam.name.split("_"))
        assert not tokens & ABBREVIATED, f"{fam.name}: abbreviated unit"
        assert not tokens & NON_BASE, f"{fam.name}: not a base unit"
        labels = {k for s in fam.samples for k in s.labels}
        if fam.type != "summary":
            assert "quantile" not in labels, f"{fam.name}: 'quantile' is a summary's label"
        if fam.type != "histogram":
            assert "le" not in labels, f"{fam.name}: 'le' is a histogram's label"
        if fam.type == "counter":  # the parser strips _total; the samples carry it
            assert all(s.name.endswith(("_total", "_created")) for s in fam.samples), fam.name
        elif fam.type not in ("histogram", "summary"):
            assert not fam.name.endswith(("_count", "_sum", "_bucket", "_total")), fam.name


def test_build_info_names_the_component() -> None:
    text = exposition("agent")
    fam = next(f for f in text_string_to_metric_families(text) if f.name == "fairbatch_build_info")
    (sample,) = fam.samples
    assert sample.labels["component"] == "agent" and sample.value == 1.0 and sample.labels["version"]


def test_slo_buckets_surround_each_target() -> None:
    edges = slo_buckets([500.0, 20_000.0], TTFT_LADDER_S)
    for target_s in (0.5, 20.0):
        for k in AROUND_TARGET:
            assert round(target_s * k, 4) in edges
    # 0.5 s x (0.9, 1.1) -> 0.45 and 0.55: a p99 near the target is read within a tenth of it
    assert 0.45 in edges and 0.55 in edges
    assert list(edges) == sorted(set(edges))
    assert set(TTFT_LADDER_S) <= set(edges)
    assert len(edges) == len(set(TTFT_LADDER_S) | {round(t * k, 4) for t in (0.5, 20.0) for k in AROUND_TARGET})


@pytest.mark.parametrize(
    ("outcome", "code", "ttft", "tpot", "expected"),
    [
        ("ok", 200, 0.4, 0.04, None),  # both under 0.5 s / 0.05 s
        ("ok", 200, 0.6, 0.04, "ttft"),
        ("ok", 200, 0.6, 0.09, "ttft"),  # both missed: counted once, as ttft
        ("ok", 200, 0.4, 0.06, "tpot"),
        ("ok", 200, 0.4, None, None),  # one token: no TPOT, that half is met
        ("slo_infeasible", 429, None, None, "rejected"),
        ("queue_full", 429, None, None, "rejected"),
        ("upstream_error", 200, 0.1, None, "failed"),  # a stream that failed mid-way
        ("no_replica", 503, None, None, "failed"),
    ],
)
def test_miss_kind(outcome: str, code: int, ttft: float | None, tpot: float | None, expected: str | None) -> None:
    assert miss_kind(outcome, code, ttft, tpot, 0.5, 0.05) == expected


def sample(m: RouterMetrics, name: str, **labels: str) -> float:
    value = m.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_attained_plus_misses_equal_judged_requests() -> None:
    m = RouterMetrics([500.0], [50.0])
    answers = [("ok", 200, 0.2, 0.03), ("ok", 200, 0.7, 0.03), ("ok", 200, 0.2, 0.08), ("queue_timeout", 429, None, None),
               ("upstream_error", 502, None, None), ("bad_request", 400, None, None),
               ("client_disconnect", 499, None, None)]  # fmt: skip
    for outcome, code, ttft, tpot in answers:
        m.observe_answer("acme", "interactive", outcome, code, 1.0, ttft, tpot, 0.5, 0.05)
    labels = {"slo_class": "interactive", "tenant": "acme"}
    assert sample(m, "fairbatch_router_slo_requests_total", **labels) == 5  # the 400 and the disconnect are not judged
    assert sample(m, "fairbatch_router_slo_attained_total", **labels) == 1
    kinds = {k: sample(m, "fairbatch_router_slo_misses_total", kind=k, **labels)
             for k in ("ttft", "tpot", "rejected", "failed")}  # fmt: skip
    assert kinds == {"ttft": 1, "tpot": 1, "rejected": 1, "failed": 1}
    # every answer is counted by outcome and in the duration histogram by status
    assert sample(m, "fairbatch_router_requests_total", tenant="acme", slo_class="interactive", outcome="ok") == 3
    assert sample(m, "fairbatch_router_request_duration_seconds_count", slo_class="interactive", code="200") == 3
    assert sample(m, "fairbatch_router_request_duration_seconds_count", slo_class="interactive", code="429") == 1
    # TTFT of the three served requests; TPOT too (0.03, 0.03, 0.08)
    assert sample(m, "fairbatch_router_ttft_seconds_count", **labels) == 3
    assert math.isclose(sample(m, "fairbatch_router_ttft_seconds_sum", **labels), 1.1)
    assert math.isclose(sample(m, "fairbatch_router_tpot_seconds_sum", **labels), 0.14)
    assert sample(m, "fairbatch_router_ttft_seconds_bucket", le="0.5", **labels) == 2


@pytest.mark.parametrize("component", ["router", "agent"])
def test_last_reload_gauges_follow_each_reload(component: str) -> None:
    """``fairbatch_<component>_config_last_reload_success`` is 1 from the start (the configuration the process
    started with), then the result of the latest reload; its timestamp is that load's Unix time, and the
    success timestamp that of the latest load applied (a refused reload leaves it)."""
    import time

    before = time.time()
    m = RouterMetrics() if component == "router" else AgentMetrics()
    after = time.time()
    prefix = f"fairbatch_{component}_config"

    def samples() -> dict[str, float]:
        return {s.name + ("" if not s.labels else "{" + ",".join(f"{k}={v}" for k, v in s.labels.items()) + "}"):
                s.value for f in text_string_to_metric_families(generate_latest(m.registry).decode())
                for s in f.samples if s.name.startswith(prefix)}  # fmt: skip

    start = samples()
    assert start[f"{prefix}_last_reload_success"] == 1.0
    assert before <= start[f"{prefix}_last_reload_timestamp_seconds"] <= after
    assert start[f"{prefix}_last_reload_success_timestamp_seconds"] == start[f"{prefix}_last_reload_timestamp_seconds"]
    assert f"{prefix}_reloads_total{{result=ok}}" not in start  # the start is no reload
    m.observe_reload(False, now_s=1_700_000_000.0)
    m.observe_reload(False, now_s=1_700_000_060.0)
    got = samples()
    assert got[f"{prefix}_last_reload_success"] == 0.0
    assert got[f"{prefix}_last_reload_timestamp_seconds"] == 1_700_000_060.0
    # two refusals: the running configuration is still the one loaded at the start
    assert got[f"{prefix}_last_reload_success_timestamp_seconds"] == start[f"{prefix}_last_reload_timestamp_seconds"]
    assert got[f"{prefix}_reloads_total{{result=invalid}}"] == 2.0
    m.observe_reload(True, now_s=1_700_000_120.5)
    got = samples()
    assert got[f"{prefix}_last_reload_success"] == 1.0
    assert got[f"{prefix}_last_reload_timestamp_seconds"] == 1_700_000_120.5
    assert got[f"{prefix}_last_reload_success_timestamp_seconds"] == 1_700_000_120.5
    m.observe_reload(False, now_s=1_700_000_180.0)
    got = samples()
    assert got[f"{prefix}_last_reload_timestamp_seconds"] == 1_700_000_180.0
    assert got[f"{prefix}_last_reload_success_timestamp_seconds"] == 1_700_000_120.5  # the applied one
    assert got[f"{prefix}_reloads_total{{result=ok}}"] == 1.0
