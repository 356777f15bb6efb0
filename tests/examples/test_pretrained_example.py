"""examples.pretrained: the wheel-shipped PP-OCR classifier and its synthetic calibration lines."""

from __future__ import annotations

import numpy as np
import pytest

import examples.pretrained as pretrained
from edgekit.errors import MissingSDKError


def _installed() -> bool:
    try:
        pretrained.find_pretrained()
    except MissingSDKError:
        return False
    return True


needs_model = pytest.mark.skipif(not _installed(), reason="rapidocr-onnxruntime (edgekit[dev]) is not installed")


@needs_model
def test_find_pretrained_returns_the_packaged_opset11_classifier() -> None:
    import onnx

    path, description = pretrained.find_pretrained()
    assert "rapidocr_onnxruntime" in path.parts and path.suffix == ".onnx"
    model = onnx.load(str(path))
    assert model.opset_import[0].version == 11
    assert [i.name for i in model.graph.input] == ["x"]
    assert "text-direction classifier" in description


def test_find_pretrained_names_the_package_to_install_when_none_is_there(monkeypatch: pytest.MonkeyPatch) -> None:
    missing = pretrained.PretrainedSource("edgekit_no_such_package", "m.onnx", "no-such-wheel", "nothing")
    monkeypatch.setattr(pretrained, "SOURCES", (missing,))
    with pytest.raises(MissingSDKError, match=r"no-such-wheel.*edgekit\[dev\]"):
        pretrained.find_pretrained()


@needs_model
def test_make_calib_builds_in_range_inputs_for_the_model_input() -> None:
    path, _ = pretrained.find_pretrained()
    calib = pretrained.make_calib(path, 12)
    assert list(calib) == ["x"]
    x = calib["x"]
    assert x.shape == (12, 3, 48, 192) and x.dtype == np.float32
    assert x.min() >= -1.0 and x.max() <= 1.0
    np.testing.assert_array_equal(x, pretrained.make_calib(path, 12)["x"])  # seeded


@needs_model
def test_text_lines_are_plausible_inputs_the_fp32_classifier_reads_correctly() -> None:
    import onnxruntime as ort

    path, _ = pretrained.find_pretrained()
    images, rotated = pretrained.text_lines(100, seed=3)
    assert 0.3 < rotated.mean() < 0.7
    scores = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": images})[0]
    # far above chance (0.5): the synthetic lines look like text to a real text-direction classifier
    assert (scores.argmax(1) == rotated).mean() >= 0.9


@needs_model
def test_rendered_lines_are_printed_text_the_fp32_classifier_reads_correctly() -> None:
    import onnxruntime as ort

    path, _ = pretrained.find_pretrained()
    images, rotated = pretrained.rendered_lines(100, seed=3)
    assert images.shape == (100, 3, 48, 192) and images.min() >= -1.0 and images.max() <= 1.0
    assert 0.3 < rotated.mean() < 0.7
    np.testing.assert_array_equal(images, pretrained.rendered_lines(100, seed=3)[0])  # seeded
    scores = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": images})[0]
    assert (scores.argmax(1) == rotated).mean() >= 0.8
    mixed, _ = pretrained.mixed_lines(10, seed=0)
    assert mixed.shape == (10, 3, 48, 192)
