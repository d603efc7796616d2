"""API key authentication: ``Authorization: Bearer <key>`` -> tenant -> SLO class.

Keys are stored hashed (sha256 hex) in the YAML; the presented key is hashed and looked up, so the
router never holds a plain key. A client cannot choose its tenant or its class.
"""

from __future__ import annotations

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
    """

    tenant: str
    slo_class: str
    slo: SloClassConfig
    weight: float


class ApiKeyAuthenticator:
    """Maps bearer keys to principals using the ``api_keys`` and ``tenants`` of the config."""

    __slots__ = ("_by_digest",)

    def __init__(self, config: RouterConfig) -> None:
        self._by_digest: dict[str, Principal] = {}
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
