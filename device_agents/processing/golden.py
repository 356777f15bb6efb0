"""The golden image of a bundle that pre- and post-processes: one encoded image and what the
whole pipeline (decode, pre-processing, the artifact, post-processing) answered for it on the
host, checked again by the device's self-test. A device whose decoder or processing differs from
the host's (another libjpeg, a channel order swapped) fails it before it serves.

In the golden ``.npz``: ``image_<input>`` (the encoded bytes as uint8) and ``expected_<output>``
for each processed output (``labels`` as fixed-width bytes). The check is what a client relies
on, with room for another CPU's arithmetic: the same best class (top-1 of a classifier, the
highest-scoring box of a detector), its score within ``SCORE_ATOL``, and the best box overlapping
the expected one by ``MIN_BOX_IOU`` or more.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from device_agents.processing.post import Postprocessor
from device_agents.processing.pre import Preprocessor
from device_agents.processing.signature import image_input, image_input_of
from edgekit.bundle.manifest import Manifest, ProcessingStep, Signature

IMAGE_PREFIX = "image_"
EXPECTED_PREFIX = "expected_"
SCORE_ATOL = 0.05
MIN_BOX_IOU = 0.9

Infer = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


def run_pipeline(
    preprocess: Sequence[ProcessingStep],
    postprocess: Sequence[ProcessingStep],
    signature: Signature,
    image: bytes,
    infer: Infer,
    read_file: Callable[[str], bytes],
) -> dict[str, np.ndarray]:
    """``image`` through the pre-processing, ``infer`` (the served signature's model) and the
    post-processing."""
    name = image_input_of(preprocess, signature)
    if name is None or not postprocess:
        raise ValueError("run_pipeline needs pre- and post-processing steps")
    spec = next(s for s in signature.inputs if s.name == name)
    tensor, geometry = Preprocessor(preprocess, spec).from_bytes(image)
    outputs = infer({name: tensor})
    return Postprocessor(postprocess, signature.outputs, read_file).run(outputs, geometry)


def golden_arrays(input_name: str, image: bytes, answer: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What the golden ``.npz`` holds for the image (no object arrays: ``np.load`` without pickle)."""
    arrays = {IMAGE_PREFIX + input_name: np.frombuffer(image, np.uint8).copy()}
    for key, value in answer.items():
        arrays[EXPECTED_PREFIX + key] = np.asarray(value.tolist(), dtype="S") if value.dtype == object else value
    return arrays


def check_golden_image(manifest: Manifest, model_dir: Path, infer: Infer) -> tuple[bool, str] | None:
    """(passed, why not) for the golden image of the bundle in ``model_dir``; None when it has none."""
    name = image_input(manifest)
    if name is None or not manifest.postprocess:
        return None
    with np.load(model_dir / manifest.golden.file, allow_pickle=False) as golden:
        if IMAGE_PREFIX + name not in golden.files:
            return None
        image = golden[IMAGE_PREFIX + name].tobytes()
        want = {k[len(EXPECTED_PREFIX) :]: golden[k] for k in golden.files if k.startswith(EXPECTED_PREFIX)}

    def read(path: str) -> bytes:
        return (model_dir / path).read_bytes()

    got = run_pipeline(manifest.preprocess, manifest.postprocess, manifest.signature, image, infer, read)
    if len(want["scores"]) == 0 or len(got["scores"]) == 0:
        same = len(want["scores"]) == len(got["scores"])
        return (
            same,
            ""
            if same
            else f"the golden image gave {len(got['scores'])} results, the host's pipeline {len(want['scores'])}",
        )
    best, host = (int(got["classes"][0]), float(got["scores"][0])), (int(want["classes"][0]), float(want["scores"][0]))
    if best[0] != host[0]:
        return False, f"the golden image's best class is {best[0]}, the host's {host[0]}"
    if abs(best[1] - host[1]) > SCORE_ATOL:
        return False, f"the golden image's best score is {best[1]:.4f}, the host's {host[1]:.4f}"
    if "boxes" in want:
        overlap = _iou(got["boxes"][0], want["boxes"][0])
        if overlap < MIN_BOX_IOU:
            return False, f"the golden image's best box overlaps the host's by IoU {overlap:.3f} (< {MIN_BOX_IOU})"
    if "labels" in want and got["labels"][0] != want["labels"][0]:
        return False, f"the golden image's best label is {got['labels'][0]!r}, the host's {want['labels'][0]!r}"
    return True, ""


def _iou(a: np.ndarray, b: np.ndarray) -> float:
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - w * h
    return float(w * h / union) if union > 0 else float(np.allclose(a, b))
