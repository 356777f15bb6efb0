"""``prepare.shape-fold``: the intel target's OpenVINO FP32 IR of a U-Net-like torch export whose
upsampling sizes are computed at run time, converted from the graph as exported (A) and from the
graph preparation folded (``edgekit.compress.shape_fold``, B).

Both IRs are converted the way the intel target converts (``convert_onnx``, saved as FP32 IR) and
compiled the way the device runtime compiles them (``ov_open``, ``INFERENCE_PRECISION_HINT`` f32,
one thread: another process on a shared machine moves both sides less), then timed interleaved at
1x3x256x256. The rows also count the IRs' ``ShapeOf`` nodes and check the two agree.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.registry import NOT_HERE, BenchContext, BenchError, Measurement
from edgekit.optimize.candidates import RunFn

SIZE = 256
CHANNELS = 16
THREADS = 1


def run(ctx: BenchContext, *, name: str) -> list[Measurement]:
    import importlib.util

    case, metric = "folded vs unfolded, openvino fp32 ir", f"p50 latency, 1x3x{SIZE}x{SIZE}, {THREADS} thread"
    if importlib.util.find_spec("openvino") is None or importlib.util.find_spec("torch") is None:
        why = f"{NOT_HERE}: needs openvino and torch (pip install 'edgekit[openvino]' torch)"
        return [Measurement(name, case, metric, "ms", "unfolded", "folded", note=why)]
    from edgekit.compress.onnx_prep import prepare_model
    from edgekit.optimize.openvino_candidates import convert_onnx, import_openvino, ov_open
    from edgekit.validate.latency import stats_side_by_side
    from tests.factories import tiny_unet  # the test suite's model, at bench size

    work = ctx.workdir / "shape-fold"
    source = tiny_unet(work / "unet.onnx", size=SIZE, channels=CHANNELS)
    prepared = prepare_model(source, work / "prepared", ctx.progress)
    if prepared.graph_path is None or prepared.graph_path == source:
        raise BenchError(f"{name}: preparation did not fold the U-Net ({'; '.join(prepared.steps)})")
    ov = import_openvino()
    sides: dict[str, Path] = {"unfolded": source, "folded": prepared.graph_path}
    shape_of: dict[str, int] = {}
    runs: dict[str, RunFn] = {}
    for label, onnx_path in sides.items():
        model = convert_onnx(ov, onnx_path)
        shape_of[label] = sum(1 for op in model.get_ordered_ops() if op.get_type_name() == "ShapeOf")
        xml = work / label / "model.xml"
        xml.parent.mkdir(parents=True, exist_ok=True)
        ov.save_model(model, str(xml), compress_to_fp16=False)
        runs[label] = ov_open(xml, "CPU", "f32")(THREADS)
    x = {"image": np.random.default_rng(0).standard_normal((1, 3, SIZE, SIZE)).astype(np.float32)}
    a, b = runs["unfolded"](x)["mask"], runs["folded"](x)["mask"]
    diff = float(np.max(np.abs(a - b)))
    if diff > 1e-4:
        raise BenchError(f"{name}: the folded IR's output differs from the unfolded one's by {diff:.3g}")
    ctx.progress(f"{name}: openvino fp32 ir unfolded vs folded, interleaved")
    stats = stats_side_by_side(
        {label: _bound(fn, x) for label, fn in runs.items()},
        repeats=ctx.repeats,
        budget_s=ctx.budget_s,
        warmup=3,
    )
    base, folded = stats["unfolded"], stats["folded"]
    note = (
        f"IR ShapeOf nodes {shape_of['unfolded']} -> {shape_of['folded']}; outputs max abs diff {diff:.2g}; "
        f"median over interleaved blocks (<= {ctx.repeats} rounds); spread p25-p75"
    )
    return [
        Measurement(
            name, case, metric, "ms", "unfolded", "folded", base.p50_ms, folded.p50_ms, note,
            a_spread=(base.p25_ms, base.p75_ms), b_spread=(folded.p25_ms, folded.p75_ms),
        )
    ]  # fmt: skip


def _bound(fn: RunFn, x: dict[str, np.ndarray]) -> Callable[[], object]:
    return lambda: fn(x)
