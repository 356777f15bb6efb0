"""Manifest v2: the only thing the device trusts about a model.

Frozen dataclasses, ``schema_version`` first, unknown keys rejected (see ``codec``). The JSON
Schema in ``schema/manifest.v2.schema.json`` describes the same structure for other tools; the
golden-file test keeps the two and ``tests/golden/manifest_v2.json`` in step. v1 manifests
(``tests/golden/manifest_v1.json``) load through ``MIGRATIONS[1]``.

v2 is designed once for every field the planned features need, so that they add behaviour, not
schema: pre/post-processing as typed data, cache policy with approximate-cache calibration, a
``stateful`` marker, memory/energy estimates, a split plan with several cuts, the provenance of
compression steps, the optimisation candidate report, calibration-data identity, mixed-precision
exclusions and the failed-validation mark. Every v2 addition is optional. A field whose
docstring says *planned* is written by no host code yet and read by no agent code yet; the
agent never acts on it until a release implements it. Additive optional fields do not bump
``SCHEMA_VERSION`` again; anything else does, with a migration and a golden-file test.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any, Literal

from edgekit.bundle.codec import from_data, to_data, upgrade
from edgekit.bundle.errors import ManifestError

SCHEMA_VERSION = 2
MANIFEST_NAME = "manifest.json"
SIGNATURE_NAME = "manifest.sig"
MAX_MANIFEST_BYTES = 4 * 1024 * 1024

# Targets this version of the contract knows. A manifest for another target parses (so that a
# newer host can ship to an older agent's neighbours) but no runtime here will load it.
KNOWN_TARGETS = ("cpu", "intel", "coral", "jetson", "apple")
DTYPES = ("float32", "float16", "int8", "uint8", "int16", "int32", "int64", "bool")
Dim = int | str  # a fixed size, or the name of a dynamic axis

# schema_version -> function upgrading a manifest dict of that version by one step.
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {}


@dataclass(frozen=True)
class SourceModel:
    """The model the bundle was made from."""

    sha256: str
    filename: str
    format: Literal["onnx"] = "onnx"
    opset: int = 0
    producer: str = ""


@dataclass(frozen=True)
class QuantParams:
    """Affine quantization of a tensor: ``real = scale * (q - zero_point)``."""

    scale: float
    zero_point: int
    dtype: Literal["int8", "uint8", "int16"]


@dataclass(frozen=True)
class TensorSpec:
    """Name, dtype and shape of a tensor. Named dims are dynamic (shown as -1 by v2)."""

    name: str
    dtype: str
    shape: tuple[Dim, ...]
    layout: str | None = None  # "NCHW", "NHWC", ... where it matters
    quant: QuantParams | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")

    @property
    def v2_shape(self) -> list[int]:
        return [d if isinstance(d, int) else -1 for d in self.shape]


@dataclass(frozen=True)
class TensorMapping:
    """How a served tensor reaches the artifact's tensor (and back, for outputs)."""

    served: str
    artifact: str
    transpose: tuple[int, ...] | None = None  # permutation applied served -> artifact


@dataclass(frozen=True)
class Signature:
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def input(self, name: str) -> TensorSpec:
        for spec in self.inputs:
            if spec.name == name:
                return spec
        raise KeyError(name)


PreOp = Literal["resize", "letterbox", "center_crop", "channel_order", "layout", "scale", "normalize", "cast"]
PostOp = Literal["softmax", "sigmoid", "argmax", "topk", "cast", "boxes"]


