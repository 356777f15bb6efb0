"""Prepare a source ONNX model once for every target: load and check it, upgrade the opset to
13+, infer shapes, fold shape sub-graphs (``edgekit.compress.shape_fold``), apply ONNX Runtime's
basic graph optimisation, and read the served signature.

The prepared model is numerically the FP32 source model; targets build from it. The served
signature is always read from the *source* model (names, dtypes, output order, dynamic axes).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.bundle.manifest import Dim, Signature, SourceModel, sha256_file
from edgekit.compress.signature import served_signature
from edgekit.errors import ConfigError, ModelFormatError

# Per-channel QDQ needs DequantizeLinear's ``axis`` attribute, which ONNX added in opset 13.
MIN_OPSET = 13


@dataclass(frozen=True)
class PreparedModel:
    path: Path  # prepared FP32 model: opset >= MIN_OPSET, shapes inferred, basic-optimised
    source_path: Path
    source: SourceModel
    served: Signature
    opset: int  # default-domain opset of the prepared model
    steps: tuple[str, ...]  # what preparation did, in order (for the manifest notes)
    # The graph as given with only its shape sub-graphs folded (no fusion, no ORT optimisation), for
    # toolchains that want the exported graph (OpenVINO / NNCF); the source file where nothing was folded.
    graph_path: Path | None = None


def load_onnx(path: Path) -> Any:
    """Load and check an ONNX model; anything else raises ``ModelFormatError`` saying what to do."""
    import onnx
    from google.protobuf.message import DecodeError

    path = Path(path)
    if path.is_dir():
        found = ", ".join(sorted(str(p) for p in path.rglob("*.onnx"))[:5]) or "no .onnx file"
        raise ModelFormatError(f"model {path} is a folder, not an ONNX file; it holds {found}")
    if not path.is_file():
        raise ModelFormatError(f"model {path} does not exist")
    with open(path, "rb") as f:
        head = f.read(64)
    if head.startswith(b"version https://git-lfs"):
        raise ModelFormatError(
            f"{path} is a git-LFS pointer, not the model itself; fetch it with `git lfs pull` (or download the file)"
        )
    try:
        model = onnx.load(str(path))
    except (DecodeError, ValueError, RuntimeError, OSError) as exc:
        if _looks_like_protobuf(head):
            raise ModelFormatError(
                f"{path} ({path.stat().st_size} bytes) starts like an ONNX model but cannot be read to the end: "
                "truncated or corrupt; copy or export it again"
            ) from exc
        raise ModelFormatError(
            f"{path} is not an ONNX model ({type(exc).__name__}: {exc}); export it to ONNX first "
            "(torch.onnx.export, tf2onnx, ...)"
        ) from exc
    if not model.graph.node or not model.graph.output:
        raise ModelFormatError(
            f"{path} is not an ONNX model (no graph nodes or outputs were read); export it to ONNX first"
        )
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelFormatError(f"{path} is not a valid ONNX model: {first}") from exc
    return model


def default_opset(model: Any) -> int:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return int(imp.version)
    raise ModelFormatError("model imports no default-domain (ai.onnx) opset")


def _looks_like_protobuf(head: bytes) -> bool:
    # An ONNX ModelProto opens with field 1 (ir_version, varint: 0x08) or, from some exporters,
    # field 7 (graph, length-delimited: 0x3A) or 2/3 (producer strings: 0x12 / 0x1A).
    return bool(head) and head[0] in (0x08, 0x12, 0x1A, 0x3A)


def prepare_model(
    source_path: Path,
    work_dir: Path,
    progress: Callable[[str], None] | None = None,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
) -> PreparedModel:
    """Load ``source_path`` and write the prepared FP32 model into ``work_dir``.

    ``input_shapes`` (``--input-shape``) size the dynamic non-batch axes the shape folding is
    checked with; without them such a model is prepared unfolded (the steps say so)."""
    import onnx

    from edgekit.compress.shape_fold import fold_shapes

    say = progress or (lambda _msg: None)
    source_path = Path(source_path)
    model = load_onnx(source_path)
    steps: list[str] = []
    served = served_signature(model)
    src_opset = default_opset(model)
    source = SourceModel(
        sha256=sha256_file(source_path),
        filename=source_path.name,
        opset=src_opset,
        producer=" ".join(p for p in (model.producer_name, model.producer_version) if p),
    )
    work_dir.mkdir(parents=True, exist_ok=True)
    if src_opset < MIN_OPSET:
        say(f"upgrading opset {src_opset} -> {MIN_OPSET}")
        model = upgrade_opset(model, MIN_OPSET)
        steps.append(f"opset {src_opset}->{MIN_OPSET}")
    try:
        model = onnx.shape_inference.infer_shapes(model, strict_mode=False)
        steps.append("onnx shape inference")
    except onnx.shape_inference.InferenceError as exc:
        say(f"ONNX shape inference failed ({exc}); continuing with declared shapes")
    clamped = clamp_mask_sentinels(model)
    if clamped:
        note = f"{clamped} mask constant(s) of +-3.4e38 written as +-{MASK_SENTINEL:g} (float16 range)"
        say(note)
        steps.append(note)
    staged = work_dir / "staged.onnx"
    onnx.save(model, str(staged))
    folded = fold_shapes(staged, work_dir / "folded.onnx", served, input_shapes)
    if folded.note:
        say(folded.note)
        steps.append(folded.note)
    prepared = work_dir / "prepared.onnx"
    steps.extend(_ort_preprocess(folded.path, prepared, say))
    final = load_onnx(prepared)
    return PreparedModel(
        path=prepared,
        source_path=source_path,
        source=source,
        served=served,
        opset=default_opset(final),
        steps=tuple(steps),
        graph_path=folded.path if folded.folded else source_path,
    )


# what an additive attention mask's "minus infinity" becomes: BERT's own -10000, which float16
# holds (65504 is its largest value) and which still gives a softmax weight of exactly 0
MASK_SENTINEL = 1e4
_SENTINEL_ABOVE = 1e30  # constants this large are "infinity" stand-ins (torch.finfo(float32).min)
_MASK_CONSUMERS = ("Mul", "Add", "Sub", "Where")


def clamp_mask_sentinels(model: Any) -> int:
    """Write float constants of magnitude >= 1e30 (exporters' ``finfo(float32).min`` for masked
    attention) that only masking arithmetic reads (Mul, Add, Sub, Where) as +-``MASK_SENTINEL``;
    returns how many tensors changed. In float16 (TensorRT FP16, Core ML, LiteRT float16) -3.4e38
    is -inf, ``0 * -inf`` is NaN and every output of a BERT-class encoder was NaN; in float32 the
    outputs are the same (``exp(-1e4)`` is 0). In place."""
    from onnx import TensorProto, numpy_helper

    graph = model.graph
    consumers: dict[str, set[str]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, set()).add(node.op_type)

    def clamp(array: np.ndarray) -> np.ndarray | None:
        if array.dtype != np.float32 or array.size > 64 or not np.any(np.abs(array) >= _SENTINEL_ABOVE):
            return None
        return np.where(np.abs(array) >= _SENTINEL_ABOVE, np.sign(array) * MASK_SENTINEL, array).astype(np.float32)

    changed = 0
    for init in graph.initializer:
        uses = consumers.get(init.name, set())
        if init.data_type != TensorProto.FLOAT or not uses or not uses <= set(_MASK_CONSUMERS):
            continue
        new = clamp(numpy_helper.to_array(init))
        if new is not None:
            init.CopyFrom(numpy_helper.from_array(new, init.name))
            changed += 1
    from edgekit.compress.onnx_nodes import constant_nodes

    for node, tensor in constant_nodes(graph):
        uses = consumers.get(node.output[0], set())
        if not uses or not uses <= set(_MASK_CONSUMERS):
            continue
        new = clamp(numpy_helper.to_array(tensor))
        if new is not None:
            tensor.CopyFrom(numpy_helper.from_array(new, tensor.name))
            changed += 1
    return changed


def model_size_bytes(path: Path) -> int:
    """Bytes of an ONNX model on disk: the model file plus the external-data files its
    initializers reference (the ``size vs fp32`` baseline)."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    locations = {ExternalDataInfo(t).location for t in model.graph.initializer if uses_external_data(t)}
    return path.stat().st_size + sum(
        (path.parent / loc).stat().st_size for loc in sorted(locations) if (path.parent / loc).is_file()
    )


