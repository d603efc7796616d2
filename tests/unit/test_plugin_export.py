"""The vLLM-free helpers of the FairBatching scheduler plugin (replica_agent/plugin_export.py)."""

from __future__ import annotations

import json
import socket
from types import SimpleNamespace

import pytest

from replica_agent.plugin_export import (
    PluginExporter,
    positive_float,
    request_slo,
    step_deadline,
    time_model_from_env,
)
from replica_agent.policy.profiles import DEFAULT_PROFILE, load_profile


def test_time_model_from_env() -> None:
    tm, src = time_model_from_env({"FAIRBATCH_COEFFICIENTS": " 8, 0.02 ,0.001"})
    assert (tm.a_ms, tm.b_ms_per_new_token, tm.c_ms_per_context_token) == (8.0, 0.02, 0.001)
    assert src == "coefficients 8,0.02,0.001"
    tm, src = time_model_from_env({"FAIRBATCH_PROFILE": "llama-3-8b-a100"})
    assert tm == load_profile("llama-3-8b-a100").time_model and src == "profile llama-3-8b-a100"
    tm, src = time_model_from_env({})
    assert tm == load_profile(DEFAULT_PROFILE).time_model
    with pytest.raises(ValueError):
        time_model_from_env({"FAIRBATCH_COEFFICIENTS": "1,2"})
    with pytest.raises(ValueError):
        time_model_from_env({"FAIRBATCH_COEFFICIENTS": "1,0,0"})  # b must be > 0
    with pytest.raises(KeyError):
        time_model_from_env({"FAIRBATCH_PROFILE": "no-such-gpu"})


def test_request_slo_from_extra_args() -> None:
    def req(extra: object) -> SimpleNamespace:
        return SimpleNamespace(sampling_params=SimpleNamespace(extra_args=extra))

    assert request_slo(req({"fairbatch_ttft_ms": 500, "fairbatch_tpot_ms": "50"})) == (500.0, 50.0)
    assert request_slo(req({"fairbatch_ttft_ms": -1, "fairbatch_tpot_ms": "x"})) == (None, None)
    assert request_slo(req({"kv_transfer_params": None})) == (None, None)
    assert request_slo(req(None)) == (None, None)
    assert request_slo(SimpleNamespace(sampling_params=None)) == (None, None)
    assert positive_float("inf") is None and positive_float(0) is None and positive_float("2.5") == 2.5


def test_step_deadline_matches_policy_formula() -> None:
    # arrival 0, ttft 1000, tpot 100, 3 tokens out: envelope deadline 1300; first token at 200 -> 500
    assert step_deadline(250.0, 0.0, 3, 1000.0, 100.0, None) == (1300.0, 1050.0)
    assert step_deadline(250.0, 0.0, 3, 1000.0, 100.0, 200.0) == (500.0, 250.0)


def test_file_export(tmp_path) -> None:
    path = tmp_path / "export.jsonl"
    ex = PluginExporter(str(path))
    assert not ex.is_socket
    assert ex.send({"step": 1}) and ex.send({"step": 2})
    ex.close()
    assert not ex.send({"step": 3})  # closed: dropped, never raises
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    assert (ex.sent, ex.dropped) == (2, 1)


def test_datagram_export_is_non_blocking_and_drops(tmp_path) -> None:
    path = tmp_path / "agent.sock"
    ex = PluginExporter(f"unix:{path}")
    assert ex.is_socket
    assert not ex.send({"step": 0})  # no reader bound yet: dropped
    reader = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    reader.bind(str(path))
    try:
        assert ex.send({"step": 1})
        assert json.loads(reader.recv(65536)) == {"step": 1}
        # a reader that never reads: the sender fills the buffer and then drops, without blocking
        big = {"pad": "x" * 4000}
        results = [ex.send(big) for _ in range(2000)]
        assert results[0] and not results[-1]
        assert ex.dropped >= 1 + results.count(False)
        # the path of an existing socket also selects datagram mode
        assert PluginExporter(str(path)).is_socket
    finally:
        reader.close()
        ex.close()


def test_agent_puts_the_slo_into_vllm_xargs_for_the_plugin() -> None:
    from types import SimpleNamespace

    from replica_agent.plugin_export import request_slo
    from replica_agent.proxy import with_slo_xargs

    body = {"prompt": "hi", "max_tokens": 3, "vllm_xargs": {"other": 1}}
    out = with_slo_xargs(body, 500.0, 50.0)
    assert out["vllm_xargs"] == {"other": 1, "fairbatch_ttft_ms": 500.0, "fairbatch_tpot_ms": 50.0}
    assert body["vllm_xargs"] == {"other": 1}  # the client's body is not changed in place
    assert with_slo_xargs({"prompt": "x"}, 1000, 100)["vllm_xargs"] == {"fairbatch_ttft_ms": 1000, "fairbatch_tpot_ms": 100}
    # vLLM copies vllm_xargs into SamplingParams.extra_args; the plugin reads the SLO back from there
    request = SimpleNamespace(sampling_params=SimpleNamespace(extra_args=out["vllm_xargs"]))
    assert request_slo(request) == (500.0, 50.0)
