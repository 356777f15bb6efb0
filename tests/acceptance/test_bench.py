"""python -m bench: the registry, a quick real run, and what it writes. No timing is asserted."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from bench import registry


def test_every_registry_entry_names_an_importable_benchmark_function() -> None:
    names = [e.name for e in registry.BENCHMARKS]
    assert len(set(names)) == len(names)
    for entry in registry.BENCHMARKS:
        module, func = entry.function.split(":")
        assert callable(getattr(importlib.import_module(module), func)), entry.name


def test_select_takes_prefixes_and_rejects_unknown_names() -> None:
    assert [e.name for e in registry.select("agent")] == ["agent.roundtrip"]
    assert {e.name for e in registry.select("quant")} >= {"quant.cpu", "quant.intel"}
    with pytest.raises(ValueError, match="matches no benchmark"):
        registry.select("nosuch")


def test_bench_agent_roundtrip_measures_both_sides_and_writes_results(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench.__main__ import main

    assert main(["--quick", "--only", "agent.roundtrip", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("machine: ") and "cores" in out
    doc = json.loads((tmp_path / "latest.json").read_text())
    assert doc["machine"]["cores"] >= 1 and "onnxruntime" in doc["machine"]["versions"]
    rows = doc["measurements"]
    assert {r["case"] for r in rows} == {"v2 binary vs in-process", "v2 json vs in-process"}
    for r in rows:
        assert r["a_value"] > 0 and r["b_value"] > 0 and r["ratio"] == pytest.approx(r["b_value"] / r["a_value"])
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "latest.png").stat().st_size > 0


def test_quant_cpu_compares_int8_with_fp32_bundles_through_the_runtime(tmp_path: Path) -> None:
    from bench.quant import run
    from edgekit.bundle import generate_keypair

    key, pub = generate_keypair(tmp_path / "keys", "bench")
    ctx = registry.BenchContext(tmp_path, key, pub, repeats=3, budget_s=0.5, progress=lambda _msg: None)
    rows = {(m.case, m.metric): m for m in run(ctx, name="quant.cpu", target="cpu", candidates=("int8",))}
    size = rows[("int8 vs fp32", "artifact size")]
    assert size.ratio is not None and size.ratio < 0.35  # int8 weights: about a quarter of fp32
    top1 = rows[("int8 vs fp32", "held-out top-1")]
    assert top1.a_value is not None and top1.b_value is not None
    assert top1.a_value >= 97.0 and abs(top1.b_value - top1.a_value) <= 1.0
    assert "onnxruntime runtime on this host" in top1.note
    for batch in (1, 32):
        latency = rows[("int8 vs fp32", f"p50 latency, batch {batch}")]
        assert latency.a_value is not None and latency.b_value is not None  # measured, whatever the numbers


def test_quant_reports_not_measured_here_for_a_target_this_checkout_lacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bench.quant import run
    from edgekit.targets import TARGETS

    monkeypatch.setitem(TARGETS, "nosuch", "edgekit.targets.nosuch_module:NoSuchTarget")
    ctx = registry.BenchContext(tmp_path, tmp_path / "k", tmp_path / "p", repeats=1, budget_s=0.1)
    (row,) = run(ctx, name="quant.nosuch", target="nosuch")
    assert row.note.startswith(registry.NOT_HERE) and row.ratio is None


def test_bench_plot_has_one_panel_per_kind_with_values_and_speedup_around_one() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.registry import Measurement
    from bench.report import plot

    rows = [
        Measurement("quant.cpu", "int8 vs fp32", "artifact size", "bytes", "fp32", "int8", 2730881, 704788),
        Measurement("quant.cpu", "int8 vs fp32", "held-out top-1", "%", "fp32", "int8", 98.9, 98.9),
        Measurement(
            "quant.cpu", "int8 vs fp32", "p50 latency, batch 1", "ms", "fp32", "int8", 0.68, 0.25,
            a_spread=(0.6, 0.7), b_spread=(0.24, 0.27),
        ),
        Measurement("quant.intel", "int8 vs fp32", "p50 latency, batch 1", "ms", "fp32", "int8", 0.5, 1.0),
        Measurement("ota.mqtt", "reconnects", "spread (last - first)", "s", "paho", "edgekit", 0.03, 6.9),
        Measurement("quant.jetson", "int8 vs fp32", "p50 latency, batch 1", "ms", "fp32", "int8", note="not here"),
    ]  # fmt: skip
    fig = plot(rows, "title")
    try:
        titles = [ax.get_title(loc="left") for ax in fig.axes]
        assert [t.split(" ")[0] for t in titles] == ["artifact", "held-out", "latency", "speed-up", "fleet"]
        size, accuracy, latency, speed, fleet = fig.axes
        texts = [t.get_text().strip() for t in size.texts]
        assert texts == ["2667 KB fp32", "688 KB int8"]  # absolute values, not only the ratio
        assert accuracy.get_xlim()[0] > 90  # 98.9% vs 98.9% is not drawn as two long bars from 0
        assert [t.get_text().strip() for t in speed.texts] == ["2.72x: 2.72x faster", "0.50x: 2.00x slower"]
        assert {round(p.get_x(), 6) for p in speed.patches} == {1.0}  # bars grow from the 1.0 line
        assert any(list(line.get_xdata()) == [1.0, 1.0] for line in speed.lines)
        assert speed.get_xscale() == "log"
        assert len(latency.collections) + len(latency.lines) > 0 and fleet.texts
    finally:
        plt.close(fig)


def test_bench_models_option_adds_engine_entries_and_a_missing_file_is_a_skip_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench.__main__ import main

    (entry,) = registry.model_entries(f"{tmp_path}/det.onnx:{tmp_path}/c.npz:{tmp_path}/e.npz")
    assert entry.name == "engine.det" and entry.params["paths"][0] == f"{tmp_path}/det.onnx"
    assert [e.name for e in registry.select("engine.det", (entry,))] == ["engine.det"]
    with pytest.raises(ValueError, match=r"expected MODEL\.onnx:CALIB\.npz:EVAL\.npz"):
        registry.model_entries("a.onnx:b.npz")
    models = f"{tmp_path}/det.onnx:{tmp_path}/c.npz:{tmp_path}/e.npz"
    assert main(["--quick", "--only", "engine.det", "--models", models, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"  skipped: model {tmp_path}/det.onnx does not exist\n" in out
    (row,) = json.loads((tmp_path / "latest.json").read_text())["measurements"]
    assert row["note"] == f"{registry.NOT_HERE}: model {tmp_path}/det.onnx does not exist"


def test_serving_splits_the_cpus_between_load_generator_and_agent_and_needs_two() -> None:
    from bench.serving import split_cpus

    assert split_cpus({0, 1}) == ([0], [1])
    assert split_cpus({0, 1, 2}) == ([0], [1, 2])
    assert split_cpus(set(range(16))) == (list(range(8)), list(range(8, 16)))
    assert split_cpus({5, 3}) == ([3], [5])
    assert split_cpus({7}) is None


def test_serving_load_generator_leaves_no_descriptors_behind_after_its_client_threads() -> None:
    """Each client thread's gevent hub (tritonclient.http runs on gevent) is destroyed with it: once
    a bench run's leaked hubs held over 1024 descriptors, every later load ran 2-3x slower."""
    import os
    import subprocess
    import sys

    import numpy as np

    from bench.serving import Load

    root = Path(__file__).resolve().parents[2]
    null = subprocess.Popen([sys.executable, "-m", "bench.null_server"], stdout=subprocess.PIPE, cwd=root)
    try:
        assert null.stdout is not None
        port = int(null.stdout.readline())
        load = Load(f"127.0.0.1:{port}", "roundtrip", {"x": np.zeros((1, 4), np.float32)}, "y")
        load.run(8, 0.2)  # what the first run opens for good (gevent's and tritonclient's own state)
        before = len(os.listdir("/proc/self/fd"))
        answered, _, errors = load.run(8, 0.2)
        assert answered > 0 and errors == 0
        assert len(os.listdir("/proc/self/fd")) <= before
    finally:
        null.terminate()
        null.wait(10)


