"""The packages' import layers (docs/architecture.md "Layout"), read from the source with ``ast``.

fairbatch_common/ imports none of the other packages; router/ imports of replica_agent/ only its
pure ``replica_agent.policy``; replica_agent/ imports nothing from router/; neither server imports
loadgen/ (their images ship without it); and no two project modules import each other, directly
or round a longer circle. Every import counts, at module level or inside a function.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("fairbatch_common", "router", "replica_agent", "loadgen", "proto")


def project_modules() -> dict[str, Path]:
    """Dotted name -> file of every module of :data:`PACKAGES` (a package is its ``__init__.py``)."""
    out: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = project_modules()


def imported(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """Project modules named by one import statement of ``module`` (``from pkg import mod`` names
    ``pkg.mod`` when that is a module, else ``pkg``; a name outside the project is left out)."""
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from the module's package, one level up per extra dot
            package = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join([*package, base] if base else package)
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    out = []
    for name in names:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name:
            out.append(name)
    return out


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported project module: line of the first such import}."""
    graph: dict[str, dict[str, int]] = {}
    for module, path in MODULES.items():
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in imported(module, node):
                    if target != module:
                        edges.setdefault(target, node.lineno)
        graph[module] = edges
    return graph


GRAPH = import_graph()


def in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def violations(source: str, forbidden: tuple[str, ...], allowed: Callable[[str], bool] = lambda m: False) -> list[str]:
    """``file:line: imports <module>`` for each import by a module of package ``source`` of a module
    inside one of the ``forbidden`` packages that ``allowed`` does not let through."""
    bad = []
    for module, edges in GRAPH.items():
        if not in_package(module, source):
            continue
        for target, line in edges.items():
            if any(in_package(target, f) for f in forbidden) and not allowed(target):
                bad.append(f"{MODULES[module].relative_to(REPO)}:{line}: imports {target}")
    return sorted(bad)


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_graph_sees_the_known_imports() -> None:
    # the reader itself: module-level, function-level, "from pkg import module" and relative forms
    assert "fairbatch_common.clock" in GRAPH["router.server"]
    assert "loadgen.vllm_fleet" in GRAPH["loadgen.demo"]  # inside main_from_args
    assert "fairbatch_common.log_redact" in GRAPH["fairbatch_common.runtime"]  # from fairbatch_common import log_redact
    assert "router.placement.registry" in GRAPH["router.config"]  # inside PlacementConfig.build
    assert imported("router.placement.scorers", ast.parse("from . import headroom").body[0]) == [  # type: ignore[arg-type]
        "router.placement.scorers.headroom"]
    assert imported("router.placement.core", ast.parse("from .fused import x").body[0]) == [  # type: ignore[arg-type]
        "router.placement.fused"]


def test_router_imports_of_the_agent_only_its_policy() -> None:
    assert violations("router", ("replica_agent",), allowed=lambda m: in_package(m, "replica_agent.policy")) == []


def test_the_agent_imports_nothing_from_the_router() -> None:
    assert violations("replica_agent", ("router",)) == []


def test_fairbatch_common_imports_no_other_package_of_the_project() -> None:
    assert violations("fairbatch_common", ("router", "replica_agent", "loadgen")) == []


def test_the_servers_import_nothing_from_loadgen() -> None:
    for package in ("fairbatch_common", "router", "replica_agent"):
        assert violations(package, ("loadgen",)) == []


def test_demo_and_vllm_fleet_do_not_import_each_other() -> None:
    assert "loadgen.demo" not in GRAPH["loadgen.vllm_fleet"]
    assert not any("loadgen.demo" in c and "loadgen.vllm_fleet" in c for c in cycles(GRAPH))


def test_no_import_circle_among_project_modules() -> None:
    found = cycles(GRAPH)
    assert found == [], "import circles (module-level and function-level imports): " + "; ".join(
        " <-> ".join(c) for c in found)
