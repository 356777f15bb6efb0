"""Packaged bundles shared by the packager and CLI tests (built once per session: seconds)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.factories import confident_inputs, tiny_classifier


@pytest.fixture(scope="session")
def calib_npz(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    path = tmp_path_factory.mktemp("data") / "calib.npz"
    np.savez(path, input=confident_inputs(tiny_model, 60))
    return path


@pytest.fixture(scope="session")
def int8_package(tmp_path_factory: pytest.TempPathFactory, calib_npz: Path, keypair: tuple[Path, Path]):
    """``edgekit.package`` of the tiny classifier for cpu int8, with progress lines recorded."""
    from edgekit import package

    root = tmp_path_factory.mktemp("int8")
    model = tiny_classifier(root / "tiny.onnx")  # the same weights as ``tiny_model``
    lines: list[str] = []
    result = package(
        model,
        targets=["cpu"],
        precision="int8",
        calib=calib_npz,
        key=keypair[0],
        name="tiny",
        version=2,
        out_dir=root / "out",
        progress=lines.append,
    )
    return result, lines