@dataclass(frozen=True)
class ProcessingStep:
    """One pre- or post-processing step, described as data and applied by the agent (never code).

    Pre-processing runs in list order from what a client sends (e.g. an HWC uint8 image) to the
    served input; post-processing from the served output to what the client receives. Each op
    reads only its own fields:

    - ``resize`` / ``center_crop``: ``size`` (height, width), ``interpolation``;
    - ``letterbox``: ``size``, ``pad_value`` (keeps aspect ratio, pads the rest);
    - ``channel_order``: ``order`` of the result ("RGB" / "BGR");
    - ``layout``: ``layout`` of the result ("NCHW" / "NHWC");
    - ``scale``: x * ``value``; ``normalize``: (x - ``mean``) / ``std`` per channel;
    - ``cast``: to ``dtype``; ``softmax`` / ``sigmoid`` / ``argmax``: along ``axis``;
      ``topk``: the ``k`` largest along ``axis`` (with ``labels_file``: their names too);
    - ``boxes``: a detector's raw output into boxes in the original image's pixels: ``box_format``
      ("yolo": per candidate cx, cy, w, h in input pixels then one score per class), ``axis`` of
      the 4 + classes values (1: ``[1, 4+C, N]``, 2: ``[1, N, 4+C]``), ``score_threshold``,
      ``iou_threshold`` (class-wise NMS), ``max_boxes``, ``labels_file``.

    ``tensor`` names the served tensor it applies to (None: the only input / output).
    The host CLI's ``--preprocess`` / ``--postprocess`` build these; the agent applies them
    (``device_agents.processing``) and then serves the processed signature: an encoded image in,
    ``classes`` / ``scores`` / ``labels`` (and ``boxes``) out.
    """

    op: PreOp | PostOp
    tensor: str | None = None
    size: tuple[int, int] | None = None
    interpolation: Literal["nearest", "bilinear", "area"] | None = None
    pad_value: float | None = None
    order: Literal["RGB", "BGR"] | None = None
    layout: Literal["NCHW", "NHWC"] | None = None
    value: float | None = None
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()
    dtype: str | None = None
    axis: int | None = None
    k: int | None = None
    # additive: detectors' box decoding and the labels of classes
    box_format: Literal["yolo"] | None = None
    score_threshold: float | None = None
    iou_threshold: float | None = None
    max_boxes: int | None = None
    labels_file: str | None = None  # a file of the bundle (role "labels"): one class name per line

    def __post_init__(self) -> None:
        needs: dict[str, tuple[str, ...]] = {
            "resize": ("size",),
            "center_crop": ("size",),
            "letterbox": ("size",),
            "channel_order": ("order",),
            "layout": ("layout",),
            "scale": ("value",),
            "normalize": ("mean", "std"),
            "cast": ("dtype",),
            "topk": ("k",),
            "boxes": ("box_format", "axis", "score_threshold", "iou_threshold"),
        }
        missing = [f for f in needs.get(self.op, ()) if getattr(self, f) in (None, ())]
        if missing:
            raise ValueError(f"op {self.op!r} needs {', '.join(missing)}")
        if self.op == "normalize" and len(self.mean) != len(self.std):
            raise ValueError(f"normalize: mean has {len(self.mean)} values, std {len(self.std)}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        for name in ("score_threshold", "iou_threshold"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 1:
                raise ValueError(f"{self.op}: {name} must be in [0, 1], got {value}")
        for name in ("k", "max_boxes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{self.op}: {name} must be >= 1, got {value}")


@dataclass(frozen=True)
class Compatibility:
    """What the device must have. ``key`` is compared with what the device reports."""

    runtime: str  # onnxruntime, openvino, litert, tensorrt, coreml
    runtime_version: str  # version the artifact was built/validated with on the host
    min_runtime_version: str | None = None
    arch: tuple[str, ...] = ()  # e.g. ("x86_64", "aarch64"); empty = any
    accelerator: str | None = None  # "edgetpu", "cuda", "ane", ...
    hardware: dict[str, str] = field(default_factory=dict)  # e.g. compute capability

    @property
    def key(self) -> str:
        hw = ",".join(f"{k}={v}" for k, v in sorted(self.hardware.items()))
        return f"{self.runtime}/{self.accelerator or 'cpu'}/{'|'.join(self.arch) or 'any'}/{hw}"


@dataclass(frozen=True)
class FileEntry:
    path: str
    size_bytes: int
    sha256: str
    role: Literal["artifact", "golden", "report", "calibration", "split_head", "split_tail", "labels"] = "artifact"


@dataclass(frozen=True)
class Precision:
    """Weights and activations separately; ``label`` is the short form (``w8a8``).

    ``excluded_nodes``: mixed precision, the source-graph nodes kept in higher precision (float)
    because the accuracy budget needed them, most sensitive first; ``excluded_reason`` says how
    they were chosen (e.g. "per-layer sensitivity on the calibration set").
    """

    weights: Literal["fp32", "fp16", "int8", "int4", "palettized-4bit", "palettized-6bit"]
    # bf16: OpenVINO's CPU plugin computing an IR in bf16 (label ``w16abf16``: weights stored in
    # fp16; ``w8abf16``: an INT8 IR whose float ops run in bf16)
    activations: Literal["fp32", "fp16", "bf16", "int8", "uint8", "int16"]
    method: str = ""  # what produced it, e.g. "ort-static-qdq minmax u8s8 per-channel"
    excluded_nodes: tuple[str, ...] = ()
    excluded_reason: str = ""

    @property
    def label(self) -> str:
        w = {"fp32": "w32", "fp16": "w16", "int8": "w8", "int4": "w4"}.get(self.weights, self.weights)
        a = {"fp32": "a32", "fp16": "a16", "bf16": "abf16", "int8": "a8", "uint8": "a8", "int16": "a16"}[
            self.activations
        ]
        return f"{w}{a}" if w.startswith("w") else f"{w}-{a}"


@dataclass(frozen=True)
class Tolerance:
    """Validation gate against the FP32 source model."""

    min_top1_agreement: float | None = 0.98  # classifiers
    max_top1_drop: float | None = 0.01  # with labels, absolute (1 point)
    min_cosine: float | None = 0.96  # dense outputs
    max_relative_error: float | None = 0.2  # dense outputs: mean |a-b| / mean |b|
    # v2 (optional): dense outputs of rank >= 3, the worst channel's cosine over all samples and
    # positions; catches small-scale channels (scores in 0-1 next to boxes in pixels) that one
    # quantization scale crushed while the global cosine stays high. None turns it off.
    min_channel_cosine: float | None = 0.9


@dataclass(frozen=True)
class Validation:
    """What the host measured against the FP32 model (``None`` = not measured here)."""

    passed: bool
    kind: Literal["classifier", "dense"]
    samples: int
    tolerance: Tolerance
    top1_agreement: float | None = None
    top1_accuracy: float | None = None
    fp32_top1_accuracy: float | None = None
    cosine: float | None = None
    relative_error: float | None = None
    max_abs_error: float | None = None
    mean_abs_error: float | None = None
    size_bytes: int = 0
    # v2 (optional): the worst channel's cosine of the dense outputs of rank >= 3 (see Tolerance)
    channel_cosine: float | None = None
    size_ratio: float | None = None
    latency_p50_ms: float | None = None
    fp32_latency_p50_ms: float | None = None
    measured_on: str = ""  # "host runtime onnxruntime 1.32 on x86_64" / "intermediate (torch)"
    notes: tuple[str, ...] = ()
    # v2: spread of the artifact's host latency (p90, interquartile range), same run as p50
    latency_p90_ms: float | None = None
    latency_iqr_ms: float | None = None
    # v2: True when the artifact measured slower than the FP32 source on the same runtime host
    # ("passed (slower than fp32)"); None when latency was not measured here.
    slower_than_fp32: bool | None = None
    # v2, the failed-validation mark: with ``passed`` False, one line per missed gate
    # ("top-1 agreement 0.95 < 0.98"); agents refuse such bundles unless configured otherwise.
    failures: tuple[str, ...] = ()


@dataclass(frozen=True)
class Golden:
    """Golden vectors for the on-device self-test, stored in ``file`` (npz: in_*/out_*)."""

    file: str
    count: int
    min_cosine: float = 0.99
    atol: float = 1e-3
    rtol: float = 1e-2
    min_top1_agreement: float | None = None


@dataclass(frozen=True)
class OpPlacementEntry:
    op: str
    node: str
    device: str  # "accelerator" device name, or "CPU" for fallback


@dataclass(frozen=True)
class OpPlacement:
    """Where ops run, as reported by the tool itself (compiler log, query_model, ...)."""

    tool: str
    accelerated: int
    fallback: int
    entries: tuple[OpPlacementEntry, ...] = ()
    log_file: str | None = None


@dataclass(frozen=True)
class SplitCut:
    """One place to cut the model: the head runs on the device, the tail on a v2 server.

    ``head_file`` is in this bundle; the tail is model ``tail_model`` on the tail server (its
    bundle travels separately). Sizes and fractions are measured on the host (planned: the
    split planner fills them).
    """

    id: str
    tensors: tuple[str, ...]  # tensor names at the cut (head outputs = tail inputs)
    head_file: str
    tail_model: str
    cut_bytes_per_sample: int
    head_flops_fraction: float | None = None
    head_latency_ms: float | None = None
    tail_latency_ms: float | None = None  # the tail on the server, as planned (profiled or assumed)


@dataclass(frozen=True)
class SplitPlan:
    """Split inference: the full model stays in the bundle as the local fallback (planned)."""

    cuts: tuple[SplitCut, ...]
    default_cut: str | None = None  # id of the cut to use when no budget says otherwise
    local_latency_ms: float | None = None  # the full model on the device, as planned
    output_bytes_per_sample: int | None = None  # what the tail sends back per sample


@dataclass(frozen=True)
class ApproximateCache:
    """Approximate-result cache calibration: reuse a cached result for an input whose embedding
    is within ``max_distance`` (cosine distance) of a cached one; ``agreement`` is the measured
    top-1 agreement with fresh inference at that threshold on ``samples`` held-out inputs (planned)."""

    embedding: str  # served output (or "input") whose vector is the cache key
    max_distance: float
    agreement: float
    samples: int
    # the host calibration (``edgekit.validate.cache_calibration``): false hits / hits at
    # ``max_distance``, its one-sided 95% upper bound, the budget it was held to, and the hits
    false_hit_rate: float | None = None
    false_hit_bound: float | None = None
    false_hit_budget: float | None = None
    hits: int | None = None
    bound_method: str | None = None  # e.g. "wilson one-sided 95%"


@dataclass(frozen=True)
class CachePolicy:
    """The model's result-cache policy on the device (``exact``: keyed by the input's hash)."""

    mode: Literal["exact", "approximate"] = "exact"
    ttl_s: int = 3600
    max_entries: int = 10000
    approximate: ApproximateCache | None = None

    def __post_init__(self) -> None:
        if (self.mode == "approximate") != (self.approximate is not None):
            raise ValueError("mode 'approximate' goes with an approximate calibration, and only it")


@dataclass(frozen=True)
class Estimates:
    """Resource estimates for budgets (planned): what was measured and where, never guessed."""

    memory_mb: float | None = None  # resident memory of a loaded session
    peak_memory_mb: float | None = None  # peak during load / first inference
    energy_mj_per_inference: float | None = None
    flops_per_inference: int | None = None
    measured_on: str = ""


@dataclass(frozen=True)
class CompressionStep:
    """One step that produced the artifact from the source model, in order (provenance).

    ``kind`` examples: fix_shapes, fold_constants, simplify, graph_optimize, convert, prune,
    distill, low_rank, palettize, quantize. ``metric`` names what ``before``/``after`` measure
    (e.g. "top1_agreement" against the ORIGINAL model).
    """

    kind: str
    tool: str
    settings: dict[str, str] = field(default_factory=dict)
    metric: str = ""
    before: float | None = None
    after: float | None = None
    notes: str = ""


@dataclass(frozen=True)
class CalibrationData:
    """Identity of the calibration (and selection) data, so a build can be reproduced."""

    sha256: str  # over the arrays actually used, in order (see edgekit.validate.calib)
    samples: int
    source: str = ""  # file or folder name as given
    selection: str = ""  # how the subset was drawn, e.g. "stratified by fp32 top-1, seed 0"


@dataclass(frozen=True)
class CandidateResult:
    """One candidate the optimisation engine built (or tried to), with what it measured."""

    id: str
    settings: dict[str, str]
    status: Literal["chosen", "passed", "failed", "error", "skipped"]
    reason: str = ""  # why failed / error (the SDK's message) / skipped (dominated by ...) / chosen (why it won)
    top1_agreement: float | None = None
    top1_drop: float | None = None
    cosine: float | None = None
    relative_error: float | None = None
    size_bytes: int | None = None
    latency_p50_ms: float | None = None
    latency_p90_ms: float | None = None
    latency_iqr_ms: float | None = None
    speedup_vs_fp32: float | None = None
    excluded_nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class CandidateReport:
    """The optimisation engine's search: objective, budget, every candidate, the choice.

    Candidates are compared on ``selection_samples`` samples that the final gate (``validation``)
    does not see. ``latency_measured`` False means the runtime cannot run here (the choice
    follows the device class's documented preference order, said in ``notes``).
    """

    objective: Literal["latency", "size", "accuracy"]
    budget: Tolerance
    chosen: str
    selection_samples: int
    latency_measured: bool
    candidates: tuple[CandidateResult, ...]
    measured_on: str = ""
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Manifest:
    schema_version: int
    name: str
    version: int
    created: str
    target: str
    compatibility: Compatibility
    source: SourceModel
    files: tuple[FileEntry, ...]
    signature: Signature  # served: the source ONNX model's interface
    artifact_signature: Signature
    mapping: tuple[TensorMapping, ...]
    precision: Precision
    validation: Validation
    golden: Golden
    expires: str | None = None
    signer_key_id: str = ""
    description: str = ""
    preprocess: tuple[ProcessingStep, ...] = ()
    postprocess: tuple[ProcessingStep, ...] = ()
    op_placement: OpPlacement | None = None
    split: SplitPlan | None = None
    variants: tuple[str, ...] = ()
    cache: CachePolicy | None = None
    estimates: Estimates | None = None
    target_options: dict[str, Any] = field(default_factory=dict)
    # v2 additions (all optional)
    # the model keeps state between calls (RNN state, KV cache): never cached or batched across clients
    stateful: bool = False
    calibration: CalibrationData | None = None
    provenance: tuple[CompressionStep, ...] = ()
    candidates: CandidateReport | None = None
    # whether each row's outputs depend on that row alone (golden rows run as a batch of 2 and
    # alone, same runtime, within the golden tolerance): false, an agent refuses to batch the
    # model (other clients' rows would change an answer); absent, not checked
    rows_independent: bool | None = None

    def __post_init__(self) -> None:
        if self.schema_version != SCHEMA_VERSION:
            raise ValueError(f"schema_version {self.schema_version} is not {SCHEMA_VERSION}")
        if not self.name or not all(c.isalnum() or c in "-_." for c in self.name):
            raise ValueError(f"name {self.name!r} must be letters, digits, '-', '_' or '.'")
        if self.version < 1:
            raise ValueError(f"version must be >= 1, got {self.version}")
        paths = [f.path for f in self.files]
        if len(set(paths)) != len(paths):
            raise ValueError("files lists a path twice")
        if self.golden.file not in paths:
            raise ValueError(f"golden.file {self.golden.file!r} is not in files")
        if self.split is not None:
            for cut in self.split.cuts:
                if cut.head_file not in paths:
                    raise ValueError(f"split cut {cut.id!r}: head_file {cut.head_file!r} is not in files")
            ids = [c.id for c in self.split.cuts]
            if self.split.default_cut is not None and self.split.default_cut not in ids:
                raise ValueError(f"split.default_cut {self.split.default_cut!r} is not one of {ids}")
        for step in (*self.preprocess, *self.postprocess):
            if step.labels_file is not None and step.labels_file not in paths:
                raise ValueError(f"{step.op}: labels_file {step.labels_file!r} is not in files")
        if self.validation.passed and self.validation.failures:
            raise ValueError("validation.passed is true but validation.failures lists missed gates")

    # -- serialisation ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = to_data(self)
        return {"schema_version": data.pop("schema_version"), **data}

    def to_json(self) -> bytes:
        """Canonical bytes: what is signed and what is stored in the bundle."""
        return json.dumps(self.to_dict(), indent=1, sort_keys=False).encode() + b"\n"

    @classmethod
    def from_dict(cls, data: Any) -> Manifest:
        if not isinstance(data, dict):
            raise ManifestError("manifest: expected a JSON object")
        data = migrate(dict(data))
        return from_data(cls, data, "manifest")

    @classmethod
    def from_json(cls, raw: bytes) -> Manifest:
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"manifest: {len(raw)} bytes is over the {MAX_MANIFEST_BYTES} cap")
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ManifestError(f"manifest: not valid JSON ({exc})") from exc
        return cls.from_dict(data)

    # -- helpers ------------------------------------------------------------------------
    def file(self, path: str) -> FileEntry:
        for entry in self.files:
            if entry.path == path:
                return entry
        raise KeyError(path)

    def artifact_files(self) -> tuple[FileEntry, ...]:
        return tuple(f for f in self.files if f.role == "artifact")

    def expired(self, now: datetime | None = None) -> bool:
        if self.expires is None:
            return False
        now = now or datetime.now(timezone.utc)
        return parse_time(self.expires) <= now

    def with_updates(self, **changes: Any) -> Manifest:
        return replace(self, **changes)


