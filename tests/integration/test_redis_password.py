"""The router's shared ledger on a Redis that requires a password (issue 30, item 3), against a real
``redis-server --requirepass`` started by the suite (tests/redis_fixture.py ``redis_auth_server``).

- with the password (``RedisLedger(password=...)``; the router CLI reads ``FAIRBATCH_REDIS_PASSWORD``)
  the ledger uses Redis: two ledgers share one token bucket;
- without it, or with a wrong one, Redis refuses (NOAUTH / WRONGPASS) and the ledger serves on its local
  fallback, reported as degraded;
- a password inside the URL works too, and no log line carries it;
- a router process started with ``FAIRBATCH_REDIS_PASSWORD``, or with ``FAIRBATCH_REDIS_PASSWORD_FILE``
  naming a file that holds it (the chart's form), keeps its tenant buckets in that Redis; an unreadable
  file stops the router (status 2, one line naming the variable and the path).
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis
import yaml

from fairbatch_common.secrets import SecretFileError
from loadgen.procs import ProcessGroup, free_port, script
from router.cli import secrets_from_env
from router.ledger import RedisLedger, Refusal, TenantLimits, Ticket, redact_url
from tests.integration.test_router_tenants import KEYS, Replicas, config_dict, metric_value, wait_fresh
from tests.redis_fixture import RedisServer, redis_auth_server  # noqa: F401

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]


@dataclass
class Clk:
    scale: float = 1.0
    t: float = 0.0

    def now_ms(self) -> float:
        return self.t


def make(url: str, password: str | None, states: list[bool] | None = None, prefix: str = "pw") -> RedisLedger:
    return RedisLedger(url, Clk(), key_prefix=prefix, timeout_ms=300, retry_initial_ms=50, retry_max_ms=200,
                       on_degraded=(states.append if states is not None else None), password=password)


async def _flush(server: RedisServer) -> None:
    client = aioredis.Redis(host="127.0.0.1", port=server.port, password=server.password)
    try:
        await client.flushall()
    finally:
        await client.aclose()


async def test_ledgers_with_the_password_share_one_bucket(redis_auth_server: RedisServer) -> None:
    await _flush(redis_auth_server)
    states: list[bool] = []
    a = make(redis_auth_server.url, redis_auth_server.password, states)
    b = make(redis_auth_server.url, redis_auth_server.password, states)
    await a.start()
    await b.start()
    try:
        assert not a.degraded and not b.degraded
        lim = TenantLimits(tokens_per_minute=600)
        assert await a.acquire("acme", "r1", lim, 400) == Ticket("acme", "r1", "redis")
        refusal = await b.acquire("acme", "r2", lim, 400)  # the other router sees 200 left: shared
        assert isinstance(refusal, Refusal) and refusal.reason == "tenant-rate"
        assert states == []
    finally:
        await a.close()
        await b.close()


@pytest.mark.parametrize("password", [None, "not-the-password"], ids=["none", "wrong"])
async def test_without_the_password_redis_refuses_and_the_ledger_falls_back(
    redis_auth_server: RedisServer, password: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    states: list[bool] = []
    led = make(redis_auth_server.url, password, states)
    caplog.set_level(logging.INFO, logger="router")
    await led.start()
    try:
        assert led.degraded and states == [True]
        lim = TenantLimits(tokens_per_minute=600)
        assert await led.acquire("acme", "r1", lim, 400) == Ticket("acme", "r1", "local")
    finally:
        await led.close()
    text = "\n".join(r.getMessage() for r in caplog.records)
    if password is None:
        assert f"Redis at {redis_auth_server.url} requires a password, none given (AuthenticationError: " in text
    else:
        assert (f"Redis at {redis_auth_server.url} refused the password given (AuthenticationError: "
                "invalid username-password pair") in text
    assert ("give Redis's requirepass as FAIRBATCH_REDIS_PASSWORD (or a file named by FAIRBATCH_REDIS_PASSWORD_FILE) "
            "or in redis_url") in text
    if password:
        assert password not in text


async def test_a_password_in_the_url_works_and_is_never_logged(
    redis_auth_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    pw = redis_auth_server.password
    assert pw
    url = f"redis://:{pw}@127.0.0.1:{redis_auth_server.port}/0"
    caplog.set_level(logging.INFO, logger="router")
    led = make(url, None)
    await led.start()
    try:
        assert not led.degraded
        assert await led.acquire("acme", "r1", TenantLimits(tokens_per_minute=600), 1) == Ticket("acme", "r1", "redis")
    finally:
        await led.close()
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert f"Redis at redis://:***@127.0.0.1:{redis_auth_server.port}/0" in text and pw not in text
    assert led.url == f"redis://:***@127.0.0.1:{redis_auth_server.port}/0"


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("redis://:s3cret@r.svc:6379/0", "redis://:***@r.svc:6379/0"),
    ("rediss://user:s3cret@r.svc:6380/2", "rediss://user:***@r.svc:6380/2"),
    ("redis://user@r.svc/0", "redis://user@r.svc/0"),
])  # fmt: skip
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_the_cli_reads_the_secrets_from_the_environment_only() -> None:
    assert secrets_from_env({}) == {"agent_token": None, "redis_password": None}
    assert secrets_from_env({"FAIRBATCH_REDIS_PASSWORD": "", "FAIRBATCH_AGENT_TOKEN": ""}) == {
        "agent_token": None, "redis_password": None}
    assert secrets_from_env({"FAIRBATCH_REDIS_PASSWORD": "p", "FAIRBATCH_AGENT_TOKEN": "t"}) == {
        "agent_token": "t", "redis_password": "p"}


def test_the_cli_reads_the_secrets_from_the_files_the_environment_names(tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("p\n")
    (tmp_path / "token").write_text("t\r\n")
    files = {"FAIRBATCH_REDIS_PASSWORD_FILE": str(tmp_path / "pw"), "FAIRBATCH_AGENT_TOKEN_FILE": str(tmp_path / "token")}
    assert secrets_from_env(files) == {"agent_token": "t", "redis_password": "p"}
    assert secrets_from_env({**files, "FAIRBATCH_REDIS_PASSWORD": "p2"}) == {"agent_token": "t", "redis_password": "p2"}
    missing = str(tmp_path / "missing")
    with pytest.raises(SecretFileError, match=f"^FAIRBATCH_REDIS_PASSWORD_FILE={missing}: cannot read"):
        secrets_from_env({"FAIRBATCH_REDIS_PASSWORD_FILE": missing})


def test_a_router_with_an_unreadable_password_file_exits_2(tmp_path: Path) -> None:
    cfg_path = tmp_path / "router.yaml"
    cfg_path.write_text(yaml.safe_dump(config_dict([{"id": "r0", "http_url": "http://127.0.0.1:1", "grpc_target": "127.0.0.1:1"}], {})))
    missing = str(tmp_path / "missing")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAIRBATCH_REDIS_PASSWORD")}
    proc = subprocess.run(script("fairbatch-router") + ["--config", str(cfg_path), "--port", str(free_port())],
                          capture_output=True, text=True, timeout=60,
                          env={**env, "FAIRBATCH_REDIS_PASSWORD_FILE": missing})  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"fairbatch-router: FAIRBATCH_REDIS_PASSWORD_FILE={missing}: cannot read the secret file (No such file or directory)")


async def test_a_router_process_with_the_password_keeps_its_buckets_in_redis(
    redis_auth_server: RedisServer, tmp_path: Path
) -> None:
    await _flush(redis_auth_server)
    pw = redis_auth_server.password
    assert pw
    reps = Replicas()
    group = ProcessGroup(tmp_path / "logs")
    client = aioredis.Redis(host="127.0.0.1", port=redis_auth_server.port, password=pw, decode_responses=True)
    try:
        replica = await reps.add("r0", 400.0)
        tenants = {"acme": {"weight": 1, "slo_class": "interactive", "tokens_per_minute": 100_000}}
        urls = {}
        (tmp_path / "pw").write_text(pw + "\n")  # the chart's form: the Secret mounted as a file
        for name, env in (("with", {"FAIRBATCH_REDIS_PASSWORD": pw}), ("without", {"FAIRBATCH_REDIS_PASSWORD": ""}),
                          ("file", {"FAIRBATCH_REDIS_PASSWORD": "", "FAIRBATCH_REDIS_PASSWORD_FILE": str(tmp_path / "pw")})):
            cfg_path = tmp_path / f"{name}.yaml"
            cfg_path.write_text(yaml.safe_dump(config_dict([replica], tenants, redis_url=redis_auth_server.url,
                                                           ledger={"key_prefix": name})))
            port = free_port()
            child = group.start(name, script("fairbatch-router") + [
                "--config", str(cfg_path), "--port", str(port), "--router-id", name], env=env)
            urls[name] = f"http://127.0.0.1:{port}"
            await asyncio.to_thread(group.wait_http_ok, child, urls[name] + "/health")
        async with aiohttp.ClientSession() as s:
            for name, url in urls.items():
                await wait_fresh(s, url, 1)
                reps.admission["r0"].set_budget(400.0)
                body = {"model": "sim-model", "prompt": "x" * 400, "max_tokens": 4}
                async with s.post(url + "/v1/completions", json=body,
                                  headers={"Authorization": f"Bearer {KEYS['acme']}"}) as r:
                    assert r.status == 200, await r.text()
            assert await metric_value(s, urls["with"], "fairbatch_router_ledger_degraded") == 0.0
            assert await metric_value(s, urls["file"], "fairbatch_router_ledger_degraded") == 0.0
            assert await metric_value(s, urls["without"], "fairbatch_router_ledger_degraded") == 1.0
        assert await client.exists("with:tpm:acme") == 1  # the bucket the request spent is in Redis
        assert await client.exists("file:tpm:acme") == 1
        assert await client.exists("without:tpm:acme") == 0  # that router spent its local one
        group.stop()
        for name in urls:
            assert pw not in (tmp_path / "logs" / f"{name}.log").read_text()
    finally:
        group.stop()
        await client.aclose()
        await reps.stop()
