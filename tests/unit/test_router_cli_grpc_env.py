"""router/cli.py sets gRPC's experiments before grpc is first imported, unless the environment sets them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = ("import sys, router.cli, os; assert 'grpc' in sys.modules; "  # grpc came in through router.cli
         "print(repr(os.environ['GRPC_EXPERIMENTS']))")


def probe(env_value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    env["PYTHONPATH"] = str(ROOT)
    if env_value is not None:
        env["GRPC_EXPERIMENTS"] = env_value
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_listener_experiment_is_off_by_default() -> None:
    # one interpreter (an import of router.cli takes seconds); the environment's own value is kept by
    # setdefault (the next test reads that off the source)
    assert probe(None) == repr("-event_engine_listener")


def test_the_setting_precedes_every_import_of_grpc_and_the_environment_wins() -> None:
    # the C core reads GRPC_EXPERIMENTS when grpc is imported: nothing above the setdefault may import it
    src = (ROOT / "router" / "cli.py").read_text()
    head = src[: src.index('os.environ.setdefault("GRPC_EXPERIMENTS"')]
    imports = [line for line in head.splitlines() if line.startswith(("import ", "from "))]
    assert imports == ["from __future__ import annotations", "import os"]
    # setdefault: an operator's GRPC_EXPERIMENTS (this process's, under pytest, included) is never replaced
    assert 'os.environ.setdefault("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS_DEFAULT)' in src
