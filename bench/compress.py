"""Compression on the digits example: pruning, distillation and low-rank, alone and with INT8.

Each technique runs through ``edgekit.compress.steps.compress`` (the ``edgekit compress`` path)
on the example, fine-tuned by distillation from the original on the training split that
``examples/digits/train.py`` uses (scikit-learn's digits; the held-out split is never trained
on); pruning and low-rank also without fine-tuning (no training data: the cut alone), for the
drop that fine-tuning recovers. Each result, and the original, is then packaged for the cpu target at INT8 by
``edgekit.package`` (the engine's own search) and opened through the device runtime. Measured:
file size, held-out top-1, and p50 latency at batch 1 with every model interleaved in one loop
(ONNX Runtime on this host).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.bundles import served_bundle
from bench.registry import BenchContext, Measurement
from edgekit.errors import EdgekitError

TECHNIQUES = (
    ("pruned 50%", "prune-channels=0.5"),
    ("student (width 0.35)", "distill=width=0.35"),
    ("low-rank 50%", "low-rank=0.5"),
)
# the same cuts with no training data: the drop fine-tuning recovers (no INT8 side)
UNTUNED = (
    ("pruned 50%, before fine-tuning", "prune-channels=0.5"),
    ("low-rank 50%, before fine-tuning", "low-rank=0.5"),
)


@dataclass
class _Side:
    label: str
    size_bytes: int
    top1: float
    infer: Callable[[np.ndarray], object]


def _onnx_side(label: str, path: Path, images: np.ndarray, labels: np.ndarray) -> _Side:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    scores = session.run(None, {name: images})[0]
    return _Side(
        label, path.stat().st_size, float((scores.argmax(1) == labels).mean()), lambda x: session.run(None, {name: x})
    )


def _int8_side(
    ctx: BenchContext,
    stack: contextlib.ExitStack[bool | None],
    label: str,
    model: Path,
    calib: Path,
    images: np.ndarray,
    labels: np.ndarray,
) -> _Side | str:
    import edgekit
    from examples.digits import INPUT_NAME

    out = ctx.workdir / "compress" / label.replace(" ", "_").replace("%", "").replace("(", "").replace(")", "")
    try:
        result = edgekit.package(
            model,
            targets=["cpu"],
            precision="int8",
            calib=calib,
            eval={INPUT_NAME: images},
            labels=labels,
            key=ctx.key,
            name="digits",
            version=1,
            out_dir=out,
            allow_failed=True,
        )
        served = stack.enter_context(served_bundle(result.bundles["cpu"], ctx.pub, out / "extracted"))
    except EdgekitError as exc:
        return f"{label}: not packaged ({exc})"
    name = served.inputs[0].name
    scores = served.infer({name: images})[served.outputs[0].name]
    size = result.manifests["cpu"].validation.size_bytes
    return _Side(label, size, float((np.asarray(scores).argmax(1) == labels).mean()), lambda x: served.infer({name: x}))


def run(ctx: BenchContext, *, name: str) -> list[Measurement]:
    from edgekit.compress.steps import Data, compress, parse_step
    from edgekit.compress.training import TrainSettings
    from edgekit.validate.latency import stats_side_by_side
    from examples.digits import INPUT_NAME, load
    from examples.digits.train import TrainConfig, prepare_data

    example = load()
    split = prepare_data(TrainConfig())
    images, labels = example.eval_inputs, example.eval_labels
    data = Data(
        eval={INPUT_NAME: images}, eval_labels=labels, train={INPUT_NAME: split.train_x}, train_labels=split.train_y
    )
    rows: list[Measurement] = []
    with contextlib.ExitStack() as stack:
        sides: dict[str, _Side] = {"fp32": _onnx_side("fp32", example.model, images, labels)}
        notes: list[str] = []
        int8 = _int8_side(ctx, stack, "int8", example.model, example.calib, images, labels)
        if isinstance(int8, str):
            notes.append(int8)
        else:
            sides["int8"] = int8
        for label, step in TECHNIQUES:
            ctx.progress(f"{name}: {label}")
            path = ctx.workdir / "compress" / f"{step.replace('=', '_')}.onnx"
            compress(example.model, [parse_step(step)], path, data, settings=TrainSettings(epochs=12, lr=2e-3))
            sides[label] = _onnx_side(label, path, images, labels)
            quantized = _int8_side(ctx, stack, f"{label} + int8", path, example.calib, images, labels)
            if isinstance(quantized, str):
                notes.append(quantized)
            else:
                sides[quantized.label] = quantized
        untuned = Data(eval={INPUT_NAME: images}, eval_labels=labels)
        for label, step in UNTUNED:
            ctx.progress(f"{name}: {label}")
            path = ctx.workdir / "compress" / f"{step.replace('=', '_')}-untuned.onnx"
            compress(example.model, [parse_step(step)], path, untuned)
            sides[label] = _onnx_side(label, path, images, labels)
        one = images[:1]
        stats = stats_side_by_side(
            {k: (lambda s=s: s.infer(one)) for k, s in sides.items()}, repeats=ctx.repeats, budget_s=ctx.budget_s
        )
        base = sides["fp32"]
        for key, side in sides.items():
            if key == "fp32":
                continue
            against = [base] + ([sides["int8"]] if key.endswith("+ int8") and "int8" in sides else [])
            for ref in against:
                case = f"{side.label} vs {ref.label}"
                rows.append(
                    Measurement(
                        name,
                        case,
                        "size",
                        "bytes",
                        ref.label,
                        side.label,
                        float(ref.size_bytes),
                        float(side.size_bytes),
                    )
                )
                rows.append(
                    Measurement(
                        name,
                        case,
                        "p50 latency, batch 1",
                        "ms",
                        ref.label,
                        side.label,
                        stats[_key(sides, ref)].p50_ms,
                        stats[key].p50_ms,
                        note="ONNX Runtime on this host, every model interleaved in one loop",
                        a_spread=(stats[_key(sides, ref)].p25_ms, stats[_key(sides, ref)].p75_ms),
                        b_spread=(stats[key].p25_ms, stats[key].p75_ms),
                    )
                )
                rows.append(
                    Measurement(
                        name,
                        case,
                        "held-out top-1",
                        "%",
                        ref.label,
                        side.label,
                        100 * ref.top1,
                        100 * side.top1,
                        note="450 held-out digits; top-1 drop = A - B",
                    )
                )
        for note in notes:
            rows.append(Measurement(name, "int8", "all", "", "fp32", "int8", note=note))
    return rows


def _key(sides: dict[str, _Side], side: _Side) -> str:
    return next(k for k, s in sides.items() if s is side)
