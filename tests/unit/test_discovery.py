"""router/discovery.py: the pure core (EndpointSlice parsing, slice sets, diffs), the discovery
config, DnsDiscovery with a stub resolver, and KubernetesDiscovery against a test double of the
API server's list + watch (real EndpointSlice JSON events; no API server can exist here)."""

from __future__ import annotations

import asyncio
import json
import queue
import socket
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from router.config import ConfigError, DiscoveryConfig, ReplicaConfig, parse_config
from router.discovery import (
    DnsDiscovery,
    Endpoint,
    KubernetesDiscovery,
    SliceSet,
    addresses_from_addrinfo,
    backoff_s,
    build_discovery,
    default_namespace,
    diff_replicas,
    dns_name_of,
    endpoint_usable,
    endpoints_to_replicas,
    parse_endpoint_slice,
    resource_version,
    split_lines,
)

SERVICE = "fb-fairbatch-agents"


def wire_slice(name: str, endpoints: list[dict[str, Any]], rv: str = "1") -> dict[str, Any]:
    """An EndpointSlice exactly as the API server sends it (camelCase JSON)."""
    return {
        "kind": "EndpointSlice",
        "apiVersion": "discovery.k8s.io/v1",
        "metadata": {
            "name": name, "namespace": "llm", "resourceVersion": rv,
            "labels": {"kubernetes.io/service-name": SERVICE, "endpointslice.kubernetes.io/managed-by":
                       "endpointslice-controller.k8s.io"},
        },
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": "http", "port": 8001, "protocol": "TCP"},
                  {"name": "grpc", "port": 9001, "protocol": "TCP", "appProtocol": "grpc"}],
    }


def wire_ep(pod: str, ip: str, ready: bool | None = True, serving: bool | None = None,
            terminating: bool | None = None) -> dict[str, Any]:
    cond: dict[str, Any] = {}
    for k, v in (("ready", ready), ("serving", serving), ("terminating", terminating)):
        if v is not None:
            cond[k] = v
    return {
        "addresses": [ip], "conditions": cond, "hostname": pod, "nodeName": "gpu-node-1",
        "targetRef": {"kind": "Pod", "namespace": "llm", "name": pod, "uid": f"uid-{pod}"},
        "zone": "z1",
    }


def replica(rid: str, host: str) -> ReplicaConfig:
    return ReplicaConfig(id=rid, http_url=f"http://{host}:8001", grpc_target=f"{host}:9001")


# ---------------------------------------------------------------------- parsing


def test_parse_wire_json_keeps_ready_and_uses_pod_names() -> None:
    text = json.dumps(wire_slice("s-1", [
        wire_ep("vllm-0", "10.0.0.10"),
        wire_ep("vllm-1", "10.0.0.11", ready=False),                                  # loading
        wire_ep("vllm-2", "10.0.0.12", ready=None),                                   # unknown = ready
        wire_ep("vllm-3", "10.0.0.13", ready=False, serving=True, terminating=True),  # draining
        wire_ep("vllm-4", "10.0.0.14", ready=False, serving=False, terminating=True),  # gone soon
    ]))
    eps = parse_endpoint_slice(json.loads(text))
    assert eps == [Endpoint("vllm-0", "10.0.0.10"), Endpoint("vllm-2", "10.0.0.12"), Endpoint("vllm-3", "10.0.0.13")]


def test_parse_real_v1_endpoint_slice_objects() -> None:
    obj = client.V1EndpointSlice(
        address_type="IPv4",
        metadata=client.V1ObjectMeta(name="s-1", resource_version="42"),
        endpoints=[
            client.V1Endpoint(addresses=["10.1.0.5"], conditions=client.V1EndpointConditions(ready=True),
                              target_ref=client.V1ObjectReference(kind="Pod", name="vllm-0")),
            client.V1Endpoint(addresses=["10.1.0.6"], conditions=client.V1EndpointConditions(ready=False),
                              target_ref=client.V1ObjectReference(kind="Pod", name="vllm-1")),
            client.V1Endpoint(addresses=["10.1.0.7"], hostname="vllm-2"),  # no conditions, no targetRef
        ],
    )
    expected = [Endpoint("vllm-0", "10.1.0.5"), Endpoint("vllm-2", "10.1.0.7")]
    assert parse_endpoint_slice(obj) == expected                   # the object (via to_dict)
    assert parse_endpoint_slice(obj.to_dict()) == expected         # snake_case dict
    wire = client.ApiClient().sanitize_for_serialization(obj)      # camelCase, as on the wire
    assert parse_endpoint_slice(wire) == expected
    assert resource_version(obj) == resource_version(wire) == "42"


