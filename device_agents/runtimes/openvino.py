"""OpenVINO runner: the ``intel`` target's runtime (IR ``.xml`` + ``.bin``).

The device comes from the agent config (``[runtimes.openvino] device``: CPU, GPU, NPU, AUTO), else
from the device the bundle was built for (``target_options.device``), else AUTO. The other
``OpenVinoOptions`` fields map one to one onto OpenVINO properties (``PERFORMANCE_HINT``,
``NUM_STREAMS``, ``INFERENCE_NUM_THREADS``, ``CACHE_DIR``, ``CPU_RUNTIME_CACHE_CAPACITY`` on the
CPU); ``inference_precision`` overrides the manifest's (``"bf16"`` trades accuracy the host did not
validate for speed).

A bundle whose manifest says ``inference_precision = "bf16"`` (activations bf16, gated on the host
like any lossy candidate) is compiled with that hint where the CPU plugin reports ``BF16`` in its
``OPTIMIZATION_CAPABILITIES`` (AVX512-BF16, AMX). Elsewhere OpenVINO would silently compute f32;
the runner asks for f32 itself, serves (f32 is the more accurate of the two, only slower than the
host measured) and says so: a warning in the log and a ``precision_note`` in ``describe()``, which
the install/start log line and the self-test report carry.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from device_agents.cpus import default_threads
from device_agents.errors import IncompatibleError
from device_agents.runtimes.options import OpenVinoOptions
from edgekit.bundle.errors import BundleError, MissingSDKError
from edgekit.bundle.manifest import Manifest

try:
    import openvino as ov
except ImportError as exc:  # pragma: no cover - exercised only without the SDK
    raise MissingSDKError("openvino", "openvino", "the openvino runtime") from exc

log = logging.getLogger("edgekit.agent")
NO_BF16 = "this CPU's OpenVINO reports no BF16"


def cpu_capabilities(core: Any | None = None) -> tuple[str, ...]:
    """The CPU plugin's ``OPTIMIZATION_CAPABILITIES`` (``BF16`` where it computes in bf16).

    The one question host and agent both ask of the CPU (rather than ``/proc/cpuinfo``: OpenVINO
    decides what it runs, and it answers on every architecture it supports).
    """
    return tuple(str(c) for c in (core or ov.Core()).get_property("CPU", "OPTIMIZATION_CAPABILITIES"))


def precision_hint(device: str, promised: str, cpu_bf16: bool = False) -> str:
    """The ``INFERENCE_PRECISION_HINT`` that computes at least as precisely as the manifest promises.

    Left to itself the CPU plugin computes in bf16 where the CPU has it (AVX512-BF16, AMX), and
    maps an ``f16`` hint to bf16 too: less precise than an fp32, int8 or fp16 manifest promises.
    So ``f16`` is asked for only on GPU/NPU; elsewhere (CPU, or AUTO, which may pick the CPU) f32.
    ``bf16`` is asked for only on the CPU and where it has it (``cpu_bf16``); elsewhere f32.
    """
    if not promised:
        return ""
    if promised == "f16" and device.split(".")[0] not in ("GPU", "NPU"):
        return "f32"
    if promised == "bf16" and not (device.split(".")[0] == "CPU" and cpu_bf16):
        return "f32"
    return promised


class OpenVinoRunner:
    name: ClassVar[str] = "openvino"

    def __init__(self, model_dir: Path, manifest: Manifest, options: OpenVinoOptions) -> None:
        xml_files = [f.path for f in manifest.artifact_files() if f.path.endswith(".xml")]
        if len(xml_files) != 1:
            raise BundleError(f"openvino needs exactly one .xml artifact, manifest lists {len(xml_files)}")
        xml = Path(model_dir) / xml_files[0]
        weights = xml.with_suffix(".bin")
        if weights.relative_to(model_dir).as_posix() not in {f.path for f in manifest.artifact_files()}:
            raise BundleError(
                f"openvino: {weights.name} (the weights of {xml.name}) is not an artifact of the manifest"
            )
        self.core = ov.Core()
        self.device = options.device or str(manifest.target_options.get("device", "")) or "AUTO"
        available = self.core.available_devices  # e.g. CPU, GPU.0, GPU.1, NPU
        virtual = self.device.split(":")[0] in ("AUTO", "MULTI", "HETERO", "BATCH")
        if not virtual and not any(self.device in (d, d.split(".")[0]) for d in available):
            raise IncompatibleError(
                f"OpenVINO device {self.device!r} is not available here (available: "
                f"{', '.join(available)}); set the runtime device to one of them or AUTO"
            )
        if options.cache_dir is not None:
            self.core.set_property({"CACHE_DIR": str(options.cache_dir)})
        config: dict[str, Any] = {}
        promised = str(manifest.target_options.get("inference_precision", ""))
        asked = options.inference_precision or promised  # the agent's config overrides the manifest
        on_cpu = self.device.split(".")[0] == "CPU"
        bf16 = asked == "bf16" and on_cpu and "BF16" in cpu_capabilities(self.core)
        hint = options.inference_precision or precision_hint(self.device, promised, cpu_bf16=bf16)
        self.precision_note = ""
        if asked == "bf16" and not bf16:
            hint = "f32"  # what OpenVINO would compute anyway, asked for rather than left to chance
            why = NO_BF16 if on_cpu else f"bf16 is a CPU plugin precision and the device is {self.device}"
            self.precision_note = f"bf16 asked, computing in f32 ({why}): more accurate, slower than measured"
            log.warning("%s: %s", manifest.name, self.precision_note)
        if hint:
            config["INFERENCE_PRECISION_HINT"] = hint
        if options.performance_hint:
            config["PERFORMANCE_HINT"] = options.performance_hint
        if options.num_streams:
            config["NUM_STREAMS"] = options.num_streams
        threads = options.threads or default_threads()  # OpenVINO follows the affinity, not a cgroup quota
        if threads:
            config["INFERENCE_NUM_THREADS"] = threads
        if options.runtime_cache_capacity is not None and self.device.split(".")[0] == "CPU":
            config["CPU_RUNTIME_CACHE_CAPACITY"] = options.runtime_cache_capacity  # a CPU plugin property
        self.config = config  # what compile_model was given (some properties are not read back)
        self.compiled = self.core.compile_model(self.core.read_model(str(xml), str(weights)), self.device, config)
        wanted = {s.name for s in manifest.artifact_signature.outputs}
        self._outputs = [
            (next((n for n in port.get_names() if n in wanted), port.get_any_name()), port)
            for port in self.compiled.outputs
        ]
        # An infer request is not re-entrant; one per serving thread keeps run() thread-safe.
        self._local = threading.local()

    def _request(self) -> Any:
        request = getattr(self._local, "request", None)
        if request is None:
            request = self._local.request = self.compiled.create_infer_request()
        return request

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        result = self._request().infer(dict(inputs))
        return {name: np.array(result[port]) for name, port in self._outputs}

    def describe(self) -> dict[str, Any]:
        return {
            "runtime": "openvino",
            "version": ov.get_version(),
            "device": self.device,
            "execution_devices": list(self.compiled.get_property("EXECUTION_DEVICES")),
            "inference_precision": str(self.config.get("INFERENCE_PRECISION_HINT", "")),
            **({"precision_note": self.precision_note} if self.precision_note else {}),
        }

    def close(self) -> None:
        self._local = threading.local()
        self.compiled = None  # released; the runner is not used again
