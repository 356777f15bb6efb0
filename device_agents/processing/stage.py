"""The pre- and post-processing stages: a manifest's steps applied around queue + infer.

    preprocess   the image a client sent (``request.raw[<input>]``: an encoded image, BYTES [1],
                 or uint8 pixels [H, W, C]) -> the model's input tensor in ``request.inputs``;
                 the image's geometry is left in ``request.raw`` (``GEOMETRY``) for the boxes
    postprocess  the model's outputs -> ``classes`` / ``scores`` / ``labels`` (and ``boxes`` in
                 the original image's pixels)

Each applies the steps of the model version that serves the request (``request.model``), built
once per loaded model, so an update that changes the steps or the labels applies with the version.
A factory returns None when the manifest serving as the endpoint's pipeline is built has no such
steps; a later version that adds processing to a model that had none is served once the agent
restarts (its pipeline is built again).

Refusals are 400s (``InferenceInputError``): no image, a corrupt one, or no image decoder on the
agent (the ``agent-images`` extra).
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from device_agents.processing.images import ImageInputError
from device_agents.processing.post import Postprocessor
from device_agents.processing.pre import Preprocessor
from device_agents.processing.signature import image_input
from device_agents.processing.transforms import Geometry
from edgekit.bundle.errors import InferenceInputError, ManifestError

if TYPE_CHECKING:
    from device_agents.pipeline.stage import Request, StageContext
    from device_agents.runtimes import ServedModel

# where the pre-processing leaves the geometry of the image it was sent, for the boxes
GEOMETRY = "image_geometry"


class _PerModel:
    """A processor per loaded model (weakly keyed: it goes with the model)."""

    def __init__(self, build: Any) -> None:
        self._build = build
        self._made: weakref.WeakKeyDictionary[ServedModel, Any] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def get(self, model: ServedModel) -> Any:
        found = self._made.get(model)
        if found is None:
            with self._lock:
                found = self._made.get(model)
                if found is None:
                    found = self._made[model] = self._build(model)
        return found


class PreprocessStage:
    name = "preprocess"

    def __init__(self) -> None:
        self._pre = _PerModel(_preprocessor)

    def process(self, request: Request) -> None:
        model = request.model
        if model is None:
            return
        pre: Preprocessor | None = self._pre.get(model)
        if pre is None:  # this version has no pre-processing
            return
        name = pre.spec.name
        sent = request.raw.pop(name, None)
        if sent is None:
            raise InferenceInputError(
                f"input {name!r}: send the image as a BYTES tensor of shape [1] (an encoded JPEG or PNG), or its "
                "uint8 pixels [H, W, C]"
            )
        if isinstance(sent, np.ndarray) and sent.dtype == object:
            if sent.size != 1:
                raise InferenceInputError(f"input {name!r}: one encoded image per request, got {sent.size}")
            data = sent.reshape(-1)[0]
            tensor, geometry = pre.from_bytes(bytes(data))
        elif isinstance(sent, np.ndarray):
            tensor, geometry = pre.from_pixels(sent)
        else:
            raise ImageInputError(f"input {name!r}: not an image")
        request.inputs[name] = tensor
        request.raw[GEOMETRY] = geometry


class PostprocessStage:
    name = "postprocess"

    def __init__(self) -> None:
        self._post = _PerModel(_postprocessor)

    def process(self, request: Request) -> None:
        model, outputs = request.model, request.outputs
        if model is None or outputs is None:
            return
        post: Postprocessor | None = self._post.get(model)
        if post is None:
            return
        geometry = request.raw.get(GEOMETRY)
        request.outputs = post.run(outputs, geometry if isinstance(geometry, Geometry) else None)


def _preprocessor(model: ServedModel) -> Preprocessor | None:
    name = image_input(model.manifest)
    if name is None:
        return None
    spec = next(s for s in model.inputs if s.name == name)
    return Preprocessor(model.manifest.preprocess, spec)


def _postprocessor(model: ServedModel) -> Postprocessor | None:
    m = model.manifest
    if not m.postprocess:
        return None
    model_dir = model.model_dir

    def read(path: str) -> bytes:
        if model_dir is None:
            raise ManifestError(f"model {m.name}: {path} is listed, but the model was loaded without its folder")
        return (model_dir / path).read_bytes()

    return Postprocessor(m.postprocess, model.outputs, read)


def preprocess(context: StageContext) -> PreprocessStage | None:
    """The ``preprocess`` entry of ``STAGE_FACTORIES``."""
    return PreprocessStage() if context.manifest.preprocess else None


def postprocess(context: StageContext) -> PostprocessStage | None:
    """The ``postprocess`` entry of ``STAGE_FACTORIES``."""
    return PostprocessStage() if context.manifest.postprocess else None