def test_parse_edge_cases() -> None:
    # no endpoints at all (the controller writes null), an endpoint without addresses, no name at all
    assert parse_endpoint_slice({"metadata": {"name": "s"}, "endpoints": None}) == []
    assert parse_endpoint_slice({"endpoints": [{"addresses": [], "conditions": {"ready": True}}]}) == []
    assert parse_endpoint_slice({"endpoints": [{"addresses": ["10.0.0.9"]}]}) == [Endpoint("10.0.0.9", "10.0.0.9")]
    # a targetRef that is not a Pod falls back to the hostname
    ep = {"addresses": ["10.0.0.8"], "hostname": "h", "targetRef": {"kind": "Node", "name": "n"}}
    assert parse_endpoint_slice({"endpoints": [ep]}) == [Endpoint("h", "10.0.0.8")]
    with pytest.raises(TypeError):
        parse_endpoint_slice(42)


def test_endpoint_usable_truth_table() -> None:
    assert endpoint_usable(None) and endpoint_usable({}) and endpoint_usable({"ready": True})
    assert not endpoint_usable({"ready": False})
    assert not endpoint_usable({"ready": False, "serving": True})  # serving but not terminating: not ready yet
    assert endpoint_usable({"ready": False, "serving": True, "terminating": True})
    assert not endpoint_usable({"ready": False, "serving": False, "terminating": True})


# ---------------------------------------------------------------------- slice sets and diffs


def test_slice_set_unions_slices_and_applies_events() -> None:
    s = SliceSet()
    assert s.reset([wire_slice("a", [wire_ep("p0", "10.0.0.1")]), wire_slice("b", [wire_ep("p1", "10.0.0.2")])])
    assert [e.replica_id for e in s.endpoints()] == ["p0", "p1"]
    assert not s.reset([wire_slice("b", [wire_ep("p1", "10.0.0.2")]), wire_slice("a", [wire_ep("p0", "10.0.0.1")])])
    assert s.apply("ADDED", wire_slice("c", [wire_ep("p2", "10.0.0.3")]))
    assert not s.apply("MODIFIED", wire_slice("c", [wire_ep("p2", "10.0.0.3")]))  # no endpoint change
    assert s.apply("MODIFIED", wire_slice("a", [wire_ep("p0", "10.0.0.1", ready=False)]))
    assert [e.replica_id for e in s.endpoints()] == ["p1", "p2"]
    assert s.apply("DELETED", wire_slice("b", []))
    assert not s.apply("BOOKMARK", {"metadata": {"resourceVersion": "9"}})
    assert not s.apply("DELETED", wire_slice("zzz", []))
    assert s.endpoints() == [Endpoint("p2", "10.0.0.3")]
    # the same pod in two slices (dual-stack / overlap during a move) counts once
    s.reset([wire_slice("a", [wire_ep("p0", "10.0.0.1")]), wire_slice("b", [wire_ep("p0", "10.0.0.1")])])
    assert s.endpoints() == [Endpoint("p0", "10.0.0.1")]


def test_endpoints_to_replicas_formats_ipv6_and_names() -> None:
    reps = endpoints_to_replicas(
        [Endpoint("p0", "10.0.0.1"), Endpoint("p1", "fd00::5"), Endpoint("p2", "vllm-2.agents.llm.svc")], 8001, 9001
    )
    assert reps["p0"] == replica("p0", "10.0.0.1")
    assert reps["p1"].http_url == "http://[fd00::5]:8001" and reps["p1"].grpc_target == "[fd00::5]:9001"
    assert reps["p2"].grpc_target == "vllm-2.agents.llm.svc:9001"


