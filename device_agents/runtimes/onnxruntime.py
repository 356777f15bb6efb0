"""ONNX Runtime runner: the ``cpu`` target's runtime (and ``jetson``'s fallback via CUDA/TRT EPs)."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from device_agents.cpus import default_threads
from device_agents.runtimes.options import OnnxRuntimeOptions
from edgekit.bundle.errors import BundleError, MissingSDKError
from edgekit.bundle.manifest import Manifest

try:
    import onnxruntime as ort
    from onnxruntime.capi.onnxruntime_pybind11_state import EPFail, InvalidArgument
except ImportError as exc:  # pragma: no cover - exercised only without the SDK
    raise MissingSDKError("onnxruntime", "agent", "the onnxruntime runtime") from exc


class OnnxRuntimeRunner:
    name: ClassVar[str] = "onnxruntime"

    @staticmethod
    def rejects_input(exc: Exception) -> bool:
        """True when ONNX Runtime refused the input's *shape* (INVALID_ARGUMENT naming a shape, rank
        or dimension: a spatial size a Conv cannot take, a wrong rank): the request's fault, a 400.
        Other INVALID_ARGUMENTs (a Gather index out of range on field data) and FAIL /
        RUNTIME_EXCEPTION are the model failing on an input its signature accepts: 500s, which
        count against its health."""
        text = str(exc).lower()
        return isinstance(exc, InvalidArgument) and any(w in text for w in ("shape", "rank", "dimension"))

    def __init__(self, model_dir: Path, manifest: Manifest, options: OnnxRuntimeOptions) -> None:
        onnx_files = [f for f in manifest.artifact_files() if f.path.endswith(".onnx")]
        if len(onnx_files) != 1:
            raise BundleError(f"onnxruntime needs exactly one .onnx artifact, manifest lists {len(onnx_files)}")
        self.session = open_session(model_dir / onnx_files[0].path, options)
        self._outputs = [o.name for o in self.session.get_outputs()]
        # The C++ session's run, with the output names bound once. ``InferenceSession.run`` wraps it
        # in Python checks that cost more than a small model's whole call (WebGPU graph capture,
        # feed names against the inputs, OrtValue ownership; ~10 us on an x86_64 server): ServedModel has checked
        # the feed against the signature already, and a missing input still fails in C++. Its one
        # behaviour of note, falling back to the next provider on ``EPFail``, is kept below.
        self._run = self.session._sess.run
        # thread id -> the RunOptions of the call running in that thread: ``terminate`` sets its
        # flag. One RunOptions per call (0.2 us): a flag set on a shared one would stop every
        # call running with it, and stay set for the next.
        self._running: dict[int, ort.RunOptions] = {}

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        outputs = self._outputs
        options = ort.RunOptions()
        me = threading.get_ident()
        self._running[me] = options
        try:
            values = self._run(outputs, inputs if type(inputs) is dict else dict(inputs), options)
        except EPFail:
            values = self.session.run(outputs, dict(inputs), options)  # ORT's own provider fallback, once
            self._run = self.session._sess.run  # the session it fell back to
        finally:
            self._running.pop(me, None)
        return dict(zip(outputs, values, strict=True))

    def terminate(self, thread_id: int) -> bool:
        """Stop the call running in thread ``thread_id`` (``RunOptions.terminate``: ONNX Runtime
        checks it between kernels and in every ``Loop``/``Scan`` iteration, and the call raises);
        False when no call of this session runs there."""
        options = self._running.get(thread_id)
        if options is None:
            return False
        options.terminate = True
        return True

    def describe(self) -> dict[str, Any]:
        return {"runtime": "onnxruntime", "version": ort.__version__, "providers": self.session.get_providers()}

    def close(self) -> None:
        # Released; the runner is not used again. ``_run`` holds the C++ session too: without
        # dropping it the session's memory stayed allocated until the runner itself was collected.
        self.session = None
        self._run = _closed


# ONNX Runtime's WeightBiasQuantization quantizes, at load, the float weights of a Conv/Gemm that
# reads a DequantizeLinear and feeds a QuantizeLinear (per tensor): exactly the layers mixed
# precision keeps in float, which then run as INT8 after all (a layer of small-weight channels
# rounds to zero). Off, they run in float as built. Names ONNX Runtime does not know are ignored.
DISABLED_OPTIMIZERS = ("WeightBiasQuantization",)


def open_session(model_path: Path, options: OnnxRuntimeOptions) -> ort.InferenceSession:
    """An ONNX Runtime session of ``model_path`` set up as the agent serves it (graph optimisation,
    threads, spinning, providers); the host times and validates ONNX models through it too."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # 0: ORT's default pool (one thread per physical core of the machine) unless this process may
    # use fewer CPUs (affinity, cgroup quota: device_agents.cpus), when that many
    threads = options.threads or default_threads()
    if threads:
        so.intra_op_num_threads = threads
    if options.inter_op_threads:
        so.inter_op_num_threads = options.inter_op_threads
    if options.cpu_mem_arena is not None:
        so.enable_cpu_mem_arena = options.cpu_mem_arena
    if options.mem_pattern is not None:
        so.enable_mem_pattern = options.mem_pattern
    if not options.spinning:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.add_session_config_entry("session.inter_op.allow_spinning", "0")
    elif not options.spin_between_runs:
        so.add_session_config_entry("session.force_spinning_stop", "1")
    available = ort.get_available_providers()
    wanted = [p for p in options.providers if p in available] or ["CPUExecutionProvider"]
    return ort.InferenceSession(str(model_path), so, providers=wanted, disabled_optimizers=list(DISABLED_OPTIMIZERS))


def _closed(*args: Any) -> Any:
    raise RuntimeError("this model was closed")
