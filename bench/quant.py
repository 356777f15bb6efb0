"""INT8 (and FP16) vs FP32 on the digits example, for one target.

Each precision is packaged by ``edgekit.package`` (the same path users take) and the bundles are
opened through the device runtime (verify, extract, ``device_agents.runtimes.load_model``).
Measured: artifact size, held-out top-1 of each, and p50 latency at batch 1 and 32 with all
precisions interleaved in one loop. The FP32 side is the target's own FP32 bundle where the
target builds one, else the FP32 source model under ONNX Runtime. Where the target's runtime
cannot run here, top-1 comes from the packager's validation (through the target's intermediate)
and latency is "not measured here".
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from bench.bundles import served_bundle, static_batch, top1
from bench.registry import NOT_HERE, BenchContext, Measurement
from edgekit.errors import EdgekitError

if TYPE_CHECKING:
    from examples.digits import DigitsExample

CANDIDATES = ("int8", "fp16")  # what each is compared with FP32 by default (the entry may list others)
BATCHES = (1, 32)


@dataclass
class _Side:
    label: str  # "fp32", "int8", "fp16", "fp32 source (onnxruntime)"
    size_bytes: int
    top1: float | None = None
    top1_note: str = ""
    infer: Callable[[np.ndarray], object] | None = None  # None: cannot run here
    why_not: str = ""
    batch: int | None = None  # fixed batch size, None = dynamic


def run(ctx: BenchContext, *, name: str, target: str, candidates: tuple[str, ...] = CANDIDATES) -> list[Measurement]:
    from edgekit.targets import TARGETS
    from examples.digits import load

    module, cls = TARGETS[target].split(":")
    try:
        target_cls = getattr(importlib.import_module(module), cls)
    except ImportError as exc:
        note = f"{NOT_HERE}: no {target} target in this checkout ({exc})"
        return [Measurement(name, "int8 vs fp32", "all", "", "fp32", "int8", note=note)]
    example = load()
    builds = [p for p in candidates if p in target_cls.precisions]
    if not builds:
        note = f"{NOT_HERE}: {target} builds {', '.join(target_cls.precisions)}"
        return [Measurement(name, "int8 vs fp32", "all", "", "fp32", "int8", note=note)]
    precisions = (["fp32"] if "fp32" in target_cls.precisions else []) + builds
    rows: list[Measurement] = []
    with contextlib.ExitStack() as stack:
        sides: dict[str, _Side] = {}
        if "fp32" not in precisions:
            sides["fp32"] = _source_side(example)
        for precision in precisions:
            ctx.progress(f"{name}: packaging {precision}")
            sides[precision] = _bundle_side(ctx, stack, target, precision, example)
        base = sides["fp32"]
        for precision in builds:
            rows += _compare(name, base, sides[precision])
        rows += _latency(ctx, name, base, [sides[p] for p in builds], example.eval_inputs)
    return rows


def _source_side(example: DigitsExample) -> _Side:
    import onnxruntime as ort

    from examples.digits import INPUT_NAME

    session = ort.InferenceSession(str(example.model), providers=["CPUExecutionProvider"])
    scores = session.run(None, {INPUT_NAME: example.eval_inputs})[0]
    return _Side(
        label="fp32 source (onnxruntime)",
        size_bytes=example.model.stat().st_size,
        top1=float((scores.argmax(1) == example.eval_labels).mean()),
        infer=lambda x: session.run(None, {INPUT_NAME: x}),
    )


def _bundle_side(
    ctx: BenchContext, stack: contextlib.ExitStack[bool | None], target: str, precision: str, example: DigitsExample
) -> _Side:
    import edgekit
    from examples.digits import INPUT_NAME

    out = ctx.workdir / "quant" / target / precision
    result = edgekit.package(
        example.model,
        targets=[target],
        precision=precision,
        calib=example.calib,
        eval={INPUT_NAME: example.eval_inputs},
        labels=example.eval_labels,
        key=ctx.key,
        name="digits",
        version=1,
        out_dir=out,
        allow_failed=True,  # measure it even if it misses the gate; the note says so
    )
    manifest = result.manifests[target]
    v = manifest.validation
    side = _Side(label=precision, size_bytes=v.size_bytes, top1=v.top1_accuracy)
    side.top1_note = f"packager validation ({v.measured_on})" + ("" if v.passed else ", FAILED the gate")
    try:
        served = stack.enter_context(served_bundle(result.bundles[target], ctx.pub, out / "extracted"))
    except EdgekitError as exc:
        side.why_not = f"{NOT_HERE}: {manifest.compatibility.runtime} ({exc})"
        return side
    side.top1 = top1(served, example.eval_inputs, example.eval_labels)
    side.top1_note = f"{served.runner.describe().get('runtime', '')} runtime on this host" + (
        "" if v.passed else ", FAILED the gate"
    )
    side.batch = static_batch(served)
    name = served.inputs[0].name
    side.infer = lambda x: served.infer({name: x})
    return side


def _compare(name: str, a: _Side, b: _Side) -> list[Measurement]:
    case = f"{b.label} vs {a.label}"
    if a.top1_note == b.top1_note:
        notes = f"both: {a.top1_note}" if a.top1_note else ""
    else:
        notes = "; ".join(n for n in (a.top1_note and f"A: {a.top1_note}", b.top1_note and f"B: {b.top1_note}") if n)
    return [
        Measurement(name, case, "artifact size", "bytes", a.label, b.label, a.size_bytes, b.size_bytes),
        Measurement(
            name, case, "held-out top-1", "%", a.label, b.label,
            None if a.top1 is None else a.top1 * 100, None if b.top1 is None else b.top1 * 100, notes,
        ),
    ]  # fmt: skip


def _latency(ctx: BenchContext, name: str, base: _Side, others: list[_Side], images: np.ndarray) -> list[Measurement]:
    from edgekit.validate.latency import LatencyStats, stats_side_by_side

    rows = []
    runnable = [s for s in (base, *others) if s.infer is not None]
    for batch in BATCHES:
        usable = [s for s in runnable if s.batch in (None, batch)]
        p50: dict[str, LatencyStats] = {}
        if base in usable and len(usable) > 1:
            x = np.ascontiguousarray(images[:batch])
            ctx.progress(f"{name}: p50 latency at batch {batch}, {', '.join(s.label for s in usable)} interleaved")
            p50 = stats_side_by_side(
                {s.label: _bound(s, x) for s in usable}, repeats=ctx.repeats, budget_s=ctx.budget_s, warmup=3
            )
        for other in others:
            metric = f"p50 latency, batch {batch}"
            case = f"{other.label} vs {base.label}"
            if base.label in p50 and other.label in p50:
                note = f"median over interleaved blocks (<= {ctx.repeats} rounds); spread p25-p75"
                a, b = p50[base.label], p50[other.label]
                rows.append(
                    Measurement(
                        name, case, metric, "ms", base.label, other.label, a.p50_ms, b.p50_ms, note,
                        a_spread=(a.p25_ms, a.p75_ms), b_spread=(b.p25_ms, b.p75_ms),
                    )
                )  # fmt: skip
            else:
                fixed = other.label if other.batch not in (None, batch) else base.label
                only = other.batch or base.batch
                why = other.why_not or base.why_not or f"not measured: {fixed} takes batch {only} only"
                rows.append(Measurement(name, case, metric, "ms", base.label, other.label, note=why))
    return rows


def _bound(side: _Side, x: np.ndarray) -> Callable[[], object]:
    infer = side.infer
    if infer is None:
        raise ValueError(f"{side.label} cannot run here")
    return lambda: infer(x)
