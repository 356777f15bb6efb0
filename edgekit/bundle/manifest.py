"""Manifest v1: the only thing the device trusts about a model.

Frozen dataclasses, ``schema_version`` first, unknown keys rejected (see ``codec``). The JSON
Schema in ``schema/manifest.v1.schema.json`` describes the same structure for other tools; the
golden-file test keeps the two and ``tests/golden/manifest_v1.json`` in step.

A schema change bumps ``SCHEMA_VERSION`` and adds a migration to ``MIGRATIONS`` (house rule 1).
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

SCHEMA_VERSION = 1
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


@dataclass(frozen=True)
class ProcessingStep:
    """Pre- or post-processing described as data, applied by the agent (never code).

    ``op`` is one of: ``scale`` (x * value), ``normalize`` (x - mean) / std per channel,
    ``softmax`` (axis), ``cast`` (dtype).
    """

    op: Literal["scale", "normalize", "softmax", "cast"]
    params: dict[str, Any] = field(default_factory=dict)


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
    role: Literal["artifact", "golden", "report", "calibration", "split_head", "split_tail"] = "artifact"


@dataclass(frozen=True)
class Precision:
    """Weights and activations separately; ``label`` is the short form (``w8a8``)."""

    weights: Literal["fp32", "fp16", "int8", "int4", "palettized-4bit", "palettized-6bit"]
    activations: Literal["fp32", "fp16", "int8", "uint8", "int16"]
    method: str = ""  # what produced it, e.g. "ort-static-qdq minmax u8s8 per-channel"

    @property
    def label(self) -> str:
        w = {"fp32": "w32", "fp16": "w16", "int8": "w8", "int4": "w4"}.get(self.weights, self.weights)
        a = {"fp32": "a32", "fp16": "a16", "int8": "a8", "uint8": "a8", "int16": "a16"}[self.activations]
        return f"{w}{a}" if w.startswith("w") else f"{w}-{a}"


@dataclass(frozen=True)
class Tolerance:
    """Validation gate against the FP32 source model."""

    min_top1_agreement: float | None = 0.98  # classifiers
    max_top1_drop: float | None = 0.01  # with labels, absolute (1 point)
    min_cosine: float | None = 0.96  # dense outputs
    max_relative_error: float | None = 0.2  # dense outputs: mean |a-b| / mean |b|


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
    size_ratio: float | None = None
    latency_p50_ms: float | None = None
    fp32_latency_p50_ms: float | None = None
    measured_on: str = ""  # "host runtime onnxruntime 1.32 on x86_64" / "intermediate (torch)"
    notes: tuple[str, ...] = ()


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
class SplitPlan:
    cut: tuple[str, ...]  # tensor names at the cut
    head_file: str
    tail_file: str
    cut_bytes_per_sample: int


@dataclass(frozen=True)
class CachePolicy:
    enabled: bool = True
    ttl_s: int = 3600
    max_entries: int = 10000


@dataclass(frozen=True)
class Estimates:
    memory_mb: float | None = None
    energy_mj_per_inference: float | None = None


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
