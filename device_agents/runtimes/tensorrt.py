"""TensorRT runner: the ``jetson`` target's runtime.

The bundle carries ONNX (FP32, or explicit-quantization Q/DQ for INT8) and the builder flags in
``target_options.builder_flags``. On first load the engine is built with the TensorRT Python API
(ONNX parser, workspace bounded by ``[runtimes.tensorrt] workspace_mb`` and the memory budget, and
an optimization profile: the manifest's ``target_options.optimization_profile`` (min/opt/max per
input, ``edgekit package --batch 1,4,8``), else pinned to its static input shapes) and cached in
``cache_dir``, keyed by GPU name, compute capability, TensorRT version, builder
flags, shapes, profile and the artifact's sha256: engines are not portable, so a change of any of these
builds a new one. Inference uses ``execute_async_v3`` with tensor addresses of torch CUDA tensors;
under a profile each call sets its input shapes, and a batch above the profile's maximum runs in parts.

Without the ``tensorrt`` package, ``[runtimes.tensorrt] fallback`` = ``ort-trt`` or
``ort-cuda`` runs the same ONNX with ONNX Runtime's TensorRT or CUDA execution provider.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from device_agents.errors import IncompatibleError
from device_agents.runtimes.options import TensorRtOptions
from edgekit.bundle.errors import BundleError, InferenceInputError, MissingSDKError
from edgekit.bundle.manifest import Manifest, Precision

FALLBACKS = {"ort-trt": "TensorrtExecutionProvider", "ort-cuda": "CUDAExecutionProvider"}
DEFAULT_WORKSPACE_MB = 1024
PROFILE_KEY = "optimization_profile"  # edgekit.targets.shape_profile writes it
ShapeRange = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # (min, opt, max)
ENGINE_SUFFIX = ".engine"


# -- engine cache (pure python) --------------------------------------------------------------


@dataclass(frozen=True)
class EngineKey:
    """Everything a serialized engine depends on; a different key means a different engine."""

    artifact_sha256: str
    gpu_name: str
    compute_capability: str  # "8.7"
    tensorrt_version: str
    builder_flags: tuple[str, ...]
    input_shapes: tuple[tuple[str, tuple[int, ...]], ...]
    profile: tuple[tuple[str, ShapeRange], ...] = ()  # the recorded optimization profile, () when pinned

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()

    @property
    def file_name(self) -> str:
        return f"{self.artifact_sha256[:16]}-{self.digest[:16]}{ENGINE_SUFFIX}"


class EngineCache:
    """Serialized engines on disk, one file per key (plus a ``.json`` with the key).

    Storing an engine removes the engines of the same artifact built under another key (another
    GPU, TensorRT version or flags): they cannot be loaded here again. ``directory=None``
    disables caching (every load builds).
    """

    def __init__(self, directory: Path | None) -> None:
        self.directory = Path(directory) if directory is not None else None

    def path(self, key: EngineKey) -> Path | None:
        return self.directory / key.file_name if self.directory is not None else None

    def load(self, key: EngineKey) -> bytes | None:
        path = self.path(key)
        if path is None or not path.is_file():
            return None
        try:
            recorded = json.loads(path.with_suffix(".json").read_text())
        except (OSError, json.JSONDecodeError):
            return None
        if recorded != json.loads(json.dumps(asdict(key))):
            return None  # a digest-prefix collision or a hand-edited file: do not trust it
        return path.read_bytes()

    def store(self, key: EngineKey, engine: bytes) -> Path | None:
        path = self.path(key)
        if path is None:
            return None
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(path.with_suffix(".json"), json.dumps(asdict(key), indent=1).encode())
        _write_atomic(path, engine)
        for stale in path.parent.glob(f"{key.artifact_sha256[:16]}-*{ENGINE_SUFFIX}"):
            if stale != path:
                stale.unlink(missing_ok=True)
                stale.with_suffix(".json").unlink(missing_ok=True)
        return path

    def discard(self, key: EngineKey) -> None:
        path = self.path(key)
        if path is not None:
            path.unlink(missing_ok=True)
            path.with_suffix(".json").unlink(missing_ok=True)

    def load_or_build(self, key: EngineKey, build: Callable[[], bytes]) -> tuple[bytes, str]:
        """(engine, how): ``hit`` from the cache, ``built`` and stored, or ``built, not cached``."""
        cached = self.load(key)
        if cached is not None:
            return cached, "hit"
        engine = build()
        return engine, "built" if self.store(key, engine) is not None else "built, not cached"


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def workspace_bound_mb(options: TensorRtOptions, manifest: Manifest) -> int:
    """Builder workspace: the agent's ``workspace_mb``, else the bundle's, else 1024 MB; never
    above ``memory_budget_mb`` (0 = no bound)."""
    requested = options.workspace_mb or int(manifest.target_options.get("workspace_mb", 0)) or DEFAULT_WORKSPACE_MB
    return min(requested, options.memory_budget_mb) if options.memory_budget_mb else requested


def builder_flags(manifest: Manifest) -> tuple[str, ...]:
    """Builder precision flags from the bundle (``target_options.builder_flags``, else its precision)."""
    flags = manifest.target_options.get("builder_flags")
    if flags is None:
        flags = _flags_for(manifest.precision)
    unknown = [f for f in flags if f not in ("fp16", "int8")]
    if unknown:
        raise BundleError(f"builder flag {unknown[0]!r} is not one of fp16, int8; package the bundle again")
    return tuple(flags)


def _flags_for(precision: Precision) -> tuple[str, ...]:
    if precision.weights == "int8":
        return ("int8",)
    return ("fp16",) if precision.weights == "fp16" else ()


def static_input_shapes(manifest: Manifest) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for spec in manifest.artifact_signature.inputs:
        if not all(isinstance(d, int) for d in spec.shape):
            raise BundleError(
                f"input {spec.name!r} has dynamic shape {spec.v2_shape}; a tensorrt bundle records static shapes"
            )
        shapes[spec.name] = tuple(int(d) for d in spec.shape)
    return shapes


def engine_profile(manifest: Manifest) -> dict[str, ShapeRange]:
    """Per artifact input, the (min, opt, max) shapes its engine's optimization profile is built
    with: the manifest's recorded profile (``target_options.optimization_profile``), else its static
    shapes (min = opt = max). A malformed profile is a ``BundleError``."""
    recorded = manifest.target_options.get(PROFILE_KEY)
    if not recorded:
        return {name: (shape, shape, shape) for name, shape in static_input_shapes(manifest).items()}
    if not isinstance(recorded, dict):
        raise BundleError(f"target_options.{PROFILE_KEY} is not a table of inputs; package the bundle again")
    out: dict[str, ShapeRange] = {}
    for spec in manifest.artifact_signature.inputs:
        where = f"target_options.{PROFILE_KEY}.{spec.name}"
        entry: Any = recorded.get(spec.name)
        try:
            lo, opt, hi = (tuple(int(d) for d in entry[k]) for k in ("min", "opt", "max"))
        except (TypeError, KeyError, ValueError) as exc:
            raise BundleError(f"{where}: expected min, opt and max shapes; package the bundle again") from exc
        for axis, dim in enumerate(spec.shape):
            sizes = (lo[axis], opt[axis], hi[axis]) if len(lo) == len(opt) == len(hi) == len(spec.shape) else ()
            if not sizes or not 1 <= sizes[0] <= sizes[1] <= sizes[2] or (isinstance(dim, int) and set(sizes) != {dim}):
                raise BundleError(
                    f"{where}: {list(lo)} / {list(opt)} / {list(hi)} does not fit input {spec.name!r} {spec.v2_shape}"
                )
        out[spec.name] = (lo, opt, hi)
    return out


def onnx_artifact(model_dir: Path, manifest: Manifest) -> tuple[Path, str]:
    found = [f for f in manifest.artifact_files() if f.path.endswith(".onnx")]
    if len(found) != 1:
        raise BundleError(f"tensorrt needs exactly one .onnx artifact, manifest lists {len(found)}")
    return Path(model_dir) / found[0].path, found[0].sha256


# -- the runner --------------------------------------------------------------------------------


class TensorRtRunner:
    name: ClassVar[str] = "tensorrt"
    serialize: ClassVar[bool] = True  # one execution context: calls are serialized by ServedModel

    def __init__(self, model_dir: Path, manifest: Manifest, options: TensorRtOptions) -> None:
        fallback = options.fallback
        try:
            import tensorrt as trt
        except ImportError as exc:
            if not fallback:
                raise MissingSDKError(
                    "tensorrt",
                    "tensorrt",
                    "the tensorrt runtime (or set [runtimes.tensorrt] fallback = ort-trt | ort-cuda)",
                ) from exc
            self._impl: _TrtEngine | _OrtFallback = _OrtFallback(model_dir, manifest, options, fallback)
        else:
            self._impl = _TrtEngine(trt, model_dir, manifest, options)

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self._impl.run(inputs)

    def describe(self) -> dict[str, Any]:
        return self._impl.describe()

    def layer_information(self) -> dict[str, Any] | None:
        """TensorRT's own layer report (``IEngineInspector``, JSON format); ``None`` under a fallback."""
        return self._impl.layer_info

    def close(self) -> None:
        self._impl.close()


