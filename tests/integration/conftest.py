"""Fixtures that start a real local fleet: simulated engines, agents and a router as child processes."""

from __future__ import annotations

import hashlib
import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from loadgen.procs import ProcessGroup, free_port, script


@dataclass
class Fleet:
    """Addresses of a started fleet (all on 127.0.0.1)."""

    group: ProcessGroup
    config_path: Path
    router_url: str
    api_keys: dict[str, str]
    engine_urls: list[str] = field(default_factory=list)
    agent_urls: list[str] = field(default_factory=list)
    grpc_targets: list[str] = field(default_factory=list)
    children: dict[str, object] = field(default_factory=dict)
    argv: dict[str, list[str]] = field(default_factory=dict)  # each child's command line (to restart it)

    def restart(self, names_urls: list[tuple[str, str]]) -> None:
        """Start each child ``name`` again with its command line (the old one must have exited), all at
        once, then wait until each one's ``health_url`` answers 200."""
        for name, _ in names_urls:
            restarts = sum(1 for c in self.group.children if c.name.split(".", 1)[0] == name)
            self.children[name] = self.group.start(f"{name}.{restarts}", self.argv[name])  # its own log file
        for name, url in names_urls:
            self.group.wait_http_ok(self.children[name], url)


def write_config(path: Path, replicas: list[dict[str, str]], api_keys: dict[str, str], **overrides: object) -> None:
    """Router YAML (docs/architecture.md) with classes `interactive` and tenants acme/beta."""
    cfg: dict[str, object] = {
        "model": "llama-3-8b-a100",
        "slo_classes": {
            "interactive": {"ttft_ms": 1000, "tpot_ms": 100, "priority": 0, "sheddable": False, "max_queue_ms": 8000},
        },
        "tenants": {"acme": {"weight": 3, "slo_class": "interactive"}, "beta": {"weight": 1, "slo_class": "interactive"}},
        "api_keys": {hashlib.sha256(k.encode()).hexdigest(): t for t, k in api_keys.items()},
        "replicas": replicas,
        "queue": {"max_requests": 64, "max_tokens": 4_000_000},
    }
    cfg.update(overrides)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))


def wait_all_replicas_usable(router_url: str, n: int, timeout_s: float = 15.0) -> None:
    """Block until the router's /health lists ``n`` usable replicas (first budget snapshot of each
    received, healthy and fresh), so a test's first requests never race the subscriptions.

    Raises:
        RuntimeError: after ``timeout_s`` wall seconds, with the last /health answer.
    """
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{router_url}/health", timeout=1.0) as resp:
                last = json.loads(resp.read())
            if isinstance(last, dict) and len(last.get("replicas_usable", [])) >= n:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    raise RuntimeError(f"router at {router_url} never saw {n} usable replicas: {last}")


PORT_TAKEN = "address already in use"
"""In a child's start-up failure: a port :func:`free_port` gave was taken by another process before the
child bound it (another test suite on the machine: seen with two `make test` runs side by side)."""


