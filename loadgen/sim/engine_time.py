"""The simulated engine's own step time, apart from the time model the policies plan with (pure: no I/O but
:func:`load_engine_time_model`, no clock; randomness from an injected, seeded numpy Generator).

For one engine step (iteration) over sequences i with ``chunk_i`` new tokens and ``prefix_i`` tokens already
computed (a decode: chunk 1 at its context length), in ms::

    step_ms = (a + b * sum chunk_i + c * sum prefix_i + d * n_seqs + e * sum chunk_i * prefix_i
               + f * sum chunk_i^2) * exp(N(0, noise_sigma))

The bracket is a fit to the component model of the GPU kernel profiles (docs/engine-time-model.md: the
model, the fit, its data and error; ``scripts/fit_engine_time_model.py`` rebuilds the shipped files);
``e`` carries a prefill chunk's attention over its prefix, ``f`` the causal attention inside the chunk.
The noise factor is log-normal with median 1, drawn independently per step. An optional ``slowdown``
(loadgen/sim/slowdown.py) multiplies each step by a factor correlated in time, the engine's share of a busy
machine: ``step_ms * exp(log_mean + sum of OU components at the step's start)``.

File format (JSON object; a missing coefficient is 0): ``{"a_ms", "b_ms", "c_ms", "d_ms", "e_ms", "f_ms",
"noise_sigma", "seed"}``, an optional ``"slowdown"`` object (:meth:`SlowdownModel.from_dict`) and an
optional ``"meta"`` object (provenance, kept but not interpreted).
Shipped files: ``loadgen/data/engine_time/<profile>.json``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from loadgen.sim.slowdown import SlowdownModel, SlowdownProcess
from replica_agent.policy.time_model import StepFeatures

COEFFICIENTS = ("a_ms", "b_ms", "c_ms", "d_ms", "e_ms", "f_ms")
KEYS = COEFFICIENTS + ("noise_sigma", "seed")
POLICY = "policy"
"""``--engine-time-model policy``: the engine's step time is the policy's TimeModel (the old oracle behaviour)."""

_NOISE_BLOCK = 1024


@dataclass(frozen=True, slots=True)
class EngineTimeModel:
    """Coefficients of the engine step time (module docstring).

    Attributes:
        a_ms: fixed cost of one step (ms).
        b_ms: per new token (ms/token).
        c_ms: per context token, summed over the sequences (ms/token).
        d_ms: per sequence in the batch (ms/sequence).
        e_ms: per chunk_i * prefix_i (ms/token^2).
        f_ms: per chunk_i^2 (ms/token^2).
        noise_sigma: std of the log of the noise factor (dimensionless, >= 0; 0 = deterministic).
        seed: seed of the noise (int >= 0); combined with a per-engine stream number by :meth:`sampler`.
        slowdown: correlated slowdowns in time (None: none); drawn from a Generator of its own, so the
            per-step noise draws are the same with and without it.
        name: where it came from (a path or a shipped profile name), for reports.
        meta: the file's optional ``meta`` object.

    Raises:
        ValueError: on a negative or non-finite coefficient, a negative noise_sigma or seed, or
            a + b + d == 0 (a one-token step would take no time).
    """

    a_ms: float = 0.0
    b_ms: float = 0.0
    c_ms: float = 0.0
    d_ms: float = 0.0
    e_ms: float = 0.0
    f_ms: float = 0.0
    noise_sigma: float = 0.0
    seed: int = 0
    slowdown: SlowdownModel | None = None
    name: str = ""
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        for k in COEFFICIENTS + ("noise_sigma",):
            v = getattr(self, k)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ValueError(f"engine time model: {k} must be a finite number >= 0, got {v!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"engine time model: seed must be an integer >= 0, got {self.seed!r}")
        if self.a_ms + self.b_ms + self.d_ms <= 0:
            raise ValueError("engine time model: a_ms + b_ms + d_ms must be > 0 (a one-token step must take time)")

    # ---- construction ----------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, obj: Any, name: str = "") -> EngineTimeModel:
        """Build from the JSON object of the module docstring (missing keys 0).

        Raises:
            ValueError: if ``obj`` is not an object, has an unknown key, a non-number value, or fails the
                checks of the class.
        """
        if not isinstance(obj, dict):
            raise ValueError(f"engine time model {name or ''}: expected a JSON object, got {type(obj).__name__}")
        unknown = sorted(set(obj) - set(KEYS) - {"meta", "slowdown"})
        if unknown:
            raise ValueError(f"engine time model {name}: unknown key(s) {', '.join(unknown)}; known: {', '.join(KEYS)}, "
                             "slowdown, meta")  # fmt: skip
        meta = obj.get("meta", {})
        if not isinstance(meta, dict):
            raise ValueError(f"engine time model {name}: meta must be an object")
        vals: dict[str, Any] = {}
        for k in COEFFICIENTS + ("noise_sigma",):
            v = obj.get(k, 0.0)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"engine time model {name}: {k} must be a number, got {v!r}")
            vals[k] = float(v)
        seed = obj.get("seed", 0)
        if isinstance(seed, float) and seed.is_integer():
            seed = int(seed)
        slowdown = None
        if obj.get("slowdown") is not None:
            try:
                slowdown = SlowdownModel.from_dict(obj["slowdown"])
            except ValueError as e:
                raise ValueError(f"engine time model {name}: {e}") from None
        return cls(**vals, seed=seed, slowdown=slowdown, name=name, meta=meta)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object (coefficients, noise_sigma, seed, and slowdown when set), for reports."""
        d: dict[str, Any] = {k: getattr(self, k) for k in KEYS}
        if self.slowdown is not None:
            d["slowdown"] = self.slowdown.to_dict()
        return d

    def describe(self) -> dict[str, Any]:
        """What reports print: ``{"name", ...coefficients}``."""
        return {"name": self.name, **self.to_dict()}

    # ---- the step time ---------------------------------------------------------------------------

    def mean_ms(self, f: StepFeatures) -> float:
        """Noiseless (median) step time of ``f`` (ms)."""
        return (self.a_ms + self.b_ms * f.new_tokens + self.c_ms * f.context_tokens + self.d_ms * f.num_seqs
                + self.e_ms * f.chunk_prefix_tokens + self.f_ms * f.chunk_sq_tokens)  # fmt: skip

    def step_ms(self, f: StepFeatures, rng: np.random.Generator | None = None) -> float:
        """Step time of ``f`` (ms): :meth:`mean_ms` times exp(N(0, noise_sigma)) drawn from ``rng``.

        ``rng`` None (or noise_sigma 0) gives the noiseless value.
        """
        t = self.mean_ms(f)
        if rng is None or self.noise_sigma == 0.0:
            return t
        return t * math.exp(self.noise_sigma * float(rng.standard_normal()))

    def sampler(self, stream: int = 0) -> EngineTimeSampler:
        """A per-engine noise source: a Generator seeded with ``(seed, stream)`` (replica i of a fleet uses stream
        i); the slowdown, when set, draws from one seeded with ``(seed, stream, 1)``."""
        slow = self.slowdown.process(np.random.default_rng([self.seed, stream, 1])) if self.slowdown is not None else None
        return EngineTimeSampler(self, np.random.default_rng([self.seed, stream]), slow)


