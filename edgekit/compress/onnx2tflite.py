"""ONNX -> full-integer TFLite, offline: onnx2tf makes a SavedModel, TFLiteConverter quantizes
it with a representative dataset made from the user's calibration data, with int8 activations
(what the Edge TPU runs) or int16 activations and int8 weights ("16x8", LiteRT's CPU kernels only).

What onnx2tf needs, and what this module does about it:
- a frozen graph: inputs fixed to the static shapes, constants folded and the graph simplified
  with onnxslim, node names made valid TensorFlow scope names (``edgekit.compress.freeze``);
  without that onnx2tf fails on dynamic-H/W graphs such as YOLOv8 in a Shape->Slice chain;
- no download: for 4-D 3-channel inputs onnx2tf fetches sample images unless
  ``calibration_image_sample_data_20x128x128x3_float32.npy`` is in its working directory, so it
  runs in a scratch directory holding that file, made from the calibration data;
- it converts NCHW to NHWC and renames tensors: the artifact's tensors are matched back to the
  served ones (inputs are renamed ``input_<i>`` first, outputs come out as ``output_<i>`` in the
  ONNX output order), and the layout of each is checked numerically against ONNX Runtime.

``to_float`` does the slow part once (freeze, onnx2tf, float TFLite, tensor matching);
``quantize`` makes one full-integer model from it per activation type, so candidates share it.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.compress.freeze import FrozenGraph, freeze_graph
from edgekit.errors import MissingSDKError, ModelFormatError, UnsupportedOpError

ONNX2TF_SAMPLE_FILE = "calibration_image_sample_data_20x128x128x3_float32.npy"
SIGNATURE_KEY = "serving_default"
# onnx2tf's float conversion must match ONNX Runtime this closely before we quantize it.
MIN_FLOAT_COSINE = 0.999


@dataclass(frozen=True)
class TensorLink:
    """A served tensor and the artifact tensor it becomes (``transpose``: served -> artifact)."""

    served: str
    artifact: str
    transpose: tuple[int, ...] | None


@dataclass(frozen=True)
class TfliteModel:
    """A converted model: full-integer flatbuffer plus how its tensors map to the served ones."""

    quantized: bytes  # int8 weights; activations (and inputs/outputs) of type ``activations``
    activations: str  # "int8", "int16" (16x8), or "float32" (the coral float fallback: not quantized)
    float32: bytes
    inputs: tuple[TensorLink, ...]
    outputs: tuple[TensorLink, ...]
    float_cosine: float  # worst output cosine, onnx2tf float conversion vs ONNX Runtime
    frozen: FrozenGraph  # what freezing did before onnx2tf


def import_tensorflow() -> Any:
    # TensorFlow logs every kernel it registers at level 0; keep the user's setting if any.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        import tensorflow as tf
        import tf_keras  # noqa: F401  # onnx2tf needs it; fail here with the extra's name, not deep inside
    except ImportError as exc:
        raise MissingSDKError(f"tensorflow/tf_keras ({exc.name})", "tflite", "the coral target") from exc
    return tf


def import_onnx2tf() -> Any:
    import_tensorflow()
    try:
        import onnx2tf
    except ImportError as exc:
        raise MissingSDKError(f"onnx2tf ({exc.name})", "tflite", "the coral target") from exc
    return onnx2tf


def onnx2tf_ops() -> frozenset[str]:
    """The ONNX op types onnx2tf converts: its own op table (``onnx2tf/ops/<OpType>.py``).

    Read from the installed package without importing it (importing loads TensorFlow).
    """
    import importlib.util

    spec = importlib.util.find_spec("onnx2tf")
    if spec is None or not spec.submodule_search_locations:
        raise MissingSDKError("onnx2tf", "tflite", "the coral target")
    ops_dir = Path(next(iter(spec.submodule_search_locations))) / "ops"
    return frozenset(p.stem for p in ops_dir.glob("*.py") if p.stem[:1].isupper())


@contextlib.contextmanager
def working_directory(path: Path) -> Iterator[None]:
    """onnx2tf reads its sample-image file from the process's working directory (no option for it)."""
    before = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def onnx_to_saved_model(onnx_path: Path, work_dir: Path, nhwc_samples: np.ndarray | None) -> Path:
    """Run onnx2tf in ``work_dir`` with its sample file made from ``nhwc_samples`` (no download)."""
    onnx2tf = import_onnx2tf()
    if nhwc_samples is not None:
        np.save(work_dir / ONNX2TF_SAMPLE_FILE, np.ascontiguousarray(nhwc_samples[:20], dtype=np.float32))
    out = work_dir / "saved_model"
    printed = io.StringIO()  # onnx2tf and the SavedModel export print to stdout; kept for errors
    with working_directory(work_dir), contextlib.redirect_stdout(printed):
        try:
            onnx2tf.convert(
                input_onnx_file_path=str(onnx_path),
                output_folder_path=str(out),
                output_signaturedefs=True,
                not_use_onnxsim=True,
                non_verbose=True,
            )
        except SystemExit as exc:  # onnx2tf calls sys.exit(1) after printing what went wrong
            raise ModelFormatError(
                f"onnx2tf {onnx2tf.__version__} could not convert the model: {_tail(printed)}"
            ) from exc
        except (ValueError, TypeError, KeyError, NotImplementedError, RuntimeError) as exc:
            raise ModelFormatError(f"onnx2tf {onnx2tf.__version__} could not convert the model: {exc}") from exc
    return out


