"""Router <-> agent authentication on by default (issue 30, item 1), with real agent processes.

- ``fairbatch-agent serve --host <not loopback>`` without ``FAIRBATCH_AGENT_TOKEN`` does not start: exit
  status 2 and one line on stderr naming ``--host`` and the variable (before it binds any port);
- the token may instead be in the file ``FAIRBATCH_AGENT_TOKEN_FILE`` names (the Helm chart's form); an
  unreadable file stops ``serve`` and ``drain`` with status 2 and one line naming the variable and the path;
- on loopback without a token it still starts (the README's by-hand trial, the demo and the benchmarks);
- with the token (the README's commands set one), a direct request without ``x-fairbatch-token`` gets
  401 in OpenAI's error format, on every relayed path, and the token is in no log line.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from loadgen.procs import ProcessGroup, free_port, script
from replica_agent.cli import is_loopback_host, token_refusal

pytestmark = pytest.mark.timeout(120)

TOKEN = "tok-3f9c1d2e8a7b6c5d4e3f2a1b0c9d8e7f"


def _env_without_token() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("FAIRBATCH_AGENT_TOKEN", None)
    env.pop("FAIRBATCH_AGENT_TOKEN_FILE", None)
    return env


def _post(url: str, body: dict, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _start_engine(group: ProcessGroup) -> str:
    port = free_port()
    engine = group.start("engine", [sys.executable, "-m", "loadgen.sim.server", "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    group.wait_http_ok(engine, url + "/health", timeout_s=30)
    return url


@pytest.mark.parametrize("host", ["0.0.0.0", "::", ""])
def test_agent_refuses_a_public_address_without_a_token(host: str) -> None:
    http_port, grpc_port = free_port(), free_port()
    proc = subprocess.run(script("fairbatch-agent") + [
        "serve", "--engine-url", "http://127.0.0.1:1", "--host", host,
        "--http-port", str(http_port), "--grpc-port", str(grpc_port)],
        capture_output=True, text=True, timeout=60, env=_env_without_token())  # fmt: skip
    shown = host or "(every interface)"
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"fairbatch-agent: refusing to serve on --host {shown} without a router token: set FAIRBATCH_AGENT_TOKEN "
        "(or FAIRBATCH_AGENT_TOKEN_FILE), the token the routers send, or listen on --host 127.0.0.1"
    ]
    # it never bound its ports
    for port in (http_port, grpc_port):
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0


def test_loopback_without_a_token_still_starts_and_serves(tmp_path: Path) -> None:
    with ProcessGroup(tmp_path / "logs") as group:
        engine = _start_engine(group)
        port = free_port()
        agent = group.start("agent", script("fairbatch-agent") + [
            "serve", "--engine-url", engine, "--host", "127.0.0.1", "--http-port", str(port),
            "--grpc-port", str(free_port())], env={"FAIRBATCH_AGENT_TOKEN": ""})  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        group.wait_http_ok(agent, url + "/health", timeout_s=30)
        status, doc = _post(url + "/v1/completions", {"model": "llama-3-8b-a100", "prompt": "hi", "max_tokens": 2})
        assert status == 200 and doc["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("form", ["env", "file"])
def test_agent_with_a_token_answers_401_in_openai_format_to_direct_requests(tmp_path: Path, form: str) -> None:
    """The README's by-hand agent (``FAIRBATCH_AGENT_TOKEN`` exported), here on every interface; or the
    chart's (``FAIRBATCH_AGENT_TOKEN_FILE``, the file ending in a newline as a Secret written by hand)."""
    if form == "env":
        env = {"FAIRBATCH_AGENT_TOKEN": TOKEN}
    else:
        (tmp_path / "token").write_text(TOKEN + "\n")
        env = {"FAIRBATCH_AGENT_TOKEN": "", "FAIRBATCH_AGENT_TOKEN_FILE": str(tmp_path / "token")}
    with ProcessGroup(tmp_path / "logs") as group:
        engine = _start_engine(group)
        port = free_port()
        agent = group.start("agent", script("fairbatch-agent") + [
            "serve", "--engine-url", engine, "--host", "0.0.0.0", "--http-port", str(port),
            "--grpc-port", str(free_port())], env=env)  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        group.wait_http_ok(agent, url + "/health", timeout_s=30)  # /health stays open (kubelet probes)
        refusal = {"error": {"message": "Missing or wrong x-fairbatch-token (this agent takes requests from its "
                                        "routers only).",
                             "type": "invalid_request_error", "param": None, "code": "invalid_token"}}
        completion = {"model": "llama-3-8b-a100", "prompt": "hi", "max_tokens": 2}
        chat = {"model": "llama-3-8b-a100", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        # a forged admission header does not help; a wrong token neither
        for headers in ({}, {"x-fairbatch-admit": "0"}, {"x-fairbatch-token": TOKEN[:-1]}):
            assert _post(url + "/v1/completions", completion, headers) == (401, refusal)
            assert _post(url + "/v1/chat/completions", chat, headers) == (401, refusal)
            assert _post(url + "/tokenize", {"model": "llama-3-8b-a100", "prompt": "hi"}, headers) == (401, refusal)
            assert _get(url + "/v1/models", headers) == (401, refusal)
        status, doc = _post(url + "/v1/completions", completion, {"x-fairbatch-token": TOKEN})
        assert status == 200 and doc["usage"]["completion_tokens"] == 2
        # the chart's preStop hook, with the same environment: the drain is accepted (the token read) and done;
        # without the token it is refused
        drain_cmd = script("fairbatch-agent") + ["drain", "--url", url, "--wait", "--timeout-s", "30"]
        refused = subprocess.run(drain_cmd, capture_output=True, text=True, timeout=60, env=_env_without_token())
        assert refused.returncode == 1 and "answered 401" in refused.stderr, refused.stderr
        drain = subprocess.run(drain_cmd, capture_output=True, text=True, timeout=60, env={**_env_without_token(), **env})
        assert drain.returncode == 0, drain.stderr
        assert agent.popen.wait(timeout=30) == 0  # drained, then exited
        group.stop()
        log = agent.log_path.read_text()
    assert "agent r0: http 0.0.0.0" in log  # it started
    assert TOKEN not in log and TOKEN[:-1] not in log


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.3.2.1", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("LocalHost", True), ("0.0.0.0", False), ("::", False), ("", False), ("10.0.0.5", False),
    ("192.168.1.20", False), ("agent.example.com", False), ("fe80::1", False),
])  # fmt: skip
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert is_loopback_host(host) is loopback
    assert (token_refusal(host, {}) is None) is loopback
    assert token_refusal(host, {"FAIRBATCH_AGENT_TOKEN": "t"}) is None


