"""edgekit ``--precision auto`` (cpu and intel) side by side with what a user could do by hand with
one peer call each, on one model: ONNX Runtime FP32, OpenVINO FP32 (``convert_model``),
``nncf.quantize`` with defaults, and ORT ``quantize_static`` QDQ U8S8 per-channel.

Every side runs on the same held-out inputs; accuracy is judged against ORT FP32 under edgekit's
default gate for the output kind (classifier: top-1 agreement >= 98 %, dense: cosine >= 0.96 and
relative error <= 0.2), and p50 latency at batch 1 is measured with all sides interleaved in one
loop (runtime default threads, as the engine measured). The headline row is the faster edgekit
artifact against the fastest peer that meets the same gate (B / A latency: < 1 = edgekit faster).
Models: the digits example, two pretrained models the tests did not build (PP-OCR's
text-direction classifier and PP-OCRv4's text detector, shipped in the rapidocr-onnxruntime wheel),
and the user's own (``python -m bench --only engine --models MODEL.onnx:CALIB.npz:EVAL.npz,...``
or ``$EDGEKIT_BENCH_MODELS``; an ``EVAL.npz`` may hold a ``labels`` array; a missing file is a
"not measured here" row, not an error).

edgekit's artifacts are timed as the peers are: the artifact's device runtime called directly
(the agent's ``runner``), without the served-signature adapter the peers do not have either
(about 0.01 ms per call on a small model); accuracy is read through the served model, as the agent serves it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.registry import NOT_HERE, BenchContext, Measurement
from edgekit.errors import EdgekitError

PEERS = ("ort fp32", "ov fp32", "nncf int8 defaults", "ort qdq u8s8 per-channel")
DET_SIZE = 320


@dataclass
class _Side:
    label: str
    run: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None
    size_bytes: int | None = None
    note: str = ""
    passed: bool | None = None
    accuracy: str = ""
    timed: Callable[[dict[str, np.ndarray]], object] | None = None  # what is timed, when not ``run``


def run(ctx: BenchContext, *, name: str, model: str, paths: tuple[str, str, str] | None = None) -> list[Measurement]:
    try:
        path, calib, held_out, labels = load_model_data(model, paths)
    except EdgekitError as exc:
        ctx.progress(f"skipped: {exc}")
        return [Measurement(name, "edgekit auto vs best peer", "p50 latency, batch 1", "ms", "peer", "edgekit",
                            note=f"{NOT_HERE}: {exc}")]  # fmt: skip
    work = ctx.workdir / "engine" / name  # one folder per entry (user models share model="file")
    work.mkdir(parents=True, exist_ok=True)
    rows: list[Measurement] = []
    with contextlib.ExitStack() as stack:
        sides = _peers(ctx, path, calib, work)
        rows += _edgekit(ctx, stack, name, path, calib, held_out, labels, work, sides)
        rows += _compare(ctx, name, sides, held_out)
    return rows


def load_model_data(
    model: str, paths: tuple[str, str, str] | None = None
) -> tuple[Path, dict[str, np.ndarray], dict[str, np.ndarray], np.ndarray | None]:
    """(ONNX path, calibration arrays, held-out arrays, held-out labels or None). ``model="file"``:
    ``paths`` = (MODEL.onnx, CALIB.npz, EVAL.npz); raises ``EdgekitError`` naming a missing one."""
    if model == "file":
        return _files(paths)
    if model == "digits":
        from examples.digits import INPUT_NAME, load

        ex = load()
        with np.load(ex.calib) as data:
            calib = {k: data[k] for k in data.files}
        return ex.model, calib, {INPUT_NAME: ex.eval_inputs[:200]}, ex.eval_labels[:200]
    from examples.pretrained import find_pretrained, text_lines

    cls_path, _ = find_pretrained()
    if model == "ppocr-cls":
        lines, _ = text_lines(300, seed=0)
        held, held_labels = text_lines(200, seed=1)
        return cls_path, {"x": lines}, {"x": held}, held_labels
    if model == "ppocr-det":
        det = cls_path.parent / "ch_PP-OCRv4_det_infer.onnx"
        if not det.is_file():
            raise EdgekitError(f"{det} is not in the installed rapidocr-onnxruntime wheel")
        return det, {"x": text_pages(64, seed=0)}, {"x": text_pages(24, seed=1)}, None
    raise EdgekitError(f"unknown bench model {model!r}")


def _files(
    paths: tuple[str, str, str] | None,
) -> tuple[Path, dict[str, np.ndarray], dict[str, np.ndarray], np.ndarray | None]:
    from edgekit.validate.calib import LABELS_KEY, load_arrays

    if paths is None or len(paths) != 3:
        raise EdgekitError(f"a model file entry needs (MODEL.onnx, CALIB.npz, EVAL.npz), got {paths!r}")
    model, calib_path, eval_path = (Path(p) for p in paths)
    for what, p in (("model", model), ("calibration data", calib_path), ("evaluation data", eval_path)):
        if not p.is_file():
            raise EdgekitError(f"{what} {p} does not exist")
    calib = load_arrays(calib_path)
    calib.pop(LABELS_KEY, None)  # the calibration samples' labels: not a model input, not needed
    held = load_arrays(eval_path, "evaluation data")
    labels = held.pop(LABELS_KEY, None)
    return model, calib, held, labels


def text_pages(n: int, seed: int = 0) -> np.ndarray:
    """``n`` pages [n, 3, 320, 320] of dark text lines (digits) on light paper, ImageNet-normalised
    as PP-OCR's detector preprocesses them."""
    from examples.pretrained import text_lines

    rng = np.random.default_rng(seed)
    lines, _ = text_lines(n * 5, seed=seed + 100)
    pages = np.ones((n, 3, DET_SIZE, DET_SIZE), np.float32) * rng.uniform(0.85, 1.0, (n, 1, 1, 1)).astype(np.float32)
    for i in range(n):
        for k in range(5):
            line = (lines[i * 5 + k, 0] * 0.5 + 0.5)[:, :190]  # back to [0, 1] gray
            top, left = 16 + k * 60, int(rng.integers(0, DET_SIZE - 192))
            crop = pages[i, :, top : top + 48, left : left + line.shape[1]]
            pages[i, :, top : top + 48, left : left + line.shape[1]] = np.minimum(crop, line[None])
    mean = np.array([0.485, 0.456, 0.406], np.float32)[None, :, None, None]
    std = np.array([0.229, 0.224, 0.225], np.float32)[None, :, None, None]
    return (pages - mean) / std