class _TrtEngine:
    def __init__(self, trt: Any, model_dir: Path, manifest: Manifest, options: TensorRtOptions) -> None:
        torch = _torch_cuda()
        self.trt, self.torch = trt, torch
        onnx_path, sha = onnx_artifact(model_dir, manifest)
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        self.flags = builder_flags(manifest)
        self.profile = engine_profile(manifest)
        shapes = {name: r[1] for name, r in self.profile.items()}  # opt: the shape a call starts from
        self.ranged = bool(manifest.target_options.get(PROFILE_KEY))
        self.workspace_mb = workspace_bound_mb(options, manifest)
        self.key = EngineKey(
            artifact_sha256=sha,
            gpu_name=props.name,
            compute_capability=f"{props.major}.{props.minor}",
            tensorrt_version=trt.__version__,
            builder_flags=self.flags,
            input_shapes=tuple(sorted(shapes.items())),
            profile=tuple(sorted(self.profile.items())) if self.ranged else (),
        )
        self.logger = trt.Logger(trt.Logger.WARNING)
        cache = EngineCache(options.cache_dir)

        def build() -> bytes:
            return build_engine(trt, self.logger, onnx_path, self.flags, self.profile, self.workspace_mb)

        plan, self.cache_status = cache.load_or_build(self.key, build)
        runtime = trt.Runtime(self.logger)
        engine = runtime.deserialize_cuda_engine(plan)
        if engine is None and self.cache_status == "hit":  # a damaged cache file: build it again
            cache.discard(self.key)
            plan, _ = cache.load_or_build(self.key, build)
            self.cache_status = "rebuilt (the cached engine did not load)"
            engine = runtime.deserialize_cuda_engine(plan)
        if engine is None:
            raise IncompatibleError(
                f"TensorRT {trt.__version__} could not load the engine it built for {onnx_path.name}"
            )
        self.engine = engine
        self.context = engine.create_execution_context()
        self.stream = torch.cuda.Stream()
        self.inputs: dict[str, tuple[np.dtype[Any], tuple[int, ...]]] = {}
        self.outputs: dict[str, np.dtype[Any]] = {}
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            dtype = np.dtype(trt.nptype(engine.get_tensor_dtype(name)))
            if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
                self.inputs[name] = (dtype, shapes[name])
                self.context.set_input_shape(name, shapes[name])
            else:
                self.outputs[name] = dtype
        inspector = engine.create_engine_inspector()
        self.layer_info: dict[str, Any] | None = json.loads(
            inspector.get_engine_information(trt.LayerInformationFormat.JSON)
        )

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        arrays = {name: np.ascontiguousarray(inputs[name], dtype=dtype) for name, (dtype, _) in self.inputs.items()}
        for name, arr in arrays.items():
            check_in_profile(name, arr.shape, self.profile[name], self.ranged)
        parts = split_over_profile(arrays, self.profile) if self.ranged else [arrays]
        if len(parts) == 1:
            return self._run_once(arrays)
        done = [self._run_once(part) for part in parts]
        return {name: np.concatenate([d[name] for d in done]) for name in done[0]}

    def _run_once(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        torch = self.torch
        held = []  # device buffers must outlive the asynchronous execution
        with torch.cuda.stream(self.stream):
            for name, arr in arrays.items():
                if self.ranged:
                    self.context.set_input_shape(name, arr.shape)
                buf = torch.from_numpy(arr).to("cuda", non_blocking=True)
                held.append(buf)
                self.context.set_tensor_address(name, buf.data_ptr())
            outs = {}
            for name, dtype in self.outputs.items():
                shape = tuple(self.context.get_tensor_shape(name))
                out = torch.empty(shape, dtype=_torch_dtype(torch, dtype), device="cuda")
                outs[name] = out
                self.context.set_tensor_address(name, out.data_ptr())
            if not self.context.execute_async_v3(self.stream.cuda_stream):
                raise RuntimeError("TensorRT execute_async_v3 failed; see the TensorRT log")
        self.stream.synchronize()
        return {name: out.cpu().numpy() for name, out in outs.items()}

    def describe(self) -> dict[str, Any]:
        layers = (self.layer_info or {}).get("Layers", [])
        return {
            "runtime": "tensorrt",
            "version": self.trt.__version__,
            "device": self.key.gpu_name,
            "compute_capability": self.key.compute_capability,
            "builder_flags": list(self.flags),
            "workspace_mb": self.workspace_mb,
            "optimization_profile": {n: [list(s) for s in r] for n, r in self.profile.items()},
            "engine_cache": self.cache_status,
            "engine_key": self.key.digest,
            "layers": len(layers),
        }

    def close(self) -> None:
        self.context = None
        self.engine = None


def build_engine(
    trt: Any,
    logger: Any,
    onnx_path: Path,
    flags: tuple[str, ...],
    profile: Mapping[str, ShapeRange],
    workspace_mb: int,
) -> bytes:
    """Parse ``onnx_path`` and build a serialized engine (TensorRT Python API), its dynamic inputs
    under one optimization profile: ``profile`` (``engine_profile``), input -> (min, opt, max)."""
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # TensorRT 10: explicit batch is the only mode
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise IncompatibleError(
            f"TensorRT {trt.__version__}'s ONNX parser refused {onnx_path.name}: {'; '.join(errors[:3])}"
        )
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_mb * 1024 * 1024)
    for flag in flags:
        config.set_flag({"fp16": trt.BuilderFlag.FP16, "int8": trt.BuilderFlag.INT8}[flag])
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED  # for the layer report
    dynamic = [network.get_input(i) for i in range(network.num_inputs) if -1 in tuple(network.get_input(i).shape)]
    if dynamic:
        ranges = builder.create_optimization_profile()
        for tensor in dynamic:
            lo, opt, hi = profile[tensor.name]
            ranges.set_shape(tensor.name, lo, opt, hi)
        config.add_optimization_profile(ranges)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise IncompatibleError(
            f"TensorRT {trt.__version__} could not build an engine for {onnx_path.name} "
            f"(flags {list(flags) or 'fp32'}, workspace {workspace_mb} MB); see the TensorRT log above"
        )
    return bytes(serialized)


