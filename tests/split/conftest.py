"""Built once per test session: the split plan of the shrinking conv net (times from profiles, so
that the chosen cuts do not depend on this machine), its device bundle and tail bundles."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from edgekit.split import graph
from edgekit.split.bundles import SplitBundles, write_split_bundles
from edgekit.split.planner import PlanRun, plan_model
from tests.split.models import inputs, shrinking_convnet

# device: head costs grow along the chain (ms per sample); server: every tail 1 ms
HEAD_MS = {"c1": 5.0, "r1": 5.0, "c2": 15.0, "r2": 15.0, "c3": 60.0, "r3": 60.0, "c4": 95.0, "r4": 95.0}
HEAD_MS.update({"gap": 99.0, "flat": 99.0, "logits": 99.9})
BANDWIDTHS_MBPS = (0.1, 1.0, 10.0, 1000.0)
RTT_MS = 5.0


def write_profiles(directory: Path, model: Path) -> tuple[Path, Path]:
    cuts = graph.enumerate_cuts(graph.load_model(model))
    device = {
        "format": "edgekit-split-profile/1",
        "full_ms": 100.0,
        "cuts": {c.id: {"tensors": list(c.tensors), "head_ms": HEAD_MS[c.tensors[0]]} for c in cuts},
    }
    server = {
        "format": "edgekit-split-profile/1",
        "full_ms": 1.0,
        "cuts": {c.id: {"tensors": list(c.tensors), "tail_ms": 1.0} for c in cuts},
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "device.json").write_text(json.dumps(device))
    (directory / "server.json").write_text(json.dumps(server))
    return directory / "device.json", directory / "server.json"


@dataclass(frozen=True)
class SplitBuild:
    model: Path
    run: PlanRun
    bundles: SplitBundles
    public_key: Path
    x: np.ndarray  # request inputs
    want: np.ndarray  # the full model's outputs for them


@pytest.fixture(scope="session")
def split_build(tmp_path_factory: pytest.TempPathFactory, keypair: tuple[Path, Path]) -> SplitBuild:
    import onnxruntime as ort

    root = tmp_path_factory.mktemp("split")
    model = shrinking_convnet(root / "m.onnx")
    device, server = write_profiles(root, model)
    calib = inputs(64, seed=3)
    np.savez(root / "calib.npz", x=calib)
    run = plan_model(
        model,
        root / "plan",
        BANDWIDTHS_MBPS,
        rtt_ms=RTT_MS,
        calib=root / "calib.npz",
        device_profile=device,
        server_profile=server,
        budget_s=0.5,
        plot=False,
    )
    heads = {m.cut.id: m.head_path for m in run.measured.cuts}
    tails = {m.cut.id: m.tail_path for m in run.measured.cuts}
    bundles = write_split_bundles(
        model, run.plan, heads, tails, {"x": calib}, key=keypair[0], name="m", out_dir=root / "bundles"
    )
    x = inputs(1, seed=9)
    want = ort.InferenceSession(str(model)).run(None, {"x": x})[0]
    return SplitBuild(model, run, bundles, keypair[1], x, want)