def _peers(ctx: BenchContext, path: Path, calib: dict[str, np.ndarray], work: Path) -> dict[str, _Side]:
    import onnxruntime as ort

    sides: dict[str, _Side] = {}

    def ort_side(label: str, model: Path) -> _Side:
        session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        return _Side(label, lambda f: dict(zip(names, session.run(names, f), strict=True)), model.stat().st_size)

    sides["ort fp32"] = ort_side("ort fp32", path)
    try:
        import nncf
        import openvino as ov

        core = ov.Core()
        ctx.progress(f"{path.name}: peers openvino fp32, nncf.quantize defaults")
        fp32 = ov.convert_model(str(path))
        ov.save_model(fp32, str(work / "ov.xml"))
        sides["ov fp32"] = _ov_side("ov fp32", core, work / "ov.xml")
        data = nncf.Dataset(
            [{k: v[i : i + 1] for k, v in calib.items()} for i in range(len(next(iter(calib.values()))))]
        )
        ov.save_model(nncf.quantize(ov.convert_model(str(path)), data), str(work / "nncf.xml"))
        sides["nncf int8 defaults"] = _ov_side("nncf int8 defaults", core, work / "nncf.xml")
    except ImportError as exc:
        for label in ("ov fp32", "nncf int8 defaults"):
            sides[label] = _Side(label, note=f"{NOT_HERE}: {exc}")
    ctx.progress(f"{path.name}: peer ort quantize_static qdq u8s8 per-channel")
    try:
        from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

        class Reader(CalibrationDataReader):  # type: ignore[misc]  # ORT ships no type stubs
            def __init__(self) -> None:
                n = len(next(iter(calib.values())))
                self.it = iter([{k: v[i : i + 1] for k, v in calib.items()} for i in range(n)])

            def get_next(self) -> dict[str, np.ndarray] | None:
                return next(self.it, None)

        out = work / "ort-qdq.onnx"
        quantize_static(str(path), str(out), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)  # fmt: skip
        sides["ort qdq u8s8 per-channel"] = ort_side("ort qdq u8s8 per-channel", out)
    # a peer recipe that raises is what a user would see: reported, not fatal
    except Exception as exc:
        sides["ort qdq u8s8 per-channel"] = _Side(
            "ort qdq u8s8 per-channel", note=f"failed: {type(exc).__name__}: {exc}"[:200]
        )
    return sides