def test_token_refusal_reads_the_token_file(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("t\n")
    assert token_refusal("0.0.0.0", {"FAIRBATCH_AGENT_TOKEN_FILE": str(path)}) is None
    path.write_text("\n")  # an empty token is none
    assert token_refusal("0.0.0.0", {"FAIRBATCH_AGENT_TOKEN_FILE": str(path)}) is not None


@pytest.mark.parametrize(("command", "prefix"), [
    (["serve", "--engine-url", "http://127.0.0.1:1", "--host", "0.0.0.0"], "fairbatch-agent"),
    (["drain", "--url", "http://127.0.0.1:1"], "fairbatch-agent drain"),
])  # fmt: skip
def test_an_unreadable_token_file_stops_serve_and_drain(tmp_path: Path, command: list[str], prefix: str) -> None:
    missing = str(tmp_path / "no-such-token")
    http_port, grpc_port = free_port(), free_port()
    ports = ["--http-port", str(http_port), "--grpc-port", str(grpc_port)] if command[0] == "serve" else []
    proc = subprocess.run(script("fairbatch-agent") + command + ports, capture_output=True, text=True, timeout=60,
                          env={**_env_without_token(), "FAIRBATCH_AGENT_TOKEN_FILE": missing})  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"{prefix}: FAIRBATCH_AGENT_TOKEN_FILE={missing}: cannot read the secret file (No such file or directory)"
    ]
