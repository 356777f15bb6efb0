"""bench/split.py on the digits example: the table's rows and the PNG."""

from __future__ import annotations

from pathlib import Path

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
    for r in rows[1:]:
        assert r.a_value is not None and r.b_value is not None
        if "planned choice vs best" in r.case:  # A: the best under the re-measured times
            assert r.b_value >= r.a_value * (1 - 1e-9)
        else:  # B: the best option, A: the better of local and remote
            assert r.b_value <= r.a_value * (1 + 1e-9)
    assert (tmp_path / "out" / "split-digits.png").read_bytes()[:4] == b"\x89PNG"
