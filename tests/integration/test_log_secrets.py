"""No API key, no prompt text and no traceback in the logs of the real router and agent processes (issue 14),
at DEBUG, after malformed header lines carrying known keys, bad bodies and normal requests.

The router process serves the fake replicas of test_router_tenants (in this process); the agent process
fronts an engine address where nothing listens (its proxy answers 502, which is fine here).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import yaml

from loadgen.procs import ProcessGroup, free_port, script
from tests.integration.test_router_hardening import raw_http
from tests.integration.test_router_tenants import KEYS, Replicas, config_dict, wait_fresh

SECRETS = ["sk-leak-header-1", "sk-leak-header-2", "sk-leak-header-3", "sk-leak-header-4", "sk-leak-header-5",
           "plainsecretvalue77", KEYS["acme"]]
PROMPT_MARK = "PROMPT-TEXT-MUST-NOT-BE-LOGGED"


def malformed_requests() -> list[bytes]:
    body = json.dumps({"model": "m", "prompt": PROMPT_MARK}).encode()
    cl = b"Content-Length: " + str(len(body)).encode() + b"\r\n"
    return [
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization Bearer sk-leak-header-1\r\n" + cl + b"\r\n" + body,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-leak-header-2\x01\r\n" + cl + b"\r\n" + body,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n Authorization: Bearer sk-leak-header-3\r\n" + cl + b"\r\n" + body,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-leak-header-4\r\n" + cl
        + b"Transfer-Encoding: chunked\r\n\r\n" + body,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Api-Key: plainsecretvalue77\x7f\r\n" + cl + b"\r\n" + body,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-leak-header-5\r\n"
        + b"Content-Length: 10\r\nContent-Length: 11\r\n\r\n" + body,
        b"GARBAGE " + PROMPT_MARK.encode() + b"\r\n\r\n",
        # well-formed HTTP, bad bodies with the prompt text and a valid key
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEYS["acme"].encode() + b"\r\n"
        + b"Content-Length: 52\r\n\r\n" + b'{"model": "m", "prompt": "' + PROMPT_MARK.encode() + b'\\ud800"}'[:26],
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEYS["acme"].encode() + b"\r\n"
        + b"Content-Encoding: gzip\r\n" + cl + b"\r\n" + body,
    ]


async def test_no_key_prompt_or_traceback_in_router_and_agent_logs(tmp_path: Path) -> None:
    reps = Replicas()
    group = ProcessGroup(tmp_path / "logs")
    try:
        replica = await reps.add("r0", 400.0)
        cfg_path = tmp_path / "fairbatch.yaml"
        rport, aport, gport, dead, mport = free_port(), free_port(), free_port(), free_port(), free_port()
        cfg_path.write_text(yaml.safe_dump(config_dict([replica], {"acme": {"weight": 1, "slo_class": "interactive"}},
                                                       http={"metrics_port": mport})))
        router = group.start("router", script("fairbatch-router") + [
            "--config", str(cfg_path), "--port", str(rport), "--log-level", "DEBUG"])
        agent = group.start("agent", script("fairbatch-agent") + [
            "serve", "--engine-url", f"http://127.0.0.1:{dead}", "--http-port", str(aport), "--grpc-port", str(gport),
            "--replica-id", "a0", "--log-level", "DEBUG"])
        rurl, aurl = f"http://127.0.0.1:{rport}", f"http://127.0.0.1:{aport}"
        murl = f"http://127.0.0.1:{mport}"
        group.wait_http_ok(router, rurl + "/health")
        group.wait_http_ok(router, murl + "/metrics")  # the router process serves its metrics port
        group.wait_http_ok(agent, aurl + "/metrics")
        async with aiohttp.ClientSession() as s:
            await wait_fresh(s, murl, 1)
            assert (await s.get(rurl + "/metrics")).status == 404
            answers = []
            for url in (rurl, aurl):
                for req in malformed_requests():
                    answers.append(await raw_http(url, req, read_timeout_s=1.0))
                # normal requests with the prompt text: served by the router, 502 from the agent's dead engine
                for _ in range(2):
                    reps.admission["r0"].set_budget(400.0)
                    async with s.post(url + "/v1/completions", json={"model": "m", "prompt": PROMPT_MARK,
                                                                     "max_tokens": 2},
                                      headers={"Authorization": f"Bearer {KEYS['acme']}"}) as r:
                        answers.append(f"HTTP/1.1 {r.status}".encode())
        statuses = [int(a.split(b" ")[1]) for a in answers if a.startswith(b"HTTP/")]
        assert len(statuses) == len(answers)
        assert all(400 <= st < 500 for st in statuses[:9]), statuses  # router: malformed -> 4xx
        assert statuses[9:11] == [200, 200]
        assert all(st < 500 for st in statuses[11:20]), statuses  # agent: malformed -> 4xx
        group.stop()
        for child in ("router", "agent"):
            text = (tmp_path / "logs" / f"{child}.log").read_text(errors="replace")
            assert "DEBUG" in text  # the level really was DEBUG
            for secret in SECRETS:
                assert secret not in text, (child, secret)
            assert PROMPT_MARK not in text, child
            assert "Traceback" not in text, (child, text[-3000:])
    finally:
        group.stop()
        await reps.stop()
