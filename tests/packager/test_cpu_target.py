"""The cpu target on its own: typed options, the bounded INT8 search, and a build outside the
packager (no ``evaluate`` callback)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from edgekit.compress.onnx_prep import prepare_model
from edgekit.errors import ConfigError
from edgekit.optimize.run import build as build_with_engine
from edgekit.targets import BuildContext, get_target
from edgekit.targets.cpu import CpuOptions, CpuTarget, candidate_configs
from edgekit.targets.options import parse_option_args, resolve_options
from tests.factories import confident_inputs, tiny_classifier


def test_cpu_target_is_listed_and_declares_its_interface() -> None:
    target = get_target("cpu")
    assert isinstance(target, CpuTarget)
    assert (target.name, target.runtime, target.precisions[0]) == ("cpu", "onnxruntime", "fp32")
    assert target.Options is CpuOptions


def test_cpu_candidates_auto_try_uint8_first_and_leave_room_for_calibration_fallbacks() -> None:
    labels = [c.label for c in candidate_configs(CpuOptions())]
    assert labels == [
        "ort-static qdq u8s8 per-channel minmax",
        "ort-static qoperator u8s8 per-channel minmax",
        "ort-static qdq u8s8 per-tensor minmax",
        "ort-static qdq s8s8 per-channel minmax",
    ]
    assert len(candidate_configs(CpuOptions(max_candidates=3))) == 1  # 3 minus two calibration fallbacks


def test_cpu_candidates_honour_fixed_options_without_duplicates() -> None:
    fixed = CpuOptions(activations="int8", quant_format="qoperator", calibration="entropy", reduce_range=True)
    labels = [c.label for c in candidate_configs(fixed)]
    assert labels == [
        "ort-static qoperator s8s8 per-channel entropy reduce-range",
        "ort-static qoperator s8s8 per-tensor entropy reduce-range",
    ]


def test_cpu_options_from_cli_strings_with_paths_in_errors() -> None:
    parsed = parse_option_args(["cpu.reduce_range=true", "cpu.max_candidates=4", "cpu.percentile=99.99"], ["cpu"])
    opts = resolve_options("cpu", CpuOptions, parsed["cpu"])
    assert (opts.reduce_range, opts.max_candidates, opts.percentile) == (True, 4, 99.99)
    with pytest.raises(ConfigError, match=re.escape("targets.cpu.reduce_range: expected true or false, got 'yes'")):
        resolve_options("cpu", CpuOptions, {"reduce_range": "yes"})
    with pytest.raises(
        ConfigError, match=re.escape("targets.cpu.activation: unknown option (known: ") + ".*did you mean 'activations'"
    ):
        resolve_options("cpu", CpuOptions, {"activation": "uint8"})
    with pytest.raises(
        ConfigError, match=re.escape("targets.cpu: int4_block_size must be a power of two >= 16, got 24")
    ):
        resolve_options("cpu", CpuOptions, {"int4_block_size": 24})
    assert resolve_options("cpu", CpuOptions, CpuOptions(max_candidates=2)).max_candidates == 2


def test_cpu_build_int8_outside_the_packager_searches_on_calibration_data(tmp_path: Path) -> None:
    model = tiny_classifier(tmp_path / "m.onnx")
    prepared = prepare_model(model, tmp_path / "prep")
    (tmp_path / "out").mkdir()
    (tmp_path / "work").mkdir()
    lines: list[str] = []
    ctx = BuildContext(
        model_path=prepared.path,
        served=prepared.served,
        precision="int8",
        calib={"input": confident_inputs(model, 30)},
        static_shapes={"input": (1, 3, 16, 16)},
        out_dir=tmp_path / "out",
        work_dir=tmp_path / "work",
        options=CpuOptions(max_candidates=3),
        progress=lines.append,
    )
    result = build_with_engine(CpuTarget(), ctx)
    assert result.files == {"model.onnx": "artifact"} and (tmp_path / "out" / "model.onnx").is_file()
    assert result.runnable_here and result.artifact_signature == prepared.served and result.mapping == ()
    assert result.precision.method == "ort-static qdq u8s8 per-channel minmax"
    assert result.notes[-1].startswith("chose ort-static qdq u8s8 per-channel minmax: ")
    assert lines[:2] == ["[cpu] candidate 1: ort fp32", "[cpu]   top-1 agreement 1.000 (passed)"]
    assert lines[2] == "[cpu] candidate 2: ort-static qdq u8s8 per-channel minmax"
    assert result.target_options["max_candidates"] == 3
