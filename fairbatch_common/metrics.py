"""The Prometheus registry both components use (router/metrics.py, replica_agent/metrics.py).

Every registry carries the process, platform (``python_info``) and GC collectors and a
``fairbatch_build_info{version,component}`` gauge (:func:`standard_registry`).
"""

from __future__ import annotations

import importlib.metadata

from prometheus_client import CollectorRegistry, Gauge
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
