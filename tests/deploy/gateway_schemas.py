"""Validation of the Gateway API objects the chart renders against the upstream CRDs vendored in
tests/deploy/schemas (README there: the InferencePool CRD of the Gateway API Inference Extension v1.6.0
and Gateway API v1.6.1's standard-channel HTTPRoute CRD, unmodified).

An object is checked as the API server checks a create against a CRD's structural ``openAPIV3Schema``:

1. defaulting: every ``default`` of the schema is filled in where the field is absent (the API server
   defaults before it validates, and the CEL rules read the defaults: an ``endpointPickerRef`` without
   ``kind`` is a ``Service`` and needs its ``port``);
2. the OpenAPI schema (types, enums, patterns, bounds, required fields) by ``jsonschema`` (Draft 4: the
   OpenAPI 3.0 schema dialect's base), with ``additionalProperties: false`` on every object that lists its
   ``properties`` and does not preserve unknown fields, as ``kubectl apply`` (strict field validation,
   its default) refuses a misspelt field;
3. every ``x-kubernetes-validations`` rule (CEL, evaluated by ``cel-python``) at the node it is declared
   on, with ``self`` the node's value and property names escaped as Kubernetes escapes them (a field
   named ``namespace`` is ``self.__namespace__``); a transition rule (one that reads ``oldSelf``) only
   runs on updates and is skipped.
"""

from __future__ import annotations

import copy
import re
from functools import cache
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import yaml

SCHEMAS = Path(__file__).parent / "schemas"
CRDS = {
    ("inference.networking.k8s.io/v1", "InferencePool"):
        "gateway-api-inference-extension/inference.networking.k8s.io_inferencepools.yaml",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "gateway-api/gateway.networking.k8s.io_httproutes.yaml",
}

# CEL's reserved words, escaped as __word__ in a rule (Kubernetes "Escaping" of CRD validation rules)
_RESERVED = frozenset({"true", "false", "null", "in", "as", "break", "const", "continue", "else", "for", "function",
                       "if", "import", "let", "loop", "package", "namespace", "return", "var", "void", "while"})
_CEL = celpy.Environment()


def escape(name: str) -> str:
    """A property name as a CEL rule names it (``__`` -> ``__underscores__``, ``.`` -> ``__dot__``,
    ``-`` -> ``__dash__``, ``/`` -> ``__slash__``, a reserved word ``w`` -> ``__w__``)."""
    if name in _RESERVED:
        return f"__{name}__"
    return (name.replace("__", "__underscores__").replace(".", "__dot__").replace("-", "__dash__")
            .replace("/", "__slash__"))


@cache
def crd_schema(api_version: str, kind: str) -> dict[str, Any]:
    """The ``openAPIV3Schema`` of ``kind`` at ``api_version`` in its vendored CRD (a served version)."""
    crd = yaml.safe_load((SCHEMAS / CRDS[(api_version, kind)]).read_text())
    group, version = api_version.split("/")
    assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["group"] == group
    assert crd["spec"]["names"]["kind"] == kind
    (v,) = [v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]]
    return v["schema"]["openAPIV3Schema"]


def _strict(schema: Any) -> Any:
    """A copy of ``schema`` whose objects with ``properties`` refuse other fields (step 2)."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (_strict(v) if k != "properties" else {p: _strict(s) for p, s in v.items()}) for k, v in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema and \
            not schema.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@cache
def validator(api_version: str, kind: str) -> jsonschema.Draft4Validator:
    """The JSON Schema validator of step 2 for ``kind``."""
    schema = _strict(crd_schema(api_version, kind))
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema)


def defaulted(schema: dict[str, Any], value: Any) -> Any:
    """``value`` with the schema's defaults filled in where fields are absent (step 1)."""
    if isinstance(value, dict):
        out = dict(value)
        for name, sub in schema.get("properties", {}).items():
            if name not in out and "default" in sub:
                out[name] = copy.deepcopy(sub["default"])
            if name in out:
                out[name] = defaulted(sub, out[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name in out:
                if name not in schema.get("properties", {}):
                    out[name] = defaulted(extra, out[name])
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [defaulted(schema["items"], v) for v in value]
    return value


def _cel_value(schema: dict[str, Any], value: Any) -> Any:
    """``value`` as a rule sees it: the declared properties of an object under their escaped names."""
    if isinstance(value, dict):
        props = schema.get("properties")
        if props is not None:
            return {escape(k): _cel_value(props.get(k, {}), v) for k, v in value.items()}
        extra = schema.get("additionalProperties")
        return {k: _cel_value(extra if isinstance(extra, dict) else {}, v) for k, v in value.items()}
    if isinstance(value, list):
        return [_cel_value(schema.get("items", {}), v) for v in value]
    return value


@cache
def _program(rule: str) -> Any:
    return _CEL.program(_CEL.compile(rule))


def cel_errors(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """``path: message`` for each ``x-kubernetes-validations`` rule that ``value`` fails (step 3)."""
    errors = []
    for rule in schema.get("x-kubernetes-validations", ()):
        if re.search(r"\boldSelf\b", rule["rule"]):
            continue  # a transition rule: updates only
        result = _program(rule["rule"]).evaluate({"self": celpy.json_to_cel(_cel_value(schema, value))})
        if isinstance(result, Exception) or not (isinstance(result, celpy.celtypes.BoolType) and bool(result)):
            errors.append(f"{path or '<root>'}: {rule.get('message') or 'failed rule: ' + rule['rule']}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for name, v in value.items():
            sub = props.get(name, extra if isinstance(extra, dict) else None)
            if sub is not None:
                errors += cel_errors(sub, v, f"{path}.{name}" if path else name)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            errors += cel_errors(schema["items"], v, f"{path}.{i}")
    return errors


def schema_errors(obj: dict[str, Any]) -> list[str]:
    """``Kind/name: path: message`` for each violation of ``obj`` against its CRD (empty when valid)."""
    api_version, kind = obj["apiVersion"], obj["kind"]
    full = defaulted(crd_schema(api_version, kind), obj)
    v = validator(api_version, kind)
    name = f"{kind}/{obj['metadata']['name']}"
    errors = [f"{name}: {'.'.join(str(p) for p in e.absolute_path)}: {e.message}"
              for e in sorted(v.iter_errors(full), key=lambda e: list(map(str, e.absolute_path)))]
    if errors:  # CEL rules assume a value of the schema's shape
        return errors
    return [f"{name}: {e}" for e in cel_errors(crd_schema(api_version, kind), full)]
