"""What the search works on: each candidate's state while it is searched, the search's own state
(its settings and what each phase has found so far), and what it answers (``Outcome`` per
candidate, ``SearchResult``). The phases are functions of ``SearchState`` in ``optimize.engine``."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.bundle.manifest import Signature, Tolerance
from edgekit.optimize.candidates import Built, Candidate, CandidatePlan, RunFn
from edgekit.optimize.data import SearchData
from edgekit.optimize.profile import DeviceLatency
from edgekit.validate.latency import LatencyStats
from edgekit.validate.metrics import Comparison, Kind


@dataclass(frozen=True)
class Outcome:
    """One candidate's record: settings, result or the reason it failed / was skipped."""

    name: str
    precision: str  # CLI name
    runtime: str
    settings: Mapping[str, Any]
    status: str  # "passed", "failed" (missed the budget), "error" (build/run raised), "skipped"
    reason: str = ""
    comparison: Comparison | None = None
    size_bytes: int = 0
    latency: LatencyStats | None = None
    build_s: float = 0.0
    label: str = ""  # weights/activations (w8a8)
    method: str = ""
    excluded_nodes: tuple[str, ...] = ()
    baseline: bool = False
    device_rank: int | None = None  # Candidate.device_rank: expected device speed order where untimed
    # the side-by-side round ``latency`` comes from ("quick": pruning, "final": the choice), and the
    # ONNX Runtime FP32 source's p50 in that same round: every ratio is within one measurement
    timed_in: str = ""
    reference_p50_ms: float | None = None
    latency_from: str = ""  # "" (host, or not measured) or the device profile the latency came from
    # passed selection by less than the sampling error of a measure (``optimize.margin``): why; such
    # a candidate ranks behind the ones that passed clear of it
    marginal: str = ""

    @property
    def p50_ms(self) -> float | None:
        return None if self.latency is None else self.latency.p50_ms

    @property
    def speed_vs_reference(self) -> float | None:
        """ONNX Runtime FP32 source p50 / this p50, both from the round in ``timed_in``."""
        if self.p50_ms is None or not self.reference_p50_ms or self.p50_ms <= 0:
            return None
        return self.reference_p50_ms / self.p50_ms


@dataclass(frozen=True)
class SearchResult:
    chosen: Outcome
    built: Built
    built_dir: Path
    why: str
    outcomes: tuple[Outcome, ...]
    reference_latency: LatencyStats | None  # ONNX Runtime FP32 source, the final round (the chosen's)
    baseline: Outcome | None
    slower_than_fp32: bool
    objective: str
    data: SearchData
    threads: int
    notes: tuple[str, ...]
    elapsed_s: float
    # the builds of the candidates that met the budget, and the baseline: name -> (build, folder)
    kept: Mapping[str, tuple[Built, Path]] = field(default_factory=dict)
    # the fallback chain after ``chosen``: what the final gate tries next, in order (names in
    # ``kept``), then ``pending`` (float candidates not built yet, built by ``build_late``)
    chain: tuple[str, ...] = ()
    pending: tuple[Candidate, ...] = ()
    build_late: Callable[[Candidate], tuple[Built, Path]] | None = None
    # candidate name -> how the layers it keeps in float were chosen, where not by the per-layer
    # sensitivity alone (``optimize.aimed``)
    excluded_by: Mapping[str, str] = field(default_factory=dict)


@dataclass
class CandidateState:
    """One candidate while it is searched: its folder, its build, how it runs here, its record."""

    candidate: Candidate
    folder: Path
    built: Built | None = None
    run: RunFn | None = None
    outcome: Outcome | None = None
    error: Exception | None = None


@dataclass
class SearchState:
    """One target's search: its settings (as ``engine.search`` was called) and what the phases
    found so far. Each phase of ``engine.search`` reads and extends it, in order."""

    plan: CandidatePlan
    target: str
    work_dir: Path
    data: SearchData
    served: Signature
    reference_open: Callable[[int], RunFn]
    kind: Kind
    tolerance: Tolerance
    precision: str
    objective: str
    mixed_precision: bool
    threads: int
    calib_batch: int
    latency_budget_s: float
    say: Callable[[str], None]
    shared: dict[tuple[str, ...], tuple[Path, Built]] | None
    time_budget_s: float | None
    device_latency: DeviceLatency | None
    dominated_factor: float | None
    clock: Callable[[], float]
    tasks: Mapping[str, str] | None
    post: Any
    t0: float  # when the search started (time.perf_counter): the time budget and elapsed_s
    batch: int  # samples per call on the selection data
    ref_out: Mapping[str, np.ndarray]  # the FP32 source's outputs on the selection samples
    one: dict[str, np.ndarray]  # the one input every timing round calls with
    states: list[CandidateState] = field(default_factory=list)  # in build order
    notes: list[str] = field(default_factory=list)
    skipped: list[Outcome] = field(default_factory=list)  # described, never built, and why
    against: dict[str, float] = field(default_factory=dict)  # what the prescreen compares with -> median ms
    baseline: CandidateState | None = None  # the target's FP32
    base_p50: float | None = None  # the baseline's p50 in the quick round
    rounds: dict[str, Mapping[str, LatencyStats]] = field(default_factory=dict)  # round -> its stats by name
    reference_latency: LatencyStats | None = None
    finalists: list[CandidateState] = field(default_factory=list)
    head_to_head: str | None = None  # the leader timed again alone with the baseline (``timing.head_to_head``)
    memory: Any = None  # optimize.memory.MemoryModel: the run's memory bound, None for none
    excluded_by: dict[str, str] = field(default_factory=dict)  # SearchResult.excluded_by

    @property
    def auto(self) -> bool:
        return self.precision == "auto"

    @property
    def prescreen(self) -> bool:
        """First calls are timed to skip what is dominated (``engine.DOMINATED_FACTOR``)."""
        return (
            self.auto
            and self.objective == "latency"
            and self.device_latency is None
            and self.dominated_factor is not None
        )

    def over_time_budget(self) -> bool:
        return self.time_budget_s is not None and time.perf_counter() - self.t0 > self.time_budget_s
