"""``coral`` target: full-integer INT8 ``.tflite`` for LiteRT, compiled for the Edge TPU when
``edgetpu_compiler`` is on PATH.

Before onnx2tf the graph is frozen (static input shapes, constants folded and simplified by
onnxslim, TF-valid node names: ``edgekit.compress.freeze``), so dynamic-shape graphs such as
YOLOv8 convert; the steps are recorded in the notes.

``activations="int16"`` (``--option coral.activations=int16``) builds LiteRT's 16x8 mode instead:
int16 activations and inputs/outputs, int8 weights. The Edge TPU runs int8 only, so a 16x8 model is
never compiled for it (``edgetpu=true`` is refused) and runs on LiteRT's CPU kernels; the manifest
notes and op placement say so.

Inputs and outputs are int8; their scale and zero point go into the manifest (artifact
signature) and the agent quantizes / dequantizes for clients that send floats, and transposes
NCHW <-> NHWC (``TensorMapping.transpose``). Shapes are static (``ctx.static_shapes``).

Edge TPU: with the compiler, the bundle holds ``model_edgetpu.tflite`` (runs only with the Edge TPU
delegate, ``Compatibility.accelerator = "edgetpu"``) and the compiler's log as a ``report`` file,
parsed into ``op_placement``; the host validates the uncompiled INT8 model it was compiled from
(same int8 arithmetic) as the intermediate. Without the compiler the bundle holds
``model.tflite`` for the CPU (XNNPACK) and says so in the notes; op placement then lists the
interpreter's own ops, all on the CPU.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np

from edgekit.bundle.manifest import (
    Compatibility,
    CompressionStep,
    OpPlacement,
    OpPlacementEntry,
    Precision,
    QuantParams,
    Signature,
    TensorMapping,
    TensorSpec,
)
from edgekit.errors import ConfigError, EdgekitError, MissingSDKError
from edgekit.targets.base import BuildContext, BuildResult
from edgekit.targets.op_support import UnsupportedNode, raise_unsupported

if TYPE_CHECKING:
    from edgekit.compress.onnx2tflite import TensorLink, TfliteModel

ARTIFACT = "model.tflite"
COMPILED = "model_edgetpu.tflite"
COMPILER_LOG = "model_edgetpu.log"
EDGETPU_COMPILER = "edgetpu_compiler"
EDGETPU_TIMEOUT_S = 600
_LOG_ROW = re.compile(r"^(?P<op>[A-Z][A-Z0-9_]*)\s+(?P<count>\d+)\s+(?P<status>\S.*?)\s*$")


@dataclass(frozen=True)
class CoralOptions:
    """Settings of the ``coral`` target (``targets.coral.*``)."""

    # Compile for the Edge TPU: "auto" when edgetpu_compiler is on PATH, True requires it, False never.
    edgetpu: bool | Literal["auto"] = "auto"
    calibration_samples: int = 300  # at most this many calibration samples feed the representative dataset
    edgetpu_compiler: str = EDGETPU_COMPILER  # command name or path
    # int8: full-integer INT8 (Edge TPU or CPU); int16: 16x8 (int16 activations, int8 weights), CPU only
    activations: Literal["int8", "int16"] = "int8"

    def __post_init__(self) -> None:
        if self.edgetpu not in (True, False, "auto"):
            raise ConfigError(f"targets.coral.edgetpu: {self.edgetpu!r} is not one of true, false, auto")
        if self.activations not in ("int8", "int16"):
            raise ConfigError(f"targets.coral.activations: {self.activations!r} is not one of int8, int16")
        if self.activations == "int16" and self.edgetpu is True:
            raise ConfigError(
                "targets.coral.activations=int16: the Edge TPU runs int8 activations only, so a 16x8 model "
                "cannot be compiled for it; set targets.coral.edgetpu to auto or false (LiteRT CPU), or "
                "targets.coral.activations=int8"
            )
        if self.calibration_samples < 1:
            raise ConfigError(f"targets.coral.calibration_samples: must be >= 1, got {self.calibration_samples}")


class CoralTarget:
    name: ClassVar[str] = "coral"
    runtime: ClassVar[str] = "litert"
    precisions: ClassVar[tuple[str, ...]] = ("int8",)
    Options: ClassVar[type] = CoralOptions
    static_shapes: ClassVar[bool] = True

    def check_model(self, model_path: Path) -> None:
        """Raise ``UnsupportedOpError`` for ops onnx2tf has no converter for (its own op table)."""
        import onnx

        from edgekit.compress.onnx2tflite import onnx2tf_ops

        known = onnx2tf_ops()
        model = onnx.load(str(model_path), load_external_data=False)
        bad = [
            UnsupportedNode(n.op_type, n.domain, n.name or n.output[0])
            for n in model.graph.node
            if n.domain not in ("", "ai.onnx") or n.op_type not in known
        ]
        if bad:
            raise_unsupported(self.name, "onnx2tf", model_path, bad)

    def build(self, ctx: BuildContext) -> BuildResult:
        from edgekit.compress import onnx2tflite

        opts: CoralOptions = ctx.options or CoralOptions()
        if ctx.precision != "int8":
            raise ConfigError(f"--precision: the coral target builds int8 only, not {ctx.precision!r}")
        compiler = self._compiler(opts)
        missing = [s.name for s in ctx.served.inputs if s.name not in ctx.static_shapes]
        if missing:
            raise ConfigError(f"--input-shape: the coral target needs a static shape for input {missing[0]!r}")
        static = {s.name: tuple(ctx.static_shapes[s.name]) for s in ctx.served.inputs}
        kind = "16x8 (int16 activations)" if opts.activations == "int16" else "full-integer"
        ctx.progress(f"[coral] freeze (onnxslim) -> onnx2tf -> SavedModel -> {kind} TFLite")
        conversion = onnx2tflite.to_float(
            ctx.model_path,
            ctx.work_dir,
            static,
            [o.name for o in ctx.served.outputs],
            ctx.calib,
            opts.calibration_samples,
        )
        quantized = onnx2tflite.quantize(conversion, opts.activations)
        return package_tflite(ctx, quantized, opts, compiler, conversion.samples)

    def _compiler(self, opts: CoralOptions) -> str | None:
        found = shutil.which(opts.edgetpu_compiler)
        if opts.edgetpu is True and found is None:
            raise ConfigError(
                f"targets.coral.edgetpu=true but {opts.edgetpu_compiler} is not on PATH: install the Edge TPU "
                "compiler (package edgetpu-compiler from Coral's Debian repository; x86-64 only), or set "
                "targets.coral.edgetpu to auto or false to build for the CPU"
            )
        return found if opts.edgetpu is not False else None


def package_tflite(
    ctx: BuildContext, converted: TfliteModel, opts: CoralOptions, compiler: str | None, samples: int
) -> BuildResult:
    """Write ``converted`` into ``ctx.out_dir`` (compiled for the Edge TPU when ``compiler`` is given
    and the activations are int8) and describe it: one candidate's artifact, as the engine builds it."""
    artifact_sig = _artifact_signature(converted, ctx.served)
    mapping = tuple(
        TensorMapping(link.served, link.artifact, link.transpose) for link in (*converted.inputs, *converted.outputs)
    )
    if converted.activations == "int16":
        precision = Precision(
            "int8",
            "int16",
            f"onnx2tf -> TFLiteConverter 16x8 PTQ (int16 activations, int8 per-channel weights), "
            f"{samples} calibration samples",
        )
    else:
        precision = Precision(
            "int8",
            "int8",
            f"onnx2tf -> TFLiteConverter full-integer PTQ, per-channel weights, {samples} calibration samples",
        )
    notes = [
        *(f"frozen: {step}" for step in converted.frozen.steps),
        f"onnx2tf float conversion vs ONNX Runtime: cosine {converted.float_cosine:.5f}",
    ]
    common: dict[str, Any] = {
        "artifact_signature": artifact_sig,
        "mapping": mapping,
        "precision": precision,
        "target_options": asdict(opts),
        "static": True,
        "provenance": _provenance(converted, samples),
    }
    if converted.activations == "int16" and compiler is not None:
        notes.append("16x8 (int16 activations): the Edge TPU runs int8 only, so it is not compiled for it")
        compiler = None
    if compiler is None:
        (ctx.out_dir / ARTIFACT).write_bytes(converted.quantized)
        if converted.activations == "int16":
            notes.append(
                "16x8 (int16 activations, int8 weights): runs on LiteRT's CPU kernels; the Edge TPU runs int8 only"
            )
        else:
            reason = "edgetpu=false" if opts.edgetpu is False else f"{opts.edgetpu_compiler} is not on PATH"
            notes.append(f"not compiled for the Edge TPU ({reason}): the runtime uses the CPU (XNNPACK)")
        return BuildResult(
            files={ARTIFACT: "artifact"},
            compatibility=Compatibility(runtime="litert", runtime_version=_litert_version()),
            runnable_here=True,
            op_placement=interpreter_placement(converted.quantized, converted.activations),
            notes=tuple(notes),
            **common,
        )
    ctx.progress(f"[coral] {compiler} (Edge TPU)")
    (ctx.work_dir / ARTIFACT).write_bytes(converted.quantized)
    version, log_text = compile_for_edgetpu(compiler, ctx.work_dir / ARTIFACT, ctx.out_dir)
    (ctx.out_dir / COMPILER_LOG).write_text(log_text)
    notes.append(f"compiled for the Edge TPU by edgetpu_compiler {version}; validated on the uncompiled int8 model")
    return BuildResult(
        files={COMPILED: "artifact", COMPILER_LOG: "report"},
        compatibility=Compatibility(
            runtime="litert",
            runtime_version=_litert_version(),
            accelerator="edgetpu",
            hardware={"edgetpu_compiler": version},
        ),
        runnable_here=False,
        op_placement=edgetpu_placement(log_text, COMPILER_LOG),
        notes=tuple(notes),
        intermediate=served_runner(converted.quantized, artifact_sig, mapping, ctx.served),
        intermediate_name="uncompiled int8 .tflite on the LiteRT CPU interpreter",
        **common,
    )


