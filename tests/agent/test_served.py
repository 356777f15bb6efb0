"""``ServedModel``: tensors that need no conversion go to the runtime as they are (no copy); the
others are converted (dtype, quantization, transpose) as the manifest says."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from device_agents.runtimes import ServedModel
from tests.agent.bundles import read_manifest
from tests.agent.conftest import Bundles


class Recorder:
    """A runner that records its feed and answers zeros of the artifact's output shape."""

    def __init__(self, outputs: dict[str, np.ndarray]) -> None:
        self.outputs = outputs
        self.feeds: list[dict[str, np.ndarray]] = []

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.feeds.append(dict(inputs))
        return dict(self.outputs)

    def describe(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


def test_served_model_feeds_tensors_that_need_no_conversion_as_they_are(bundles: Bundles) -> None:
    manifest = read_manifest(bundles.v1)
    spec = manifest.signature.inputs[0]
    out = manifest.signature.outputs[0]
    runner = Recorder({out.name: np.zeros((2, 10), np.float32)})
    served = ServedModel(runner, manifest)
    x = np.ones((2, *spec.shape[1:]), np.float32)
    result = served.infer({spec.name: x})
    assert runner.feeds[0][spec.name] is x  # not copied on the way in
    assert result[out.name] is runner.outputs[out.name]  # nor on the way out


def test_served_model_converts_tensors_whose_artifact_dtype_differs(bundles: Bundles) -> None:
    manifest = read_manifest(bundles.v1)
    spec = manifest.signature.inputs[0]
    out = manifest.signature.outputs[0]
    art = manifest.artifact_signature
    half = replace(
        art, inputs=(replace(art.inputs[0], dtype="float16"),), outputs=(replace(art.outputs[0], dtype="float16"),)
    )
    runner = Recorder({out.name: np.zeros((2, 10), np.float16)})
    served = ServedModel(runner, replace(manifest, artifact_signature=half))
    x = np.ones((2, *spec.shape[1:]), np.float32)
    result = served.infer({spec.name: x})
    assert runner.feeds[0][spec.name].dtype == np.float16  # cast to what the artifact takes
    assert result[out.name].dtype == np.float32  # and back to what the signature serves
