"""What the demo's two engines share: its tenants, its SLO class and its options.

``fairbatch-loadgen demo`` runs on simulated engines (loadgen/demo.py) or on real vLLM replicas
(loadgen/vllm_fleet.py ``run_vllm_demo``); both read these, so neither imports the other for them
(loadgen/demo.py calls into loadgen/vllm_fleet.py for ``--engine vllm``; the other way round there
is no import).
"""

from __future__ import annotations

from dataclasses import dataclass

DEMO_TENANTS: tuple[tuple[str, int], ...] = (("acme", 3), ("beta", 1))
"""(tenant, weight) of the demo; both in class ``interactive``; the load is split by the same weights."""
SLO_CLASS = "interactive"


@dataclass(slots=True)
class DemoOptions:
    """Knobs of the demo (defaults: ``make demo``).

    Attributes:
        replicas: number of engine + agent pairs.
        trace: embedded trace name or path.
        duration_s: window of the trace replayed (trace seconds, before rate scaling).
        start_s: where the window starts (trace seconds).
        rate_scale: arrival-rate multiplier (2 = twice the trace's rate).
        time_scale: wall seconds per simulated second for every process.
        profile: GPU profile of the simulated engines and agents.
        ttft_ms, tpot_ms: targets of the ``interactive`` class (simulated ms).
        out: report JSON path.
        keep_logs: folder to keep the children's logs and the YAML in (None: a temp dir, removed).
        seed: seed of the tenant draw (engines get seed + i).
        startup_timeout_s: wall seconds to wait for each /health.
        max_wall_s: wall-clock limit of the replay.
        request_timeout_s: per-request limit (simulated s).
        progress: progress bar on stderr.
        engine_time_model: the simulated engines' own step time (``--engine-time-model``): a JSON file, a
            shipped profile name or ``policy``; None = the profile's shipped file (loadgen/data/engine_time/).
    """

    replicas: int = 4
    trace: str = "azure-conv"
    duration_s: float = 180.0
    start_s: float = 0.0
    rate_scale: float = 7.0
    time_scale: float = 4.0
    profile: str = "llama-3-8b-a100"
    ttft_ms: float = 500.0
    tpot_ms: float = 50.0
    out: str | None = "out/demo-report.json"
    keep_logs: str | None = None
    seed: int = 0
    startup_timeout_s: float = 60.0
    max_wall_s: float = 900.0
    request_timeout_s: float = 600.0
    progress: bool = True
    engine_time_model: str | None = None
