"""Open a signed bundle on this host exactly as the agent would: verify, extract, device runtime."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from device_agents.runtimes import ServedModel, load_model
from edgekit.bundle import TrustStore, extract, read_verified_manifest


@contextlib.contextmanager
def served_bundle(bundle: Path, pub: Path, dest: Path) -> Iterator[ServedModel]:
    """The bundle's model behind the served interface; raises ``EdgekitError`` if it cannot run here."""
    verified = read_verified_manifest(bundle, TrustStore.from_files([pub]))
    model_dir = extract(bundle, verified, dest)
    served = load_model(model_dir, verified.manifest)
    try:
        yield served
    finally:
        served.close()


def static_batch(served: ServedModel) -> int | None:
    """The fixed batch size of the first input, or None when the batch axis is dynamic."""
    first = served.inputs[0].shape[0] if served.inputs and served.inputs[0].shape else None
    return first if isinstance(first, int) else None


def top1(served: ServedModel, inputs: np.ndarray, labels: np.ndarray, batch: int = 64) -> float:
    """Held-out top-1 accuracy of a single-input classifier (first output = scores)."""
    name = served.inputs[0].name
    out_name = served.outputs[0].name
    step = static_batch(served) or batch
    predictions = []
    for start in range(0, len(inputs), step):
        scores = served.infer({name: inputs[start : start + step]})[out_name]
        predictions.append(np.argmax(scores, axis=1))
    return float((np.concatenate(predictions) == labels).mean())
