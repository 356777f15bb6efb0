"""The target interface: one host module per target, each describing how a prepared FP32 ONNX
model becomes an artifact set for one runtime.

A target describes; the optimisation engine (``edgekit.optimize``) builds. A target offers checks
on the model (``check_model``), its candidates with their build recipes (``candidates``: an
``edgekit.optimize.candidates.CandidatePlan``) and how to finish the chosen candidate into bundle
files (``finish``: a ``BuildResult``). The packager (``edgekit.packaging``) prepares the source
model once (load, opset upgrade, shape inference, served signature, calibration data checked),
then hands each target with a ``BuildContext`` to the engine (``edgekit.optimize.run``), which
builds the candidates, measures them side by side, chooses one and has the target finish it
under ``ctx.out_dir``. The packager then validates the artifact against the FP32 model (through
the device runtime where it can run here, else through ``BuildResult.intermediate``), writes
golden vectors, the manifest, signs, and writes the ``.ekb``.

A target imports no other target and not the engine's runner; builders shared by several
targets live with the engine (``edgekit.optimize.openvino_candidates``). Targets import their
SDKs inside their module only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

from edgekit.bundle.manifest import (
    Compatibility,
    CompressionStep,
    OpPlacement,
    Precision,
    Signature,
    TensorMapping,
)

if TYPE_CHECKING:
    from edgekit.optimize.candidates import Built, CandidatePlan

# CLI precision names, shared by every target. Each target lists the ones it can build.
# ``auto``: the optimisation engine chooses among every candidate of the target (edgekit.optimize).
PRECISIONS = ("fp32", "fp16", "bf16", "int8", "int8-weights", "int4-weights", "palettize6", "palettize4", "auto")


@dataclass(frozen=True)
class BuildContext:
    model_path: Path  # prepared FP32 ONNX (opset >= 13, shapes inferred); do not modify
    served: Signature  # the source model's interface, which every target serves
    precision: str  # one of PRECISIONS, already checked against the target's list
    calib: Mapping[str, np.ndarray]  # one array per input name, samples on axis 0
    static_shapes: Mapping[str, tuple[int, ...]]  # per input; from --input-shape or calib (batch 1)
    out_dir: Path  # write bundle files here (relative paths become manifest paths)
    work_dir: Path  # scratch space, removed afterwards
    options: Any  # the target's own typed Options dataclass
    progress: Callable[[str], None] = print
    # Set by the packager: runs a candidate (served inputs -> served outputs) over the held-out
    # evaluation data and returns an ``edgekit.validate.metrics.Comparison`` with FP32 under the
    # requested tolerance (``.passed``, ``.failures``, ``.summary()``). Targets that choose among
    # candidates (quantization settings, calibration methods) call it; ``None`` outside the packager.
    evaluate: Callable[[Callable[[dict[str, np.ndarray]], Mapping[str, np.ndarray]]], Any] | None = None
    # The source model as given with its shape sub-graphs folded (before opset upgrade and ORT's
    # optimisation): toolchains that expect the exporter's graph (OpenVINO / NNCF) build from it.
    # ``None``: use ``model_path``.
    source_path: Path | None = None
    # Outputs that are a detector's or segmenter's head: recognised (``validate.heads``) or declared
    # ``detect`` / ``segment`` by ``--task``; output -> task (``heads.head_outputs``). Targets offer
    # their INT8 with the head's decode kept in float (``optimize.head_scope``).
    heads: Mapping[str, str] = field(default_factory=dict)


def static_signature(served: Signature, shapes: Mapping[str, tuple[int, ...]]) -> Signature:
    """``served`` with its inputs fixed to ``shapes`` (``BuildContext.static_shapes``), as a
    static-shape artifact serves it; output dims named like a now-fixed input dim take its size."""
    fixed: dict[str, int] = {}
    inputs = []
    for spec in served.inputs:
        shape = shapes.get(spec.name)
        if shape is None:
            inputs.append(spec)
            continue
        for d, s in zip(spec.shape, shape, strict=True):
            if isinstance(d, str):
                fixed[d] = s
        inputs.append(dataclasses.replace(spec, shape=tuple(shape)))
    outputs = tuple(
        dataclasses.replace(o, shape=tuple(fixed.get(d, d) if isinstance(d, str) else d for d in o.shape))
        for o in served.outputs
    )
    return Signature(inputs=tuple(inputs), outputs=outputs)


@dataclass(frozen=True)
class BuildResult:
    files: dict[str, str]  # relative path under out_dir -> role ("artifact", "report", ...)
    compatibility: Compatibility
    artifact_signature: Signature
    mapping: tuple[TensorMapping, ...]
    precision: Precision
    runnable_here: bool  # can the device runtime open it on this host?
    op_placement: OpPlacement | None = None
    notes: tuple[str, ...] = ()
    target_options: dict[str, Any] = field(default_factory=dict)
    # For artifacts that cannot run here: a function running a numerically faithful
    # intermediate (e.g. the Core ML weights dequantized into the ONNX/torch graph) on served
    # inputs, returning served outputs. Validation then says what it measured.
    intermediate: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None
    intermediate_name: str = ""
    # Static input shapes the artifact requires (the agent refuses others with a 4xx).
    static: bool = False
    # What produced the artifact from the prepared model, in order (manifest ``provenance``).
    provenance: tuple[CompressionStep, ...] = ()


class Target(Protocol):
    name: ClassVar[str]  # cpu, intel, coral, jetson, apple
    runtime: ClassVar[str]  # key in device_agents.runtimes.RUNTIMES
    precisions: ClassVar[tuple[str, ...]]  # subset of PRECISIONS, first is the default
    Options: ClassVar[type]  # frozen dataclass of this target's settings (all defaulted)
    static_shapes: ClassVar[bool]  # artifacts take static shapes only (BuildResult.static)

    def check_model(self, model_path: Path) -> None:
        """Raise ``UnsupportedOpError`` naming op, node and the targets that can take it."""
        ...

    def candidates(self, ctx: BuildContext) -> CandidatePlan:
        """The candidates for ``ctx.precision`` (typed, each with its build recipe), in the order
        the engine builds them, and those left out with why."""
        ...

    def finish(self, ctx: BuildContext, built: Built, built_dir: Path) -> BuildResult:
        """The chosen candidate (``built``, its files in ``built_dir``) as bundle files under
        ``ctx.out_dir``, described for the manifest."""
        ...
