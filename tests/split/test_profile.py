"""``edgekit-agent profile``: a split bundle's segments timed on the device with the agent's own
runtime, in the profile format ``edgekit split plan --device-profile`` reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from device_agents.cli import main as agent_main
from device_agents.split.profile import time_interleaved
from edgekit.bundle.archive import read_unverified_manifest
from edgekit.split import profile as host_profile
from edgekit.split.planner import plan_model
from tests.agent.conftest import write_config
from tests.split.conftest import SplitBuild, write_profiles


def _profile(tmp_path: Path, split_build: SplitBuild, *extra: str) -> dict[str, object]:
    config = write_config(tmp_path / "agent", split_build.public_key)
    out = tmp_path / "device.json"
    args = ["profile", str(split_build.bundles.device), "-o", str(out), "--budget-s", "0.2", "--config", str(config)]
    assert agent_main([*args, *extra]) == 0
    doc: dict[str, object] = json.loads(out.read_text())
    return doc


def test_agent_profile_times_the_full_model_and_every_head_of_the_bundle(
    tmp_path: Path, split_build: SplitBuild, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = _profile(tmp_path, split_build)
    manifest, _ = read_unverified_manifest(split_build.bundles.device)
    assert manifest.split is not None
    assert doc["format"] == host_profile.FORMAT and str(doc["runtime"]).startswith("onnxruntime ")
    cuts = doc["cuts"]
    assert isinstance(cuts, dict) and list(cuts) == [c.id for c in manifest.split.cuts]
    for c in manifest.split.cuts:
        assert cuts[c.id]["tensors"] == list(c.tensors) and cuts[c.id]["head_ms"] > 0
    assert isinstance(doc["full_ms"], float) and doc["full_ms"] > 0
    assert "device_power_w" not in doc or str(doc["power_source"]).startswith("measured")
    assert "full model" in capsys.readouterr().out


def test_split_plan_reads_the_agents_profile_for_the_device_side(tmp_path: Path, split_build: SplitBuild) -> None:
    doc = _profile(tmp_path, split_build, "--device-power-w", "3.5")
    _, server = write_profiles(tmp_path / "server", split_build.model)
    run = plan_model(
        split_build.model,
        tmp_path / "plan",
        [1.0, 10.0],
        device_profile=tmp_path / "device.json",
        server_profile=server,
        budget_s=0.3,
        plot=False,
    )
    cuts = doc["cuts"]
    assert isinstance(cuts, dict)
    assert run.plan.option("local").device_ms == doc["full_ms"]
    for cut_id, times in cuts.items():
        assert run.plan.option(cut_id).device_ms == times["head_ms"]
    # the cuts the bundle did not ship: this host's times scaled by the device's full model against this host's
    others = [o for o in run.plan.cuts if o.id not in cuts]
    assert others, "the bundle ships only the cuts chosen, so some are not profiled"
    scale = float(doc["full_ms"]) / run.measured.full_ms
    host = {m.cut.id: m.head_ms for m in run.measured.cuts}
    for o in others:
        assert o.device_ms == pytest.approx(host[o.id] * scale)
    assert any("not in the device profile" in n for n in run.plan.assumptions)
    loaded = host_profile.read(tmp_path / "device.json")
    assert loaded.device_power_w == 3.5 and "stated" in loaded.power_source


def test_time_interleaved_takes_the_median_of_each_rounds_block_median() -> None:
    now = [0.0]
    rounds_s = [0.0, 0.5, 0.002, 0.004, 0.5, 0.002, 0.002, 0.5, 0.001, 0.001, 0.5, 0.004, 0.006]
    costs = {"a": iter([9.0, *rounds_s]), "b": iter([0.0] * 100)}

    def call(name: str) -> object:
        now[0] += next(costs[name])
        return None

    got = time_interleaved(
        {"a": lambda: call("a"), "b": lambda: call("b")},
        budget_s=0.0,
        min_rounds=4,
        max_rounds=4,
        block=2,
        clock=lambda: now[0],
    )
    # a, per round: one untimed call (0.5 s), then a block of two timed ones; the warm-up is not timed
    assert got["b"] == 0.0
    assert got["a"] == pytest.approx(2.5)  # the rounds' block medians 3, 2, 1, 5 ms -> 2.5


def test_interleaved_rounds_sizes_each_block_to_about_block_ms() -> None:
    from device_agents.split.profile import interleaved_rounds

    now = [0.0]
    calls = {"slow": 0, "fast": 0}

    def run(name: str, cost_s: float) -> None:
        calls[name] += 1
        now[0] += cost_s

    rounds = interleaved_rounds(
        {"slow": lambda: run("slow", 0.050), "fast": lambda: run("fast", 0.0005)},
        budget_s=0.0,
        min_rounds=3,
        max_rounds=3,
        block_ms=10.0,
        clock=lambda: now[0],
    )
    # 2 warm-up calls, then per round 1 untimed call and a block: 1 call of 50 ms, 20 calls of 0.5 ms
    assert calls == {"slow": 2 + 3 * (1 + 1), "fast": 2 + 3 * (1 + 20)}
    assert rounds["slow"] == pytest.approx([50.0] * 3) and rounds["fast"] == pytest.approx([0.5] * 3)
