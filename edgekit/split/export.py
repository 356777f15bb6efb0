"""Tails for v2 servers that are not ours: a Triton model repository and a KServe layout.

Triton (``--triton-repo DIR``)::

    DIR/<name>/config.pbtxt   platform onnxruntime_onnx; inputs/outputs from the ONNX graph
    DIR/<name>/1/model.onnx

A leading axis that is dynamic on every input and output becomes Triton's batch axis
(``max_batch_size``, dims without it); otherwise ``max_batch_size: 0`` with the full dims
(-1 for a dynamic one).

KServe (``--kserve DIR``): ``DIR/<name>/model.onnx``, served by KServe's own ``ModelServer``
with ``python -m edgekit.split.kserve_tail DIR --http_port 8080`` (one ``kserve.Model`` per
tail, ONNX Runtime inside), e.g. as the container of a custom-predictor InferenceService.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

from edgekit.errors import ConfigError

_TRITON_TYPES = {
    "tensor(float)": "TYPE_FP32",
    "tensor(float16)": "TYPE_FP16",
    "tensor(double)": "TYPE_FP64",
    "tensor(int64)": "TYPE_INT64",
    "tensor(int32)": "TYPE_INT32",
    "tensor(int8)": "TYPE_INT8",
    "tensor(uint8)": "TYPE_UINT8",
    "tensor(bool)": "TYPE_BOOL",
}
TRITON_MAX_BATCH = 8


def triton_config(name: str, onnx_path: Path) -> str:
    import onnxruntime as ort

    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    tensors = [*session.get_inputs(), *session.get_outputs()]
    batched = all(t.shape and not isinstance(t.shape[0], int) for t in tensors)
    lines = [f'name: "{name}"', 'platform: "onnxruntime_onnx"', f"max_batch_size: {TRITON_MAX_BATCH if batched else 0}"]
    for kind, items in (("input", session.get_inputs()), ("output", session.get_outputs())):
        entries = []
        for t in items:
            if t.type not in _TRITON_TYPES:
                raise ConfigError(f"{onnx_path}: {kind} {t.name} is {t.type}, which this export does not map to Triton")
            shape = t.shape[1:] if batched else t.shape
            dims = ", ".join(str(d) if isinstance(d, int) else "-1" for d in shape)
            entries.append(
                f'  {{\n    name: "{t.name}"\n    data_type: {_TRITON_TYPES[t.type]}\n    dims: [ {dims} ]\n  }}'
            )
        lines.append(f"{kind} [\n" + ",\n".join(entries) + "\n]")
    return "\n".join(lines) + "\n"


def export_triton(tails: Sequence[tuple[str, Path]], repo: Path) -> list[Path]:
    """One Triton model directory per (name, tail.onnx); returns the config files written."""
    written = []
    for name, onnx_path in tails:
        model_dir = repo / name
        (model_dir / "1").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(onnx_path, model_dir / "1" / "model.onnx")
        (model_dir / "config.pbtxt").write_text(triton_config(name, onnx_path))
        written.append(model_dir / "config.pbtxt")
    return written


def export_kserve(tails: Sequence[tuple[str, Path]], root: Path) -> list[Path]:
    """``root/<name>/model.onnx`` per tail (what ``edgekit.split.kserve_tail`` serves)."""
    written = []
    for name, onnx_path in tails:
        (root / name).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(onnx_path, root / name / "model.onnx")
        written.append(root / name / "model.onnx")
    return written
