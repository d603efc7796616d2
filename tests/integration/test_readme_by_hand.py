"""README's "Running the parts by hand", as a fresh user runs it (issue 30, done-when): the shipped
examples/fairbatch.yaml, a simulated engine, the agent and the router as separate processes, the same
``FAIRBATCH_AGENT_TOKEN`` exported for both. Only the ports are moved (free ones instead of 8000, 8001,
9001, 8080 and 8090) so that the test runs beside anything else.

- a completion through the router with the example's key is served;
- the agent, called directly without the token, answers 401 in OpenAI's error format;
- the router's public port names no tenant: /metrics is 404 and /health says only ``status``; the
  metrics port has the per-tenant series.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from loadgen.procs import ProcessGroup, free_port, script

pytestmark = pytest.mark.timeout(180)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fairbatch.yaml"
TOKEN = "readme-token-0f1e2d3c4b5a69788796a5b4c3d2e1f0"


def _call(url: str, body: dict | None = None, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def test_the_readme_by_hand_fleet_is_closed_by_default(tmp_path: Path) -> None:
    cfg = yaml.safe_load(EXAMPLE.read_text())
    assert cfg["replicas"][0]["http_url"] == "http://127.0.0.1:8001" and cfg["http"]["metrics_port"] == 8090
    eport, aport, gport, rport, mport = (free_port() for _ in range(5))
    cfg["replicas"][0].update(http_url=f"http://127.0.0.1:{aport}", grpc_target=f"127.0.0.1:{gport}")
    cfg["http"]["metrics_port"] = mport
    config = tmp_path / "fairbatch.yaml"
    config.write_text(yaml.safe_dump(cfg))
    env = {"FAIRBATCH_AGENT_TOKEN": TOKEN}
    with ProcessGroup(tmp_path / "logs") as group:
        engine = group.start("engine", [sys.executable, "-m", "loadgen.sim.server", "--port", str(eport),
                                        "--profile", "llama-3-8b-a100"])
        group.wait_http_ok(engine, f"http://127.0.0.1:{eport}/health", timeout_s=30)
        agent = group.start("agent", script("fairbatch-agent") + [
            "serve", "--engine-url", f"http://127.0.0.1:{eport}", "--http-port", str(aport), "--grpc-port", str(gport),
            "--replica-id", "r0", "--profile", "llama-3-8b-a100", "--config", str(config)], env=env)  # fmt: skip
        router = group.start("router", script("fairbatch-router") + [
            "--config", str(config), "--port", str(rport)], env=env)  # fmt: skip
        aurl, rurl, murl = (f"http://127.0.0.1:{p}" for p in (aport, rport, mport))
        group.wait_http_ok(agent, aurl + "/health", timeout_s=30)
        group.wait_http_ok(router, murl + "/health", timeout_s=30)
        body = {"model": "llama-3-8b-a100", "prompt": "Hello", "max_tokens": 8}
        # the router has the agent's budget once its WatchBudget stream (with the token) delivered one
        end = time.monotonic() + 30
        while time.monotonic() < end:
            if json.loads(_call(murl + "/health")[1]).get("replicas_usable") == ["r0"]:
                break
            time.sleep(0.1)
        status, raw = _call(rurl + "/v1/completions", body, {"Authorization": "Bearer sk-my-key"})
        assert status == 200, raw
        assert json.loads(raw)["usage"]["completion_tokens"] == 8

        status, raw = _call(aurl + "/v1/completions", body)  # straight to the agent, no token
        assert status == 401
        assert json.loads(raw)["error"] == {
            "message": "Missing or wrong x-fairbatch-token (this agent takes requests from its routers only).",
            "type": "invalid_request_error", "param": None, "code": "invalid_token"}

        status, raw = _call(rurl + "/metrics")
        assert status == 404 and json.loads(raw)["error"]["code"] == "unsupported_endpoint"
        status, raw = _call(rurl + "/health")
        assert status == 200 and json.loads(raw) == {"status": "ok"}
        status, raw = _call(murl + "/metrics")
        assert status == 200 and b'tenant="acme"' in raw
