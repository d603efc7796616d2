"""The configuration schema: one YAML file (the router's), validated by pydantic, read by both processes.

The router loads the whole file (router/config.py: ``load_config``, which adds the router's own
behaviour to these models, e.g. building the placement policy); an agent reads its part,
``slo_classes`` (:func:`load_agent_section`), and refuses a router file that the router would
refuse anywhere, with the same models. Nothing here imports router/ or replica_agent/
(docs/architecture.md "Layout").

Schema (docs/architecture.md, section "Router"; docs/design.md section 6)::

    model: llama-3-8b-a100            # optional: served model name for /v1/models
    slo_classes:
      interactive: {ttft_ms: 500, tpot_ms: 50, priority: 0, sheddable: true, max_queue_ms: 2000}
    tenants:
      acme: {weight: 3, slo_class: interactive, max_concurrency: 256, tokens_per_minute: 2000000,
             requests_per_minute: 600, min_share: 0.2}
    api_keys:                          # sha256 hex of the API key -> tenant
      "<64 hex>": acme
    replicas:                          # static list (discovery.mode: static, the default)
      - {id: r0, http_url: "http://127.0.0.1:8101", grpc_target: "127.0.0.1:9101"}
    discovery: {mode: static}          # or kubernetes / dns: replicas found at run time (router/discovery.py)
    queue: {max_requests: 1024, max_tokens: 4000000, max_bypass: 8, aging_floor_share: 0.5}
    admission: {bytes_per_token: 4.0, reserve_timeout_ms: 200, estimate_refuse_factor: 2.0,
                start_window_steps: 4, step_tokens: 2048, lease_mode: inline,
                work_shed: {enabled: false, gain: 4.0, max_share: 0.25, window: 2000, horizon: 100,
                            min_samples: 200}}
    http: {max_body_bytes: 4194304, body_timeout_s: 10, header_timeout_s: 10}
    placement: {seed: null,            # tie-break RNG seed; null = random per process
                profile: pab,          # or a baseline router to A/B against: least-outstanding, ...
                prefix_cache: {enabled: false, chunk_chars: 64, capacity_tokens: 500000}}
    telemetry: {otlp_endpoint: null, service_name: fairbatch-router, sample_ratio: 1.0}
    auth: {trusted_header: x-tenant, trusted_networks: ["10.0.0.0/8"]}   # optional gateway identity
    fairness: {w_prefill: 1.0, w_decode: 2.0, default_max_tokens: 256, counter_sync_ms: 100}
    ledger: {key_prefix: fairbatch, timeout_ms: 200, retry_initial_ms: 100, retry_max_ms: 5000,
             concurrency_ttl_ms: 600000}
    migration: {max_migrations: 3}     # streamed /v1/completions continued on another replica (0 = off)
    redis_url: null                    # redis://host:port/0 -> quotas and VTC counters shared by routers
                                       #   (password: FAIRBATCH_REDIS_PASSWORD in the router's environment)

Every error is reported as ``<file>:<line>: <field.path>: <message>``; the line comes from the
YAML node of the failing field (``yaml.compose`` marks), or from the parser's mark for a YAML
syntax error.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class ConfigError(Exception):
    """A configuration file that cannot be used; the message names file, line and field path."""


class _FieldError(ValueError):
    """Cross-reference error raised inside a model validator, carrying the field path it concerns."""

    def __init__(self, loc: tuple[str | int, ...], message: str) -> None:
        super().__init__(f"{_dotted(loc)}: {message}")
        self.loc = loc
        self.message = message


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SloClassConfig(_Strict):
    """One SLO class.

    Attributes:
        ttft_ms: time-to-first-token target (simulated ms, > 0).
        tpot_ms: time-per-output-token target (simulated ms, > 0).
        priority: band, 0 = most urgent (>= 0).
        sheddable: may be rejected early when its deadline cannot be met.
        max_queue_ms: longest wait in the router queue before a 429 queue-timeout (simulated ms, > 0).
        stall_timeout_ms: silence from the engine (simulated ms) after which the agent gives up a request
            of this class as stalled; None = ``max(1000, 4 * ttft_ms + 20 * tpot_ms)``. Read by the agents.
    """

    ttft_ms: float = Field(gt=0)
    tpot_ms: float = Field(gt=0)
    priority: int = Field(default=0, ge=0)
    sheddable: bool = False
    max_queue_ms: float = Field(default=30000.0, gt=0)
    stall_timeout_ms: float | None = Field(default=None, gt=0)


class TenantConfig(_Strict):
    """One tenant.

    Attributes:
        weight: fair-share weight (> 0).
        slo_class: name of an SLO class in ``slo_classes``.
        max_concurrency: requests in flight cap (router ledger), None = unlimited.
        tokens_per_minute: token bucket (prompt + max_tokens per request; simulated minute, burst of
            one minute), None = unlimited.
        requests_per_minute: request bucket (simulated minute, burst of one minute), None = unlimited.
        min_share: service share reserved for this tenant's band against higher bands under
            contention, in [0, 1] (sum over tenants <= 1).
    """

    weight: float = Field(default=1.0, gt=0)
    slo_class: str
    max_concurrency: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)
    requests_per_minute: int | None = Field(default=None, ge=1)
    min_share: float | None = Field(default=None, ge=0, le=1)


class ReplicaConfig(_Strict):
    """One replica (its agent's HTTP and gRPC addresses).

    Attributes:
        id: replica id, unique in the file.
        http_url: agent HTTP base URL, e.g. ``http://127.0.0.1:8101``.
        grpc_target: agent gRPC target, e.g. ``127.0.0.1:9101``.
    """

    id: str = Field(min_length=1)
    http_url: str = Field(pattern=r"^https?://")
    grpc_target: str = Field(min_length=1)

    @field_validator("http_url")
    @classmethod
    def _strip_slash(cls, v: str) -> str:
        return v.rstrip("/")


class DiscoveryConfig(_Strict):
    """How the router finds its replicas (router/discovery.py).

    Attributes:
        mode: ``static`` (the ``replicas`` list, the default), ``kubernetes`` (watch the
            EndpointSlices of the agents' headless Service; DNS fallback when the API cannot be used
            at start) or ``dns`` (poll the A/AAAA records of ``dns_name``; one replica per address).
        namespace: namespace of the Service; None = the pod's own namespace (service-account
            namespace file), else ``default``.
        service: name of the agents' headless Service (required for ``kubernetes``).
        http_port: the agents' HTTP proxy port on every discovered address.
        grpc_port: the agents' gRPC AdmissionService port on every discovered address.
        dns_name: name resolved in ``dns`` mode and by the kubernetes mode's DNS fallback; None =
            ``<service>.<namespace>.svc``.
        resync_s: wall seconds between full re-lists of the EndpointSlices (the watch is reopened)
            and between two DNS look-ups (> 0).
    """

    mode: Literal["static", "kubernetes", "dns"] = "static"
    namespace: str | None = Field(default=None, min_length=1)
    service: str | None = Field(default=None, min_length=1)
    http_port: int = Field(default=8001, ge=1, le=65535)
    grpc_port: int = Field(default=9001, ge=1, le=65535)
    dns_name: str | None = Field(default=None, min_length=1)
    resync_s: float = Field(default=30.0, gt=0)

    @model_validator(mode="after")
    def _needs(self) -> DiscoveryConfig:
        if self.mode == "kubernetes" and not self.service:
            raise _FieldError(("discovery", "service"), "kubernetes discovery needs the headless Service name")
        if self.mode == "dns" and not (self.dns_name or self.service):
            raise _FieldError(("discovery", "dns_name"), "dns discovery needs dns_name (or service)")
        return self


class QueueConfig(_Strict):
    """Bounds of the router's admission queue.

    Attributes:
        max_requests: most waiting requests (>= 1).
        max_tokens: most waiting prompt tokens, summed (>= 1).
        max_bypass: how many later requests may pass a head that fits nowhere before one replica
            is held for it (>= 0; router/admission_queue.py, "Holds"; the rest of the fleet keeps
            serving the queue).
        aging_floor_share: min_share a less urgent band's tenant counts while one of its requests
            has waited its class's ttft_ms (router/fair_queue.py, "Aging"; 0..1, default 0.5).
        shed_recheck_ms: while sheddable requests wait in the queue, the dispatcher asks again at
            least this often whether each can still meet its TTFT (simulated ms, > 0; default 10:
            a request that turns infeasible is refused within about this long, not at the next
            periodic budget push; router/admission_queue.py ``Dispatcher.shed_recheck_ms``).
    """

    max_requests: int = Field(default=1024, ge=1)
    max_tokens: int = Field(default=4_000_000, ge=1)
    max_bypass: int = Field(default=8, ge=0)
    aging_floor_share: float = Field(default=0.5, ge=0, le=1)
    shed_recheck_ms: float = Field(default=10.0, gt=0)


class WorkShedConfig(_Strict):
    """Work-aware admission under contention (router/work_shed.py, which derives the rule).

    While the router refuses requests of a sheddable class for lack of budget (``slo-infeasible``,
    ``queue-timeout``), a new request of that class whose predicted GPU work is in the costliest
    share of recent arrivals is refused at once (429 ``work-shed``), so the budget goes to cheaper
    ones. It trades token-weighted SLO attainment for request-weighted attainment.

    Attributes:
        enabled: False (the default): off, because its gain depends on the traffic mix
            (docs/evaluation.md, "Work-aware admission"; 16 replicas, fleet simulation): on
            azure-conv it raised capacity 6 % and on mooncake-conv 3 % (request and token-weighted
            attainment both up: the requests it refuses would have been served late), on azure-code
            it was even (PAB's own
            refusals already fall on the largest prompts) and cost a point of token-weighted
            attainment.
        gain: share refused by work per unit of the recent budget-refusal share (> 0).
        max_share: the most arrivals refused by work, in (0, 1).
        window: arrivals whose works form the quantile (>= 1).
        horizon: arrivals the contention share spans, about (>= 1); 100 = about the TTFT target
            at 100 requests/s, so the rule acts while a burst lasts, not long after (a longer
            horizon, 2000, refused large prompts in quiet spells and lost attainment).
        min_samples: arrivals seen before the rule refuses anything (>= 1).
    """

    enabled: bool = False
    gain: float = Field(default=4.0, gt=0)
    max_share: float = Field(default=0.25, gt=0, lt=1)
    window: int = Field(default=2000, ge=1)
    horizon: int = Field(default=100, ge=1)
    min_samples: int = Field(default=200, ge=1)


class AdmissionConfig(_Strict):
    """Admission knobs.

    Attributes:
        bytes_per_token: UTF-8 bytes per token of the text estimate (> 0).
        reserve_timeout_ms: deadline of one Reserve call (simulated ms, > 0).
        estimate_refuse_factor: a prompt counted from its text (an estimate, not token ids) is
            refused up front (400 ``context_length_exceeded``) only when the estimate exceeds every
            replica's max context by this factor (>= 1); below it the request is placed with its
            estimate capped at the largest max context, and the engine's own tokenizer decides (its
            400 is relayed, the reservation freed). Token-id prompts are exact and refused at 1x.
        start_window_steps: the start window (issue 18): a replica gets a prompt only when its
            un-started prefill work plus this prompt fits this many engine steps of
            ``step_tokens`` tokens by its own time model (``steps * (a + b * step_tokens)`` ms),
            or when nothing is pending there; the rest waits in the weighted fair queue, so tenant
            weights bind whatever the SLO. 0 = off (PAB alone decides). Default 4: the engine
            always has the next steps' prefill while the router refills it within one budget push
            (docs/architecture.md, "Start window", gives the measurements).
        step_tokens: tokens per engine step in that window (vLLM's max_num_batched_tokens: 2048
            on A100 defaults, 8192 on H100), >= 1.
        contention_max_inflight: while requests of two tenants or more wait in the router's
            fair queue, a replica that already runs this many of this router's requests takes no
            more, so the weights decide who runs next (the engine serves its running requests
            alike, so without it a closed loop that fits the engine splits 1:1 whatever the
            weights). 0 = off. Default 32 (docs/architecture.md, "Start window", measurements).
        contention_keep_running: the cap of a replica is ``max(contention_max_inflight, the
            requests of this router it ran when the contention began)`` (default True): under
            contention a replica keeps its batch and each request that ends frees a slot the fair
            queue fills, instead of the batch shrinking to the cap (on azure-conv at 16 replicas the
            fixed cap cost 7-8 % of capacity: docs/architecture.md "Start window"). False: the
            fixed cap of earlier releases.
        lease_mode: ``inline`` (default): no round trip before forwarding; the router admits on
            its streamed view and its own outstanding placements (``BudgetBook.take_local``) and
            the forwarded request carries ``x-fairbatch-admit: <prompt tokens>``; the agent runs the
            Reserve decision when the request arrives and takes it (lease granted and consumed at
            once) or refuses it with 409 ``x-fairbatch-refused`` (the router re-places it).
            ``reserve``: a gRPC Reserve per request before forwarding (the lease id travels in
            ``x-fairbatch-lease``). docs/architecture.md "Leases on the request path" measures both.
        work_shed: work-aware admission under contention (:class:`WorkShedConfig`), off by default.
    """

    bytes_per_token: float = Field(default=4.0, gt=0)
    estimate_refuse_factor: float = Field(default=2.0, ge=1.0)
    reserve_timeout_ms: float = Field(default=200.0, gt=0)
    start_window_steps: float = Field(default=4.0, ge=0)
    step_tokens: int = Field(default=2048, ge=1)
    contention_max_inflight: int = Field(default=32, ge=0)
    contention_keep_running: bool = True
    lease_mode: Literal["inline", "reserve"] = "inline"
    work_shed: WorkShedConfig = Field(default_factory=WorkShedConfig)


class PrefixCacheConfig(_Strict):
    """Prefix-cache-aware placement (router/prefix_index.py; docs/design.md "Prefix-aware PAB").

    Attributes:
        enabled: keep a map of which replica holds which prompt prefix and price each candidate's
            prefill at its uncached tokens (False, the default: every prompt priced whole).
        chunk_chars: characters of prompt text per map key (64 = about 16 tokens at 4 bytes per
            token, vLLM's default block size).
        capacity_tokens: prompt tokens remembered per replica (about one replica's KV cache), LRU.
    """

    enabled: bool = False
    chunk_chars: int = Field(default=64, ge=1)
    capacity_tokens: int = Field(default=500_000, ge=1)


class ScorerEntry(_Strict):
    """One scorer of a custom placement chain: plugin name, weight, the plugin's parameters."""

    name: str
    weight: float = 1.0
    params: dict[str, Any] = Field(default_factory=dict)


class PickerEntry(_Strict):
    """The picker of a custom placement chain: plugin name and parameters (``seed`` comes from ``placement.seed``)."""

    name: str = "highest"
    params: dict[str, Any] = Field(default_factory=dict)


PLACEMENT_PLUGINS: Mapping[str, frozenset[str]] = {
    "policies": frozenset({"pab", "pab-chain", "round-robin", "least-outstanding", "least-outstanding-tokens",
                           "power-of-two", "llm-d-scorer", "llm-d-prefix", "sglang-cache-aware",
                           "vllm-router-cache-aware", "static-queue-cap", "llm-d-flow-control", "dynamo-kv",
                           "llm-d-sticky", "llm-d-predicted-latency"}),
    "filters": frozenset({"exclude", "fits", "fresh", "healthy", "max-prompt", "on-time", "window", "dynamo-busy",
                          "protect-headroom", "speed-match", "long-prompt-pool"}),
    "scorers": frozenset({"headroom", "kv-headroom", "least-outstanding", "least-outstanding-tokens", "engine-queue",
                          "llm-d-queue", "kv-usage", "prefix-cache", "dynamo-kv-cost", "reserve-fit"}),
    "pickers": frozenset({"highest", "round-robin", "power-of-two", "softmax"}),
    "hooks": frozenset({"decision-count"}),
}
"""The names the ``placement`` section may use, by kind: the profiles and the plugins of
router/placement/registry.py ``default_registry()``. Written out here so that an agent checks a
router file as the router does without importing router code; tests/unit/test_placement_config.py
checks that it equals the registry (a new plugin module adds its name here)."""


class PlacementConfig(_Strict):
    """Placement knobs: a named profile, or a filters -> scorers -> picker chain of plugins
    (router/placement/registry.py; docs/architecture.md "Placement plugins").

    Attributes:
        seed: seed of the tie-break RNG among replicas of equal score (None, the default: a
            random seed per router process, so that routers and restarts do not all prefer one
            replica; set it for a reproducible run).
        profile: a named policy (``pab``, the default: the fused one-pass form of the default
            chain; ``pab-chain``: the same chain from the plugins; or a baseline router of the
            fleet benchmark, router/placement/baselines.py: ``round-robin``, ``least-outstanding``,
            ``least-outstanding-tokens``, ``power-of-two``, ``llm-d-scorer``, ``llm-d-prefix``,
            ``sglang-cache-aware``, ``vllm-router-cache-aware``, ``static-queue-cap``, ``dynamo-kv``,
            ``llm-d-sticky``, ``llm-d-predicted-latency`` (which refuses sheddable requests it predicts
            late), which admit every request and forward it at once, without PAB, queue or lease;
            ``llm-d-flow-control``, which holds requests at the router while llm-d's saturation
            detector says the pool is saturated; ``dynamo-kv`` also holds them while every replica's
            prefill load is over its queue threshold) used when no chain is given.
        params: the profile's own parameters (``static-queue-cap``: ``queue_cap_tokens``, the bound
            on a replica's queued prompt tokens; the others: router/placement/baselines.py); only
            with a profile, not with a chain.
        filters: filter names in order (None: the profile's).
        scorers: scorers with weights (None: the profile's).
        picker: the picker (None: ``highest``).
        hooks: post-decision hook names (plugins told of every granted placement).
        prefix_cache: prefix-cache-aware placement (:class:`PrefixCacheConfig`), off by default.

    The router's subclass (router/config.py ``PlacementConfig``) builds the policy of the section.
    """

    seed: int | None = None
    profile: str = "pab"
    params: dict[str, Any] = Field(default_factory=dict)
    filters: list[str] | None = None
    scorers: list[ScorerEntry] | None = None
    picker: PickerEntry | None = None
    hooks: list[str] = Field(default_factory=list)
    prefix_cache: PrefixCacheConfig = Field(default_factory=PrefixCacheConfig)

    @model_validator(mode="after")
    def _known_plugins(self) -> PlacementConfig:
        known_profiles = PLACEMENT_PLUGINS["policies"]
        if self.profile not in known_profiles:
            raise ValueError(f"placement.profile {self.profile!r} is not one of {', '.join(sorted(known_profiles))}")
        if self.params and not (self.filters is None and self.scorers is None and self.picker is None):
            raise ValueError("placement.params are the profile's; a chain's plugins take theirs (scorers[].params, "
                             "picker.params)")
        for kind, names, known in (
            ("filters", self.filters or [], PLACEMENT_PLUGINS["filters"]),
            ("scorers", [e.name for e in self.scorers or []], PLACEMENT_PLUGINS["scorers"]),
            ("picker", [self.picker.name] if self.picker else [], PLACEMENT_PLUGINS["pickers"]),
            ("hooks", self.hooks, PLACEMENT_PLUGINS["hooks"]),
        ):
            for n in names:
                if n not in known:
                    raise ValueError(f"placement.{kind}: unknown plugin {n!r}; known: {', '.join(sorted(known))}")
        return self


class HttpConfig(_Strict):
    """Bounds of the HTTP front door.

    Attributes:
        max_body_bytes: largest request body (bytes, >= 1024); a larger ``Content-Length`` is refused
            with 413 before the body is read, a chunked body when it grows past it.
        body_timeout_s: wall seconds a request body may take to arrive (> 0), else 408.
        header_timeout_s: wall seconds a client has to send a request's head (request line and headers;
            > 0): from the connection's start, or from the first byte of a next request on a kept-alive
            connection; else 408 and the connection closed (fairbatch_common/http_guard.py
            ``HeaderTimeoutHandler``). Read at start (a restart applies a change).
        metrics_port: when set, ``/metrics`` and the detailed ``/health`` (replica ids) are served only on
            this port (for Prometheus and operators); the public port then has no ``/metrics`` and its
            ``/health`` says only ``status``. None = both on the public port (a restart applies a change).
    """

    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    body_timeout_s: float = Field(default=10.0, gt=0)
    header_timeout_s: float = Field(default=10.0, gt=0)
    metrics_port: int | None = Field(default=None, ge=1, le=65535)


class TelemetryConfig(_Strict):
    """OpenTelemetry export.

    Attributes:
        otlp_endpoint: OTLP/gRPC collector, None = no export.
        service_name: ``service.name`` of the spans.
        sample_ratio: share of root traces recorded when exporting (ParentBased(TraceIdRatio)), in
            [0, 1]; without ``otlp_endpoint`` no span is recorded at all (no-op tracer).
    """

    otlp_endpoint: str | None = None
    service_name: str = "fairbatch-router"
    sample_ratio: float = Field(1.0, ge=0.0, le=1.0)


class AuthConfig(_Strict):
    """Tenant identity from a header set by a trusted gateway (docs/design.md section 5 step 1).

    Attributes:
        trusted_header: header naming the tenant (e.g. ``x-tenant``); None = API keys only.
        trusted_networks: CIDRs whose connections may set it; from anywhere else the header is
            ignored (a spoofed header never selects a tenant).
    """

    trusted_header: str | None = Field(default=None, min_length=1)
    trusted_networks: list[str] = Field(default_factory=list)

    @field_validator("trusted_networks")
    @classmethod
    def _cidrs(cls, v: list[str]) -> list[str]:
        for i, net in enumerate(v):
            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError as exc:
                raise _FieldError(("auth", "trusted_networks", i), f"not a CIDR network: {exc}") from None
        return v


class FairnessConfig(_Strict):
    """Virtual token counter weights (VTC, arXiv 2401.00588 section 4: cost = w_p * prefill + w_q * decode).

    Attributes:
        w_prefill: cost per prompt token (VTC default 1).
        w_decode: cost per output token (VTC default 2).
        default_max_tokens: decode tokens assumed at dispatch when the request gives no max_tokens.
        counter_sync_ms: how often (simulated ms) the router merges the ledger's shared counters.
    """

    w_prefill: float = Field(default=1.0, ge=0)
    w_decode: float = Field(default=2.0, ge=0)
    default_max_tokens: int = Field(default=256, ge=0)
    counter_sync_ms: float = Field(default=100.0, gt=0)


class LedgerConfig(_Strict):
    """Quota/fairness ledger knobs (used with ``redis_url``).

    Attributes:
        key_prefix: prefix of every Redis key (routers sharing limits use the same prefix).
        timeout_ms: wall ms allowed per Redis call before the router falls back to its local ledger.
        retry_initial_ms: first reconnect delay after Redis fails (wall ms; doubles each try).
        retry_max_ms: longest reconnect delay (wall ms).
        concurrency_ttl_ms: a concurrency slot held longer than this (simulated ms) is dropped, so a
            crashed router cannot hold a tenant's slots for ever.
    """

    key_prefix: str = Field(default="fairbatch", min_length=1)
    timeout_ms: float = Field(default=200.0, gt=0)
    retry_initial_ms: float = Field(default=100.0, gt=0)
    retry_max_ms: float = Field(default=5000.0, gt=0)
    concurrency_ttl_ms: float = Field(default=600_000.0, gt=0)


class MigrationConfig(_Strict):
    """Token-resume migration of streamed ``/v1/completions`` (router/migration.py).

    A stream whose replica fails after its first byte (connection lost, the agent's error event,
    silence past the router's limit) is continued on another replica: prompt + the text (or token
    ids) generated so far, ``max_tokens`` reduced by the tokens already sent, the same sampling
    parameters and seed; the client's stream goes on with the same response id.

    Attributes:
        max_migrations: continuations placed per request, at most (0 = off: a failure mid-stream
            ends the stream with the SSE error event, as before); in [0, 16].
    """

    max_migrations: int = Field(default=3, ge=0, le=16)


class RouterConfig(_Strict):
    """The whole router YAML (see the module docstring). Cross-references are checked:
    a tenant's slo_class exists, api_keys are 64-hex sha256 digests of existing tenants,
    replica ids are unique; ``replicas`` is non-empty in static discovery mode and empty otherwise."""

    model: str | None = None
    slo_classes: dict[str, SloClassConfig] = Field(min_length=1)
    tenants: dict[str, TenantConfig] = Field(default_factory=dict)
    api_keys: dict[str, str] = Field(default_factory=dict)
    replicas: list[ReplicaConfig] = Field(default_factory=list)
    discovery: DiscoveryConfig = Field(default_factory=DiscoveryConfig)
    queue: QueueConfig = Field(default_factory=QueueConfig)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    http: HttpConfig = Field(default_factory=HttpConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    fairness: FairnessConfig = Field(default_factory=FairnessConfig)
    ledger: LedgerConfig = Field(default_factory=LedgerConfig)
    migration: MigrationConfig = Field(default_factory=MigrationConfig)
    redis_url: str | None = Field(default=None, pattern=r"^(redis|rediss|unix)://")

    @field_validator("api_keys", mode="before")
    @classmethod
    def _check_hashes(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        for key in v:
            if not isinstance(key, str) or not _HEX64.match(key.lower()):
                raise _FieldError(
                    ("api_keys", str(key)),
                    "key must be the sha256 hex digest (64 hex characters) of an API key",
                )
        return {k.lower(): t for k, t in v.items()}

    @model_validator(mode="after")
    def _cross_check(self) -> RouterConfig:
        for name, tenant in self.tenants.items():
            if tenant.slo_class not in self.slo_classes:
                raise _FieldError(
                    ("tenants", name, "slo_class"),
                    f"unknown SLO class {tenant.slo_class!r} (known: {', '.join(sorted(self.slo_classes))})",
                )
        for digest, tenant_name in self.api_keys.items():
            if tenant_name not in self.tenants:
                raise _FieldError(("api_keys", digest), f"unknown tenant {tenant_name!r}")
        seen: set[str] = set()
        for i, rep in enumerate(self.replicas):
            if rep.id in seen:
                raise _FieldError(("replicas", i, "id"), f"duplicate replica id {rep.id!r}")
            seen.add(rep.id)
        if self.discovery.mode == "static" and not self.replicas:
            raise _FieldError(("replicas",), "at least one replica is needed (or set discovery.mode)")
        if self.discovery.mode != "static" and self.replicas:
            raise _FieldError(
                ("replicas",), f"must be empty when discovery.mode is {self.discovery.mode} (replicas are discovered)"
            )
        total_share = sum(t.min_share or 0.0 for t in self.tenants.values())
        if total_share > 1.0 + 1e-9:
            raise _FieldError(("tenants",), f"min_share values sum to {total_share:g} > 1")
        if self.auth.trusted_header and not self.auth.trusted_networks:
            raise _FieldError(("auth", "trusted_networks"), "trusted_header needs at least one trusted network")
        return self

    def band_of(self, tenant: str) -> int:
        """Priority band of a tenant (its SLO class's ``priority``; 0 = most urgent)."""
        return self.slo_classes[self.tenants[tenant].slo_class].priority


def _dotted(loc: tuple[str | int, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "<root>"


def _node_line(root: yaml.Node | None, loc: tuple[str | int, ...]) -> int:
    """1-based line of the deepest YAML node reachable along ``loc`` (1 when none)."""
    if root is None:
        return 1
    node: yaml.Node = root
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            nxt = None
            for key_node, value_node in node.value:
                if str(key_node.value) == str(part):
                    nxt = value_node
                    break
            if nxt is None:
                break
            node = nxt
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            if 0 <= part < len(node.value):
                node = node.value[part]
            else:
                break
        else:
            break
    return node.start_mark.line + 1


def _format_validation(path: Path, root: yaml.Node | None, exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if p != "[key]")
        msg = err["msg"]
        inner = (err.get("ctx") or {}).get("error")
        if isinstance(inner, _FieldError):
            loc, msg = inner.loc, inner.message
        lines.append(f"{path.name}:{_node_line(root, loc)}: {_dotted(loc)}: {msg}")
    return "\n".join(lines)


def _compose(text: str, path: Path) -> tuple[yaml.Node | None, dict[str, Any]]:
    """The YAML node tree (for line numbers) and the data of ``text``, a mapping.

    Raises:
        ConfigError: a syntax error (``file:line: YAML syntax error: ...``) or a root that is not a mapping.
    """
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else 1
        raise ConfigError(f"{path.name}:{line}: YAML syntax error: {exc.problem or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path.name}:1: YAML error: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path.name}:1: <root>: the file must hold a mapping (slo_classes, tenants, ...)")
    return root, data


_M = TypeVar("_M", bound=BaseModel)


def validate_yaml(model: type[_M], text: str, path: Path | str) -> _M:
    """``model`` validated from YAML text, errors as ``file:line: field.path: reason`` (:class:`ConfigError`)."""
    path = Path(path)
    root, data = _compose(text, path)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation(path, root, exc)) from None


class AgentSection(BaseModel):
    """The part of the router YAML an agent reads: ``slo_classes``, validated with the router's own
    :class:`SloClassConfig` (the other sections are the router's and are not read here)."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    slo_classes: dict[str, SloClassConfig] = Field(min_length=1)


def parse_agent_section(text: str, path: Path | str = "<config>") -> AgentSection:
    """Validate the agent's part of router YAML text (same models, same ``file:line`` errors as the router).

    A file that holds only ``slo_classes`` (an agent's own file) is checked with :class:`AgentSection`.
    A file with any other top-level key is the router's file and is checked whole, with
    :class:`RouterConfig`, as the router checks it: so an agent never applies classes from a file the
    router refuses (a bad tenant weight, an unknown class named by a tenant), and the two never plan
    with different targets after a reload.

    Raises:
        ConfigError: YAML syntax error, no ``slo_classes``, a class field that fails validation, or
            (the router's file) anything the router refuses.
    """
    _, data = _compose(text, Path(path))
    if set(data) - {"slo_classes"}:
        return AgentSection(slo_classes=validate_yaml(RouterConfig, text, path).slo_classes)
    return validate_yaml(AgentSection, text, path)


def load_agent_section(path: Path | str) -> AgentSection:
    """Read and validate the agent's part of the router YAML at ``path``.

    Raises:
        ConfigError: file unreadable, YAML syntax error or invalid field; the message is
            ``<file>:<line>: <field.path>: <reason>`` (one line per error), as the router's ``load_config``.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror or exc}") from None
    return parse_agent_section(text, path)