def test_diff_replicas() -> None:
    cur = {"a": replica("a", "10.0.0.1"), "b": replica("b", "10.0.0.2")}
    assert not diff_replicas(cur, dict(cur))
    d = diff_replicas(cur, {"b": replica("b", "10.0.0.2"), "c": replica("c", "10.0.0.3")})
    assert d.removed == ("a",) and [r.id for r in d.added] == ["c"]
    # same pod name, new address (StatefulSet pod recreated): removed and added again
    d = diff_replicas(cur, {"a": replica("a", "10.0.0.9"), "b": replica("b", "10.0.0.2")})
    assert d.removed == ("a",) and d.added == (replica("a", "10.0.0.9"),)
    assert diff_replicas({}, cur).added == (cur["a"], cur["b"])
    assert diff_replicas(cur, {}).removed == ("a", "b")


def test_small_helpers() -> None:
    assert split_lines(b"", b'{"a":1}\n{"b"') == ([b'{"a":1}'], b'{"b"')
    assert split_lines(b'{"b"', b':2}\n\n') == ([b'{"b":2}'], b"")
    assert [backoff_s(n, 0.5, 30) for n in (1, 2, 3, 7, 20)] == [0.5, 1.0, 2.0, 30.0, 30.0]
    infos = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.2", 0)),
             (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.1", 0)),
             (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.2", 0))]
    assert addresses_from_addrinfo(infos) == ["10.0.0.1", "10.0.0.2"]


# ---------------------------------------------------------------------- config

BASE = """\
slo_classes:
  interactive: {ttft_ms: 500, tpot_ms: 50}
"""


def test_discovery_config_defaults_and_modes(tmp_path: Path) -> None:
    cfg = parse_config(BASE + "replicas:\n  - {id: r0, http_url: 'http://h:1', grpc_target: 'h:2'}\n")
    assert cfg.discovery.mode == "static" and build_discovery(cfg.discovery) is None
    cfg = parse_config(BASE + "discovery: {mode: kubernetes, namespace: llm, service: fb-agents}\n")
    d = cfg.discovery
    assert (d.http_port, d.grpc_port, d.resync_s, cfg.replicas) == (8001, 9001, 30.0, [])
    assert isinstance(build_discovery(d), KubernetesDiscovery)
    assert dns_name_of(d, "llm") == "fb-agents.llm.svc"
    cfg = parse_config(BASE + "discovery: {mode: dns, dns_name: agents.llm.svc.cluster.local, resync_s: 5}\n")
    src = build_discovery(cfg.discovery)
    assert isinstance(src, DnsDiscovery) and src.name == "agents.llm.svc.cluster.local"
    ns_file = tmp_path / "namespace"
    ns_file.write_text("team-a\n")
    assert default_namespace(DiscoveryConfig(mode="kubernetes", service="s"), ns_file) == "team-a"
    assert default_namespace(DiscoveryConfig(mode="kubernetes", service="s"), tmp_path / "none") == "default"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("discovery: {mode: kubernetes}\n", "fairbatch.yaml:3: discovery.service: kubernetes discovery needs"),
        ("discovery: {mode: dns}\n", "fairbatch.yaml:3: discovery.dns_name: dns discovery needs dns_name"),
        ("", "fairbatch.yaml:1: replicas: at least one replica is needed"),
        ("discovery: {mode: kubernetes, service: s, bogus: 1}\n", "discovery.bogus: Extra inputs are not permitted"),
        ("discovery: {mode: consul}\n", "discovery.mode: Input should be 'static', 'kubernetes' or 'dns'"),
        ("discovery: {mode: dns, dns_name: x, http_port: 0}\n", "discovery.http_port: Input should be greater"),
        ("discovery: {mode: dns, dns_name: x}\nreplicas:\n  - {id: r0, http_url: 'http://h:1', grpc_target: 'h:2'}\n",
         "fairbatch.yaml:5: replicas: must be empty when discovery.mode is dns"),
    ],
    ids=["k8s-no-service", "dns-no-name", "static-no-replicas", "extra-field", "bad-mode", "bad-port", "both"],
)
def test_discovery_config_errors(extra: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(BASE + extra, "fairbatch.yaml")
    assert message in str(err.value), str(err.value)


# ---------------------------------------------------------------------- DNS


def _infos(*addrs: str) -> list[tuple[Any, ...]]:
    return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 0)) for a in addrs]


