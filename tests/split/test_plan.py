"""The split planner: cut points, head/tail composition, bytes, compression cost, the choice per
bandwidth (from profiles, so that no assertion depends on this machine's timing), the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edgekit.cli import main
from edgekit.errors import ConfigError
from edgekit.split import graph
from edgekit.split.measure import SplitCompositionError, measure
from edgekit.split.planner import plan_model
from tests.split.conftest import write_profiles
from tests.split.models import TENSOR_BYTES, inputs, shrinking_convnet


def test_enumerate_cuts_keeps_single_tensor_cuts_only_when_max_tensors_is_one(tmp_path: Path) -> None:
    model = graph.load_model(shrinking_convnet(tmp_path / "skip.onnx", skip=True))
    single = [c.tensors for c in graph.enumerate_cuts(model, max_tensors=1)]
    double = [c.tensors for c in graph.enumerate_cuts(model, max_tensors=2)]
    assert ("r2", "r3") not in single and ("r2", "r3") in double
    assert all(len(t) == 1 for t in single)
    # no cut before any compute, none sending the raw input, none after the last node
    assert ("x",) not in single and ("probs",) not in single


def test_extract_head_and_tail_compose_to_the_full_model(tmp_path: Path) -> None:
    import onnxruntime as ort

    model = graph.load_model(shrinking_convnet(tmp_path / "m.onnx"))
    x = inputs(3)
    full = ort.InferenceSession(str(tmp_path / "m.onnx")).run(None, {"x": x})[0]
    for cut in graph.enumerate_cuts(model):
        head, tail = graph.extract(model, cut)
        hs = ort.InferenceSession(head.SerializeToString())
        ts = ort.InferenceSession(tail.SerializeToString())
        assert [i.name for i in hs.get_outputs()] == list(cut.tensors) == [i.name for i in ts.get_inputs()]
        mid = dict(zip(cut.tensors, hs.run(None, {"x": x}), strict=True))
        np.testing.assert_allclose(ts.run(None, mid)[0], full, rtol=1e-5, atol=1e-6)


def test_measure_refuses_a_tail_that_does_not_compose(tmp_path: Path) -> None:
    model = graph.load_model(shrinking_convnet(tmp_path / "m.onnx"))
    other = graph.load_model(shrinking_convnet(tmp_path / "other.onnx", seed=7))  # other weights
    cut = graph.enumerate_cuts(model)[3]
    head, _ = graph.extract(model, cut)
    _, wrong_tail = graph.extract(other, cut)
    files = [(cut, graph.save(head, tmp_path / "h.onnx"), graph.save(wrong_tail, tmp_path / "t.onnx"))]
    with pytest.raises(SplitCompositionError, match=cut.id):
        measure(tmp_path / "m.onnx", files, [{"x": inputs(1)}], compress=False)


def test_plan_measures_bytes_per_sample_and_compression_cost(tmp_path: Path) -> None:
    run = plan_model(shrinking_convnet(tmp_path / "m.onnx"), tmp_path / "out", [1.0], budget_s=0.5, plot=False)
    assert run.measured.input_bytes_per_sample == 3 * 96 * 96 * 4
    for m in run.measured.cuts:
        if m.cut.tensors[0] in TENSOR_BYTES:
            assert m.bytes_per_sample == TENSOR_BYTES[m.cut.tensors[0]]
        comp = {c.mode: c for c in m.compression}
        assert comp["none"].max_abs_error == 0.0  # lossless
        if m.bytes_per_sample > 1000:  # a few floats deflate to the codec's overhead whatever their type
            assert comp["int8"].bytes_per_sample < comp["fp16"].bytes_per_sample < m.bytes_per_sample
        assert 0.9 < comp["int8"].mean_cosine <= 1.0 + 1e-9


def test_plan_choice_changes_with_bandwidth(tmp_path: Path) -> None:
    model = shrinking_convnet(tmp_path / "m.onnx")
    device, server = write_profiles(tmp_path, model)
    run = plan_model(
        model,
        tmp_path / "out",
        [0.1, 1, 10, 1000],
        rtt_ms=5,
        device_profile=device,
        server_profile=server,
        budget_s=0.5,
        plot=False,
    )
    chosen = [c.best for c in run.plan.choices]
    tensors = [run.plan.option(c).tensors for c in chosen]
    # 0.1 Mbit/s: nothing crosses in time -> local; 1: the 4.6 KB cut after conv2; 10: the cheaper
    # head after conv1 (9.2 KB); 1000: sending the raw input costs less than any head
    assert chosen[0] == "local"
    assert tensors[1][0] in ("c2", "r2")
    assert tensors[2][0] in ("c1", "r1")
    assert chosen[3] == "remote"
    assert run.plan.choices[1].best_ms == pytest.approx(15.0 + 4608 * 8 / 1000 + 40 * 8 / 1000 + 5 + 1.0)


def test_plan_says_the_server_speedup_is_assumed_without_a_server_profile(tmp_path: Path) -> None:
    run = plan_model(shrinking_convnet(tmp_path / "m.onnx"), tmp_path / "out", [10.0], budget_s=0.5, plot=False)
    assert any("ASSUMED 10x faster" in n for n in run.plan.assumptions)
    remote = run.plan.option("remote")
    assert remote.server_ms == pytest.approx(run.measured.full_ms / 10)


def test_profile_with_an_unknown_key_is_an_error_naming_its_path(tmp_path: Path) -> None:
    model = shrinking_convnet(tmp_path / "m.onnx")
    bad = tmp_path / "p.json"
    bad.write_text(
        json.dumps(
            {"format": "edgekit-split-profile/1", "full_ms": 1, "cuts": {"cut1": {"tensors": ["c1"], "head_mz": 1}}}
        )
    )
    with pytest.raises(ConfigError, match=r"cuts\.cut1: unknown key 'head_mz'"):
        plan_model(model, tmp_path / "out", [1.0], device_profile=bad, budget_s=0.5, plot=False)


def test_profile_of_another_model_is_refused(tmp_path: Path) -> None:
    model = shrinking_convnet(tmp_path / "m.onnx")
    bad = tmp_path / "p.json"
    bad.write_text(
        json.dumps(
            {"format": "edgekit-split-profile/1", "full_ms": 1, "cuts": {"cut1": {"tensors": ["zz"], "head_ms": 1}}}
        )
    )
    with pytest.raises(ConfigError, match="another model"):
        plan_model(model, tmp_path / "out", [1.0], device_profile=bad, budget_s=0.5, plot=False)


def test_cli_split_plan_prints_the_choice_per_bandwidth_and_writes_the_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = shrinking_convnet(tmp_path / "m.onnx")
    device, server = write_profiles(tmp_path, model)
    np.savez(tmp_path / "calib.npz", x=inputs(4))
    out = tmp_path / "plan"
    code = main(
        [
            "split",
            "plan",
            str(model),
            "--target",
            "cpu",
            "--calib",
            str(tmp_path / "calib.npz"),
            "--device-profile",
            str(device),
            "--server-profile",
            str(server),
            "--bandwidth-mbps",
            "0.1,1,10,1000",
            "--rtt-ms",
            "5",
            "--budget-s",
            "0.5",
            "-o",
            str(out),
            "--save-profile",
            str(tmp_path / "host.json"),
        ]
    )
    text = capsys.readouterr().out
    assert code == 0
    rows = [
        line.split() for line in text.splitlines() if line.strip() and line.split()[0] in ("0.1", "1", "10", "1000")
    ]
    assert [r[0] for r in rows] == ["0.1", "1", "10", "1000"]
    assert rows[0][-2] == "local" and rows[-1][-2] == "remote" and rows[1][-2].startswith("cut")
    assert (out / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plan = json.loads((out / "plan.json").read_text())
    assert plan["useful_cuts"] and all((out / c["head_file"]).is_file() for c in plan["cuts"])
    host = json.loads((tmp_path / "host.json").read_text())
    assert host["format"] == "edgekit-split-profile/1" and host["cuts"]


def test_cli_split_plan_rejects_a_target_it_cannot_measure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = shrinking_convnet(tmp_path / "m.onnx")
    assert main(["split", "plan", str(model), "--target", "coral", "-o", str(tmp_path / "o")]) == 2
    assert "--device-profile" in capsys.readouterr().err


def test_undominated_drops_cuts_that_send_no_fewer_bytes_than_an_earlier_one(tmp_path: Path) -> None:
    model = graph.load_model(shrinking_convnet(tmp_path / "m.onnx"))
    every = graph.enumerate_cuts(model)
    kept = [c.tensors[0] for c in graph.undominated(model, every)]
    # r1 sends what c1 sends, after more work; c3/r3 (18 KB) more than c2 (4.6 KB); logits more than gap
    assert kept == ["c1", "c2", "c4", "gap"]
    assert graph.tensor_bytes(model, "c3") == TENSOR_BYTES["c3"] and graph.tensor_bytes(model, "x") == 3 * 96 * 96 * 4


def test_plan_energy_objective_picks_the_option_costing_the_device_least_energy(tmp_path: Path) -> None:
    model = shrinking_convnet(tmp_path / "m.onnx")
    device, server = write_profiles(tmp_path, model)
    common = {"rtt_ms": 5, "device_profile": device, "server_profile": server, "budget_s": 0.5, "plot": False}
    fast = plan_model(model, tmp_path / "lat", [10.0], **common)  # type: ignore[arg-type]  # keyword bundle
    assert fast.plan.option(fast.plan.choices[0].best).tensors[0] in ("c1", "r1")  # latency: the cut after conv1
    # a power-hungry device (50 W computing), radio 1 W, idle 0 W: sending the whole input costs it least
    run = plan_model(
        model, tmp_path / "energy", [10.0], objective="energy", device_power_w=50.0, radio_power_w=1.0,
        idle_power_w=0.0, **common,  # type: ignore[arg-type]  # keyword bundle
    )  # fmt: skip
    c = run.plan.choices[0]
    assert c.best == "remote"
    assert c.best_mj == pytest.approx(1.0 * (3 * 96 * 96 * 4 + 40) * 8 / 10_000)  # radio W x transfer ms
    assert c.local_mj == pytest.approx(50.0 * 100.0)
    cut1 = run.plan.option(c.best_cut or "")
    assert c.best_cut_mj == pytest.approx(50.0 * cut1.device_ms + 1.0 * (cut1.up_bytes + 40) * 8 / 10_000)
    assert "objective: the device's energy per request (mJ), not latency" in run.plan.assumptions
    assert "mJ" in run.table


def test_plan_energy_objective_reads_the_device_power_from_the_profile_and_states_assumed_powers(
    tmp_path: Path,
) -> None:
    model = shrinking_convnet(tmp_path / "m.onnx")
    device, server = write_profiles(tmp_path, model)
    doc = json.loads(device.read_text())
    doc.update(device_power_w=2.0, power_source="measured: rapl (package-0)")
    device.write_text(json.dumps(doc))
    run = plan_model(
        model, tmp_path / "o", [1.0], objective="energy", device_profile=device, server_profile=server,
        rtt_ms=5, budget_s=0.5, plot=False,
    )  # fmt: skip
    assert run.plan.power is not None and run.plan.power.device_w == 2.0
    assert any("radio power ASSUMED 1 W" in n for n in run.plan.assumptions)
    assert any("idle power ASSUMED 0.2 W" in n for n in run.plan.assumptions)
    c = run.plan.choices[0]
    best = run.plan.option(c.best)
    assert c.best_mj is not None
    assert c.best_mj == pytest.approx(best.energy_mj(1.0, 5.0, run.plan.power))
    assert all(c.best_mj <= run.plan.option(o.id).energy_mj(1.0, 5.0, run.plan.power) for o in run.plan.options)


def test_plan_energy_objective_without_a_device_power_is_an_error(tmp_path: Path) -> None:
    model = shrinking_convnet(tmp_path / "m.onnx")
    with pytest.raises(ConfigError, match="--device-power-w W, or a --device-profile recorded by `edgekit-agent"):
        plan_model(model, tmp_path / "o", [1.0], objective="energy", budget_s=0.3, plot=False)


def test_plan_times_one_thread_sessions_by_cpu_time_unless_timing_wall(tmp_path: Path) -> None:
    model = shrinking_convnet(tmp_path / "m.onnx")
    cpu = plan_model(model, tmp_path / "cpu", [10.0], budget_s=0.2, plot=False)
    assert any("CPU time of one-thread ONNX Runtime sessions" in n for n in cpu.plan.assumptions)
    wall = plan_model(model, tmp_path / "wall", [10.0], budget_s=0.2, plot=False, timing="wall")
    assert any("wall-clock with ONNX Runtime's default thread pool" in n for n in wall.plan.assumptions)
    with pytest.raises(ConfigError, match="--timing 'gpu'"):
        plan_model(model, tmp_path / "x", [10.0], budget_s=0.2, plot=False, timing="gpu")