def _ov_side(label: str, core: Any, xml: Path) -> _Side:
    compiled = core.compile_model(core.read_model(str(xml)), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    request = compiled.create_infer_request()
    names = [p.get_any_name() for p in compiled.outputs]

    def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        result = request.infer(feed)
        return {n: np.array(result[p]) for n, p in zip(names, compiled.outputs, strict=True)}

    size = xml.stat().st_size + xml.with_suffix(".bin").stat().st_size
    return _Side(label, run, size)


def _edgekit(
    ctx: BenchContext,
    stack: contextlib.ExitStack[bool | None],
    name: str,
    path: Path,
    calib: dict[str, np.ndarray],
    held_out: dict[str, np.ndarray],
    labels: np.ndarray | None,
    work: Path,
    sides: dict[str, _Side],
) -> list[Measurement]:
    import edgekit
    from bench.bundles import served_bundle

    t0 = time.perf_counter()
    result = edgekit.package(
        path, targets=["cpu", "intel"], precision="auto", calib=calib, eval=held_out, labels=labels,
        key=ctx.key, name=name.replace(".", "-"), out_dir=work / "out", overwrite=True, allow_failed=True,
        progress=ctx.progress,
    )  # fmt: skip
    elapsed = time.perf_counter() - t0
    rows = [Measurement(name, "edgekit auto cpu+intel", "search time", "s", "edgekit", "edgekit", elapsed, elapsed,
                        "one package call, both targets, this host")]  # fmt: skip
    for target, bundle in result.bundles.items():
        m = result.manifests[target]
        label = f"edgekit {target} auto ({m.candidates.chosen if m.candidates else m.precision.method})"
        served = stack.enter_context(served_bundle(bundle, ctx.pub, work / f"x-{target}"))
        # the runtime directly where the artifact takes the served tensors as they are (cpu, intel)
        direct = not m.mapping and m.artifact_signature == m.signature
        timed = served.runner.run if direct else None
        sides[f"edgekit {target}"] = _Side(label, served.infer, m.validation.size_bytes, timed=timed)
    return rows


def _compare(ctx: BenchContext, name: str, sides: dict[str, _Side], held: dict[str, np.ndarray]) -> list[Measurement]:
    from edgekit.bundle.manifest import Signature, TensorSpec
    from edgekit.validate.latency import call_with, stats_side_by_side
    from edgekit.validate.metrics import compare, output_kind, run_all

    base = sides["ort fp32"]
    if base.run is None:
        raise ValueError("the ort fp32 side is always built")
    reference = run_all(base.run, held, 8)
    first = next(iter(reference.values()))
    kind = output_kind(Signature(inputs=(), outputs=(TensorSpec("o", "float32", tuple(first.shape)),)))
    from edgekit.bundle.manifest import Tolerance

    for s in sides.values():
        if s.run is None:
            continue
        out = run_all(s.run, held, 8)
        out = {k: out[k] if k in out else next(iter(out.values())) for k in reference}
        c = compare(reference, out, kind, Tolerance())
        s.passed, s.accuracy = c.passed, c.summary()
    runnable = {k: s for k, s in sides.items() if s.run is not None}
    one = {k: v[:1] for k, v in held.items()}
    ctx.progress(f"{name}: p50 latency, batch 1, {', '.join(runnable)} interleaved")
    stats = stats_side_by_side(
        {k: call_with(s.timed or s.run, one) for k, s in runnable.items() if s.run is not None},
        repeats=ctx.repeats, budget_s=ctx.budget_s * 2, warmup=3, discard=1,
    )  # fmt: skip
    rows = []
    fp32 = stats["ort fp32"].p50_ms
    for key, s in sides.items():
        if key == "ort fp32":
            continue
        st = stats.get(key)
        note = f"{s.accuracy} ({'meets' if s.passed else 'misses'} the gate)" if s.run is not None else s.note
        if st is not None:
            note += f"; p90 {st.p90_ms:.3f} ms, IQR {st.iqr_ms:.3f} ms"
        rows.append(Measurement(name, f"{s.label} vs ort fp32", "p50 latency, batch 1", "ms", "ort fp32", s.label,
                                fp32, None if st is None else st.p50_ms, note))  # fmt: skip
        if s.size_bytes:
            rows.append(Measurement(name, f"{s.label} vs ort fp32", "artifact size", "bytes", "ort fp32", s.label,
                                    base.size_bytes, s.size_bytes))  # fmt: skip
    peers = [k for k in PEERS if k in stats and sides[k].passed]
    ours = [k for k in ("edgekit cpu", "edgekit intel") if k in stats]
    if peers and ours:
        best_peer = min(peers, key=lambda k: stats[k].p50_ms)
        best_ours = min(ours, key=lambda k: stats[k].p50_ms)
        rows.append(Measurement(
            name, "edgekit auto (better target) vs fastest peer meeting the gate", "p50 latency, batch 1", "ms",
            sides[best_peer].label, sides[best_ours].label, stats[best_peer].p50_ms, stats[best_ours].p50_ms,
            f"< 1 = edgekit faster; edgekit {'meets' if sides[best_ours].passed else 'MISSES'} the gate",
        ))  # fmt: skip
    return rows
