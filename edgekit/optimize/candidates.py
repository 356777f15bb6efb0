"""What a target hands the engine: candidates (how to build one artifact) and what a build gives back.

A target describes its search as a ``CandidatePlan``: a first wave of candidates, refinements that
only pay when the candidate they refine missed the accuracy budget (other calibration methods, a
more accurate preset), and for mixed precision a way to rebuild a candidate with some layers kept
in float. The engine owns the loop: it builds, measures, prunes, chooses and records.

A candidate whose artifact cannot run on this host (an Edge TPU model, a TensorRT engine) returns
``Built.open = None`` and, where it can, an ``intermediate`` to measure accuracy with: its latency
is then recorded as "not measured here" and the choice among such candidates goes by accuracy and
size.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.bundle.manifest import Precision, Signature

RunFn = Callable[[dict[str, np.ndarray]], Mapping[str, np.ndarray]]
OBJECTIVES: tuple[str, ...] = ("latency", "size")


@dataclass(frozen=True)
class BuildSpace:
    """What one candidate build gets: its own folder and the calibration subset."""

    work_dir: Path  # the candidate's own folder; its files are written here
    calib: Mapping[str, np.ndarray]  # the bounded, stratified calibration subset (one array per input)
    served: Signature
    calib_batch: int  # samples per calibration call (the model's fixed batch, else 1..16)
    progress: Callable[[str], None] = print


@dataclass(frozen=True)
class Built:
    """A built candidate: files under ``BuildSpace.work_dir`` and how to run them here."""

    files: dict[str, str]  # path relative to work_dir -> role ("artifact", ...)
    runtime: str  # the device runtime that serves it (onnxruntime, openvino, ...)
    precision: Precision
    # threads -> a function from served inputs to served outputs, opened the way the device
    # runtime opens it; None: the runtime does not run on this host ("latency not measured here").
    open: Callable[[int], RunFn] | None
    intermediate: RunFn | None = None  # accuracy where ``open`` is None (a faithful stand-in)
    notes: tuple[str, ...] = ()
    excluded_nodes: tuple[str, ...] = ()  # layers kept in higher precision (mixed precision)
    # what the target's ``finish`` needs of this build (a converted model, its own description);
    # opaque to the engine
    detail: Any = None


@dataclass(frozen=True)
class Candidate:
    """One way to build the target's artifact.

    ``name`` is unique within one search and is what the report calls it. ``precision`` is the CLI
    precision it satisfies (``fp32``, ``int8``, ...). ``family`` groups candidates whose latency
    is the same kernel layout (calibration methods of one layout): a refinement inherits its
    family's speed, which is what lets the engine skip dominated refinements before building them.
    ``exclude`` rebuilds the candidate with the given layers kept in float (mixed precision), and
    ``rank_layers`` orders its quantized layers by their measured contribution to the output error
    (each with the layers that must stay in float with it, such as the producer of its input).
    """

    name: str
    precision: str
    runtime: str
    build: Callable[[BuildSpace], Built]
    settings: Mapping[str, Any] = field(default_factory=dict)
    family: str = ""
    baseline: bool = False  # the target's FP32 on its own runtime: "never slower than" refers to it
    # Where latency cannot be measured here (TensorRT, Core ML, the Edge TPU): the expected speed
    # order on the device class, lower = faster, taken from the vendor's documentation (the target
    # cites it). ``auto`` then ships the lowest-ranked candidate within the budget. None: unranked.
    device_rank: int | None = None
    exclude: Callable[[tuple[str, ...]], Candidate] | None = None
    # (layers to keep in float together, score), most sensitive first
    rank_layers: Callable[[BuildSpace, Built], list[tuple[tuple[str, ...], float]]] | None = None
    # its calibration keeps a layer's inputs and outputs for every calibration sample at once
    # (NNCF's full bias correction), not one call's worth: the memory bound counts them all
    holds_every_sample: bool = False
    # samples its calibrator runs per call, every tensor of each kept for the call (None: ONNX
    # Runtime's chunk, ``optimize.memory.CALIB_CALL_SAMPLES``; NNCF collects one sample at a time)
    calib_call_samples: int | None = None
    # (seconds, how) its build may take given the FP32 baseline's p50 in ms (one call) and the
    # calibration calls, where that is far more than a conversion (NNCF's accuracy control
    # evaluates the model once per layer): a refinement that may not finish within what is left
    # of the search time budget is skipped
    cost_s: Callable[[float, int], tuple[float, str]] | None = None


@dataclass(frozen=True)
class Refinement:
    """``candidate`` is worth building only when ``of`` (a first-wave candidate's name) missed the
    accuracy budget: a more accurate calibration or preset of the same layout."""

    candidate: Candidate
    of: str


@dataclass(frozen=True)
class CandidatePlan:
    first: tuple[Candidate, ...]
    refinements: tuple[Refinement, ...] = ()
    skipped: tuple[tuple[str, str], ...] = ()  # (candidate name, why) decided by the target up front
    max_refinements: int | None = None  # at most this many refinements are built (None: no bound)
    bound_name: str = ""  # the option that sets max_refinements, for the record
    # under ``auto``, built only when nothing else met the budget (refinements and mixed precision
    # included): e.g. a float artifact of a target whose own form is integer, shipped as what it is
    fallback: tuple[Candidate, ...] = ()


def by_name(cands: Sequence[Candidate]) -> dict[str, Candidate]:
    return {c.name: c for c in cands}
