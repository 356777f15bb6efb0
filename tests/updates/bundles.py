"""Bundles the update tests need beyond ``tests.factories``: padded, fragile, re-signed, tampered.

All built in code from the tiny classifier; nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import io
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from tests.factories import make_cpu_bundle, tiny_classifier


def padded_classifier(path: Path, pad_bytes: int, *, seed: int = 0) -> Path:
    """The tiny classifier plus an unused initializer of ``pad_bytes`` random (incompressible) bytes."""
    import onnx
    from onnx import numpy_helper

    tiny_classifier(path, seed=seed)
    model = onnx.load(str(path))
    noise = np.random.default_rng(seed).standard_normal(pad_bytes // 4).astype(np.float32)
    model.graph.initializer.append(numpy_helper.from_array(noise, "padding"))
    onnx.save(model, str(path))
    return path


def fragile_classifier(path: Path, *, seed: int = 0) -> Path:
    """The tiny classifier with a data-dependent Gather: fine on its golden vectors (|x| < 10),
    a runtime error (index out of range) on inputs with larger values, like the field may send."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    tiny_classifier(path, seed=seed)
    model = onnx.load(str(path))
    g = model.graph
    softmax = next(n for n in g.node if n.op_type == "Softmax")
    softmax.output[0] = "probs_raw"
    g.initializer.append(numpy_helper.from_array(np.zeros(10, np.float32), "table"))
    g.node.extend(
        [
            helper.make_node("ReduceMax", ["input"], ["peak"], keepdims=0, name="peak"),
            helper.make_node("Cast", ["peak"], ["index"], to=TensorProto.INT64, name="index"),
            helper.make_node("Gather", ["table", "index"], ["offset"], axis=0, name="lookup"),
            helper.make_node("Add", ["probs_raw", "offset"], ["probs"], name="add_offset"),
        ]
    )
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def bundle(
    out: Path, key: Path, version: int, *, seed: int | None = None, model: Path | None = None, **kwargs: Any
) -> Path:
    """A signed ``tiny`` bundle; the model's weights differ per version (seed = version by default)."""
    if model is None:
        model = tiny_classifier(out.with_suffix(".onnx"), seed=version if seed is None else seed)
    return make_cpu_bundle(out, model, key, name="tiny", version=version, **kwargs)


def resign(src: Path, key: Path, out: Path, trusted_pub: Path, **manifest_changes: Any) -> Path:
    """``src`` with a changed manifest (e.g. ``compatibility=...``), signed again with ``key``."""
    from edgekit.bundle import TrustStore, extract, load_private_key, read_verified_manifest, write_bundle

    verified = read_verified_manifest(src, TrustStore.from_files([trusted_pub]))
    with tempfile.TemporaryDirectory() as tmp:
        root = extract(src, verified, Path(tmp) / "files")
        (root / "manifest.json").unlink()
        return write_bundle(verified.manifest.with_updates(**manifest_changes), root, load_private_key(key), out)


def wrong_hardware(src: Path, key: Path, out: Path, trusted_pub: Path) -> Path:
    """``src`` re-signed for a CPU architecture no test machine has."""
    from edgekit.bundle import TrustStore, read_verified_manifest

    m = read_verified_manifest(src, TrustStore.from_files([trusted_pub])).manifest
    compat = dataclasses.replace(m.compatibility, arch=("riscv64",))
    return resign(src, key, out, trusted_pub, compatibility=compat)


def tamper_member(src: Path, out: Path, member: str = "model.onnx") -> Path:
    """``src`` with one byte of ``member`` flipped; manifest and signature untouched."""
    with tarfile.open(src, "r:gz") as tar:
        members = [(info, tar.extractfile(info).read() if info.isreg() else b"") for info in tar.getmembers()]  # type: ignore[union-attr]  # regular members have a file
    with tarfile.open(out, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            if info.name == member:
                data = data[:-1] + bytes([data[-1] ^ 0xFF])
            tar.addfile(info, io.BytesIO(data))
    return out


def reference_outputs(model: Path, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return sess.run(None, {"input": x})[0]  # type: ignore[no-any-return]
