"""Device runtimes: one module each, listed in ``RUNTIMES`` (imported only when used).

Each module defines one ``ArtifactRunner`` class (see ``base``) that takes its own typed options
(``options.OPTIONS``). Its SDK is imported inside that module; a missing SDK raises
``MissingSDKError`` naming the extra to install.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from device_agents.errors import IncompatibleError
from device_agents.runtimes.base import ArtifactRunner, ServedModel
from device_agents.runtimes.options import OPTIONS, RuntimeOptions
from device_agents.threads import os_named
from edgekit.bundle.errors import ConfigError
from edgekit.bundle.manifest import Manifest

# runtime name -> "module:Class"
RUNTIMES: dict[str, str] = {
    "onnxruntime": "device_agents.runtimes.onnxruntime:OnnxRuntimeRunner",
    "openvino": "device_agents.runtimes.openvino:OpenVinoRunner",
    "litert": "device_agents.runtimes.litert:LiteRtRunner",
    "tensorrt": "device_agents.runtimes.tensorrt:TensorRtRunner",
    "coreml": "device_agents.runtimes.coreml:CoreMlRunner",
}


def runner_class(runtime: str) -> type[ArtifactRunner]:
    try:
        spec = RUNTIMES[runtime]
    except KeyError as exc:
        raise IncompatibleError(
            f"no runtime {runtime!r} in this agent (known: {', '.join(RUNTIMES)}); upgrade edgekit-agent"
        ) from exc
    module, cls = spec.split(":")
    runner_cls: type[ArtifactRunner] = getattr(importlib.import_module(module), cls)
    return runner_cls


def load_model(model_dir: Path, manifest: Manifest, options: RuntimeOptions | None = None) -> ServedModel:
    """Open an extracted, verified bundle with its runtime and wrap it in the served interface.

    ``options`` is the bundle runtime's options class (e.g. ``OpenVinoOptions`` for an openvino
    bundle); ``None`` = that class's defaults.
    """
    runtime = manifest.compatibility.runtime
    cls = runner_class(runtime)
    wanted = OPTIONS[runtime]
    if options is None:
        options = wanted()
    elif not isinstance(options, wanted):
        raise ConfigError(
            f"model {manifest.name} runs on {runtime}, which takes {wanted.__name__}, not {type(options).__name__}"
        )
    # Threads the runtime starts while its runner is built (ONNX Runtime's intra-op pool) inherit
    # this name: top -H then tells a model's runtime threads from the agent's own.
    with os_named(f"rt-{manifest.name}"):
        runner = cls(Path(model_dir), manifest, options)  # type: ignore[call-arg]  # the Protocol leaves __init__ to each runtime
    served = ServedModel(runner, manifest)
    served.model_dir = Path(model_dir)
    return served


__all__ = ["OPTIONS", "RUNTIMES", "ArtifactRunner", "RuntimeOptions", "ServedModel", "load_model", "runner_class"]