def _provenance(converted: TfliteModel, samples: int) -> tuple[CompressionStep, ...]:
    from importlib.metadata import version

    from edgekit.compress.onnx2tflite import import_tensorflow

    tf_version = str(import_tensorflow().__version__)
    return (
        *converted.frozen.provenance(),
        CompressionStep(
            kind="convert",
            tool=f"onnx2tf {version('onnx2tf')}",
            settings={"layout": "NCHW -> NHWC", "output": "SavedModel -> float32 TFLite"},
            metric="worst output cosine, float TFLite vs ONNX Runtime",
            after=converted.float_cosine,
        ),
        CompressionStep(
            kind="quantize",
            tool=f"tensorflow {tf_version} TFLiteConverter",
            settings={
                "weights": "int8 per-channel",
                "activations": converted.activations,
                "mode": "16x8" if converted.activations == "int16" else "full-integer",
                "calibration_samples": str(samples),
            },
        ),
    )


def _litert_version() -> str:
    try:
        import ai_edge_litert
    except ImportError as exc:
        raise MissingSDKError("ai-edge-litert", "tflite", "the coral target") from exc
    return str(getattr(ai_edge_litert, "__version__", "unknown"))


def _artifact_signature(converted: TfliteModel, served: Signature) -> Signature:
    from edgekit.compress.onnx2tflite import signature_details

    in_details, out_details = signature_details(converted.quantized)

    def spec(name: str, d: Mapping[str, Any], layout: str | None) -> TensorSpec:
        scale, zero_point = d["quantization"]
        dtype = np.dtype(d["dtype"]).name
        quant = QuantParams(float(scale), int(zero_point), dtype) if scale else None
        return TensorSpec(name, dtype, tuple(int(x) for x in d["shape"]), layout=layout, quant=quant)

    def layout(link: TensorLink, served_spec: TensorSpec) -> str | None:
        if link.transpose and served_spec.layout == "NCHW":
            return "NHWC"
        return served_spec.layout if not link.transpose else None

    inputs = tuple(
        spec(link.artifact, in_details[link.artifact], layout(link, served.input(link.served)))
        for link in converted.inputs
    )
    by_name = {o.name: o for o in served.outputs}
    outputs = tuple(
        spec(link.artifact, out_details[link.artifact], layout(link, by_name[link.served]))
        for link in converted.outputs
    )
    return Signature(inputs=inputs, outputs=outputs)


