#!/usr/bin/env python3
"""Turn ``pip install`` output (stdin) into short progress lines for ``make`` (stdout).

One line per package pip collects (``  [12] collecting grpcio``), one when it builds fairbatch, one
when it installs, and the final count; everything else pip says about the steps it takes is left
out. Lines that are none of those (errors, a resolver conflict, anything unexpected) pass through
unchanged, so a failure is still explained. Exit status: 0 (make takes pip's own through pipefail).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Iterator

_NOISE = re.compile(
    r"^\s*(WARNING: Location .* is ignored|Looking in (indexes|links)|Requirement already satisfied|Downloading |"
    r"Using cached |Obtaining |Installing build dependencies|Checking if build backend|Getting requirements|"
    r"Preparing (editable )?metadata|Building (editable|wheel) for|Created wheel for|Stored in directory|"
    r"Attempting uninstall|Found existing installation|Uninstalling |Successfully uninstalled|Successfully built|"
    r"━|\S+ \d+(\.\d+)? .?B )"
)


def progress(lines: Iterable[str]) -> Iterator[str]:
    """The progress lines for pip's output ``lines`` (module docstring)."""
    n = 0
    for raw in lines:
        line = raw.rstrip("\n")
        if m := re.match(r"^Collecting (\S+)", line):
            n += 1
            yield f"  [{n}] collecting {m.group(1)}"
        elif m := re.match(r"^Processing (\S+\.whl)", line):  # a wheel from a local index or link
            n += 1
            name, version = (m.group(1).rsplit("/", 1)[-1].split("-") + [""])[:2]
            yield f"  [{n}] collecting {name}=={version}"
        elif line.startswith("Building wheels for collected packages"):
            yield "  building fairbatch (editable)"
        elif line.startswith("Installing collected packages"):
            yield "  installing ..."
        elif line.startswith("Successfully installed"):
            yield f"  installed {len(line.split()) - 2} packages"
        elif not line.strip() or _NOISE.match(line):
            continue
        else:
            yield line


def main() -> int:
    """Filter stdin to stdout, line by line (flushed: make shows each as it comes)."""
    for out in progress(sys.stdin):
        print(out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