def upgrade_opset(model: Any, opset: int) -> Any:
    import onnx
    from onnx import version_converter

    try:
        upgraded = version_converter.convert_version(model, opset)
        onnx.checker.check_model(upgraded)
    except (RuntimeError, ValueError, IndexError, onnx.checker.ValidationError) as exc:
        raise ModelFormatError(
            f"cannot upgrade the model from opset {default_opset(model)} to {opset} ({exc}); "
            f"re-export it with opset {opset} or newer"
        ) from exc
    return upgraded


def _ort_preprocess(src: Path, dst: Path, say: Callable[[str], None]) -> list[str]:
    """ORT's quant_pre_process: basic graph optimisation, plus symbolic shape inference where
    ONNX shape inference left tensors without a shape (importing it loads torch when installed,
    seconds that most CNNs do not need). Falls back without the symbolic pass, which asserts on
    some real opset-11 graphs (on a Concat's axis), then without optimisation."""
    import onnx
    from onnxruntime.quantization.shape_inference import quant_pre_process

    unshaped = _unshaped_tensors(onnx.load(str(src)))
    if unshaped:
        try:
            quant_pre_process(str(src), str(dst), skip_symbolic_shape=False)
            return ["ort basic optimisation", f"symbolic shape inference ({len(unshaped)} tensors lacked shapes)"]
        except Exception as exc:  # symbolic shape inference raises bare Exception/AssertionError: retry without it
            say(f"symbolic shape inference failed ({type(exc).__name__}: {exc}); retrying without it")
    try:
        quant_pre_process(str(src), str(dst), skip_symbolic_shape=True)
        return ["ort basic optimisation"] + (["symbolic shape inference failed; skipped"] if unshaped else [])
    except Exception as exc:  # ORT's optimiser raises Fail/RuntimeError types it does not export
        say(f"ORT graph optimisation failed ({type(exc).__name__}: {exc}); using the model unoptimised")
    shutil.copyfile(src, dst)
    return ["ort optimisation skipped"]


