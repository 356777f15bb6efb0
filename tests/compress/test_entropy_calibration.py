"""Entropy calibration really searches a threshold (ORT's defaults, 128 bins for 128 quantized
bins, left only the full range: entropy ranges were MinMax's), for the cpu target's
``quantize_static_int8`` and the jetson target's ``quantize_for_tensorrt``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edgekit.compress.ort_quant import StaticQuantConfig, quantize_static_int8
from edgekit.targets.jetson import JetsonOptions, quantize_for_tensorrt


def _long_tail_model(path: Path) -> Path:
    """x [N, 64] -> Gemm -> y: y's values are mostly small with rare large outliers (from x)."""
    from onnx import TensorProto, helper, numpy_helper, save

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((8, 64)) * 0.2).astype(np.float32), "w")
    b = numpy_helper.from_array(np.zeros(8, np.float32), "b")
    graph = helper.make_graph(
        [
            helper.make_node("Gemm", ["x", "w", "b"], ["h"], transB=1, name="fc1"),
            helper.make_node("Relu", ["h"], ["y"], name="relu"),
        ],
        "long_tail",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
        [w, b],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    save(model, str(path))
    return path


def _samples() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 64)).astype(np.float32)
    x[::16] *= 40.0  # 4 of 64 samples far out: the tail MinMax covers and entropy clips
    return {"x": x}


def _width(ranges: dict[str, tuple[float, float]], name: str) -> float:
    low, high = ranges[name]
    return high - low


def _cached_ranges(cache: Path) -> dict[str, tuple[float, float]]:
    from onnxruntime.quantization.calibrate import load_tensors_data

    data = load_tensors_data(cache)
    return {k: (float(np.min(v.range_value[0])), float(np.max(v.range_value[1]))) for k, v in data.data.items()}


def test_jetson_entropy_calibration_clips_the_tail_minmax_keeps(tmp_path: Path) -> None:
    model = _long_tail_model(tmp_path / "m.onnx")
    widths = {}
    for method in ("minmax", "entropy"):
        work = tmp_path / method
        work.mkdir()
        ranges = quantize_for_tensorrt(model, work / "q.onnx", _samples(), method, JetsonOptions(), work)
        widths[method] = _width(ranges, "h")
    assert widths["entropy"] < 0.75 * widths["minmax"], widths  # equal before: ORT searched no threshold


@pytest.mark.parametrize("activations", ["uint8", "int8"])
def test_cpu_entropy_calibration_clips_the_tail_minmax_keeps(tmp_path: Path, activations: str) -> None:
    model = _long_tail_model(tmp_path / "m.onnx")
    widths = {}
    for method in ("minmax", "entropy"):
        work = tmp_path / method
        work.mkdir()
        config = StaticQuantConfig(activations=activations, calibration=method)  # type: ignore[arg-type]
        quantize_static_int8(model, work / "q.onnx", _samples(), config, work)
        cache = work / f"ranges-{method}.json"
        assert json.loads(cache.read_text())["calibration_method"]["value"].lower().endswith(method)
        widths[method] = _width(_cached_ranges(cache), "h")
    assert widths["entropy"] < 0.75 * widths["minmax"], widths  # equal before: ORT searched no threshold