def start_fleet(tmp: Path, n: int, **kw: object) -> Fleet:
    """Start ``n`` simulated engines + ``n`` agents + one router; wait for every /health.

    Keywords as :func:`_start_fleet_once`. A start that fails because a chosen port was taken meanwhile
    (:data:`PORT_TAKEN`) is tried again with new ports, twice at most, in a new folder under ``tmp``.
    """
    for attempt in range(3):
        try:
            return _start_fleet_once(tmp if attempt == 0 else tmp / f"retry{attempt}", n, **kw)  # type: ignore[arg-type]
        except RuntimeError as exc:
            if PORT_TAKEN not in str(exc).lower() or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _start_fleet_once(tmp: Path, n: int, *, time_scale: float = 1.0, ttl_ms: int = 1000,
                      engine_args: list[str] | None = None, agent_args: list[str] | None = None,
                      router_args: list[str] | None = None, **config_overrides: object) -> Fleet:
    """One try of :func:`start_fleet`.

    ``engine_args`` / ``agent_args`` / ``router_args`` are appended to every engine's / agent's / the
    router's command line;
    ``config_overrides`` replace top-level keys of the router YAML (e.g. ``telemetry={...}``).
    """
    tmp.mkdir(parents=True, exist_ok=True)
    group = ProcessGroup(tmp / "logs")
    api_keys = {"acme": "sk-test-acme", "beta": "sk-test-beta"}
    ts = str(time_scale)
    replicas = []
    fleet = Fleet(group, tmp / "fairbatch.yaml", "", api_keys)
    ports = [(free_port(), free_port(), free_port()) for _ in range(n)]
    for i, (_, http_port, grpc_port) in enumerate(ports):
        replicas.append({"id": f"r{i}", "http_url": f"http://127.0.0.1:{http_port}", "grpc_target": f"127.0.0.1:{grpc_port}"})
    write_config(fleet.config_path, replicas, api_keys, **config_overrides)
    try:
        for i, (eport, hport, gport) in enumerate(ports):
            argv = fleet.argv[f"engine{i}"] = script("fairbatch-loadgen") + [
                "sim-engine", "--port", str(eport), "--time-scale", ts, *(engine_args or [])]
            e = group.start(f"engine{i}", argv)
            fleet.engine_urls.append(f"http://127.0.0.1:{eport}")
            fleet.children[f"engine{i}"] = e
        for i, (eport, hport, gport) in enumerate(ports):
            group.wait_http_ok(fleet.children[f"engine{i}"], f"http://127.0.0.1:{eport}/health")
            argv = fleet.argv[f"agent{i}"] = script("fairbatch-agent") + [
                "serve", "--engine-url", f"http://127.0.0.1:{eport}", "--http-port", str(hport), "--grpc-port", str(gport),
                "--replica-id", f"r{i}", "--profile", "llama-3-8b-a100", "--config", str(fleet.config_path),
                "--time-scale", ts, "--ttl-ms", str(ttl_ms), *(agent_args or [])]
            a = group.start(f"agent{i}", argv)
            fleet.agent_urls.append(f"http://127.0.0.1:{hport}")
            fleet.grpc_targets.append(f"127.0.0.1:{gport}")
            fleet.children[f"agent{i}"] = a
        for i in range(n):
            group.wait_http_ok(fleet.children[f"agent{i}"], f"{fleet.agent_urls[i]}/health")
        rport = free_port()
        r = group.start("router", script("fairbatch-router") + [
            "--config", str(fleet.config_path), "--port", str(rport), "--time-scale", ts, *(router_args or [])])
        fleet.children["router"] = r
        fleet.router_url = f"http://127.0.0.1:{rport}"
        group.wait_http_ok(r, f"{fleet.router_url}/health")
        try:
            wait_all_replicas_usable(fleet.router_url, n, timeout_s=30.0)
        except RuntimeError as exc:
            # a child whose port another process took meanwhile (an agent's gRPC port: its budget stream then
            # comes from someone else or nobody; the router's: another server answered its /health) never
            # makes the fleet usable: say so, so that start_fleet tries new ports
            logs = " ".join(p.read_text(errors="replace").lower() for p in sorted(group.log_dir.glob("*.log")))
            if PORT_TAKEN in logs or "failed to bind" in logs:
                raise RuntimeError(f"{exc} ({PORT_TAKEN}: a child's port)") from exc
            raise
    except BaseException:
        group.stop()
        raise
    return fleet


@pytest.fixture
def fleet_factory(tmp_path: Path) -> Iterator[object]:
    """Call ``fleet_factory(n, **kw)`` to start a fleet; everything is stopped after the test."""
    started: list[Fleet] = []

    def make(n: int = 2, **kw: object) -> Fleet:
        f = start_fleet(tmp_path, n, **kw)  # type: ignore[arg-type]
        started.append(f)
        return f

    yield make
    for f in started:
        f.group.stop()
