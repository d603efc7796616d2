"""Authentication: ``Authorization: Bearer <key>`` -> tenant -> SLO class, or a trusted gateway header.

Keys are stored hashed (sha256 hex) in the YAML; the presented key is hashed and looked up, so the
router never holds a plain key. A client cannot choose its tenant or its class: the optional
``auth.trusted_header`` (e.g. ``x-tenant``) is believed only on connections whose source address is
inside ``auth.trusted_networks``; from anywhere else it is ignored and the API key decides.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from router.config import RouterConfig, SloClassConfig, hash_api_key


@dataclass(frozen=True, slots=True)
class Principal:
    """The authenticated caller.

    Attributes:
        tenant: tenant name.
        slo_class: SLO class name of the tenant.
        slo: that class's settings (ttft_ms, tpot_ms, max_queue_ms in simulated ms).
        weight: the tenant's fair-share weight.
        via: ``api-key`` or ``trusted-header``.
    """

    tenant: str
    slo_class: str
    slo: SloClassConfig
    weight: float
    via: str = "api-key"


class ApiKeyAuthenticator:
    """Maps bearer keys to principals using the ``api_keys`` and ``tenants`` of the config."""

    __slots__ = ("_by_digest", "_by_tenant", "_header", "_networks")

    def __init__(self, config: RouterConfig) -> None:
        self._by_digest: dict[str, Principal] = {}
        self._by_tenant: dict[str, Principal] = {
            name: Principal(name, t.slo_class, config.slo_classes[t.slo_class], t.weight, "trusted-header")
            for name, t in config.tenants.items()
        }
        self._header = config.auth.trusted_header
        self._networks = [ipaddress.ip_network(n, strict=False) for n in config.auth.trusted_networks]
        for digest, tenant_name in config.api_keys.items():
            tenant = config.tenants[tenant_name]
            self._by_digest[digest] = Principal(
                tenant=tenant_name,
                slo_class=tenant.slo_class,
                slo=config.slo_classes[tenant.slo_class],
                weight=tenant.weight,
            )

    def authenticate(self, authorization: str | None) -> Principal | None:
        """Principal for an ``Authorization`` header value, or None when missing, malformed or unknown."""
        if not authorization:
            return None
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            return None
        key = key.strip()
        if not key:
            return None
        return self._by_digest.get(hash_api_key(key))

    def trusted_source(self, peer: str | None) -> bool:
        """True when ``peer`` (an IP address string) lies in ``auth.trusted_networks``."""
        if not peer or not self._networks:
            return False
        try:
            addr = ipaddress.ip_address(peer.split("%", 1)[0])
        except ValueError:
            return False
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        return any(addr in net for net in self._networks)

    def _named_by(self, headers: Mapping[str, str], tenant_headers: Sequence[str]) -> list[str]:
        """The header names that may name the tenant, in order: ``tenant_headers``, then
        ``auth.trusted_header``."""
        return [*tenant_headers, self._header] if self._header else list(tenant_headers)

    def identify(self, headers: Mapping[str, str], peer: str | None,
                 tenant_headers: Sequence[str] = ()) -> Principal | None:
        """Principal of a request: the trusted header when configured and sent from a trusted
        network and naming a known tenant, else the bearer key (None when neither identifies).

        ``tenant_headers``: more headers that name the tenant, tried first under the same rule (the
        ext_proc picker's ``x-gateway-inference-fairness-id``, router/ext_proc.py): believed only
        from a peer in ``auth.trusted_networks``."""
        names = self._named_by(headers, tenant_headers)
        if names and self.trusted_source(peer):
            for header in names:
                name = headers.get(header)
                if name:
                    principal = self._by_tenant.get(name.strip())
                    if principal is not None:
                        return principal
        return self.authenticate(headers.get("Authorization") or headers.get("authorization"))

    def refusal(self, headers: Mapping[str, str], peer: str | None, tenant_headers: Sequence[str] = ()) -> str:
        """The 401 message for a request that :meth:`identify` did not identify.

        Names the tenant when a trusted gateway sent a tenant the config does not know (an
        operator's error, worth saying); otherwise the generic API-key message, which tells an
        untrusted client nothing about the trusted header.
        """
        for header in self._named_by(headers, tenant_headers):
            name = (headers.get(header) or "").strip()
            if name and name not in self._by_tenant and self.trusted_source(peer):
                return f"Unknown tenant {name!r} in header {header!r}, and no valid API key."
        return "Invalid or missing API key."