def served_runner(
    model: bytes, artifact: Signature, mapping: tuple[TensorMapping, ...], served: Signature
) -> Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """Served float inputs -> served float outputs on an int8 ``.tflite`` (the host-side intermediate)."""
    from ai_edge_litert.interpreter import Interpreter

    from device_agents.runtimes.base import dequantize, quantize

    runner = Interpreter(model_content=model).get_signature_runner()
    specs = {s.name: s for s in (*artifact.inputs, *artifact.outputs)}
    links = {m.served: m for m in mapping}

    def run(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feed = {}
        for name, arr in inputs.items():
            m = links[name]
            x = np.transpose(arr, m.transpose) if m.transpose else arr
            q = specs[m.artifact].quant
            feed[m.artifact] = quantize(x, q) if q else np.ascontiguousarray(x)
        raw = runner(**feed)
        out = {}
        for o in served.outputs:
            m = links[o.name]
            q = specs[m.artifact].quant
            y = dequantize(raw[m.artifact], q) if q else np.asarray(raw[m.artifact])
            out[o.name] = np.transpose(y, np.argsort(m.transpose)) if m.transpose else y
        return out

    return run


def interpreter_placement(model: bytes, activations: str = "int8") -> OpPlacement:
    """The LiteRT interpreter's own op list (not compiled for the Edge TPU: every op on the CPU)."""
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_content=model)
    ops = interpreter._get_ops_details()  # the interpreter's only op listing (private API)
    entries = tuple(OpPlacementEntry(op=str(o["op_name"]), node=f"op{o['index']}", device="CPU") for o in ops)
    why = "16x8: the Edge TPU runs int8 only" if activations == "int16" else "not compiled for the Edge TPU"
    return OpPlacement(
        tool=f"litert interpreter op list ({why})",
        accelerated=0,
        fallback=len(entries),
        entries=entries,
    )


