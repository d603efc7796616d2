"""Replica discovery: which agents the router talks to, found while running.

Pure core (no I/O, no clock):

- :func:`parse_endpoint_slice`: one ``discovery.k8s.io/v1`` EndpointSlice (the JSON dict the API
  server delivers, a ``V1EndpointSlice.to_dict()`` dict, or the object itself) -> its usable
  :class:`Endpoint` s. An endpoint counts while ``ready`` (a missing ``ready`` means ready, as the
  API documents), or while terminating but still ``serving`` (it drains; the agent's budget stream
  says whether it takes new work). Its replica id is the Pod's name (``targetRef``), else the
  endpoint's ``hostname``, else its address.
- :class:`SliceSet`: the EndpointSlices of one Service (a Service can have several), fed the list
  and the watch events (ADDED / MODIFIED / DELETED) -> the union of their endpoints.
- :func:`endpoints_to_replicas`: endpoints + the agents' ports -> ``{id: ReplicaConfig}``.
- :func:`diff_replicas`: current replicas, desired replicas -> (added, removed). A replica whose
  address changed (a StatefulSet pod recreated under its name) is removed and added again.

I/O shells, both implementing :class:`DiscoverySource` (``run(publish)`` until cancelled, calling
``publish({id: ReplicaConfig})`` with the whole desired set whenever it may have changed):

- :class:`KubernetesDiscovery`: the official ``kubernetes`` client, in-cluster configuration;
  lists the Service's EndpointSlices (label ``kubernetes.io/service-name``), then watches from the
  list's resourceVersion; the watch is reopened with a fresh list every ``resync_s``, at once after
  ``410 Gone``, and with capped exponential backoff (0.5 s doubling to 30 s) after any other error,
  keeping the last known set meanwhile. The blocking HTTP reads run in worker threads (the list in
  ``asyncio.to_thread``, the watch stream in one daemon thread per stream, closed on cancel);
  every read has a timeout. When the API cannot be used at start (no in-cluster configuration, or
  ``FALLBACK_AFTER`` failed lists before the first success, e.g. missing RBAC), it falls back to
  :class:`DnsDiscovery` for the rest of the process.
- :class:`DnsDiscovery`: ``loop.getaddrinfo`` of the headless Service's name every ``resync_s``;
  one replica per address (id = the address). "No such name" means no replica; any other
  resolver failure keeps the last set.

All durations here are wall seconds (discovery is infrastructure, not simulated time).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import socket
import threading
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from fairbatch_common.aio import within
from router.config import DiscoveryConfig, ReplicaConfig

log = logging.getLogger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
BACKOFF_START_S = 0.5
BACKOFF_CAP_S = 30.0
FALLBACK_AFTER = 3            # failed lists before the first success that switch to DNS
LIST_TIMEOUT_S = 10.0         # one list call, connect + read (wall s)
CONNECT_TIMEOUT_S = 5.0       # watch connect (wall s)
WATCH_READ_SLACK_S = 30.0     # a watch read may wait resync_s + this before it counts as dead
DNS_TIMEOUT_S = 5.0           # one look-up (wall s)

Publish = Callable[[Mapping[str, ReplicaConfig]], None]


# ====================================================================== pure core


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One usable agent address.

    Attributes:
        replica_id: Pod name (or hostname, or the address).
        address: IPv4/IPv6 address or host name.
    """

    replica_id: str
    address: str


@dataclass(frozen=True, slots=True)
class ReplicaDiff:
    """What changed between two replica sets.

    Attributes:
        added: replicas to subscribe to (new ids, or ids whose addresses changed), by id.
        removed: ids to drop (gone, or whose addresses changed), sorted.
    """

    added: tuple[ReplicaConfig, ...]
    removed: tuple[str, ...]

    def __bool__(self) -> bool:
        return bool(self.added or self.removed)


def _get(obj: Mapping[str, Any] | None, camel: str, snake: str | None = None) -> Any:
    """A field of a wire-format (camelCase) or ``to_dict()`` (snake_case) mapping; None when absent."""
    if not obj:
        return None
    value = obj.get(camel)
    if value is None and snake is not None:
        value = obj.get(snake)
    return value


