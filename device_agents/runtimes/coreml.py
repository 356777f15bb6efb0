"""Core ML runner: the ``apple`` target's runtime (an ``.mlpackage`` ML Program), macOS only.

The compute units come from the agent config (``[runtimes.coreml] compute_units``: ALL, CPU_AND_NE,
CPU_AND_GPU, CPU_ONLY), else from the bundle (``target_options.compute_units``), else ALL.
Tensors are named as the package names them; ``ServedModel`` maps them to the served names with
the manifest's ``mapping``. Core ML prediction does not exist on Linux: loading there raises
``IncompatibleError``.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar

import numpy as np

from device_agents.errors import IncompatibleError
from device_agents.runtimes.options import COMPUTE_UNITS, CoreMlOptions
from edgekit.bundle.errors import BundleError, MissingSDKError
from edgekit.bundle.manifest import Manifest


def package_dir(manifest: Manifest) -> str:
    """The one ``*.mlpackage`` directory all artifact files of the bundle lie in."""
    roots = set()
    for entry in manifest.artifact_files():
        parts = PurePosixPath(entry.path).parts
        root = next((p for p in parts if p.endswith(".mlpackage")), None)
        if root is None:
            raise BundleError(f"coreml: artifact {entry.path} is not inside an .mlpackage")
        roots.add(PurePosixPath(*parts[: parts.index(root) + 1]).as_posix())
    if len(roots) != 1:
        raise BundleError(f"coreml needs exactly one .mlpackage, manifest lists {len(roots)}")
    return roots.pop()


def compute_units(options: CoreMlOptions, manifest: Manifest) -> str:
    units = options.compute_units or str(manifest.target_options.get("compute_units", "")) or "ALL"
    if units not in COMPUTE_UNITS:
        raise BundleError(
            f"target_options.compute_units: {units!r} is not a Core ML compute unit ({', '.join(COMPUTE_UNITS)}); "
            "package the bundle again"
        )
    return units


class CoreMlRunner:
    name: ClassVar[str] = "coreml"
    serialize: ClassVar[bool] = True  # one MLModel; predictions are serialized by ServedModel
    model: Any  # coremltools.models.MLModel
    version: str
    _outputs: list[str]

    def __init__(self, model_dir: Path, manifest: Manifest, options: CoreMlOptions) -> None:
        package = Path(model_dir) / package_dir(manifest)
        self.compute_units = compute_units(options, manifest)
        if sys.platform != "darwin":
            raise IncompatibleError(
                f"Core ML prediction needs macOS; this device runs {sys.platform}: ship the cpu or jetson target"
            )
        try:
            import coremltools as ct
        except ImportError as exc:
            raise MissingSDKError("coremltools", "coreml", "the coreml runtime") from exc
        self.version = ct.__version__
        self.model = ct.models.MLModel(str(package), compute_units=getattr(ct.ComputeUnit, self.compute_units))
        self._outputs = [o.name for o in manifest.artifact_signature.outputs]

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        result = self.model.predict({k: np.ascontiguousarray(v) for k, v in inputs.items()})
        return {name: np.asarray(result[name]) for name in self._outputs}

    def describe(self) -> dict[str, Any]:
        return {"runtime": "coreml", "version": f"coremltools {self.version}", "compute_units": self.compute_units}

    def close(self) -> None:
        self.model = None


__all__ = ["COMPUTE_UNITS", "CoreMlRunner", "compute_units", "package_dir"]
