"""Router configuration: the YAML schema of fairbatch_common/config_schema.py, loaded by the router.

The models (and their docs) live in :mod:`fairbatch_common.config_schema`, which the agent reads
too (its ``slo_classes``; a router file it checks whole, as the router does). This module re-exports
them and adds what only the router does with them: :class:`PlacementConfig` builds the placement
policy of its section (router/placement/), :class:`RouterConfig` is the schema's whole-file model
with that placement section, :func:`load_config` reads and validates a file, :func:`hash_api_key`
hashes a key as ``api_keys`` stores it.

Every error is reported as ``<file>:<line>: <field.path>: <message>`` (:class:`ConfigError`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from pydantic import Field

from fairbatch_common import config_schema as _schema
from fairbatch_common.config_schema import (
    AdmissionConfig,
    AuthConfig,
    ConfigError,
    DiscoveryConfig,
    FairnessConfig,
    HttpConfig,
    LedgerConfig,
    MigrationConfig,
    PickerEntry,
    PrefixCacheConfig,
    QueueConfig,
    ReplicaConfig,
    ScorerEntry,
    SloClassConfig,
    TelemetryConfig,
    TenantConfig,
    WorkShedConfig,
    validate_yaml,
)

__all__ = [
    "AdmissionConfig",
    "AuthConfig",
    "ConfigError",
    "DiscoveryConfig",
    "FairnessConfig",
    "HttpConfig",
    "LedgerConfig",
    "MigrationConfig",
    "PickerEntry",
    "PlacementConfig",
    "PrefixCacheConfig",
    "QueueConfig",
    "ReplicaConfig",
    "RouterConfig",
    "ScorerEntry",
    "SloClassConfig",
    "TelemetryConfig",
    "TenantConfig",
    "WorkShedConfig",
    "hash_api_key",
    "load_config",
    "parse_config",
]


class PlacementConfig(_schema.PlacementConfig):
    """The ``placement`` section (:class:`fairbatch_common.config_schema.PlacementConfig`: fields,
    plugin names checked) and the policy it describes (:meth:`build`)."""

    def build(self, seed: int | None, load: Any = None) -> Any:
        """The :class:`~router.placement.core.PlacementPolicy` of this section (``seed`` for the picker;
        ``load``: the router's :class:`~router.placement.load.RouterLoad`, read by the baseline
        profiles and plugins; None: a fresh empty one).

        Raises:
            TypeError: a plugin or profile parameter the plugin or profile does not take.
        """
        from router.placement.registry import build_policy, default_registry  # placement imports no config

        return build_policy(
            default_registry(), self.profile, seed, self.filters,
            None if self.scorers is None else [(e.name, e.weight, e.params) for e in self.scorers],
            None if self.picker is None else self.picker.name, None if self.picker is None else self.picker.params,
            self.hooks, load, self.params,
        )  # fmt: skip


class RouterConfig(_schema.RouterConfig):
    """The whole router YAML (:class:`fairbatch_common.config_schema.RouterConfig`: the same fields and
    cross-checks), its ``placement`` section the router's :class:`PlacementConfig`."""

    placement: PlacementConfig = Field(default_factory=PlacementConfig)


def hash_api_key(key: str) -> str:
    """sha256 hex digest (64 lower-case hex characters) of an API key, as stored in ``api_keys``.

    A key read from a header that held non-UTF-8 bytes (aiohttp decodes them to lone surrogates) is
    hashed over the bytes the client sent (``surrogateescape``); it never raises.
    """
    try:
        data = key.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate no byte decodes to (not from a header): any stable bytes do
        data = key.encode("utf-8", "surrogatepass")
    return hashlib.sha256(data).hexdigest()


def parse_config(text: str, path: Path | str = "<config>") -> RouterConfig:
    """Validate YAML text as a :class:`RouterConfig`.

    Raises:
        ConfigError: YAML syntax error (line of the parser's mark) or a field that fails
            validation (line of that field's node), message ``file:line: field.path: reason``.
    """
    return validate_yaml(RouterConfig, text, path)


def load_config(path: Path | str) -> RouterConfig:
    """Read and validate the router YAML at ``path``.

    Raises:
        ConfigError: file unreadable, YAML syntax error or invalid field; the message is
            ``<file>:<line>: <field.path>: <reason>`` (one line per error).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror or exc}") from None
    return parse_config(text, path)
