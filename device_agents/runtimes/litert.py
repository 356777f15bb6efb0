"""LiteRT runner: the ``coral`` target's runtime (``ai-edge-litert``, or ``tflite_runtime`` where only it exists).

The interpreter comes from ``ai_edge_litert.interpreter``; where that is not installed (older
Coral / Mendel images, 32-bit Arm) from ``tflite_runtime.interpreter``, which has the same
``Interpreter`` and ``load_delegate`` (so the Edge TPU delegate loads the same way).
``INTERPRETER_PACKAGE`` names the one in use.

A bundle compiled for the Edge TPU (``Compatibility.accelerator == "edgetpu"``) runs only through
the Edge TPU delegate (``libedgetpu.so.1``); without it the runner refuses to load rather than
fail on the first request. Otherwise the interpreter runs on the CPU (XNNPACK).
Tensors are addressed through the model's serving signature, whose names the manifest records.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from device_agents.errors import IncompatibleError
from device_agents.runtimes.options import LiteRtOptions
from edgekit.bundle.errors import BundleError, MissingSDKError
from edgekit.bundle.manifest import Manifest

try:
    import ai_edge_litert as _package
    from ai_edge_litert.interpreter import Interpreter, load_delegate
except ImportError as exc:
    try:
        import tflite_runtime as _package  # the same API, from the older distribution
        from tflite_runtime.interpreter import Interpreter, load_delegate
    except ImportError:
        raise MissingSDKError("ai-edge-litert (or tflite-runtime)", "agent-coral", "the litert runtime") from exc

INTERPRETER_PACKAGE: str = _package.__name__  # "ai_edge_litert" or "tflite_runtime"

EDGETPU_LIBRARY = "libedgetpu.so.1"
SIGNATURE_KEY = "serving_default"


def edgetpu_delegate(library: str = EDGETPU_LIBRARY) -> Any:
    """The Edge TPU delegate, or ``IncompatibleError`` saying what to install."""
    try:
        return load_delegate(library)
    except (ValueError, OSError) as exc:
        raise IncompatibleError(
            f"this bundle is compiled for the Edge TPU but {library} cannot be loaded ({exc}); install "
            "libedgetpu1-std from Coral's repository and plug in the Edge TPU, or ship a coral bundle built "
            "with targets.coral.edgetpu=false"
        ) from exc


class LiteRtRunner:
    name: ClassVar[str] = "litert"
    serialize: ClassVar[bool] = True  # an interpreter is not re-entrant: ServedModel serialises calls

    def __init__(self, model_dir: Path, manifest: Manifest, options: LiteRtOptions) -> None:
        files = [f.path for f in manifest.artifact_files() if f.path.endswith(".tflite")]
        if len(files) != 1:
            raise BundleError(f"litert needs exactly one .tflite artifact, manifest lists {len(files)}")
        self.accelerator = manifest.compatibility.accelerator
        delegates = []
        if self.accelerator == "edgetpu":
            delegates.append(edgetpu_delegate(options.edgetpu_library))
        elif self.accelerator is not None:
            raise IncompatibleError(f"litert runner has no delegate for accelerator {self.accelerator!r}")
        self.interpreter = Interpreter(
            model_path=str(Path(model_dir) / files[0]),
            experimental_delegates=delegates or None,
            num_threads=options.threads or None,
        )
        signatures = self.interpreter.get_signature_list()
        if SIGNATURE_KEY not in signatures:
            raise BundleError(f"litert: the model has no {SIGNATURE_KEY!r} signature (has {', '.join(signatures)})")
        self.runner = self.interpreter.get_signature_runner(SIGNATURE_KEY)

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        # Copies: the signature runner returns views into the interpreter's buffers.
        return {name: np.array(value) for name, value in self.runner(**inputs).items()}

    def describe(self) -> dict[str, Any]:
        return {
            "runtime": "litert",
            "interpreter": INTERPRETER_PACKAGE,
            "version": getattr(_package, "__version__", "unknown"),
            "delegate": "edgetpu" if self.accelerator == "edgetpu" else "xnnpack (cpu)",
        }

    def close(self) -> None:
        self.runner = None
        self.interpreter = None  # released; the runner is not used again
