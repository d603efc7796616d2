"""Validation of the Gateway API objects the chart renders against tests/deploy/schemas (see its README:
our transcription of the published v1 APIs, not the upstream CRD files)."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema

SCHEMAS = Path(__file__).parent / "schemas"
FILES = {
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool.inference.networking.k8s.io_v1.json",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute.gateway.networking.k8s.io_v1.json",
}


@cache
def validator(api_version: str, kind: str) -> jsonschema.Draft7Validator:
    """The schema of ``kind``; a vendored CRD's ``openAPIV3Schema`` is accepted as well as a plain schema."""
    doc = json.loads((SCHEMAS / FILES[(api_version, kind)]).read_text())
    if doc.get("kind") == "CustomResourceDefinition":
        doc = next(v["schema"]["openAPIV3Schema"] for v in doc["spec"]["versions"] if v["name"] == api_version.split("/")[1])
    jsonschema.Draft7Validator.check_schema(doc)
    return jsonschema.Draft7Validator(doc)


def schema_errors(obj: dict[str, Any]) -> list[str]:
    """``Kind/name: path: message`` for each schema violation of ``obj`` (empty when valid)."""
    v = validator(obj["apiVersion"], obj["kind"])
    return [f"{obj['kind']}/{obj['metadata']['name']}: {'.'.join(str(p) for p in e.absolute_path)}: {e.message}"
            for e in sorted(v.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))]
