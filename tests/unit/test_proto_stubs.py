"""The committed gRPC stubs must match proto/admission.proto (regenerated with grpcio-tools)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_committed_stubs_match_the_proto(tmp_path: Path) -> None:
    (tmp_path / "proto").mkdir()
    (tmp_path / "proto" / "admission.proto").write_bytes((ROOT / "proto" / "admission.proto").read_bytes())
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.", "--pyi_out=.",
         "--grpc_python_out=.", "proto/admission.proto"],
        cwd=tmp_path, check=True,
    )
    for name in ("admission_pb2.py", "admission_pb2.pyi", "admission_pb2_grpc.py"):
        assert (tmp_path / "proto" / name).read_text() == (ROOT / "proto" / name).read_text(), (
            f"proto/{name} is stale: run `make proto`"
        )


def test_contract_has_the_three_rpcs() -> None:
    from proto import admission_pb2

    service = admission_pb2.DESCRIPTOR.services_by_name["AdmissionService"]
    methods = {m.name: m for m in service.methods}
    assert set(methods) == {"WatchBudget", "Reserve", "Release"}
    assert methods["WatchBudget"].server_streaming and not methods["Reserve"].server_streaming
    fields = set(admission_pb2.ClassBudget.DESCRIPTOR.fields_by_name)
    assert {"pab_ms", "pab_tokens", "decode_reservation_ms", "inflight_reservation_ms", "kv_free_tokens"} <= fields
    snap = set(admission_pb2.BudgetSnapshot.DESCRIPTOR.fields_by_name)
    assert {"coefficients", "seq", "timestamp_ms", "ttl_ms", "classes"} <= snap
