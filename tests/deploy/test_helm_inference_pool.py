"""The chart behind a Kubernetes inference gateway (issue 28 item 3): ``inferencePool.enabled`` renders an
``InferencePool`` (inference.networking.k8s.io/v1) of the vLLM pods whose endpoint picker is the router's
ext_proc port, the picker's Service, the router's ``--ext-proc-port`` and an example ``HTTPRoute``; every
object validates against tests/deploy/schemas (README there says what those schemas are)."""

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


def test_the_schemas_refuse_what_the_api_refuses(helm: Path) -> None:
    pool = one(render(helm, _ci(POOL_VALUES)), "InferencePool")
    cases = {
        "no target port": lambda p: p["spec"].update(targetPorts=[]),
        "port out of range": lambda p: p["spec"]["targetPorts"][0].update(number=70000),
        "unknown failure mode": lambda p: p["spec"]["endpointPickerRef"].update(failureMode="Retry"),
        "service without port": lambda p: p["spec"]["endpointPickerRef"].pop("port"),
        "empty selector": lambda p: p["spec"]["selector"].update(matchLabels={}),
        "misspelt field": lambda p: p["spec"].update(targetPort=[{"number": 8001}]),
        "no picker": lambda p: p["spec"].pop("endpointPickerRef"),
    }
    for name, mutate in cases.items():
        bad = copy.deepcopy(pool)
        mutate(bad)
        assert schema_errors(bad), name