def _v1_to_v2(data: dict[str, Any]) -> dict[str, Any]:
    """v1 -> v2: typed processing steps, split plan with cuts, cache mode; the rest is additive."""
    out = dict(data, schema_version=2)
    for key in ("preprocess", "postprocess"):
        steps = []
        for step in out.get(key) or ():
            if isinstance(step, dict) and isinstance(step.get("params"), dict):
                step = {"op": step.get("op"), **step["params"]}
            steps.append(step)
        if key in out:
            out[key] = steps
    split = out.get("split")
    if isinstance(split, dict) and "cut" in split:
        out["split"] = {
            "cuts": [
                {
                    "id": "cut0",
                    "tensors": split.get("cut"),
                    "head_file": split.get("head_file"),
                    "tail_model": split.get("tail_file"),
                    "cut_bytes_per_sample": split.get("cut_bytes_per_sample"),
                }
            ],
            "default_cut": "cut0",
        }
    cache = out.get("cache")
    if isinstance(cache, dict) and "enabled" in cache:
        cache = dict(cache)
        out["cache"] = None if not cache.pop("enabled") else {**cache, "mode": "exact"}
    return out


MIGRATIONS[1] = _v1_to_v2


def migrate(data: dict[str, Any]) -> dict[str, Any]:
    """Bring a manifest dict up to ``SCHEMA_VERSION`` (or refuse a newer one)."""
    return upgrade(
        data, "schema_version", SCHEMA_VERSION, MIGRATIONS, "manifest", ManifestError, "upgrade edgekit on the device"
    )


def utc_now() -> str:
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def parse_time(text: str) -> datetime:
    try:
        dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as exc:
        raise ManifestError(f"manifest: {text!r} is not an ISO 8601 time") from exc
    return dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)


def sha256_file(path: Any, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
