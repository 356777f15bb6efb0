"""The signature clients see of a model whose manifest pre- or post-processes: an encoded image
in, labels or boxes out. Computed from the manifest alone (no file is read).

- pre-processing: the image input becomes ``BYTES`` [1] (one encoded image, JPEG or PNG) under
  the model input's own name; a client may also send its uint8 pixels ``UINT8`` [H, W, C];
- post-processing ``boxes``: ``boxes`` FP32 [-1, 4], ``scores`` FP32 [-1], ``classes`` INT32
  [-1] (and ``labels`` BYTES [-1] with a labels file); ``topk``: ``scores``, ``classes`` (and
  ``labels``) of shape [k].

A model without processing keeps its served signature (the very tuples of the manifest).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from edgekit.bundle.manifest import Manifest, ProcessingStep, Signature, TensorSpec


@dataclass(frozen=True, slots=True)
class WireTensor:
    """A tensor of a processed signature, in v2 terms: ``datatype`` (``BYTES``, ``FP32``, ...)
    and ``shape`` (-1: varies per request)."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    @property
    def v2_shape(self) -> list[int]:
        return list(self.shape)


def processed_outputs(steps: Sequence[ProcessingStep]) -> tuple[WireTensor, ...]:
    """The outputs a post-processing answers with (its last step: ``topk`` or ``boxes``)."""
    final = steps[-1]
    n = int(final.k) if final.op == "topk" and final.k is not None else -1
    specs = [WireTensor("boxes", "FP32", (n, 4))] if final.op == "boxes" else []
    specs += [WireTensor("scores", "FP32", (n,)), WireTensor("classes", "INT32", (n,))]
    if final.labels_file is not None:
        specs.append(WireTensor("labels", "BYTES", (n,)))
    return tuple(specs)


def image_input(manifest: Manifest) -> str | None:
    """The input an encoded image goes to (None: the manifest does not pre-process)."""
    return image_input_of(manifest.preprocess, manifest.signature)


def image_input_of(preprocess: Sequence[ProcessingStep], signature: Signature) -> str | None:
    """``image_input`` from the steps and the served signature."""
    if not preprocess:
        return None
    named = {s.tensor for s in preprocess if s.tensor is not None}
    return named.pop() if len(named) == 1 else signature.inputs[0].name


def wire_signature(
    manifest: Manifest,
) -> tuple[tuple[TensorSpec | WireTensor, ...], tuple[TensorSpec | WireTensor, ...]]:
    """(inputs, outputs) as clients send and receive them."""
    inputs: tuple[TensorSpec | WireTensor, ...] = manifest.signature.inputs
    outputs: tuple[TensorSpec | WireTensor, ...] = manifest.signature.outputs
    image = image_input(manifest)
    if image is not None:
        inputs = tuple(WireTensor(s.name, "BYTES", (1,)) if s.name == image else s for s in inputs)
    if manifest.postprocess:
        outputs = processed_outputs(manifest.postprocess)
    return inputs, outputs
