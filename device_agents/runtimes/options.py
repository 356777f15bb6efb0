"""Typed device-side options, one frozen dataclass per runtime (``[runtimes.<runtime>]`` in agent.toml).

Each runtime module reads only its own class; nothing reaches an SDK as a free-form dict. This
module imports no SDK (the config loads it), so the runtime modules' SDK imports stay where they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

COMPUTE_UNITS = ("ALL", "CPU_AND_NE", "CPU_AND_GPU", "CPU_ONLY")


def _check_non_negative(**numbers: int) -> None:
    for label, number in numbers.items():
        if number < 0:
            raise ValueError(f"{label} must be >= 0 (0 = the runtime's default), got {number}")


@dataclass(frozen=True)
class OnnxRuntimeOptions:
    """ONNX Runtime session settings."""

    # intra-op threads; 0 = ONNX Runtime's default (one per physical core), or the CPUs this process
    # may use where that is fewer (affinity, cgroup quota: device_agents.cpus)
    threads: int = 0
    inter_op_threads: int = 0  # 0 = ONNX Runtime's default
    providers: tuple[str, ...] = ()  # execution providers in preference order; () = CPUExecutionProvider
    # session.intra_op.allow_spinning: idle intra-op threads spin for work (ORT's default) or sleep.
    # Spinning trades CPU for wake-up latency; on a device whose cores the server's own threads
    # (and other processes) share, the spinning threads take the cores those need.
    spinning: bool = True
    # session.force_spinning_stop: with spinning on, whether the threads keep spinning after a run
    # returns (ORT's default) or sleep until the next run (false: they still spin inside a run,
    # between its parallel sections). Between runs is when a server's own threads need the cores.
    # Not the default: on bench/serving.py's MLP (2 cores, clients on them) it was mixed at 16
    # clients (agent / client CPU per request 2.60-3.32 vs 2.82-2.99 spinning, three quiet runs
    # each) and cost latency at 1 client (p50 2.11-2.26 ms vs 1.55-1.68 in two of three runs: the
    # threads are woken for every run).
    spin_between_runs: bool = True
    # SessionOptions.enable_cpu_mem_arena; None = ONNX Runtime's default (on), off under a [budgets]
    # memory_mb (device_agents.budgets.knobs): the arena keeps a large batch's activations for good
    cpu_mem_arena: bool | None = None
    # SessionOptions.enable_mem_pattern (one block per input shape, planned ahead); None = ONNX
    # Runtime's default (on), off under a [budgets] memory_mb
    mem_pattern: bool | None = None

    def __post_init__(self) -> None:
        _check_non_negative(threads=self.threads, inter_op_threads=self.inter_op_threads)


@dataclass(frozen=True)
class OpenVinoOptions:
    """OpenVINO ``compile_model`` settings. Each field is one OpenVINO property."""

    device: str = ""  # CPU, GPU, NPU, AUTO, ...; "" = the bundle's device, else AUTO
    threads: int = 0  # INFERENCE_NUM_THREADS; 0 = OpenVINO's default, capped by a cgroup CPU quota
    cache_dir: Path | None = None  # CACHE_DIR: compiled-model cache
    performance_hint: Literal["", "LATENCY", "THROUGHPUT", "CUMULATIVE_THROUGHPUT"] = ""  # PERFORMANCE_HINT
    num_streams: int = 0  # NUM_STREAMS; 0 = OpenVINO's default
    # INFERENCE_PRECISION_HINT; "" = what the manifest promises. bf16/f16 on a CPU trade accuracy the
    # host did not validate for speed: set it only after measuring. bf16 where the CPU's OpenVINO
    # reports no BF16 computes f32, with a warning.
    inference_precision: Literal["", "f32", "f16", "bf16"] = ""
    # CPU_RUNTIME_CACHE_CAPACITY (CPU device only): how many input shapes' compiled kernels the CPU
    # plugin keeps; None = OpenVINO's default (5000), 0 under a [budgets] memory_mb
    runtime_cache_capacity: int | None = None

    def __post_init__(self) -> None:
        _check_non_negative(threads=self.threads, num_streams=self.num_streams)
        if self.runtime_cache_capacity is not None and self.runtime_cache_capacity < 0:
            raise ValueError(f"runtime_cache_capacity must be >= 0 (0: no cache), got {self.runtime_cache_capacity}")


@dataclass(frozen=True)
class LiteRtOptions:
    """LiteRT interpreter settings."""

    threads: int = 0  # interpreter threads; 0 = LiteRT's default
    edgetpu_library: str = "libedgetpu.so.1"  # the Edge TPU delegate, for bundles compiled for it

    def __post_init__(self) -> None:
        _check_non_negative(threads=self.threads)
        if not self.edgetpu_library:
            raise ValueError("edgetpu_library must name the delegate library, e.g. 'libedgetpu.so.1'")


@dataclass(frozen=True)
class TensorRtOptions:
    """TensorRT engine-building settings (and the ONNX Runtime GPU fallback without tensorrt)."""

    workspace_mb: int = 0  # builder workspace bound; 0 = the bundle's, else 1024 MB
    memory_budget_mb: int = 0  # the workspace never goes above this; 0 = no bound
    cache_dir: Path | None = None  # serialized engines (they are built on first load)
    fallback: Literal["", "ort-trt", "ort-cuda"] = ""  # without the tensorrt package: ONNX Runtime's EP
    threads: int = 0  # the fallback session's intra-op threads

    def __post_init__(self) -> None:
        _check_non_negative(
            workspace_mb=self.workspace_mb, memory_budget_mb=self.memory_budget_mb, threads=self.threads
        )


@dataclass(frozen=True)
class CoreMlOptions:
    """Core ML settings."""

    compute_units: Literal["", "ALL", "CPU_AND_NE", "CPU_AND_GPU", "CPU_ONLY"] = ""  # "" = the bundle's, else ALL


RuntimeOptions = OnnxRuntimeOptions | OpenVinoOptions | LiteRtOptions | TensorRtOptions | CoreMlOptions


@dataclass(frozen=True)
class RuntimesConfig:
    """``[runtimes.<runtime>]``: one table per runtime, each optional."""

    onnxruntime: OnnxRuntimeOptions = field(default_factory=OnnxRuntimeOptions)
    openvino: OpenVinoOptions = field(default_factory=OpenVinoOptions)
    litert: LiteRtOptions = field(default_factory=LiteRtOptions)
    tensorrt: TensorRtOptions = field(default_factory=TensorRtOptions)
    coreml: CoreMlOptions = field(default_factory=CoreMlOptions)

    def options_for(self, runtime: str) -> RuntimeOptions:
        """The options of ``runtime`` (a key of ``device_agents.runtimes.RUNTIMES``)."""
        options: RuntimeOptions | None = getattr(self, runtime, None)
        if options is None:
            raise ValueError(f"no [runtimes.{runtime}] options (runtimes: {', '.join(OPTIONS)})")
        return options


# runtime name -> its options class (the same names as device_agents.runtimes.RUNTIMES)
OPTIONS: dict[str, type[RuntimeOptions]] = {
    "onnxruntime": OnnxRuntimeOptions,
    "openvino": OpenVinoOptions,
    "litert": LiteRtOptions,
    "tensorrt": TensorRtOptions,
    "coreml": CoreMlOptions,
}