async def test_dns_discovery_answers() -> None:
    answers: list[Any] = [_infos("10.0.0.2", "10.0.0.1"), socket.gaierror(socket.EAI_NONAME, "no name"),
                          socket.gaierror(socket.EAI_AGAIN, "try again"), "hang"]

    async def resolver(name: str) -> list[tuple[Any, ...]]:
        assert name == "agents.llm.svc"
        a = answers.pop(0)
        if a == "hang":
            await asyncio.sleep(10)
        if isinstance(a, BaseException):
            raise a
        return a

    dns = DnsDiscovery("agents.llm.svc", 8001, 9001, interval_s=0.01, timeout_s=0.05, resolver=resolver)
    first = await dns.resolve_once()
    assert first == {"10.0.0.1": replica("10.0.0.1", "10.0.0.1"), "10.0.0.2": replica("10.0.0.2", "10.0.0.2")}
    assert await dns.resolve_once() == {}        # the name does not exist: no ready replica
    assert await dns.resolve_once() is None      # transient: keep the last set
    assert await dns.resolve_once() is None      # timed out
    with pytest.raises(ValueError):
        DnsDiscovery("x", 1, 2, interval_s=0)


async def test_dns_discovery_run_publishes_only_answers() -> None:
    answers: list[Any] = [
        _infos("10.0.0.1"), socket.gaierror(socket.EAI_AGAIN, "again"), _infos("10.0.0.1", "10.0.0.3"),
    ]

    async def resolver(name: str) -> list[tuple[Any, ...]]:
        a = answers.pop(0) if answers else _infos("10.0.0.3")
        if isinstance(a, BaseException):
            raise a
        return a

    published: list[list[str]] = []
    dns = DnsDiscovery("agents", 8001, 9001, interval_s=0.01, resolver=resolver)
    task = asyncio.create_task(dns.run(lambda reps: published.append(sorted(reps))))
    while len(published) < 3:
        await asyncio.sleep(0.01)
    task.cancel()
    assert published[:3] == [["10.0.0.1"], ["10.0.0.1", "10.0.0.3"], ["10.0.0.3"]]


# ---------------------------------------------------------------------- Kubernetes (test double of the API)


class FakeWatch:
    """A blocking watch stream like the client's: yields event dicts until the server ends it
    (``None`` pushed) or ``close()`` is called from another thread."""

    def __init__(self) -> None:
        self.events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.closed = False

    def push(self, event_type: str, obj: dict[str, Any]) -> None:
        # every event crosses JSON, as on the wire
        self.events.put(json.loads(json.dumps({"type": event_type, "object": obj})))

    def end(self) -> None:
        self.events.put(None)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while not self.closed:
            try:
                ev = self.events.get(timeout=0.05)
            except queue.Empty:
                continue
            if ev is None:
                return
            yield ev

    def close(self) -> None:
        self.closed = True


