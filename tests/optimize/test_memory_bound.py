"""The packaging run's memory bound (``--max-memory-gb``): a candidate estimated over it is skipped
with its reason before it is built; nothing that fits is a clear error, never a crash."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edgekit.cli import main
from edgekit.errors import ConfigError
from edgekit.optimize.memory import (
    CALIB_CALL_SAMPLES,
    GB,
    REFUSAL,
    RUNTIME_BYTES,
    activation_bytes,
    memory_model,
)
from edgekit.optimize.run import EngineSettings
from tests.factories import package_small_data, tiny_dense

SIZE, FEATURES = 64, 128


def _data(tmp_path: Path, n: int = 20) -> tuple[Path, Path]:
    rng = np.random.default_rng(3)
    calib, eval_ = tmp_path / "calib.npz", tmp_path / "eval.npz"
    np.savez(calib, image=rng.standard_normal((n, 3, SIZE, SIZE)).astype(np.float32))
    np.savez(eval_, image=rng.standard_normal((n, 3, SIZE, SIZE)).astype(np.float32))
    return calib, eval_


def test_activation_bytes_from_shape_inference(tmp_path: Path) -> None:
    import onnx

    model = tiny_dense(tmp_path / "d.onnx", size=SIZE, features=FEATURES)
    node_peak, every = activation_bytes(onnx.load(str(model)), {"image": (3, SIZE, SIZE)})
    conv = FEATURES * SIZE * SIZE * 4  # one sample of conv1's output, float32
    assert node_peak == 2 * conv  # the Relu: conv1's output in, its own out
    assert every > 2 * conv and every < 3 * conv  # + the input, the mask and the small tensors


def test_calibrating_needs_more_than_measuring(tmp_path: Path) -> None:
    model = tiny_dense(tmp_path / "d.onnx", size=SIZE, features=FEATURES)
    held = {"image": np.zeros((10, 3, SIZE, SIZE), np.float32)}
    m = memory_model(model, {"image": (3, SIZE, SIZE)}, [held, held, None], 2 * GB, 16)
    assert m.held_bytes == held["image"].nbytes  # one array held twice counts once
    assert m.needs(True) - m.needs(False) == CALIB_CALL_SAMPLES * m.all_tensors_bytes
    assert m.refusal("int8") == "" and m.refusal("fp32") == ""
    tight = memory_model(model, {"image": (3, SIZE, SIZE)}, [held], RUNTIME_BYTES, 16)
    why = tight.refusal("int8")
    assert why.startswith(REFUSAL) and "to calibrate" in why and "--max-memory-gb" in why
    assert "to build and measure" in tight.refusal("fp32")


def test_bad_bound_is_a_config_error() -> None:
    for bad in (0, -1.0, "4", True):
        with pytest.raises(ConfigError, match="--max-memory-gb"):
            EngineSettings(max_memory_gb=bad)  # type: ignore[arg-type]


def test_int8_over_the_bound_is_skipped_and_float_ships(tmp_path: Path, keypair: tuple[Path, Path]) -> None:
    model = tiny_dense(tmp_path / "d.onnx", size=SIZE, features=FEATURES)
    calib, eval_ = _data(tmp_path)
    # a bound between what measuring a float candidate needs and what calibrating needs: the data
    # this run holds (a few MB) is well within the calibration's share (16 samples of every tensor)
    bare = memory_model(model, {"image": (3, SIZE, SIZE)}, [], 0, 16)
    headroom = CALIB_CALL_SAMPLES * bare.all_tensors_bytes
    assert headroom > 60 * 1024**2
    bound = bare.needs(False) + headroom // 2
    result = package_small_data(
        model, targets="cpu", precision="auto", calib=calib, eval=eval_, key=keypair[0], name="d",
        out_dir=tmp_path / "out", options={"cpu": {"openvino": False}}, max_memory_gb=bound / GB,
    )  # fmt: skip
    report = json.loads(result.reports["cpu"].with_suffix(".json").read_text())
    by_status = {c["name"]: (c["status"], c["reason"]) for c in report["candidates"]}
    int8 = [n for n, c in zip(by_status, report["candidates"], strict=True) if c["precision"] == "int8"]
    # the first wave refused before it is built; its refinements say so after its reason
    assert int8 and all(by_status[n][0] == "skipped" and REFUSAL in by_status[n][1] for n in int8)
    first = [n for n in int8 if by_status[n][1].startswith(REFUSAL)]
    assert first and all("to calibrate" in by_status[n][1] and "--max-memory-gb" in by_status[n][1] for n in first)
    chosen = next(c for c in report["candidates"] if c["status"] == "chosen")
    assert chosen["precision"] in ("fp32", "fp16")
    assert any(n.startswith("memory: peak RSS") for n in report["notes"])
    assert result.passed


def test_nothing_fits_is_a_one_line_error(tmp_path: Path, keypair: tuple[Path, Path], capsys) -> None:
    model = tiny_dense(tmp_path / "d.onnx", size=SIZE, features=16)
    calib, eval_ = _data(tmp_path)
    code = main([
        "package", str(model), "--target", "cpu", "--precision", "auto", "--calib", str(calib), "--eval",
        str(eval_), "--key", str(keypair[0]), "--name", "d", "-o", str(tmp_path / "out"), "-q",
        "--allow-small-eval", "--option", "cpu.openvino=false", "--max-memory-gb", "0.001",
    ])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2  # bad arguments: nothing was converted
    assert "fits the memory bound" in err and "--max-memory-gb" in err and "Traceback" not in err
    assert not list((tmp_path / "out").glob("*.ekb"))


def test_a_large_accuracy_pass_gets_its_session_reopened(tmp_path: Path) -> None:
    model = tiny_dense(tmp_path / "d.onnx", size=SIZE, features=FEATURES)
    small = memory_model(model, {"image": (3, SIZE, SIZE)}, [], int(GB), 16)
    assert not small.reopen_after_accuracy()  # 16 samples x 4 MB x 2: a second open is not worth it
    large = memory_model(model, {"image": (3, 4 * SIZE, 4 * SIZE)}, [], int(GB), 16)
    assert large.reopen_after_accuracy()  # 16 samples x 64 MB x 2
    one = memory_model(model, {"image": (3, 4 * SIZE, 4 * SIZE)}, [], int(GB), 1)
    assert not one.reopen_after_accuracy()  # one sample per call: what the timing rounds hold anyway


def test_default_bound_is_three_quarters_of_what_the_machine_or_its_cgroup_allows() -> None:
    import os

    from edgekit.package_defaults import default_max_memory_gb, usable_memory_bytes
    from edgekit.packaging.request import PackageRequest

    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < usable_memory_bytes() <= physical
    assert default_max_memory_gb() == round(0.75 * usable_memory_bytes() / 2**30, 1)
    # unset (None) means that machine-sized bound, not a fixed one that would refuse int8 on a
    # large model with RAM to spare
    assert EngineSettings().max_memory_gb is None and PackageRequest(model=Path("m.onnx")).max_memory_gb is None


def test_full_bias_correction_counts_every_calibration_sample(tmp_path: Path) -> None:
    from edgekit.optimize.openvino_candidates import NncfRecipe, nncf_candidate

    model = tiny_dense(tmp_path / "d.onnx", size=SIZE, features=FEATURES)
    m = memory_model(model, {"image": (3, SIZE, SIZE)}, [], 4 * GB, 16, calib_samples=96)
    assert m.needs(True, every_sample=True) - m.needs(True) == 96 * m.node_peak_bytes // 2
    assert m.needs(False, every_sample=True) == m.needs(False)  # nothing is calibrated
    # a bound the per-call calibration fits and the all-samples one does not
    bound = m.needs(True) + 48 * m.node_peak_bytes // 2
    tight = memory_model(model, {"image": (3, SIZE, SIZE)}, [], bound, 16, calib_samples=96)
    assert tight.refusal("int8") == ""
    why = tight.refusal("int8", every_sample=True)
    assert why.startswith(REFUSAL) and "all 96 calibration samples at once" in why
    full = nncf_candidate(model, NncfRecipe("mixed", fast_bias_correction=False), "CPU", model)
    fast = nncf_candidate(model, NncfRecipe("performance", fast_bias_correction=True), "CPU", model)
    assert full.holds_every_sample and not fast.holds_every_sample
    # NNCF collects its statistics one sample at a time: one sample's tensors, not a chunk's
    assert full.calib_call_samples == fast.calib_call_samples == 1
    assert m.needs(True) - m.needs(True, call_samples=1) == (CALIB_CALL_SAMPLES - 1) * m.all_tensors_bytes
    one = memory_model(model, {"image": (3, SIZE, SIZE)}, [], m.needs(True, call_samples=1), 16)
    assert one.refusal("int8", call_samples=1) == "" and one.refusal("int8").startswith(REFUSAL)


def test_open_sessions_of_measured_candidates_count_under_the_bound(tmp_path: Path) -> None:
    model = tiny_dense(tmp_path / "d.onnx", size=SIZE, features=FEATURES)
    m = memory_model(model, {"image": (3, SIZE, SIZE)}, [], 4 * GB, 1)
    per_session = m.session_bytes()
    assert per_session == m.all_tensors_bytes + m.model_bytes  # one call's arena, and the weights
    assert m.needs(False, open_sessions=3) - m.needs(False) == 3 * per_session
    bound = m.needs(False, open_sessions=2)
    tight = memory_model(model, {"image": (3, SIZE, SIZE)}, [], bound, 1)
    assert tight.refusal("fp32", open_sessions=2) == ""
    why = tight.refusal("fp32", open_sessions=3)
    assert why.startswith(REFUSAL) and "3 open sessions of candidates measured before it" in why


def test_mixed_precision_ranking_is_refused_over_the_bound(tmp_path: Path) -> None:
    from edgekit.optimize.memory import RANKING_TENSOR_COPIES

    model = tiny_dense(tmp_path / "d.onnx", size=SIZE, features=FEATURES)
    m = memory_model(model, {"image": (3, SIZE, SIZE)}, [], 4 * GB, 1)
    assert m.ranking_refusal() == ""
    base = m.held_bytes + 3 * m.model_bytes + RUNTIME_BYTES
    just = base + RANKING_TENSOR_COPIES * m.all_tensors_bytes
    fits = memory_model(model, {"image": (3, SIZE, SIZE)}, [], just, 1)
    assert fits.ranking_refusal() == ""
    why = fits.ranking_refusal(open_sessions=1)  # one open session more: over
    assert why.startswith(REFUSAL) and "to rank the layers" in why and "1 open sessions" in why