def _as_mapping(obj: Any) -> Mapping[str, Any]:
    if isinstance(obj, Mapping):
        return obj
    to_dict = getattr(obj, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    raise TypeError(f"not an EndpointSlice: {type(obj).__name__}")


def endpoint_usable(conditions: Mapping[str, Any] | None) -> bool:
    """True for a ready endpoint (missing ``ready`` = ready), or a terminating one still serving."""
    ready = _get(conditions, "ready")
    if ready is None or ready is True:
        return True
    return _get(conditions, "terminating") is True and _get(conditions, "serving") is True


def parse_endpoint_slice(obj: Any) -> list[Endpoint]:
    """The usable endpoints of one EndpointSlice, sorted by replica id.

    Args:
        obj: the slice as the API server sends it (camelCase dict), as ``V1EndpointSlice.to_dict()``
            (snake_case dict), or a ``V1EndpointSlice``.

    Raises:
        TypeError: ``obj`` is neither a mapping nor has ``to_dict()``.
    """
    data = _as_mapping(obj)
    out: dict[str, Endpoint] = {}
    for ep in data.get("endpoints") or ():
        if not endpoint_usable(ep.get("conditions")):
            continue
        addresses = ep.get("addresses") or ()
        if not addresses:
            continue
        address = str(addresses[0])
        ref = _get(ep, "targetRef", "target_ref")
        name = ref.get("name") if isinstance(ref, Mapping) and ref.get("kind", "Pod") == "Pod" else None
        rid = name or ep.get("hostname") or address
        out.setdefault(str(rid), Endpoint(str(rid), address))
    return [out[k] for k in sorted(out)]


def slice_name(obj: Any) -> str:
    """``metadata.name`` of an EndpointSlice ("" when absent)."""
    meta = _as_mapping(obj).get("metadata") or {}
    return str(meta.get("name") or "")


def resource_version(obj: Any) -> str:
    """``metadata.resourceVersion`` of an object or a list ("" when absent)."""
    meta = _as_mapping(obj).get("metadata") or {}
    return str(_get(meta, "resourceVersion", "resource_version") or "")


class SliceSet:
    """The EndpointSlices of one Service, by slice name, and the union of their endpoints."""

    def __init__(self) -> None:
        self._slices: dict[str, list[Endpoint]] = {}

    def reset(self, items: Iterable[Any]) -> bool:
        """Replace every slice with a fresh list; True when the endpoints changed."""
        before = self.endpoints()
        self._slices = {slice_name(item): parse_endpoint_slice(item) for item in items}
        return self.endpoints() != before

    def apply(self, event_type: str, obj: Any) -> bool:
        """Apply one watch event (``ADDED``, ``MODIFIED``, ``DELETED``; others are ignored);
        True when the endpoints changed."""
        before = self.endpoints()
        name = slice_name(obj)
        if event_type in ("ADDED", "MODIFIED"):
            self._slices[name] = parse_endpoint_slice(obj)
        elif event_type == "DELETED":
            self._slices.pop(name, None)
        else:
            return False
        return self.endpoints() != before

    def endpoints(self) -> list[Endpoint]:
        """Union over slices, one per replica id (the first slice by name wins), sorted by id."""
        out: dict[str, Endpoint] = {}
        for name in sorted(self._slices):
            for ep in self._slices[name]:
                out.setdefault(ep.replica_id, ep)
        return [out[k] for k in sorted(out)]


def _host(address: str) -> str:
    try:
        return f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    except ValueError:
        return address  # a host name


def endpoints_to_replicas(endpoints: Iterable[Endpoint], http_port: int, grpc_port: int) -> dict[str, ReplicaConfig]:
    """``{id: ReplicaConfig}`` with the agent's HTTP URL and gRPC target on each address."""
    out: dict[str, ReplicaConfig] = {}
    for ep in endpoints:
        host = _host(ep.address)
        out[ep.replica_id] = ReplicaConfig(
            id=ep.replica_id, http_url=f"http://{host}:{http_port}", grpc_target=f"{host}:{grpc_port}"
        )
    return out


def diff_replicas(current: Mapping[str, ReplicaConfig], desired: Mapping[str, ReplicaConfig]) -> ReplicaDiff:
    """Replicas to add and ids to remove to go from ``current`` to ``desired`` (both by id)."""
    removed = sorted(rid for rid, rep in current.items() if desired.get(rid) != rep)
    added = tuple(desired[rid] for rid in sorted(desired) if current.get(rid) != desired[rid])
    return ReplicaDiff(added, tuple(removed))


def addresses_from_addrinfo(infos: Iterable[tuple[Any, ...]]) -> list[str]:
    """Unique addresses of a ``getaddrinfo`` answer, sorted."""
    return sorted({str(info[4][0]) for info in infos})


def backoff_s(failures: int, start_s: float = BACKOFF_START_S, cap_s: float = BACKOFF_CAP_S) -> float:
    """Delay before retry number ``failures`` (>= 1): start_s * 2^(failures-1), capped."""
    return min(cap_s, start_s * (2 ** max(0, failures - 1)))


def split_lines(buffer: bytes, chunk: bytes) -> tuple[list[bytes], bytes]:
    """Complete non-empty lines of ``buffer + chunk`` and the incomplete rest (watch streams are
    one JSON event per line)."""
    data = buffer + chunk
    *lines, rest = data.split(b"\n")
    return [ln for ln in (x.strip() for x in lines) if ln], rest


# ====================================================================== sources


class DiscoverySource(Protocol):
    """Something that publishes the desired replica set; the router runs it as a task."""

    async def run(self, publish: Publish) -> None:
        """Call ``publish(replicas_by_id)`` with the whole desired set whenever it may have changed;
        runs until cancelled."""


def default_namespace(cfg: DiscoveryConfig, namespace_file: Path = NAMESPACE_FILE) -> str:
    """``cfg.namespace``, else the pod's namespace (service-account file), else ``default``."""
    if cfg.namespace:
        return cfg.namespace
    try:
        return namespace_file.read_text(encoding="utf-8").strip() or "default"
    except OSError:
        return "default"


def dns_name_of(cfg: DiscoveryConfig, namespace: str) -> str:
    """``cfg.dns_name``, else ``<service>.<namespace>.svc``."""
    if cfg.dns_name:
        return cfg.dns_name
    return f"{cfg.service}.{namespace}.svc"


Resolver = Callable[[str], Awaitable[list[tuple[Any, ...]]]]


class DnsDiscovery:
    """Poll the A/AAAA records of a headless Service; each address is a replica (id = address).

    Args:
        name: the name to resolve.
        http_port: the agents' HTTP port.
        grpc_port: the agents' gRPC port.
        interval_s: wall seconds between look-ups (> 0).
        timeout_s: wall seconds one look-up may take.
        resolver: ``async (name) -> getaddrinfo list``; default ``loop.getaddrinfo`` (TCP).
    """

    def __init__(
        self, name: str, http_port: int, grpc_port: int, interval_s: float,
        timeout_s: float = DNS_TIMEOUT_S, resolver: Resolver | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.name = name
        self._ports = (http_port, grpc_port)
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._resolver = resolver or self._getaddrinfo

    @staticmethod
    async def _getaddrinfo(name: str) -> list[tuple[Any, ...]]:
        return await asyncio.get_running_loop().getaddrinfo(name, None, type=socket.SOCK_STREAM)

    async def resolve_once(self) -> dict[str, ReplicaConfig] | None:
        """The replicas the name resolves to now: ``{}`` when the name does not exist (no ready
        endpoint), None when the look-up failed otherwise or timed out (keep the last set)."""
        try:
            infos = await within(self._resolver(self.name), self._timeout_s)
        except socket.gaierror as exc:
            if exc.errno in _NO_NAME_ERRNOS:
                return {}
            log.warning("dns discovery: %s: %s", self.name, exc)
            return None
        except (TimeoutError, OSError) as exc:
            log.warning("dns discovery: %s: %s", self.name, exc.__class__.__name__)
            return None
        endpoints = [Endpoint(a, a) for a in addresses_from_addrinfo(infos)]
        return endpoints_to_replicas(endpoints, *self._ports)

    async def run(self, publish: Publish) -> None:
        """Resolve every ``interval_s`` and publish each successful answer; until cancelled."""
        log.info("dns discovery: resolving %s every %.1f s", self.name, self._interval_s)
        while True:
            replicas = await self.resolve_once()
            if replicas is not None:
                publish(replicas)
            await asyncio.sleep(self._interval_s)


_NO_NAME_ERRNOS = frozenset(
    e for e in (getattr(socket, "EAI_NONAME", None), getattr(socket, "EAI_NODATA", None)) if e is not None
)


class WatchGone(Exception):
    """The watch's resourceVersion is too old (HTTP 410 Gone): list again."""


class WatchStream(Protocol):
    """One open watch: iterate raw event dicts ``{"type", "object"}``; ``close`` from any thread
    ends the iteration."""

    def __iter__(self) -> Iterator[dict[str, Any]]: ...

    def close(self) -> None: ...


class EndpointSliceApi(Protocol):
    """The two calls discovery needs (blocking; run in worker threads)."""

    def list(self) -> dict[str, Any]:
        """The EndpointSliceList (wire JSON). Raises on HTTP or connection errors (410 as WatchGone)."""

    def watch(self, resource_version: str, timeout_s: int) -> WatchStream:
        """Open a watch from ``resource_version`` that the server ends after ``timeout_s``."""


class _HttpWatchStream:
    """A watch response of the kubernetes client (urllib3, ``_preload_content=False``) as event dicts."""

    def __init__(self, response: Any) -> None:
        self._resp = response

    def __iter__(self) -> Iterator[dict[str, Any]]:
        rest = b""
        for chunk in self._resp.stream(amt=None, decode_content=True):
            lines, rest = split_lines(rest, chunk)
            for line in lines:
                yield json.loads(line)
        if rest.strip():
            yield json.loads(rest)

    def close(self) -> None:
        shutdown = getattr(self._resp, "shutdown", None)  # unblocks a read in progress (urllib3 >= 2.3)
        try:
            if callable(shutdown):
                shutdown()
            self._resp.close()
            self._resp.release_conn()
        except Exception:  # noqa: BLE001 - closing a broken stream
            pass


class KubernetesEndpointSliceApi:
    """:class:`EndpointSliceApi` over the official client (``DiscoveryV1Api``).

    Args:
        api_client: a ``kubernetes.client.ApiClient`` (see :meth:`in_cluster`).
        namespace: the Service's namespace.
        service: the headless Service's name.
    """

    def __init__(self, api_client: Any, namespace: str, service: str) -> None:
        from kubernetes import client

        self._api = client.DiscoveryV1Api(api_client)
        self._exc = client.ApiException
        self.namespace = namespace
        self.selector = f"{SERVICE_NAME_LABEL}={service}"

    @classmethod
    def in_cluster(cls, namespace: str, service: str) -> KubernetesEndpointSliceApi:
        """Client from the pod's service account (token, CA, API host from the environment).

        Raises:
            kubernetes.config.ConfigException: not in a cluster, or no token mounted.
        """
        from kubernetes import client, config

        configuration = client.Configuration()
        config.load_incluster_config(client_configuration=configuration)
        return cls(client.ApiClient(configuration), namespace, service)

    def list(self) -> dict[str, Any]:
        try:
            resp = self._api.list_namespaced_endpoint_slice(
                self.namespace, label_selector=self.selector,
                _preload_content=False, _request_timeout=(CONNECT_TIMEOUT_S, LIST_TIMEOUT_S),
            )
        except self._exc as exc:
            if exc.status == 410:
                raise WatchGone(str(exc.reason)) from None
            raise
        try:
            return json.loads(resp.data)
        finally:
            resp.release_conn()

    def watch(self, resource_version: str, timeout_s: int) -> WatchStream:
        try:
            resp = self._api.list_namespaced_endpoint_slice(
                self.namespace, label_selector=self.selector, watch=True,
                resource_version=resource_version, allow_watch_bookmarks=True, timeout_seconds=timeout_s,
                _preload_content=False, _request_timeout=(CONNECT_TIMEOUT_S, timeout_s + WATCH_READ_SLACK_S),
            )
        except self._exc as exc:
            if exc.status == 410:
                raise WatchGone(str(exc.reason)) from None
            raise
        return _HttpWatchStream(resp)


_END = object()


async def _iterate_in_thread(stream: WatchStream, name: str) -> Any:
    """Async iterator over a blocking stream read by one daemon thread (closed on exit/cancel)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()

    def post(item: Any) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # loop closed: nobody listens any more
            pass

    def pump() -> None:
        try:
            for event in stream:
                post(event)
        except BaseException as exc:  # noqa: BLE001 - handed to the loop
            post(exc)
        else:
            post(_END)

    thread = threading.Thread(target=pump, name=name, daemon=True)
    thread.start()
    try:
        while True:
            item = await queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stream.close()


class KubernetesDiscovery:
    """Watch the EndpointSlices of the agents' headless Service (see the module docstring).

    Args:
        cfg: the ``discovery`` section (mode ``kubernetes``).
        api: the API calls; default: :meth:`KubernetesEndpointSliceApi.in_cluster` at start.
        fallback: source used when the API cannot be used at start; default DNS of
            :func:`dns_name_of` (None disables the fallback only when ``use_dns_fallback`` is False).
        use_dns_fallback: fall back to DNS at all.
        backoff_start_s: first retry delay after a failed list or watch (wall s; doubles).
        backoff_cap_s: longest retry delay (wall s).
    """

    def __init__(
        self, cfg: DiscoveryConfig, api: EndpointSliceApi | None = None,
        fallback: DiscoverySource | None = None, use_dns_fallback: bool = True,
        backoff_start_s: float = BACKOFF_START_S, backoff_cap_s: float = BACKOFF_CAP_S,
    ) -> None:
        self._cfg = cfg
        self._backoff = (backoff_start_s, backoff_cap_s)
        self._namespace = default_namespace(cfg)
        self._api = api
        if fallback is None and use_dns_fallback:
            fallback = DnsDiscovery(dns_name_of(cfg, self._namespace), cfg.http_port, cfg.grpc_port, cfg.resync_s)
        self._fallback = fallback
        self._state = SliceSet()
        self.lists = 0       # successful lists (for tests and logs)
        self.fell_back = False

    def _replicas(self) -> dict[str, ReplicaConfig]:
        return endpoints_to_replicas(self._state.endpoints(), self._cfg.http_port, self._cfg.grpc_port)

    async def run(self, publish: Publish) -> None:
        """List, watch, re-list; publish on every change; until cancelled (see the module docstring)."""
        api = self._api
        if api is None:
            try:
                api = KubernetesEndpointSliceApi.in_cluster(self._namespace, self._cfg.service or "")
            except Exception as exc:  # noqa: BLE001 - kubernetes.config.ConfigException and friends
                await self._fall_back(publish, f"no in-cluster Kubernetes configuration ({exc})")
                return
        log.info("kubernetes discovery: watching EndpointSlices %s=%s in %s",
                 SERVICE_NAME_LABEL, self._cfg.service, self._namespace)
        failures = 0
        while True:
            try:
                body = await asyncio.to_thread(api.list)
                items = body.get("items") or []
                self._state.reset(items)
                self.lists += 1
                failures = 0
                publish(self._replicas())
                await self._watch(api, resource_version(body), publish)
            except asyncio.CancelledError:
                raise
            except WatchGone as exc:
                log.info("kubernetes discovery: watch expired (410 Gone: %s); listing again", exc)
                failures += 1
                if failures > 1:  # a second Gone in a row: do not spin
                    await asyncio.sleep(backoff_s(failures - 1, *self._backoff))
            except Exception as exc:  # noqa: BLE001 - any API/transport error: keep the last set, retry
                failures += 1
                if self.lists == 0 and failures >= FALLBACK_AFTER and self._fallback is not None:
                    await self._fall_back(publish, f"{failures} failed lists ({exc.__class__.__name__}: {exc})")
                    return
                delay = backoff_s(failures, *self._backoff)
                log.warning("kubernetes discovery: %s: %s; retrying in %.1f s (keeping %d replicas)",
                            exc.__class__.__name__, exc, delay, len(self._state.endpoints()))
                await asyncio.sleep(delay)

    async def _watch(self, api: EndpointSliceApi, rv: str, publish: Publish) -> None:
        """Apply watch events until the server ends the watch (``resync_s``).

        Raises:
            WatchGone: an ERROR event with code 410.
            RuntimeError: any other ERROR event.
        """
        timeout_s = max(1, int(round(self._cfg.resync_s)))
        stream = await asyncio.to_thread(api.watch, rv, timeout_s)
        try:
            await self._consume(stream, publish)
        finally:
            stream.close()

    async def _consume(self, stream: WatchStream, publish: Publish) -> None:
        events = _iterate_in_thread(stream, f"endpointslice-watch-{self._cfg.service}")
        async with contextlib.aclosing(events):
            async for event in events:
                kind = event.get("type")
                obj = event.get("object") or {}
                if kind == "ERROR":
                    code = obj.get("code")
                    if code == 410:
                        raise WatchGone(str(obj.get("message", "")))
                    raise RuntimeError(f"watch error {code}: {obj.get('reason')}: {obj.get('message')}")
                if kind == "BOOKMARK":
                    continue
                if self._state.apply(str(kind), obj):
                    publish(self._replicas())

    async def _fall_back(self, publish: Publish, why: str) -> None:
        if self._fallback is None:
            raise RuntimeError(f"kubernetes discovery unusable: {why}")
        self.fell_back = True
        log.warning("kubernetes discovery unusable: %s; falling back to DNS for this process", why)
        await self._fallback.run(publish)


def build_discovery(cfg: DiscoveryConfig) -> DiscoverySource | None:
    """The source for ``cfg.mode`` (None for ``static``)."""
    if cfg.mode == "kubernetes":
        return KubernetesDiscovery(cfg)
    if cfg.mode == "dns":
        ns = default_namespace(cfg)
        return DnsDiscovery(dns_name_of(cfg, ns), cfg.http_port, cfg.grpc_port, cfg.resync_s)
    return None