class FakeApi:
    """Test double of the API server's EndpointSlice list + watch for one Service."""

    def __init__(self) -> None:
        self.slices: dict[str, dict[str, Any]] = {}
        self.rv = 10
        self.list_errors: list[BaseException] = []
        self.lists: list[str] = []
        self.watches: list[tuple[str, int, FakeWatch]] = []
        self.watch_opened = asyncio.Event()
        self._loop = asyncio.get_running_loop()

    def list(self) -> dict[str, Any]:
        if self.list_errors:
            raise self.list_errors.pop(0)
        self.lists.append(str(self.rv))
        return {"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                "metadata": {"resourceVersion": str(self.rv)}, "items": list(self.slices.values())}

    def watch(self, resource_version: str, timeout_s: int) -> FakeWatch:
        w = FakeWatch()
        self.watches.append((resource_version, timeout_s, w))
        self._loop.call_soon_threadsafe(self.watch_opened.set)
        return w

    def event(self, event_type: str, obj: dict[str, Any]) -> None:
        """Change the stored slices and tell the open watch."""
        self.rv += 1
        obj = json.loads(json.dumps(obj))
        obj["metadata"]["resourceVersion"] = str(self.rv)
        if event_type == "DELETED":
            self.slices.pop(obj["metadata"]["name"], None)
        else:
            self.slices[obj["metadata"]["name"]] = obj
        self.watches[-1][2].push(event_type, obj)


class Recorder:
    def __init__(self) -> None:
        self.sets: list[Mapping[str, ReplicaConfig]] = []
        self.changed = asyncio.Event()

    def __call__(self, reps: Mapping[str, ReplicaConfig]) -> None:
        self.sets.append(dict(reps))
        self.changed.set()

    async def until(self, pred: Any, timeout_s: float = 3.0) -> Mapping[str, ReplicaConfig]:
        async def wait() -> Mapping[str, ReplicaConfig]:
            while not (self.sets and pred(self.sets[-1])):
                self.changed.clear()
                await self.changed.wait()
            return self.sets[-1]
        return await asyncio.wait_for(wait(), timeout_s)


def k8s_cfg(**kw: Any) -> DiscoveryConfig:
    return DiscoveryConfig(mode="kubernetes", namespace="llm", service=SERVICE, resync_s=kw.pop("resync_s", 30), **kw)


async def _wait_watches(api: FakeApi, n: int) -> None:
    async def wait() -> None:
        while len(api.watches) < n:
            await asyncio.sleep(0.01)
    await asyncio.wait_for(wait(), 3.0)


async def test_kubernetes_discovery_lists_then_follows_watch_events() -> None:
    api = FakeApi()
    api.slices["s-a"] = wire_slice("s-a", [wire_ep("vllm-0", "10.0.0.10"), wire_ep("vllm-1", "10.0.0.11", ready=False)])
    rec = Recorder()
    kd = KubernetesDiscovery(k8s_cfg(), api=api, use_dns_fallback=False)
    task = asyncio.create_task(kd.run(rec))
    try:
        first = await rec.until(lambda s: True)
        assert first == {"vllm-0": replica("vllm-0", "10.0.0.10")}
        await _wait_watches(api, 1)
        assert api.watches[0][:2] == ("10", 30)  # from the list's resourceVersion, server ends it after resync_s
        # vllm-1 becomes ready; a second slice appears; vllm-0 vanishes
        api.event("MODIFIED", wire_slice("s-a", [wire_ep("vllm-0", "10.0.0.10"), wire_ep("vllm-1", "10.0.0.11")]))
        await rec.until(lambda s: set(s) == {"vllm-0", "vllm-1"})
        api.event("ADDED", wire_slice("s-b", [wire_ep("vllm-2", "10.0.1.12")]))
        await rec.until(lambda s: set(s) == {"vllm-0", "vllm-1", "vllm-2"})
        api.watches[-1][2].push("BOOKMARK", {"kind": "EndpointSlice", "metadata": {"resourceVersion": "99"}})
        api.event("MODIFIED", wire_slice("s-a", [wire_ep("vllm-1", "10.0.0.11")]))
        last = await rec.until(lambda s: set(s) == {"vllm-1", "vllm-2"})
        assert last["vllm-2"] == replica("vllm-2", "10.0.1.12")
        n = len(rec.sets)
        api.event("MODIFIED", wire_slice("s-a", [wire_ep("vllm-1", "10.0.0.11")]))  # no endpoint change
        api.event("DELETED", wire_slice("s-b", []))
        await rec.until(lambda s: set(s) == {"vllm-1"})
        assert len(rec.sets) == n + 1  # the no-op MODIFIED published nothing
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert api.watches[-1][2].closed  # the open watch is closed on cancel


async def test_kubernetes_discovery_relists_on_410_and_on_resync() -> None:
    api = FakeApi()
    api.slices["s-a"] = wire_slice("s-a", [wire_ep("vllm-0", "10.0.0.10")])
    rec = Recorder()
    kd = KubernetesDiscovery(k8s_cfg(), api=api, use_dns_fallback=False, backoff_start_s=0.01)
    task = asyncio.create_task(kd.run(rec))
    try:
        await _wait_watches(api, 1)
        # while nobody watched, vllm-0 was replaced by vllm-5; the server says our version is gone
        api.slices["s-a"] = wire_slice("s-a", [wire_ep("vllm-5", "10.0.0.15")])
        api.rv = 50
        api.watches[0][2].push("ERROR", {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                         "message": "too old resource version: 10 (45)", "reason": "Expired",
                                         "code": 410})
        assert await rec.until(lambda s: set(s) == {"vllm-5"})
        await _wait_watches(api, 2)
        assert api.watches[1][0] == "50" and api.watches[0][2].closed
        # the server ends the watch (timeoutSeconds): list again, then watch again
        api.watches[1][2].end()
        await _wait_watches(api, 3)
        assert api.lists == ["10", "50", "50"]
        assert kd.lists == 3
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_kubernetes_discovery_backs_off_and_keeps_the_last_set_on_errors() -> None:
    api = FakeApi()
    api.slices["s-a"] = wire_slice("s-a", [wire_ep("vllm-0", "10.0.0.10")])
    rec = Recorder()
    kd = KubernetesDiscovery(k8s_cfg(), api=api, use_dns_fallback=False, backoff_start_s=0.01, backoff_cap_s=0.02)
    task = asyncio.create_task(kd.run(rec))
    try:
        await _wait_watches(api, 1)
        api.list_errors = [ConnectionError("api down")] * 4
        api.watches[0][2].push("ERROR", {"kind": "Status", "code": 500, "reason": "InternalError", "message": "x"})
        await _wait_watches(api, 2)  # four failed lists, then a good one
        assert len(api.lists) == 2
        assert all(set(s) == {"vllm-0"} for s in rec.sets)  # never an empty set in between
        assert not kd.fell_back  # failures after a first success never switch to DNS
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class StubSource:
    def __init__(self) -> None:
        self.ran = asyncio.Event()

    async def run(self, publish: Any) -> None:
        publish({"10.0.0.7": replica("10.0.0.7", "10.0.0.7")})
        self.ran.set()
        await asyncio.Event().wait()


async def test_kubernetes_discovery_falls_back_to_dns_when_the_api_never_answers() -> None:
    api = FakeApi()
    api.list_errors = [client.ApiException(status=403, reason="Forbidden")] * 3
    rec = Recorder()
    fallback = StubSource()
    kd = KubernetesDiscovery(k8s_cfg(), api=api, fallback=fallback, backoff_start_s=0.01)
    task = asyncio.create_task(kd.run(rec))
    try:
        await asyncio.wait_for(fallback.ran.wait(), 3.0)
        assert kd.fell_back and rec.sets == [{"10.0.0.7": replica("10.0.0.7", "10.0.0.7")}]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_kubernetes_discovery_outside_a_cluster_uses_dns(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
        monkeypatch.delenv(var, raising=False)
    fallback = StubSource()
    kd = KubernetesDiscovery(k8s_cfg(), fallback=fallback)
    rec = Recorder()
    task = asyncio.create_task(kd.run(rec))
    try:
        await asyncio.wait_for(fallback.ran.wait(), 3.0)
        assert kd.fell_back
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    with pytest.raises(RuntimeError, match="kubernetes discovery unusable"):
        await KubernetesDiscovery(k8s_cfg(), use_dns_fallback=False).run(rec)
