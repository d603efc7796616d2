"""Plugins by name, and placement policies built from the router YAML's ``placement`` section. PURE.

Discovery: every module of ``router/placement/filters``, ``scorers`` and ``pickers`` (and of
``hooks``) that defines ``PLUGIN`` (a dataclass with a ``name`` field whose default is the
plugin's name) is registered under that name, so adding a scorer is one new module, its test,
its line in the YAML docs (docs/architecture.md "Placement plugins") and its name in the YAML
schema's ``PLACEMENT_PLUGINS`` (fairbatch_common/config_schema.py, which both processes validate
the file with and which imports no router code; a test compares it with this registry).

Profiles: ``pab`` (the default) is :class:`~router.placement.fused.FusedPabPolicy`, the one-pass
form of the chain ``exclude, healthy, fresh, max-prompt, fits, on-time, window`` ->
``headroom: 1, kv-headroom: 1`` -> ``highest``; ``pab-chain`` is the same chain built from the
plugins. The baseline routers of the fleet benchmark (``round-robin``, ``least-outstanding``, ...,
``static-queue-cap``) are profiles too (router/placement/baselines.py), built with the router's
load view (``load``). :func:`build_policy` builds a custom chain from the YAML and uses the fused
form when the chain is the default one; a plugin with a ``load`` field (the baseline scorers) gets
the router's load view.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, fields
from typing import Any

from router.placement.baselines import register_baselines
from router.placement.core import DEFAULT_MAX_CANDIDATES, Filter, Picker, PlacementPolicy, PostDecisionHook, Scorer
from router.placement.fused import _PAB_FILTERS, FusedPabPolicy
from router.placement.load import RouterLoad

DEFAULT_SCORERS: tuple[tuple[str, float], ...] = (("headroom", 1.0), ("kv-headroom", 1.0))
"""The ``pab`` profile's scorers and weights."""

DEFAULT_PICKER = "highest"


class PlacementRegistry:
    """Name -> factory for filters, scorers, pickers and hooks, and named policies built from them."""

    def __init__(self) -> None:
        self.filters: dict[str, Callable[..., Filter]] = {}
        self.scorers: dict[str, Callable[..., Scorer]] = {}
        self.pickers: dict[str, Callable[..., Picker]] = {}
        self.hooks: dict[str, Callable[..., PostDecisionHook]] = {}
        self.policies: dict[str, Callable[..., PlacementPolicy]] = {}

    def build(self, name: str, **params: object) -> PlacementPolicy:
        """A fresh policy by name.

        Raises:
            KeyError: unknown policy name (the message lists the known ones).
        """
        try:
            factory = self.policies[name]
        except KeyError:
            raise KeyError(f"unknown placement policy {name!r}; known: {', '.join(sorted(self.policies))}") from None
        return factory(**params)


def plugin_name(cls: type) -> str:
    """The default of a plugin dataclass's ``name`` field.

    Raises:
        TypeError: the class has no ``name`` field with a default.
    """
    for f in fields(cls):
        if f.name == "name" and f.default is not MISSING:
            return str(f.default)
    raise TypeError(f"placement plugin {cls.__name__} needs a 'name' field with a default")


def discover(package: str) -> dict[str, type]:
    """name -> class of every ``PLUGIN`` in the modules of ``package`` (module docstring)."""
    pkg = importlib.import_module(package)
    out: dict[str, type] = {}
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        mod = importlib.import_module(f"{package}.{info.name}")
        cls = getattr(mod, "PLUGIN", None)
        if cls is not None:
            out[plugin_name(cls)] = cls
    return out


