"""The Prometheus registry both components use (router/metrics.py, replica_agent/metrics.py).

Every registry carries the process, platform (``python_info``) and GC collectors and a
``fairbatch_build_info{version,component}`` gauge (:func:`standard_registry`).
"""

from __future__ import annotations

import importlib.metadata
import time

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector


def build_version() -> str:
    """The installed fairbatch version ("unknown" when run from a tree that is not installed)."""
    try:
        return importlib.metadata.version("fairbatch")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def standard_registry(component: str) -> CollectorRegistry:
    """A fresh registry (never the library's global one) with the process, platform and GC
    collectors and ``fairbatch_build_info{version,component} 1``.

    Args:
        component: ``router`` or ``agent``.
    """
    r = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=r)
    PlatformCollector(registry=r)
    GCCollector(registry=r)
    info = Gauge("fairbatch_build_info", "Build of this process (value 1)", ["version", "component"], registry=r)
    info.labels(build_version(), component).set(1)
    return r


class ReloadMetrics:
    """A component's configuration reloads: ``fairbatch_<component>_config_reloads_total{result}``
    (``ok``, ``invalid``) and the last-reload gauges ``..._config_last_reload_success`` (1 applied,
    0 refused and the running configuration kept; 1 at start),
    ``..._config_last_reload_timestamp_seconds`` (Unix wall seconds of that load, whatever its result)
    and ``..._config_last_reload_success_timestamp_seconds`` (Unix wall seconds of the latest load that
    was applied: the age of the running configuration; Prometheus's own
    ``prometheus_config_last_reload_success_timestamp_seconds`` has the same meaning).

    Args:
        registry: the component's registry (:func:`standard_registry`).
        component: ``router`` or ``agent`` (the metric names' prefix).
        what: what a reload loads, for the help texts (e.g. ``configuration``, ``slo_classes``).
    """

    def __init__(self, registry: CollectorRegistry, component: str, what: str) -> None:
        prefix = f"fairbatch_{component}_config"
        self.reloads = Counter(f"{prefix}_reloads", f"{what} reloads by result (ok, invalid)", ["result"],
                               registry=registry)  # fmt: skip
        self.success = Gauge(f"{prefix}_last_reload_success",
                             f"1 when the latest {what} load (the start, then each reload) was applied, 0 when it "
                             "was refused and the running one kept", registry=registry)  # fmt: skip
        self.timestamp = Gauge(f"{prefix}_last_reload_timestamp_seconds",
                               "Unix time (wall s) of that load, whatever its result", registry=registry)
        self.success_timestamp = Gauge(f"{prefix}_last_reload_success_timestamp_seconds",
                                       f"Unix time (wall s) of the latest {what} load that was applied (the start, "
                                       "then each applied reload)", registry=registry)  # fmt: skip
        self.success.set(1)  # what the process starts with
        started = time.time()
        self.timestamp.set(started)
        self.success_timestamp.set(started)

    def observe(self, ok: bool, now_s: float | None = None) -> None:
        """Count one reload and set the gauges: success 1 (applied) or 0 (refused), timestamp
        ``now_s`` (Unix wall seconds; default now), and the success timestamp to ``now_s`` only when
        applied (a refused reload leaves it at the running configuration's load)."""
        now = time.time() if now_s is None else now_s
        self.reloads.labels("ok" if ok else "invalid").inc()
        self.success.set(1 if ok else 0)
        self.timestamp.set(now)
        if ok:
            self.success_timestamp.set(now)