def test_bench_markdown_page_stamps_date_machine_flags_command_and_every_row(tmp_path: Path) -> None:
    from bench.registry import Measurement
    from bench.report import load_doc_rows, to_json, to_markdown

    machine = {
        "cpu": "Some CPU", "cores": 4, "cores_usable": 2, "machine": "x86_64", "os": "Linux 6.1",
        "python": "3.11.7", "cpu_flags": ["avx2", "avx512_vnni"], "versions": {"onnxruntime": "1.32.0"},
    }  # fmt: skip
    rows = [
        Measurement("quant.cpu", "int8 vs fp32", "artifact size", "bytes", "fp32", "int8", 2048.0, 512.0),
        Measurement("quant.cpu", "int8 vs fp32", "p50 latency, batch 1", "ms", "fp32", "int8", 0.5, 0.25,
                    note="a|b"),
        Measurement("quant.jetson", "int8 vs fp32", "p50 latency", "ms", "fp32", "int8",
                    note="not measured here: no GPU"),
    ]  # fmt: skip
    doc = json.loads(json.dumps(to_json(machine, rows, "2026-12-02T17:00:00+00:00", 12.3, "python -m bench --quick")))
    assert load_doc_rows(doc) == rows
    page = to_markdown(doc, Path("../bench/results/latest.png")).splitlines()
    assert "- **Date**: 2026-12-02T17:00:00+00:00 (UTC), 12.3 s" in page
    assert "- **Command**: `python -m bench --quick`" in page
    assert any(line.startswith("A `--quick` run: fewer repeats") for line in page)
    assert "- **Machine**: Some CPU, 4 logical CPUs (2 usable), x86_64, Linux 6.1, Python 3.11.7" in page
    assert "- **CPU flags**: `avx2`, `avx512_vnni`" in page
    assert "- **Runtimes**: onnxruntime 1.32.0" in page
    assert "![python -m bench: one panel per kind of number](../bench/results/latest.png)" in page
    assert page.index("## quant.cpu") < page.index("## quant.jetson")
    assert "| int8 vs fp32 | artifact size | fp32 2.0 KB | int8 0.5 KB | 0.25x |  |" in page
    assert "| int8 vs fp32 | p50 latency, batch 1 | fp32 0.500 ms | int8 0.250 ms | 0.50x | a\\|b |" in page
    assert "| int8 vs fp32 | p50 latency | fp32 | int8 | - | not measured here: no GPU |" in page


def test_bench_markdown_from_recorded_results_says_what_was_not_recorded(tmp_path: Path) -> None:
    """``--plot-only --markdown`` on a results file written before the command and the CPU flags
    were recorded: the page is written from it, says "not recorded" for both, and links the plot."""
    from bench.__main__ import main

    recorded = json.loads((Path(__file__).resolve().parents[2] / "bench" / "results" / "latest.json").read_text())
    recorded.pop("command", None)
    recorded["machine"].pop("cpu_flags", None)
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "latest.json").write_text(json.dumps(recorded))
    page_path = tmp_path / "docs" / "benchmarks.md"
    code = main(["--plot-only", "--out", str(tmp_path / "results"), "--markdown", str(page_path)])
    page = page_path.read_text()
    assert "- **Command**: not recorded" in page and "- **CPU flags**: not recorded" in page
    assert f"- **Date**: {recorded['started']} (UTC)" in page
    table_rows = [
        line for line in page.splitlines() if line.startswith("| ") and not line.startswith(("| case", "| ---"))
    ]
    assert len(table_rows) == len(recorded["measurements"])
    if importlib.util.find_spec("matplotlib") is not None:
        assert code == 0 and "](../results/latest.png)" in page
