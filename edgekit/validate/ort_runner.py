"""A model under ONNX Runtime's CPU provider as a function: served inputs -> named outputs.

The session settings are the device runtime's (``device_agents.runtimes.onnxruntime``), so the
FP32 reference and the candidates a target compares are run the way a device runs them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np


def ort_cpu_runner(model_path: Path) -> Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(str(model_path), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]

    def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(names, session.run(names, feed), strict=True))

    return run