class _OrtFallback:
    """The bundle's ONNX under ONNX Runtime's TensorRT or CUDA execution provider."""

    layer_info: dict[str, Any] | None = None

    def __init__(self, model_dir: Path, manifest: Manifest, options: TensorRtOptions, fallback: str) -> None:
        try:
            import onnxruntime as ort
        except ImportError as exc:
            raise MissingSDKError("onnxruntime-gpu", "agent", f"the tensorrt runtime's {fallback} fallback") from exc
        onnx_path, _ = onnx_artifact(model_dir, manifest)
        self.provider = FALLBACKS[fallback]
        self.fallback = fallback
        self.version = ort.__version__
        available = ort.get_available_providers()
        if self.provider not in available:
            raise IncompatibleError(
                f"runtime fallback {fallback!r} needs ONNX Runtime's {self.provider}, and onnxruntime "
                f"{ort.__version__} here has {', '.join(available)}: install onnxruntime-gpu, or install tensorrt"
            )
        self.flags = builder_flags(manifest)
        providers: list[Any]
        if self.provider == "TensorrtExecutionProvider":
            trt_options: dict[str, Any] = {
                "trt_fp16_enable": "fp16" in self.flags,
                "trt_int8_enable": "int8" in self.flags,
                "trt_max_workspace_size": workspace_bound_mb(options, manifest) * 1024 * 1024,
            }
            if options.cache_dir is not None:
                trt_options |= {"trt_engine_cache_enable": True, "trt_engine_cache_path": str(options.cache_dir)}
            if manifest.target_options.get(PROFILE_KEY):  # the same profile through ONNX Runtime's TensorRT EP
                trt_options |= ort_trt_profile_options(engine_profile(manifest))
            providers = [(self.provider, trt_options), "CUDAExecutionProvider"]
        else:
            providers = [self.provider]
        so = ort.SessionOptions()
        if options.threads:
            so.intra_op_num_threads = options.threads
        self.session = ort.InferenceSession(str(onnx_path), so, providers=providers)
        if self.session.get_providers()[0] != self.provider:
            raise IncompatibleError(
                f"ONNX Runtime could not start {self.provider} (CUDA/TensorRT libraries missing?) and would run "
                f"on {self.session.get_providers()[0]}; fix the GPU libraries or use the cpu target"
            )
        self._outputs = [o.name for o in self.session.get_outputs()]

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self._outputs, self.session.run(self._outputs, dict(inputs)), strict=True))

    def describe(self) -> dict[str, Any]:
        described: dict[str, Any] = {
            "runtime": "tensorrt",
            "version": f"onnxruntime {self.version}",
            "fallback": self.fallback,
            "providers": self.session.get_providers(),
            "builder_flags": list(self.flags),
        }
        if self.provider == "CUDAExecutionProvider" and self.flags:
            described["note"] = f"CUDA EP runs the ONNX as it is; builder flags {list(self.flags)} do not apply"
        return described

    def close(self) -> None:
        self.session = None  # released; the runner is not used again