def compile_for_edgetpu(compiler: str, tflite: Path, out_dir: Path) -> tuple[str, str]:
    """Run ``edgetpu_compiler``; returns (compiler version, its operation log)."""
    try:
        proc = subprocess.run(
            [compiler, "-s", "-o", str(out_dir), str(tflite)],
            capture_output=True,
            text=True,
            timeout=EDGETPU_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EdgekitError(f"{compiler} could not run: {exc}") from exc
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise EdgekitError(f"{compiler} failed (exit {proc.returncode}): {tail}")
    version = re.search(r"Edge TPU Compiler version (\S+)", proc.stdout)
    produced = out_dir / f"{tflite.stem}_edgetpu.tflite"
    if not produced.is_file():
        raise EdgekitError(f"{compiler} reported success but wrote no {produced.name}")
    if produced.name != COMPILED:
        produced.rename(out_dir / COMPILED)
    log = out_dir / f"{tflite.stem}_edgetpu.log"
    text = log.read_text() if log.is_file() else proc.stdout
    if log.is_file() and log.name != COMPILER_LOG:
        log.unlink()
    return (version.group(1) if version else "unknown"), text


def edgetpu_placement(log_text: str, log_file: str) -> OpPlacement:
    """Parse the compiler's ``Operator / Count / Status`` table (one entry per op type and status)."""
    entries, accelerated, fallback = [], 0, 0
    in_table = False
    for line in log_text.splitlines():
        if re.match(r"^\s*Operator\s+Count\s+Status", line):
            in_table = True
            continue
        row = _LOG_ROW.match(line.strip()) if in_table else None
        if row is None:
            continue
        count, status = int(row["count"]), row["status"]
        on_tpu = status.startswith("Mapped to Edge TPU")
        accelerated += count if on_tpu else 0
        fallback += 0 if on_tpu else count
        entries.append(
            OpPlacementEntry(op=row["op"], node=f"{count} op(s): {status}", device="EdgeTPU" if on_tpu else "CPU")
        )
    return OpPlacement(
        tool="edgetpu_compiler", accelerated=accelerated, fallback=fallback, entries=tuple(entries), log_file=log_file
    )