def _tail(buffer: io.StringIO, lines: int = 5) -> str:
    text = [line for line in buffer.getvalue().splitlines() if line.strip()]
    return " | ".join(text[-lines:]) or "no message"


ACTIVATIONS = ("int8", "int16")


def tflite_from_saved_model(saved_model: Path, representative: Any | None, activations: str = "int8") -> bytes:
    """Float32 TFLite, or full-integer TFLite when ``representative`` is given: int8 weights and
    ``activations`` (``int8``, or ``int16``: LiteRT's 16x8 mode) with inputs/outputs of that type."""
    tf = import_tensorflow()
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    converter = tf.lite.TFLiteConverter.from_saved_model(str(saved_model))
    if representative is not None:
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
        converter.representative_dataset = representative
        if activations == "int16":
            ops = tf.lite.OpsSet.EXPERIMENTAL_TFLITE_BUILTINS_ACTIVATIONS_INT16_WEIGHTS_INT8
            io_type = tf.int16
        else:
            ops, io_type = tf.lite.OpsSet.TFLITE_BUILTINS_INT8, tf.int8
        converter.target_spec.supported_ops = [ops]
        converter.inference_input_type = io_type
        converter.inference_output_type = io_type
    try:
        return bytes(converter.convert())
    except Exception as exc:  # TF raises ConverterError / RuntimeError / ValueError alike
        message = str(exc).strip().splitlines()
        last = message[-1] if message else type(exc).__name__
        if representative is None:  # the float conversion: no calibration, no integer kernels involved
            raise UnsupportedOpError(f"TFLite float32 conversion failed (an op has no TFLite builtin): {last}") from exc
        kind = "16x8 (int16 activations)" if activations == "int16" else "full-integer"
        raise UnsupportedOpError(
            f"TFLite {kind} conversion failed (an op has no {activations} kernel, or the calibration data does "
            f"not cover it): {last}"
        ) from exc


def channels_last(rank: int) -> tuple[int, ...] | None:
    """onnx2tf's layout change for a rank-``rank`` tensor (NCHW -> NHWC); None below rank 3."""
    return (0, *range(2, rank), 1) if rank >= 3 else None


