"""`edgekit export MODULE:FACTORY`: a PyTorch module to ONNX with a dynamic batch axis, checked against
PyTorch, then packaged: the exact commands and lines a new user sees."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from edgekit.cli import main
from tests.cli.test_first_hour import _cli

NET = """
import torch


def make_net():
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Linear(4, 10), torch.nn.Softmax(dim=1),
    )
"""


@pytest.fixture()
def net_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "mynets.py").write_text(NET)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_cli_export_module_factory_with_a_dynamic_batch_then_package(capsys, net_dir: Path) -> None:
    code, out, err = _cli(capsys, "export", "mynets:make_net", "--example-shape", "1x3x16x16", "-o", "net.onnx")
    lines = out.splitlines()
    assert (code, err) == (0, "")
    assert lines[0] == "wrote net.onnx: input 'input' float32 [batch, 3, 16, 16]; output 'output' float32 [batch, 10]"
    assert lines[1].startswith("ONNX Runtime matches PyTorch on the example input (max abs error ")
    assert lines[2] == "next: edgekit package net.onnx --calib DATA.npz"
    dims = onnx.load("net.onnx").graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in dims] == ["batch", 3, 16, 16]
    np.savez("calib.npz", input=np.random.default_rng(0).standard_normal((250, 3, 16, 16)).astype(np.float32))
    argv = ["package", "net.onnx", "--calib", "calib.npz", "--precision", "fp32", "-q", "--key"]
    assert main(["keygen", "--out", "keys", "--name", "k"]) == 0
    capsys.readouterr()
    assert main([*argv, "keys/k.key"]) == 0
    assert Path("dist/net-cpu-v1.ekb").is_file()


def test_cli_export_from_a_file_path_with_a_static_batch(capsys, net_dir: Path) -> None:
    code, out, _ = _cli(capsys, "export", "mynets.py:make_net", "--example-shape", "2x3x16x16", "--static-batch")
    assert code == 0 and out.splitlines()[0] == (
        "wrote model.onnx: input 'input' float32 [2, 3, 16, 16]; output 'output' float32 [2, 10]"
    )


def test_cli_export_names_the_nearest_factory_and_the_missing_module(capsys, net_dir: Path) -> None:
    assert _cli(capsys, "export", "mynets:make_nett", "--example-shape", "1x3x16x16") == (
        2,
        "",
        "edgekit: error: mynets has no function or class 'make_nett'; did you mean 'make_net'?\n",
    )
    assert _cli(capsys, "export", "nonets:make", "--example-shape", "1x3x16x16") == (
        2,
        "",
        "edgekit: error: cannot import 'nonets' (No module named 'nonets'); run from the folder that holds it or "
        "give a path such as nonets.py:make\n",
    )
