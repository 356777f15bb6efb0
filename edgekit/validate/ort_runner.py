"""A model under ONNX Runtime's CPU provider as a function: served inputs -> named outputs.

The session settings are the device runtime's (``device_agents.runtimes.onnxruntime``), so the
FP32 reference and the candidates a target compares are run the way a device runs them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

Runner = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


def ort_open(model_path: Path) -> Callable[[int], Runner]:
    """threads -> a runner of ``model_path`` (0 threads: ONNX Runtime's default pool). What the
    optimisation engine times candidates with, at the device runtime's thread count."""

    def open_(threads: int) -> Runner:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            so.intra_op_num_threads = threads
        session = ort.InferenceSession(str(model_path), so, providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]

        def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            return dict(zip(names, session.run(names, feed), strict=True))

        return run

    return open_


def ort_cpu_runner(model_path: Path) -> Runner:
    """A runner of ``model_path`` with ONNX Runtime's default thread pool."""
    return ort_open(model_path)(0)