def layout_candidates(served: tuple[int, ...], artifact: tuple[int, ...]) -> list[tuple[int, ...] | None]:
    """Transposes (served -> artifact) that produce the artifact's shape, onnx2tf's convention first."""
    options: list[tuple[int, ...] | None] = [channels_last(len(served)), None]
    out = []
    for perm in options:
        shape = tuple(served[i] for i in perm) if perm else tuple(served)
        if shape == tuple(artifact) and perm not in out:
            out.append(perm)
    return out


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    denom = float(np.linalg.norm(a64) * np.linalg.norm(b64))
    return float(a64 @ b64 / denom) if denom > 0 else float(np.array_equal(a64, b64))


def signature_details(model: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    """The serving signature's input and output details (name -> details) of a TFLite model."""
    from ai_edge_litert.interpreter import Interpreter

    runner = Interpreter(model_content=model).get_signature_runner(SIGNATURE_KEY)
    return runner.get_input_details(), runner.get_output_details()


def run_signature(model: bytes, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    from ai_edge_litert.interpreter import Interpreter

    runner = Interpreter(model_content=model).get_signature_runner(SIGNATURE_KEY)
    return {k: np.array(v) for k, v in runner(**feed).items()}


def link_tensors(
    float_model: bytes,
    served_inputs: Mapping[str, tuple[int, ...]],
    served_outputs: list[str],
    renamed: Mapping[str, str],
    sample: Mapping[str, np.ndarray],
    reference: Mapping[str, np.ndarray],
) -> tuple[tuple[TensorLink, ...], tuple[TensorLink, ...], float]:
    """Match the converted model's tensors to the served ones and check them numerically.

    ``sample``: one served-layout input batch; ``reference``: ONNX Runtime's outputs for it.
    """
    in_details, _ = signature_details(float_model)
    inputs = []
    for name, shape in served_inputs.items():
        art = renamed[name]
        if art not in in_details:
            raise ModelFormatError(f"onnx2tf dropped input {name!r} (signature has {', '.join(in_details)})")
        options = layout_candidates(shape, tuple(int(d) for d in in_details[art]["shape"]))
        if not options:
            raise ModelFormatError(
                f"input {name!r}: onnx2tf made shape {list(in_details[art]['shape'])} from {list(shape)}"
            )
        inputs.append(TensorLink(name, art, options[0]))
    feed = {link.artifact: _apply(sample[link.served], link.transpose) for link in inputs}
    got = run_signature(float_model, feed)
    outputs, worst = [], 1.0
    for i, name in enumerate(served_outputs):
        art = f"output_{i}"
        if art not in got:
            raise ModelFormatError(f"onnx2tf made no {art} for output {name!r} (signature has {', '.join(got)})")
        ref = reference[name]
        scored = [
            (cosine(_apply(ref, perm), got[art]), perm)
            for perm in layout_candidates(tuple(ref.shape), tuple(got[art].shape))
        ]
        if not scored:
            raise ModelFormatError(f"output {name!r}: onnx2tf made shape {list(got[art].shape)} from {list(ref.shape)}")
        best, perm = max(scored, key=lambda s: s[0])
        if best < MIN_FLOAT_COSINE:
            raise ModelFormatError(
                f"onnx2tf's conversion does not match the ONNX model on output {name!r} "
                f"(cosine {best:.4f} < {MIN_FLOAT_COSINE}); the model needs a graph change or an onnx2tf fix"
            )
        worst = min(worst, best)
        outputs.append(TensorLink(name, art, perm))
    return tuple(inputs), tuple(outputs), worst


def _apply(arr: np.ndarray, perm: tuple[int, ...] | None) -> np.ndarray:
    return np.ascontiguousarray(np.transpose(arr, perm) if perm else arr)


@dataclass(frozen=True)
class FloatConversion:
    """onnx2tf's float conversion of a frozen graph, matched to the served tensors: what every
    quantized candidate is made from."""

    saved_model: Path
    float32: bytes
    inputs: tuple[TensorLink, ...]
    outputs: tuple[TensorLink, ...]
    float_cosine: float  # worst output cosine, float TFLite vs ONNX Runtime
    frozen: FrozenGraph
    batches: tuple[dict[str, np.ndarray], ...]  # calibration batches, served layout, static shapes

    @property
    def samples(self) -> int:
        return sum(len(next(iter(b.values()))) for b in self.batches)

    def model(self, quantized: bytes, activations: str) -> TfliteModel:
        """A quantized flatbuffer made from this conversion, with what it was made from."""
        return TfliteModel(
            quantized=quantized,
            activations=activations,
            float32=self.float32,
            inputs=self.inputs,
            outputs=self.outputs,
            float_cosine=self.float_cosine,
            frozen=self.frozen,
        )


def to_float(
    model_path: Path,
    work_dir: Path,
    static_shapes: Mapping[str, tuple[int, ...]],
    served_outputs: list[str],
    calib: Mapping[str, np.ndarray],
    max_samples: int,
) -> FloatConversion:
    """Freeze the ONNX model at ``model_path``, convert it with onnx2tf and check the float result."""
    import onnxruntime as ort

    batches = list(_static_batches(calib, static_shapes, max_samples))
    if not batches:
        raise ModelFormatError("the coral target needs calibration samples for its static input shapes")
    renamed = {name: f"input_{i}" for i, name in enumerate(static_shapes)}
    frozen = freeze_graph(
        model_path,
        work_dir / "for_onnx2tf.onnx",
        static_shapes,
        check=batches[0],
        input_names=renamed,
        tf_scope_names=True,
        erf_tanh=True,  # TFLite has no Erf builtin: a GELU's Erf failed the float and the integer conversion
    )
    first_input = next(iter(static_shapes))
    first = np.concatenate([b[first_input] for b in batches])
    sample_images = _apply(first, channels_last(first.ndim)) if first.ndim == 4 else None
    saved_model = onnx_to_saved_model(frozen.path, work_dir, sample_images)
    float_model = tflite_from_saved_model(saved_model, None)
    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    reference = dict(zip(served_outputs, session.run(served_outputs, batches[0]), strict=True))
    inputs, outputs, worst = link_tensors(float_model, static_shapes, served_outputs, renamed, batches[0], reference)
    return FloatConversion(saved_model, float_model, inputs, outputs, worst, frozen, tuple(batches))


def quantize(conversion: FloatConversion, activations: str = "int8") -> TfliteModel:
    """Full-integer TFLite from ``conversion``: int8 weights, ``activations`` int8 or int16 (16x8)."""

    def representative() -> Iterator[dict[str, np.ndarray]]:
        for batch in conversion.batches:
            yield {
                link.artifact: _apply(batch[link.served].astype(np.float32), link.transpose)
                for link in conversion.inputs
            }

    return conversion.model(tflite_from_saved_model(conversion.saved_model, representative, activations), activations)


def convert(
    model_path: Path,
    work_dir: Path,
    static_shapes: Mapping[str, tuple[int, ...]],
    served_outputs: list[str],
    calib: Mapping[str, np.ndarray],
    max_samples: int,
    activations: str = "int8",
) -> TfliteModel:
    """Full-integer TFLite for the ONNX model at ``model_path``, calibrated on ``calib`` (served layout)."""
    return quantize(to_float(model_path, work_dir, static_shapes, served_outputs, calib, max_samples), activations)


def _static_batches(
    calib: Mapping[str, np.ndarray], static_shapes: Mapping[str, tuple[int, ...]], max_samples: int
) -> Iterator[dict[str, np.ndarray]]:
    """Calibration samples in batches of the static batch size, up to ``max_samples`` samples."""
    batch = next(iter(static_shapes.values()))[0] if static_shapes else 1
    count = min(min(len(calib[n]) for n in static_shapes), max_samples)
    for start in range(0, count - batch + 1, batch):
        yield {n: np.ascontiguousarray(calib[n][start : start + batch]) for n in static_shapes}
