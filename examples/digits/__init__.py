"""The embedded default example: a digits CNN with its calibration and held-out data.

``load()`` returns the committed files made by ``examples/digits/train.py`` (see README.md there).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
INPUT_NAME = "image"
OUTPUT_NAME = "logits"


@dataclass(frozen=True)
class DigitsExample:
    model: Path  # ONNX, input ``image`` [batch, 1, 32, 32] float32 in [0, 1], output ``logits`` [batch, 10]
    calib: Path  # npz, key ``image``: 300 training images
    eval_inputs: np.ndarray  # held-out images [450, 1, 32, 32]
    eval_labels: np.ndarray  # their digits, int64

    def calib_arrays(self) -> dict[str, np.ndarray]:
        with np.load(self.calib) as data:
            return {k: data[k] for k in data.files}


def load(root: Path = HERE) -> DigitsExample:
    """The example as committed; says how to rebuild it when a file is missing."""
    files = [root / n for n in ("model.onnx", "calib.npz", "eval.npz", "eval_labels.npy")]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(
            f"{root}: {', '.join(missing)} missing; rebuild with `python examples/digits/train.py --out {root}`"
        )
    with np.load(files[2]) as data:
        images = data[INPUT_NAME]
    return DigitsExample(model=files[0], calib=files[1], eval_inputs=images, eval_labels=np.load(files[3]))
