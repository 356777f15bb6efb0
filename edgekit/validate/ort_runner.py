"""A model under ONNX Runtime's CPU provider as a function: served inputs -> named outputs.

The session is the device runtime's (``device_agents.runtimes.onnxruntime.open_session``, with
the agent's default options but the thread count), so the FP32 reference and the candidates a
target compares are run the way a device runs them, by the same code.
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
        from device_agents.runtimes.onnxruntime import open_session
        from device_agents.runtimes.options import OnnxRuntimeOptions

        session = open_session(model_path, OnnxRuntimeOptions(threads=threads))
        names = [o.name for o in session.get_outputs()]

        def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            return dict(zip(names, session.run(names, feed), strict=True))

        return run

    return open_


def ort_cpu_runner(model_path: Path) -> Runner:
    """A runner of ``model_path`` with ONNX Runtime's default thread pool."""
    return ort_open(model_path)(0)
