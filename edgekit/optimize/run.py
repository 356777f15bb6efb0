"""A target's build: its candidate plan through the search, then its ``finish``.

Targets describe (checks, candidates, finishing); only the engine builds. ``optimize`` is what
the packager calls per target (with the run's FP32 reference, gate and settings); ``build`` is
the same outside the packager (defaults: the default gate, selection on the calibration data).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.bundle.manifest import Tolerance
from edgekit.errors import ConfigError
from edgekit.optimize.candidates import OBJECTIVES
from edgekit.optimize.data import search_data
from edgekit.optimize.engine import record_of, search
from edgekit.optimize.memory import bound_bytes, memory_model
from edgekit.optimize.profile import DeviceProfile
from edgekit.optimize.record import choice_step
from edgekit.optimize.search_state import Outcome, SearchResult
from edgekit.package_defaults import DEFAULT_CALIB_SAMPLES, DEFAULT_OBJECTIVE, default_max_memory_gb
from edgekit.targets.base import BuildContext, BuildResult, static_signature
from edgekit.validate.calib import even_batch, fixed_batch, sample_count
from edgekit.validate.metrics import kind_of, output_kind, run_all
from edgekit.validate.ort_runner import ort_open


@dataclass(frozen=True)
class EngineSettings:
    """How the engine searches (the same for every target of one ``package`` call)."""

    objective: str = DEFAULT_OBJECTIVE  # or "size"
    mixed_precision: bool = False  # for explicit --precision int8; auto always may keep layers in float
    threads: int = 0  # the device runtime's thread count; 0 = the runtime's default
    calib_samples: int = DEFAULT_CALIB_SAMPLES  # calibration subset size, every target
    tolerance: Tolerance = dataclasses.field(default_factory=Tolerance)
    latency_budget_s: float = 6.0  # per side-by-side round
    # per target: refinements and mixed precision not started by then are skipped (and recorded);
    # the first wave always runs
    time_budget_s: float | None = 420.0
    # latency measured on the device (``edgekit bench --profile``), used instead of the host's
    device_profile: DeviceProfile | None = None
    # (output, task) per output (``validate.metrics.output_tasks``); empty: the kind from the shapes
    tasks: tuple[tuple[str, str], ...] = ()
    # the bundle's post-processing (``device_agents.processing.post.Postprocessor``): a boxes one
    # judges a detector by its detections (``validate.detections``)
    post: Any = None
    # the run's memory bound (``optimize.memory``): a candidate estimated over it is skipped; None: none
    max_memory_gb: float | None = None  # None: default_max_memory_gb() of this machine; inf: no bound

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"--objective {self.objective!r}: choose one of {', '.join(OBJECTIVES)}")
        if self.calib_samples < 1:
            raise ConfigError(f"--calib-samples must be >= 1, got {self.calib_samples}")
        if self.threads < 0:
            raise ConfigError(f"threads must be >= 0, got {self.threads}")
        gb = self.max_memory_gb
        if gb is not None and (isinstance(gb, bool) or not isinstance(gb, (int, float)) or not gb > 0):
            raise ConfigError(f"--max-memory-gb must be a number of GB > 0 (such as 4 or 0.5), got {gb!r}")


@dataclass(frozen=True)
class Optimized:
    build: BuildResult
    search: SearchResult


def optimize(
    target: Any,
    ctx: BuildContext,
    settings: EngineSettings | None = None,
    reference_path: Path | None = None,
    shared: dict[Any, Any] | None = None,
    holdout_reference: Mapping[str, np.ndarray] | None = None,
    also_held: Sequence[Mapping[str, np.ndarray]] = (),
) -> Optimized:
    """Search ``target``'s candidates for ``ctx.precision`` and finish the chosen one into
    ``ctx.out_dir``. ``reference_path``: the FP32 model accuracy is compared with and latency
    referred to (the source model; default ``ctx.source_path`` or ``ctx.model_path``). ``shared``:
    one dict per ``package`` call, so targets reuse each other's identical builds.
    ``holdout_reference``: the FP32 outputs on the held-out evaluation inputs; for a classifier,
    their top-1 margins are what the selection predicts agreement at (``optimize.flip_risk``):
    only the FP32 model's outputs on them are used, never a candidate's. ``also_held``: the caller's
    arrays held while the search runs (the packager's evaluation inputs), counted under the bound."""
    settings = settings or EngineSettings()
    ref_path = reference_path or ctx.source_path or ctx.model_path
    reference_open = ort_open(ref_path)
    served = ctx.served
    if getattr(target, "static_shapes", False):  # the artifact takes the static shapes only: measure at them
        served = static_signature(ctx.served, ctx.static_shapes)
    tasks = dict(settings.tasks) or None
    kind = kind_of(tasks, ctx.served) if tasks else output_kind(ctx.served)
    batch = fixed_batch(ctx.served) or 16
    classes = None
    if kind == "classifier":
        first = ctx.served.outputs[0].name
        scores = run_all(reference_open(0), dict(ctx.calib), batch, pad=fixed_batch(ctx.served) is not None)[first]
        classes = np.asarray(scores).reshape(sample_count(ctx.calib), -1).argmax(-1)
    data = search_data(ctx.calib, settings.calib_samples, classes)
    if kind == "classifier" and holdout_reference is not None:
        from edgekit.optimize.flip_risk import top1_margins

        held = np.asarray(holdout_reference[ctx.served.outputs[0].name])
        source = f"the {len(held)} held-out evaluation inputs (fp32 outputs)"
        data = dataclasses.replace(data, margins=top1_margins(held), margins_source=source)
    calib_batch = fixed_batch(served) or even_batch(sample_count(data.calib))
    plan = target.candidates(ctx)
    memory = None
    bound_gb = default_max_memory_gb() if settings.max_memory_gb is None else settings.max_memory_gb
    if math.isfinite(bound_gb):
        per_sample = {k: tuple(int(d) for d in np.asarray(v).shape[1:]) for k, v in ctx.calib.items()}
        arrays = (ctx.calib, data.calib, data.selection, holdout_reference, *also_held)
        memory = memory_model(
            ctx.model_path, per_sample, arrays, bound_bytes(bound_gb), batch, sample_count(data.calib)
        )
    result = search(
        plan,
        target=target.name,
        work_dir=ctx.work_dir / "candidates",
        data=data,
        served=served,
        reference=reference_open(0),  # held by search alone: it frees the session once it has its outputs
        reference_open=reference_open,
        kind=kind,
        tolerance=settings.tolerance,
        precision=ctx.precision,
        objective=settings.objective,
        mixed_precision=settings.mixed_precision,
        threads=settings.threads,
        calib_batch=calib_batch,
        latency_budget_s=settings.latency_budget_s,
        progress=ctx.progress,
        shared=shared,
        time_budget_s=settings.time_budget_s,
        device_latency=settings.device_profile.for_target(target.name) if settings.device_profile else None,
        tasks=tasks,
        post=settings.post,
        memory=memory,
    )
    return _finished(target, ctx, settings, result)


def build(target: Any, ctx: BuildContext, settings: EngineSettings | None = None) -> BuildResult:
    """``target``'s chosen candidate for ``ctx.precision``, finished into ``ctx.out_dir`` (the
    search with ``settings``, default ones: the default gate, selection on the calibration data)."""
    return optimize(target, ctx, settings).build


def _finished(target: Any, ctx: BuildContext, settings: EngineSettings, result: SearchResult) -> Optimized:
    built = target.finish(ctx, result.built, result.built_dir)
    notes = (*built.notes, *summary_notes(result))
    # the target's own steps describe how the chosen artifact was made; the last step is the choice
    provenance = (*built.provenance, choice_step(result, settings.tolerance))
    return Optimized(build=dataclasses.replace(built, notes=notes, provenance=provenance), search=result)


def fall_back(
    target: Any,
    ctx: BuildContext,
    previous: Optimized,
    failure: str,
    settings: EngineSettings | None = None,
    before_finish: Callable[[], None] | None = None,
) -> Optimized | None:
    """The next candidate of the fallback chain (``SearchResult.chain``, then ``pending``), finished
    into ``ctx.out_dir`` (``before_finish`` is called first, to empty it), after ``previous``'s
    chosen one failed the final gate with ``failure``; None when the chain is spent. The failed
    one is recorded as failed with that reason; a pending float candidate whose build raises is
    recorded as an error and the chain goes on."""
    settings = settings or EngineSettings()
    res = previous.search
    failed = dataclasses.replace(res.chosen, status="failed", reason=f"failed the final gate: {failure}")
    outcomes = [failed if o.status == "chosen" else o for o in res.outcomes]
    chain, pending = list(res.chain), list(res.pending)
    while chain or pending:
        if chain:
            name = chain.pop(0)
            found = next((o for o in outcomes if o.name == name), None)
            if found is None or name not in res.kept:
                continue
            built, folder = res.kept[name]
            nxt = found
        else:
            cand = pending.pop(0)
            if res.build_late is None:
                continue
            ctx.progress(f"[{target.name}] fallback: building {cand.name}")
            try:
                built, folder = res.build_late(cand)
            # a converter may raise anything; the chain goes on to the next float candidate
            except Exception as exc:
                why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]
                outcomes.append(_late_outcome(cand, "error", why))
                continue
            nxt = _late_outcome(cand, "passed", "")
            outcomes.append(nxt)
        why = f"{failed.name} failed the final gate on the held-out samples ({failure}); next in the fallback chain"
        chosen = dataclasses.replace(nxt, status="chosen")
        outcomes = [chosen if o is nxt else o for o in outcomes]
        base = res.baseline
        result = dataclasses.replace(
            res,
            chosen=chosen,
            built=built,
            built_dir=folder,
            why=why,
            outcomes=tuple(outcomes),
            slower_than_fp32=bool(
                base is not None
                and base.p50_ms is not None
                and chosen.p50_ms is not None
                and chosen.name != base.name
                and chosen.p50_ms > base.p50_ms
            ),
            notes=(*res.notes, f"final gate: {failed.name} failed ({failure}); fell back to {chosen.name}"),
            chain=tuple(chain),
            pending=tuple(pending),
            kept={**res.kept, chosen.name: (built, folder)},
        )
        if before_finish is not None:
            before_finish()
        return _finished(target, ctx, settings, result)
    return None


def _late_outcome(cand: Any, status: str, reason: str) -> Outcome:
    why = reason or "built after the final gate failed the candidates ahead of it (not measured on selection)"
    return dataclasses.replace(record_of(cand, why), status=status)


def summary_notes(result: SearchResult) -> tuple[str, ...]:
    """One line per candidate (``tried ...``), what was skipped and why, and the choice."""
    lines = list(result.notes)
    for o in result.outcomes:
        if o.status == "skipped":
            lines.append(f"skipped {o.name}: {o.reason}")
            continue
        speed = f", p50 {o.p50_ms:.3f} ms" if o.p50_ms is not None else ""
        acc = o.comparison.summary() if o.comparison is not None else ""
        verdict = "passed" if o.comparison is not None and o.comparison.passed else "failed: " + o.reason
        if o.comparison is None and o.status == "chosen":
            verdict = "built after the final gate failed the candidates ahead of it"
        lines.append(f"tried {o.name}: {acc}{speed} ({verdict})".replace(": ,", ":").replace(":  (", ": ("))
    lines.append(f"chose {result.chosen.name}: {result.why}")
    return tuple(lines)
