"""The chart behind a Kubernetes inference gateway (issue 28 item 3): ``inferencePool.enabled`` renders an
``InferencePool`` (inference.networking.k8s.io/v1) of the vLLM pods whose endpoint picker is the router's
ext_proc port, the picker's Service, the router's ``--ext-proc-port`` and an example ``HTTPRoute``; every
object validates against the upstream CRDs vendored in tests/deploy/schemas (README there: GIE v1.6.0's
InferencePool, Gateway API v1.6.1's HTTPRoute), CEL rules included (tests/deploy/gateway_schemas.py)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from gateway_schemas import schema_errors
from test_helm import CHART, NAMESPACE, RELEASE, _ci, _run, container, helm, one, render  # noqa: F401

pytestmark = pytest.mark.timeout(300)

POOL_VALUES = "inference-pool-values.yaml"


def test_the_pool_points_at_the_picker_service_and_the_agents(helm: Path) -> None:
    objs = render(helm, _ci(POOL_VALUES))
    pool = one(objs, "InferencePool")
    assert schema_errors(pool) == []
    spec = pool["spec"]
    # the vLLM pods (their agent sidecar's HTTP port 8001, not vLLM's 8000)
    sts = one(objs, "StatefulSet")
    assert spec["selector"]["matchLabels"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    assert spec["targetPorts"] == [{"number": 8001}]
    agent = container(sts["spec"]["template"]["spec"], "agent")
    assert 8001 in [p["containerPort"] for p in agent["ports"]]
    ref = spec["endpointPickerRef"]
    assert ref == {"name": f"{RELEASE}-fairbatch-picker", "port": {"number": 9002}, "failureMode": "FailClose"}
    # the picker Service selects the router pods' ext-proc port, HTTP/2
    svc = one(objs, "Service", ref["name"])
    assert svc["spec"]["ports"] == [{"name": "ext-proc", "port": 9002, "targetPort": "ext-proc", "protocol": "TCP",
                                     "appProtocol": "http2"}]
    dep = one(objs, "Deployment", f"{RELEASE}-fairbatch-router")
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    router = container(dep["spec"]["template"]["spec"], "router")
    args = router["args"]
    assert args[args.index("--ext-proc-port") + 1] == "9002" and args[args.index("--ext-proc-fallbacks") + 1] == "2"
    assert {"name": "ext-proc", "containerPort": 9002, "protocol": "TCP"} in router["ports"]


def test_the_example_route_sends_v1_to_the_pool(helm: Path) -> None:
    objs = render(helm, _ci(POOL_VALUES))
    route = one(objs, "HTTPRoute")
    assert schema_errors(route) == []
    assert route["spec"]["parentRefs"] == [{"name": "inference-gateway", "namespace": "envoy-gateway-system"}]
    rule = route["spec"]["rules"][0]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                    "name": f"{RELEASE}-fairbatch"}]
    assert rule["timeouts"] == {"request": "300s"}


def test_the_gateway_reaches_the_picker_and_the_agents_and_nothing_more(helm: Path) -> None:
    objs = render(helm, _ci(POOL_VALUES))
    gw = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "envoy-gateway-system"}}}]
    agents = one(objs, "NetworkPolicy", f"{RELEASE}-fairbatch-agents")["spec"]["ingress"]
    assert {"ports": [{"port": "http", "protocol": "TCP"}], "from": gw} in agents
    assert not any(r.get("from") == gw and {"port": "grpc", "protocol": "TCP"} in r["ports"] for r in agents)
    router = one(objs, "NetworkPolicy", f"{RELEASE}-fairbatch-router")["spec"]["ingress"]
    assert {"ports": [{"port": "ext-proc", "protocol": "TCP"}], "from": gw} in router


def test_off_by_default(helm: Path) -> None:
    objs = render(helm)
    assert not [o for o in objs if o["kind"] in ("InferencePool", "HTTPRoute")]
    assert not [o for o in objs if o["metadata"]["name"].endswith("-picker")]
    dep = one(objs, "Deployment", f"{RELEASE}-fairbatch-router")
    assert "--ext-proc-port" not in container(dep["spec"]["template"]["spec"], "router")["args"]


def test_existing_fleet_needs_its_pod_labels(helm: Path) -> None:
    base = ["inferencePool.enabled=true", "router.discovery.service=vllm"]
    proc = _run(helm, "template", RELEASE, str(CHART), "-n", NAMESPACE, "-f", str(_ci("existing-fleet-values.yaml")),
                *sum((["--set", s] for s in base), []))
    assert proc.returncode != 0 and "inferencePool.selector" in proc.stderr
    objs = render(helm, _ci("existing-fleet-values.yaml"), set_=(*base, "inferencePool.selector.app=vllm"))
    pool = one(objs, "InferencePool")
    assert pool["spec"]["selector"] == {"matchLabels": {"app": "vllm"}} and schema_errors(pool) == []


@pytest.mark.parametrize("set_, message", [
    (("router.discovery.mode=static",), "pod IP:port"),
    (("inferencePool.pickerPort=8080",), "inferencePool.pickerPort (8080) must differ"),
])
def test_mistakes_fail_with_a_readable_message(helm: Path, set_: tuple[str, ...], message: str) -> None:
    args = ["template", RELEASE, str(CHART), "-n", NAMESPACE, "--set", "inferencePool.enabled=true"]
    for s in set_:
        args += ["--set", s]
    proc = _run(helm, *args)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


def test_the_crds_refuse_what_the_api_server_refuses(helm: Path) -> None:
    # each mutation of the rendered objects breaks one rule of the vendored CRDs (GIE v1.6.0's
    # InferencePool, Gateway API v1.6.1's HTTPRoute): the schema, strict fields, or a CEL rule
    objs = render(helm, _ci(POOL_VALUES))
    pool, route = one(objs, "InferencePool"), one(objs, "HTTPRoute")
    pool_cases = {
        "no target port": (lambda p: p["spec"].update(targetPorts=[]), "spec.targetPorts: [] should be non-empty"),
        "port out of range": (lambda p: p["spec"]["targetPorts"][0].update(number=70000), "70000 is greater than"),
        "unknown failure mode": (lambda p: p["spec"]["endpointPickerRef"].update(failureMode="Retry"), "'Retry' is not one of"),
        "empty selector": (lambda p: p["spec"]["selector"].update(matchLabels={}), "spec.selector.matchLabels: {} should be non-empty"),
        "misspelt field": (lambda p: p["spec"].update(targetPort=[{"number": 8001}]), "'targetPort' was unexpected"),
        "no selector": (lambda p: p["spec"].pop("selector"), "'selector' is a required property"),
        # CEL (x-kubernetes-validations), over the defaulted object: kind defaults to Service
        "service without port": (lambda p: p["spec"]["endpointPickerRef"].pop("port"),
                                 "port is required when kind is 'Service' or unspecified"),
        "same port twice": (lambda p: p["spec"].update(targetPorts=[{"number": 8001}, {"number": 8001}]),
                            "port number must be unique"),
    }
    route_cases = {
        "a Service backend without port": (lambda r: r["spec"]["rules"][0]["backendRefs"][0].update(
            group="", kind="Service"), "Must have port for Service reference"),
        "backend timeout over the request's": (lambda r: r["spec"]["rules"][0]["timeouts"].update(
            backendRequest="600s"), "backendRequest timeout cannot be longer than request timeout"),
        "bad duration": (lambda r: r["spec"]["rules"][0]["timeouts"].update(request="5 minutes"), "does not match"),
    }
    for obj, cases in ((pool, pool_cases), (route, route_cases)):
        for name, (mutate, message) in cases.items():
            bad = copy.deepcopy(obj)
            mutate(bad)
            errors = schema_errors(bad)
            assert any(message in e for e in errors), (name, errors)
    # the rendered pool names the picker; the v1.6.0 API also takes a pool without one
    nopicker = copy.deepcopy(pool)
    nopicker["spec"].pop("endpointPickerRef")
    assert schema_errors(nopicker) == []
