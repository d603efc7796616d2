"""router/config.py: a valid file loads; every error names file, line and field path."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from router.cli import main as cli_main
from router.config import ConfigError, hash_api_key, load_config

KEY_HASH = hash_api_key("sk-acme")

VALID = f"""\
model: llama-3-8b-a100
slo_classes:
  interactive: {{ttft_ms: 500, tpot_ms: 50, priority: 0, sheddable: true, max_queue_ms: 2000}}
  batch: {{ttft_ms: 20000, tpot_ms: 200, priority: 1, sheddable: false, max_queue_ms: 600000}}
tenants:
  acme: {{weight: 3, slo_class: interactive, max_concurrency: 256, tokens_per_minute: 2000000, min_share: 0.2}}
  jobs: {{weight: 1, slo_class: batch}}
api_keys:
  "{KEY_HASH}": acme
replicas:
  - {{id: r0, http_url: "http://127.0.0.1:8101/", grpc_target: "127.0.0.1:9101"}}
  - {{id: r1, http_url: "http://127.0.0.1:8102", grpc_target: "127.0.0.1:9102"}}
queue: {{max_requests: 1024, max_tokens: 4000000}}
admission: {{bytes_per_token: 4.0, reserve_timeout_ms: 200}}
telemetry: {{otlp_endpoint: null, service_name: fairbatch-router}}
"""


def write(tmp_path: Path, text: str, name: str = "fairbatch.yaml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def test_hash_api_key_is_sha256_hex() -> None:
    assert hash_api_key("test") == "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"


def test_valid_file_loads(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, VALID))
    assert cfg.model == "llama-3-8b-a100"
    assert cfg.slo_classes["interactive"].ttft_ms == 500
    assert cfg.tenants["acme"].weight == 3 and cfg.tenants["acme"].min_share == 0.2
    assert cfg.api_keys == {KEY_HASH: "acme"}
    assert [r.id for r in cfg.replicas] == ["r0", "r1"]
    assert cfg.replicas[0].http_url == "http://127.0.0.1:8101"  # trailing slash stripped
    assert cfg.queue.max_requests == 1024 and cfg.queue.max_bypass == 8
    assert cfg.admission.reserve_timeout_ms == 200
    assert cfg.redis_url is None


def test_yaml_syntax_error_names_the_line(tmp_path: Path) -> None:
    text = VALID.replace("  jobs: {weight: 1, slo_class: batch}", "  jobs: {weight: 1, slo_class: batch")
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    msg = str(err.value)
    assert msg.startswith("fairbatch.yaml:"), msg
    line = int(msg.split(":")[1])
    assert line in (7, 8), msg  # the unclosed flow mapping on line 7 (parser reports where it noticed)
    assert "YAML syntax error" in msg


def test_wrong_field_names_line_and_path(tmp_path: Path) -> None:
    text = VALID.replace(
        "  jobs: {weight: 1, slo_class: batch}", "  jobs:\n    slo_class: batch\n    weight: 0"
    )
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    assert str(err.value) == "fairbatch.yaml:9: tenants.jobs.weight: Input should be greater than 0"


def test_unknown_field_is_rejected(tmp_path: Path) -> None:
    text = VALID.replace("queue: {max_requests: 1024,", "queue: {max_requets: 1024,")
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    assert "fairbatch.yaml:13: queue.max_requets: Extra inputs are not permitted" in str(err.value)


def test_replica_list_error_path(tmp_path: Path) -> None:
    text = VALID.replace('http_url: "http://127.0.0.1:8102"', 'http_url: "127.0.0.1:8102"')
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    assert str(err.value).startswith("fairbatch.yaml:12: replicas[1].http_url: String should match pattern")


def test_unknown_tenant_in_api_keys(tmp_path: Path) -> None:
    text = VALID.replace(f'"{KEY_HASH}": acme', f'"{KEY_HASH}": nobody')
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    assert str(err.value) == f"fairbatch.yaml:9: api_keys.{KEY_HASH}: unknown tenant 'nobody'"


def test_bad_hash_in_api_keys(tmp_path: Path) -> None:
    text = VALID.replace(f'"{KEY_HASH}": acme', '"sk-plain-key": acme')
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    msg = str(err.value)
    assert msg.startswith("fairbatch.yaml:9: api_keys.sk-plain-key: "), msg
    assert "sha256" in msg


def test_unknown_slo_class_of_tenant(tmp_path: Path) -> None:
    text = VALID.replace("jobs: {weight: 1, slo_class: batch}", "jobs: {weight: 1, slo_class: bulk}")
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    assert str(err.value).startswith("fairbatch.yaml:7: tenants.jobs.slo_class: unknown SLO class 'bulk'")


def test_duplicate_replica_id(tmp_path: Path) -> None:
    text = VALID.replace("id: r1,", "id: r0,")
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    assert str(err.value) == "fairbatch.yaml:12: replicas[1].id: duplicate replica id 'r0'"


def test_missing_required_field_points_at_parent(tmp_path: Path) -> None:
    text = VALID.replace("ttft_ms: 500, ", "")
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    assert str(err.value) == "fairbatch.yaml:3: slo_classes.interactive.ttft_ms: Field required"


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "nope.yaml")


def test_cli_broken_config_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = VALID.replace("weight: 3", "weight: -1")
    path = write(tmp_path, text)
    assert cli_main(["--config", str(path)]) == 2
    assert "fairbatch.yaml:6: tenants.acme.weight: Input should be greater than 0" in capsys.readouterr().err


def test_hash_api_key_of_a_header_with_non_utf8_bytes_never_raises() -> None:
    import hashlib

    from router.config import hash_api_key

    # aiohttp decodes header bytes b"\xff\xfe" to the lone surrogates \udcff\udcfe (surrogateescape)
    assert hash_api_key("sk-\udcff\udcfe") == hashlib.sha256(b"sk-\xff\xfe").hexdigest()
    assert len(hash_api_key("\ud800")) == 64  # a surrogate no byte decodes to: still a digest, no exception
    assert hash_api_key("test") == "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