class EngineTimeSampler:
    """Draws the step times of one engine: :meth:`EngineTimeModel.mean_ms` times the log-normal noise (and
    the slowdown factor at the step's start, when the model has one).

    The normals come from ``rng`` in blocks of 1024 (the same sequence for a given seed and stream).
    """

    __slots__ = ("model", "_rng", "_buf", "_i", "_slow", "_clock_ms")

    def __init__(self, model: EngineTimeModel, rng: np.random.Generator, slowdown: SlowdownProcess | None = None) -> None:
        self.model = model
        self._rng = rng
        self._buf = np.empty(0)
        self._i = 0
        self._slow = slowdown
        self._clock_ms = 0.0

    def step_ms(self, f: StepFeatures, now_ms: float | None = None) -> float:
        """Step time of ``f`` (ms), with this engine's next noise draw.

        ``now_ms``: the step's start on the engine's clock (ms), which moves the slowdown; None: the end of
        the previous step (steps back to back).
        """
        m = self.model
        t = m.mean_ms(f)
        slow = self._slow
        if slow is not None:
            if now_ms is not None:
                self._clock_ms = now_ms
            t *= slow.factor(self._clock_ms / 1000.0)
        if m.noise_sigma != 0.0:
            if self._i >= self._buf.size:
                self._buf = np.exp(m.noise_sigma * self._rng.standard_normal(_NOISE_BLOCK))
                self._i = 0
            t *= float(self._buf[self._i])
            self._i += 1
        if slow is not None:
            self._clock_ms += t  # the next step starts when this one ends, unless told otherwise
        return t


# ---- files ----------------------------------------------------------------------------------------

def shipped_path(profile: str) -> Path | None:
    """Path of the shipped engine-time file of ``profile`` (``loadgen/data/engine_time/<profile>.json``), None if none."""
    p = resources.files("loadgen").joinpath("data", "engine_time", f"{profile.lower()}.json")
    return Path(str(p)) if p.is_file() else None


def load_engine_time_model(spec: str | None, profile: str) -> EngineTimeModel | None:
    """Resolve ``--engine-time-model``: ``policy`` -> None (engine = policy's TimeModel); a path -> that file;
    None (flag not given) -> the shipped file of ``profile``, or None when there is none.

    Raises:
        ValueError: on invalid JSON or a file the class refuses (the message names the file).
        FileNotFoundError: for a path that does not exist.
    """
    if spec is not None and spec.strip().lower() == POLICY:
        return None
    if spec is None:
        path = shipped_path(profile)
        if path is None:
            return None
        name = f"shipped:{profile.lower()}"
    else:
        path = Path(spec)
        if not path.is_file():
            shipped = shipped_path(spec)
            if shipped is None:
                raise FileNotFoundError(f"engine time model file {spec!r} not found (nor a shipped profile of that name)")
            path, name = shipped, f"shipped:{spec.lower()}"
        else:
            name = str(spec)
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"engine time model {path}: invalid JSON: {e}") from e
    return EngineTimeModel.from_dict(obj, name=name)


def describe_engine(model: EngineTimeModel | None) -> dict[str, Any]:
    """The ``engine_time_model`` entry of reports: ``{"name": "policy"}`` or :meth:`EngineTimeModel.describe`."""
    return {"name": POLICY} if model is None else model.describe()


def engine_label(model: EngineTimeModel | None) -> str:
    """One-line name for printed tables: ``policy`` or the model's name."""
    return POLICY if model is None else model.name