def ort_trt_profile_options(profile: Mapping[str, ShapeRange]) -> dict[str, str]:
    """ONNX Runtime TensorRT EP options for an optimization profile (``trt_profile_min_shapes`` and
    friends take ``name:1x3x224x224,other:...``)."""
    keys = ("trt_profile_min_shapes", "trt_profile_opt_shapes", "trt_profile_max_shapes")
    return {
        key: ",".join(f"{name}:{'x'.join(map(str, r[i]))}" for name, r in profile.items()) for i, key in enumerate(keys)
    }


def check_in_profile(name: str, shape: tuple[int, ...], r: ShapeRange, ranged: bool = True) -> None:
    """``InferenceInputError`` (a 400) for a request shape the engine cannot take. Under a recorded
    profile axis 0 may exceed its maximum batch (``split_over_profile`` runs the call in parts)."""
    lo, _, hi = r
    fits = len(shape) == len(lo) and all(
        a <= s and (s <= b or (ranged and axis == 0)) for axis, (a, s, b) in enumerate(zip(lo, shape, hi, strict=True))
    )
    if fits and ranged and shape and shape[0] > hi[0] and 0 < shape[0] % hi[0] < lo[0]:
        fits = False  # the last part would be smaller than the profile's minimum batch
    if not fits:
        fixed = lo == hi
        takes = list(lo) if fixed else f"{list(lo)} to {list(hi)} (its optimization profile)"
        raise InferenceInputError(f"input {name!r}: shape {list(shape)}; this TensorRT engine takes {takes}")


def split_over_profile(
    arrays: Mapping[str, np.ndarray], profile: Mapping[str, ShapeRange]
) -> list[dict[str, np.ndarray]]:
    """``arrays`` cut along axis 0 into parts no larger than the profile's maximum batch."""
    limit = min(r[2][0] for r in profile.values()) if profile else 0
    total = next(iter(arrays.values())).shape[0] if arrays else 0
    if not limit or total <= limit:
        return [dict(arrays)]
    return [{n: a[start : start + limit] for n, a in arrays.items()} for start in range(0, total, limit)]


def _torch_cuda() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise MissingSDKError("torch (a CUDA build)", "tensorrt", "TensorRT input/output buffers") from exc
    if not torch.cuda.is_available():
        raise IncompatibleError(
            f"the tensorrt runtime needs a CUDA GPU and torch {torch.__version__} sees none "
            "(a CPU-only torch build, or no NVIDIA driver); install a CUDA build of torch or ship the cpu target"
        )
    return torch


def _torch_dtype(torch: Any, dtype: np.dtype[Any]) -> Any:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


__all__ = [
    "FALLBACKS",
    "EngineCache",
    "EngineKey",
    "TensorRtRunner",
    "build_engine",
    "builder_flags",
    "workspace_bound_mb",
]
