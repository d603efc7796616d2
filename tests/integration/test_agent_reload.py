"""The agent reads its part of the router YAML with the router's models and reloads it while serving.

A real agent process in front of a real simulated engine (loopback). On an idle engine a class's
PAB is its horizon H = ttft_ms - min(margin * ttft_ms, tpot_ms), margin 0.1 by default
(replica_agent/policy/pab.py planning_horizon_ms): 500 / 50 ms -> 0.45 s, 1000 / 50 ms -> 0.95 s,
20000 / 200 ms -> 19.8 s. The file changes -> the new classes apply (no restart);
SIGHUP on a broken file -> refused, counted, the running classes kept, a ``file:line`` message and
no traceback in the log. A file the router's models refuse stops the agent at start the same way, and a router file the
router refuses anywhere (not only in ``slo_classes``) is refused by the agent too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from loadgen.procs import ProcessGroup, free_port, script
from router.config import ConfigError, load_config

pytestmark = pytest.mark.timeout(120)

BASE = "model: m\nreplicas: [{id: r0, http_url: 'http://127.0.0.1:1', grpc_target: '127.0.0.1:2'}]\nslo_classes:\n"


def metric_value(url: str, series: str) -> float | None:
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def wait_value(url: str, series: str, expected: float | None, timeout_s: float = 20.0) -> None:
    end = time.monotonic() + timeout_s
    got = None
    while time.monotonic() < end:
        got = metric_value(url, series)
        if got == expected:
            return
        time.sleep(0.1)
    raise AssertionError(f"{series}: {got} (expected {expected})")


def wait_until(pred, what: str, timeout_s: float = 20.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def start_agent(group: ProcessGroup, config: Path, engine: str) -> tuple[object, str]:
    http_port = free_port()
    child = group.start("agent", script("fairbatch-agent") + [
        "serve", "--engine-url", engine, "--http-port", str(http_port), "--grpc-port", str(free_port()),
        "--replica-id", "r0", "--config", str(config), "--reload-poll-s", "0.2"])  # fmt: skip
    url = f"http://127.0.0.1:{http_port}"
    group.wait_http_ok(child, url + "/health", timeout_s=30)
    return child, url


def test_slo_classes_reload_on_file_change_and_sighup(tmp_path: Path) -> None:
    config = tmp_path / "fairbatch.yaml"
    config.write_text(BASE + "  interactive: {ttft_ms: 500, tpot_ms: 50}\n")
    with ProcessGroup(tmp_path / "logs") as group:
        eport = free_port()
        engine = group.start("engine", [sys.executable, "-m", "loadgen.sim.server", "--port", str(eport)])
        group.wait_http_ok(engine, f"http://127.0.0.1:{eport}/health", timeout_s=30)
        child, url = start_agent(group, config, f"http://127.0.0.1:{eport}")
        pab = 'fairbatch_agent_pab_seconds{slo_class="interactive"}'
        wait_value(url, pab, 0.45)
        started = time.time()  # the edit below is written, and reloaded, after this

        # an edit: TTFT 1000 ms, and a new class
        config.write_text(BASE + "  interactive: {ttft_ms: 1000, tpot_ms: 50}\n  batch: {ttft_ms: 20000, tpot_ms: 200}\n")
        wait_value(url, pab, 0.95)
        wait_value(url, 'fairbatch_agent_pab_seconds{slo_class="batch"}', 19.8)
        assert metric_value(url, 'fairbatch_agent_config_reloads_total{result="ok"}') == 1.0
        success = "fairbatch_agent_config_last_reload_success"
        stamp = "fairbatch_agent_config_last_reload_timestamp_seconds"
        assert metric_value(url, success) == 1.0
        applied = metric_value(url, stamp)
        assert applied is not None and started <= applied <= time.time()

        # a broken file, then SIGHUP: refused, the running classes kept (the poll may see the change
        # first and refuse it too: counted once or twice)
        invalid = 'fairbatch_agent_config_reloads_total{result="invalid"}'
        config.write_text(BASE + "  interactive: {ttft_ms: 1000, tpot_ms: [50\n")
        os.kill(child.popen.pid, signal.SIGHUP)  # type: ignore[attr-defined]
        wait_until(lambda: (metric_value(url, invalid) or 0.0) >= 1.0, "the broken file refused")
        time.sleep(0.5)
        n = metric_value(url, invalid) or 0.0
        assert metric_value(url, pab) == 0.95
        assert metric_value(url, success) == 0.0  # FairbatchConfigReloadFailed's signal
        assert applied <= (metric_value(url, stamp) or 0.0) <= time.time()
        # the running classes' load: the edit above (at or after the one read), before the refusal
        applied_at = metric_value(url, "fairbatch_agent_config_last_reload_success_timestamp_seconds") or 0.0
        assert applied <= applied_at < (metric_value(url, stamp) or 0.0)
        # a value the router's model refuses: refused at the next poll
        config.write_text(BASE + "  interactive: {ttft_ms: -5, tpot_ms: 50}\n")
        wait_value(url, invalid, n + 1.0)
        assert metric_value(url, pab) == 0.95
        # new class targets in a file the router refuses elsewhere (a tenant's weight 0): the router
        # keeps its running file, so the agent keeps its classes too (a user's trial found them apart)
        config.write_text(BASE + "  interactive: {ttft_ms: 400, tpot_ms: 50}\n"
                          "tenants:\n  acme: {weight: 0, slo_class: interactive}\n")
        wait_value(url, invalid, n + 2.0)
        assert metric_value(url, pab) == 0.95
        assert metric_value(url, 'fairbatch_agent_config_reloads_total{result="ok"}') == 1.0
        assert child.popen.poll() is None  # type: ignore[attr-defined]
    log = Path(child.log_path).read_text()  # type: ignore[attr-defined]
    assert "fairbatch.yaml:5: YAML syntax error" in log
    assert "fairbatch.yaml:4: slo_classes.interactive.ttft_ms: Input should be greater than 0" in log
    assert "Traceback" not in log


def test_agent_refuses_at_start_what_the_router_refuses(tmp_path: Path) -> None:
    config = tmp_path / "fairbatch.yaml"
    for body, message in [
        ("  interactive: {ttft_ms: 500, tpot_ms: 50, priority: -1}\n",
         "fairbatch.yaml:4: slo_classes.interactive.priority: Input should be greater than or equal to 0"),
        ("  interactive: {ttft_ms: 500, tpot_ms: 50, colour: red}\n",
         "fairbatch.yaml:4: slo_classes.interactive.colour: Extra inputs are not permitted"),
        ("  interactive: {ttft_ms: 500\n", "fairbatch.yaml:5: YAML syntax error"),
        ("  interactive: {ttft_ms: 500, tpot_ms: 50}\ntenants:\n  acme: {weight: 0, slo_class: interactive}\n",
         "fairbatch.yaml:6: tenants.acme.weight: Input should be greater than 0"),  # outside slo_classes
    ]:
        config.write_text(BASE + body)
        with pytest.raises(ConfigError) as router_err:
            load_config(config)
        assert message in str(router_err.value)  # the router's own message
        proc = subprocess.run(script("fairbatch-agent") + [
            "serve", "--engine-url", "http://127.0.0.1:1", "--config", str(config)],
            capture_output=True, text=True, timeout=60)  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr and "Traceback" not in proc.stderr
        assert "usage:" not in proc.stderr  # a file error, not a flag error
