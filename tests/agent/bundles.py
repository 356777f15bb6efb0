"""Bundle variants for the agent's bad-input tests, made from a real ``make_cpu_bundle`` output.

``rebundle`` re-signs a bundle after changing manifest fields or file contents (what a
misconfigured or malicious publisher could ship); ``tamper`` changes bytes *without* re-signing
(what an attacker or a bad disk could do).
"""

from __future__ import annotations

import io
import tarfile
import tempfile
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.bundle import file_entries, load_private_key, write_bundle
from edgekit.bundle.manifest import MANIFEST_NAME, SIGNATURE_NAME, Manifest


def _members(bundle: Path) -> dict[str, bytes]:
    with tarfile.open(bundle, "r:gz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isreg()}  # type: ignore[union-attr]  # regular files always have a reader


def _write_tar(members: dict[str, bytes], out: Path) -> Path:
    with tarfile.open(out, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out


def rebundle(
    src: Path,
    key_path: Path,
    out: Path,
    *,
    files: Mapping[str, bytes | None] | None = None,
    compat: dict[str, Any] | None = None,
    roles: dict[str, str] | None = None,
    **changes: Any,
) -> Path:
    """A correctly signed copy of ``src`` with ``files`` replaced (None: removed; a new file needs
    its role in ``roles``) and manifest (``compat``: compatibility) fields changed."""
    members = _members(src)
    manifest = Manifest.from_json(members.pop(MANIFEST_NAME))
    members.pop(SIGNATURE_NAME)
    if compat:
        changes["compatibility"] = replace(manifest.compatibility, **compat)
    for name, data in (files or {}).items():
        if data is None:
            members.pop(name, None)
        else:
            members[name] = data
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name, data in members.items():
            (root / name).write_bytes(data)
        roles = {**{e.path: e.role for e in manifest.files if e.path in members}, **(roles or {})}
        manifest = manifest.with_updates(files=file_entries(root, roles), **changes)
        return write_bundle(manifest, root, load_private_key(key_path), out)


def tamper(src: Path, out: Path, member: str, mutate: Any = None) -> Path:
    """A copy of ``src`` with one member's bytes changed and the signature left as it was."""
    members = _members(src)
    data = bytearray(members[member])
    if mutate is None:
        data[len(data) // 2] ^= 0xFF
    else:
        data = bytearray(mutate(bytes(data)))
    members[member] = bytes(data)
    return _write_tar(members, out)


def reshape_model(path: Path) -> Path:
    """``x[batch, 4] -> Reshape(x, [1, 4])``: declares a dynamic batch but fails at run time for batch > 1."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"], name="reshape")],
        "reshape_fails_for_batch_gt_1",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [numpy_helper.from_array(np.array([1, 4], dtype=np.int64), "shape")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def conv_model(path: Path) -> Path:
    """``x[batch, 1, h, w] -> Conv 5x5``: dynamic height and width, but ONNX Runtime refuses inputs
    smaller than the kernel (INVALID_ARGUMENT "Invalid input shape") at run time."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], name="conv")],
        "conv_5x5_dynamic_hw",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1, "h", "w"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 1, "oh", "ow"])],
        [numpy_helper.from_array(np.full((1, 1, 5, 5), 0.04, np.float32), "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def read_manifest(bundle: Path) -> Manifest:
    """The manifest inside ``bundle`` (no trust decision: for building variants in tests)."""
    return Manifest.from_json(_members(bundle)[MANIFEST_NAME])