def default_registry() -> PlacementRegistry:
    """Registry with the discovered plugins, the ``pab`` (fused; ``seed``, ``max_candidates``,
    default :data:`DEFAULT_MAX_CANDIDATES`, None = all) and ``pab-chain`` (``seed``) policies and the
    baseline profiles (router/placement/baselines.py; ``load``, ``seed``). Every policy takes
    ``seed`` and ``load`` (the PAB ones read budgets, not the load: they ignore it)."""
    reg = PlacementRegistry()
    reg.filters.update(discover("router.placement.filters"))  # type: ignore[arg-type]
    reg.scorers.update(discover("router.placement.scorers"))  # type: ignore[arg-type]
    reg.pickers.update(discover("router.placement.pickers"))  # type: ignore[arg-type]
    reg.hooks.update(discover("router.placement.hooks"))  # type: ignore[arg-type]

    def pab_chain(seed: int | None = None, load: RouterLoad | None = None) -> PlacementPolicy:
        return PlacementPolicy(
            filters=[reg.filters[n]() for n in _PAB_FILTERS],
            scorers=[(reg.scorers[n](), w) for n, w in DEFAULT_SCORERS],
            picker=reg.pickers[DEFAULT_PICKER](seed=seed),
        )

    def pab_policy(seed: int | None = None, max_candidates: int | None = DEFAULT_MAX_CANDIDATES,
                   load: RouterLoad | None = None) -> PlacementPolicy:  # fmt: skip
        chain = pab_chain(seed)
        return FusedPabPolicy(chain.filters, chain.scorers, chain.picker, max_candidates=max_candidates)

    reg.policies["pab"] = pab_policy
    reg.policies["pab-chain"] = pab_chain
    register_baselines(reg)
    return reg


def _with_load(cls: Callable[..., Any], load: RouterLoad, params: Mapping[str, Any]) -> Any:
    """A plugin built with ``params``, and with ``load`` when its dataclass has a ``load`` field."""
    if "load" in {f.name for f in fields(cls)}:  # type: ignore[arg-type]
        return cls(load=load, **dict(params))
    return cls(**dict(params))


def is_default_chain(filters: Sequence[str], scorers: Sequence[tuple[str, float]], picker: str) -> bool:
    """True when the chain is the ``pab`` profile's (same filters in order, same scorers and weights)."""
    return tuple(filters) == _PAB_FILTERS and tuple(scorers) == DEFAULT_SCORERS and picker == DEFAULT_PICKER


def build_policy(
    reg: PlacementRegistry,
    profile: str,
    seed: int | None,
    filters: Sequence[str] | None = None,
    scorers: Sequence[tuple[str, float, Mapping[str, Any]]] | None = None,
    picker: str | None = None,
    picker_params: Mapping[str, Any] | None = None,
    hooks: Sequence[str] = (),
    load: RouterLoad | None = None,
    profile_params: Mapping[str, Any] | None = None,
) -> PlacementPolicy:
    """The policy of a ``placement`` section: the named ``profile`` when no chain is given, else the
    chain (missing parts from the default profile, ``pab``: a chain is admitted by PAB); the fused
    ``pab`` when the chain is the default.

    Args:
        reg: the registry (names were validated against it).
        profile: a policy name of ``reg`` (``pab``, ``pab-chain``, a baseline profile).
        seed: the picker's tie-break seed.
        filters: filter names in order, or None.
        scorers: (name, weight, params) triples, or None.
        picker: picker name, or None; ``picker_params``: its parameters besides ``seed``.
        hooks: hook names (post-decision plugins).
        load: the router's load view (router/placement/load.py), given to the profile and to every
            plugin with a ``load`` field; None: a fresh empty one.
        profile_params: the profile's own parameters (``static-queue-cap``: ``queue_cap_tokens``).

    Raises:
        KeyError: an unknown name.
        TypeError: a parameter the profile or plugin does not take.
    """
    hook_objs = [reg.hooks[h]() for h in hooks]
    load = RouterLoad() if load is None else load
    if filters is None and scorers is None and picker is None:
        pol = reg.build(profile, seed=seed, load=load, **dict(profile_params or {}))
    else:
        f_names = list(filters) if filters is not None else list(_PAB_FILTERS)
        s_items = list(scorers) if scorers is not None else [(n, w, {}) for n, w in DEFAULT_SCORERS]
        p_name = picker or DEFAULT_PICKER
        p_params = dict(picker_params or {})
        if is_default_chain(f_names, [(n, w) for n, w, prm in s_items if not prm], p_name) and \
                all(not prm for _, _, prm in s_items) and not p_params:  # fmt: skip
            pol = reg.build("pab", seed=seed)
        else:
            pol = PlacementPolicy(
                filters=[reg.filters[n]() for n in f_names],
                scorers=[(_with_load(reg.scorers[n], load, prm), float(w)) for n, w, prm in s_items],
                picker=reg.pickers[p_name](seed=seed, **p_params) if "seed" in
                {f.name for f in fields(reg.pickers[p_name])} else reg.pickers[p_name](**p_params),  # type: ignore[arg-type]
            )
    pol.hooks = hook_objs
    return pol
