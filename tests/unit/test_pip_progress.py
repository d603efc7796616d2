"""scripts/pip_progress.py: pip's output summarised, errors kept (the make target's install progress)."""

from __future__ import annotations

from tests.scripts import load_script

pip_progress = load_script("pip_progress")

PIP_OUTPUT = """\
Looking in indexes: https://pypi.org/simple
Obtaining file:///work/fairbatch
  Installing build dependencies: started
  Installing build dependencies: finished with status 'done'
  Preparing editable metadata (pyproject.toml): finished with status 'done'
Collecting aiohttp==3.14.5 (from fairbatch==0.1.0)
  Using cached aiohttp-3.14.5-cp311-cp311-manylinux_2_17_x86_64.whl.metadata (8.1 kB)
Collecting grpcio==1.85.3 (from fairbatch==0.1.0)
Processing /opt/wheels/protobuf-7.36.2-cp310-abi3-manylinux2014_x86_64.whl (from fairbatch==0.1.0)
  Downloading grpcio-1.85.3-cp311-cp311-manylinux_2_17_x86_64.whl (6.1 MB)
Requirement already satisfied: idna>=2.0 in ./.venv/lib/python3.11/site-packages (from yarl)
Building wheels for collected packages: fairbatch
  Building editable for fairbatch (pyproject.toml): started
  Created wheel for fairbatch: filename=fairbatch-0.1.0-0.editable-py3-none-any.whl size=18735 sha256=7f89
  Stored in directory: /tmp/pip-ephem-wheel-cache/wheels/d2
Successfully built fairbatch
Installing collected packages: grpcio, aiohttp, fairbatch
Successfully installed aiohttp-3.14.5 fairbatch-0.1.0 grpcio-1.85.3
"""


def test_pip_output_becomes_one_line_per_step() -> None:
    assert list(pip_progress.progress(PIP_OUTPUT.splitlines(keepends=True))) == [
        "  [1] collecting aiohttp==3.14.5",
        "  [2] collecting grpcio==1.85.3",
        "  [3] collecting protobuf==7.36.2",
        "  building fairbatch (editable)",
        "  installing ...",
        "  installed 3 packages",
    ]


def test_errors_pass_through() -> None:
    lines = ["Collecting nope==9.9\n", "ERROR: Could not find a version that satisfies the requirement nope==9.9\n",
             "ERROR: No matching distribution found for nope==9.9\n"]  # fmt: skip
    out = list(pip_progress.progress(lines))
    assert out[0] == "  [1] collecting nope==9.9"
    assert out[1:] == [line.rstrip("\n") for line in lines[1:]]
