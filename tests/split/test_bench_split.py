"""bench/split.py on the digits example and the bottleneck network: the table's rows and the PNG."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.registry import BenchContext
from bench.split import BANDWIDTHS_MBPS, _one


def test_bench_split_reports_prediction_error_regret_and_gain_and_writes_the_plot(
    tmp_path: Path, keypair: tuple[Path, Path]
) -> None:
    from examples.digits import load

    ctx = BenchContext(tmp_path, keypair[0], keypair[1], repeats=3, budget_s=0.3, progress=lambda _: None)
    rows = _one(ctx, "split.plan", "digits", load().model, {}, tmp_path / "out")
    cases = [r.case for r in rows]
    assert cases[0] == "digits: segment latency" and rows[0].b_value is not None
    assert sum("planned choice vs best" in c for c in cases) == len(BANDWIDTHS_MBPS)
    assert sum("slower: best vs l/r" in c for c in cases) == len(BANDWIDTHS_MBPS)
    assert all("re-measured best" in r.note and "regret" in r.note for r in rows if "slower: best vs l/r" in r.case)
    shape = [r for r in rows if r.case.startswith("digits: shape")]
    assert len(shape) == 1 and ("allows >= 2x" in shape[0].note or "does not allow 2x" in shape[0].note)
    assert cases[1] == "digits: segment share of the full model" and rows[1].b_value is not None
    for r in rows[2:]:
        if r in shape:
            continue
        assert r.a_value is not None and r.b_value is not None
        if "planned choice vs best" in r.case:  # A: the best under the re-measured times
            assert r.b_value >= r.a_value * (1 - 1e-9)
        else:  # B: the best option, A: the better of local and remote
            assert r.b_value <= r.a_value * (1 + 1e-9)
    assert (tmp_path / "out" / "split-digits.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "out" / "split-digits-slower-device.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_split_shape_row_says_a_bottleneck_network_allows_a_2x_split_on_a_slower_device(
    tmp_path: Path,
) -> None:
    from dataclasses import replace
    from types import SimpleNamespace

    from bench.split import _slow_device_rows, bottleneck_convnet
    from edgekit.split.planner import plan_model

    model = bottleneck_convnet(tmp_path / "b.onnx", size=128, width=32, depth=3)
    run = plan_model(model, tmp_path / "plan", BANDWIDTHS_MBPS, budget_s=0.3, plot=False)
    stem = run.measured.cuts[0]
    assert stem.bytes_per_sample * 48 == run.measured.input_bytes_per_sample  # the 8x8/8 stem to 4 channels
    # set times (not this machine's): the stem 1 ms of a 100 ms model, later heads the rest
    cuts = tuple(
        replace(c, head_ms=1.0 if k == 0 else 100.0 * (k + 1) / len(run.measured.cuts), tail_ms=10.0)
        for k, c in enumerate(run.measured.cuts)
    )
    measured = replace(run.measured, full_ms=100.0, cuts=cuts)
    rows = _slow_device_rows("split.plan", "b", SimpleNamespace(measured=measured), 5.0, "x5 for the test")
    (shape,) = [r for r in rows if r.case.startswith("b: shape")]
    assert shape.a_value == pytest.approx(100.0 / 48) and shape.b_value == pytest.approx(1.0)
    assert "allows >= 2x" in shape.note
    # 1 Mbit/s: local 500 ms, remote 1573 ms + 20 + 10, the stem cut 5 + 32.8 + 20 + 1 ms (tail: 10 / 10)
    at_1 = next(r for r in rows if r.case.startswith("b at 1 Mbit/s"))
    assert at_1.a_value == 500.0 and at_1.b_value is not None and at_1.b_value < 250.0