def _unshaped_tensors(model: Any) -> list[str]:
    """Node outputs of the main graph that shape inference gave no rank."""
    shaped = {
        vi.name
        for vi in (*model.graph.value_info, *model.graph.output)
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape")
    }
    return [o for n in model.graph.node for o in n.output if o and o not in shaped]


def resolve_static_shapes(
    served: Signature,
    calib: Mapping[str, np.ndarray],
    given: Mapping[str, Sequence[int]] | None,
) -> dict[str, tuple[int, ...]]:
    """Static input shapes for targets that need them: ``given`` (``--input-shape``), else the
    model's fixed dims with batch 1 and the other dynamic dims taken from the calibration data."""
    given = dict(given or {})
    names = [s.name for s in served.inputs]
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise ConfigError(
            f"--input-shape {unknown[0]}: the model has no input {unknown[0]!r} (inputs: {', '.join(names)})"
        )
    out: dict[str, tuple[int, ...]] = {}
    for spec in served.inputs:
        if spec.name in given:
            shape = tuple(int(d) for d in given[spec.name])
            if (
                len(shape) != len(spec.shape)
                or any(isinstance(d, int) and d != s for d, s in zip(spec.shape, shape, strict=True))
                or any(s < 1 for s in shape)
            ):
                raise ConfigError(
                    f"--input-shape {spec.name}={'x'.join(map(str, shape))} does not fit the model's input "
                    f"{spec.name} {_fmt_shape(spec.shape)}"
                )
            out[spec.name] = shape
            continue
        sample = calib[spec.name].shape
        dims = []
        for axis, d in enumerate(spec.shape):
            if isinstance(d, int):
                dims.append(d)
            elif axis == 0:
                dims.append(1)
            else:
                dims.append(int(sample[axis]))
        out[spec.name] = tuple(dims)
    return out


def parse_input_shape(text: str) -> tuple[str, tuple[int, ...]]:
    """``"input=1x3x224x224"`` -> ``("input", (1, 3, 224, 224))``."""
    name, sep, dims = text.rpartition("=")
    try:
        shape = tuple(int(d) for d in dims.lower().split("x"))
    except ValueError:
        shape = ()
    if not sep or not name or not shape or any(d < 1 for d in shape):
        raise ConfigError(f"--input-shape {text!r}: expected NAME=DIMxDIMx... such as input=1x3x224x224")
    return name, shape


def _fmt_shape(shape: Sequence[Dim]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"
