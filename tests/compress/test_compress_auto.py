"""``--compress auto`` (edgekit.compress.auto): compressed variants kept only where their quantized
form passes the gate against the original and is faster or smaller than the quantized original."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch_pruning")
onnx = pytest.importorskip("onnx")

from edgekit.compress import auto  # noqa: E402
from edgekit.compress.steps import Data  # noqa: E402
from edgekit.errors import ConfigError  # noqa: E402


class _LowRankMlp(torch.nn.Module):
    """A classifier whose weights are all of rank 8: factorising them loses nothing, and its
    2048 x 2048 layer shrinks about 128x (so much faster that the per-layer timing cannot miss
    it); zeroing 95 % of them changes the decisions."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 2048)
        self.b = torch.nn.Linear(2048, 2048)
        self.c = torch.nn.Linear(2048, 10)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for layer in (self.a, self.b, self.c):
                rows, cols = layer.weight.shape
                low = torch.randn(rows, 8, generator=g) @ torch.randn(8, cols, generator=g)
                layer.weight.copy_(low / cols**0.5)

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _clear_inputs(net: torch.nn.Module, count: int) -> np.ndarray:
    """Inputs whose decision has a wide margin (top-1 over top-2 logit), so that INT8 rounding of
    the original flips none of them on any CPU: the test is about which variant is kept, not
    about how close a random network's decisions sit to its boundaries."""
    pool = np.random.default_rng(1).normal(size=(20 * count, 64)).astype(np.float32)
    with torch.no_grad():
        logits = net(torch.from_numpy(pool)).numpy()
    top2 = np.sort(logits, axis=1)[:, -2:]
    margin = (top2[:, 1] - top2[:, 0]) / (np.abs(logits).max(axis=1) + 1e-9)
    return pool[np.argsort(margin)[-count:]]


def _model(tmp_path: Path) -> tuple[Path, np.ndarray]:
    path = tmp_path / "mlp.onnx"
    net = _LowRankMlp().eval()
    torch.onnx.export(
        net,
        (torch.zeros(1, 64),),
        str(path),
        input_names=["features"],
        output_names=["scores"],
        dynamic_axes={"features": {0: "batch"}, "scores": {0: "batch"}},
        opset_version=17,
        dynamo=False,
    )
    return path, _clear_inputs(net, 96)


def test_choose_keeps_the_variant_smaller_than_the_quantized_original_and_drops_a_failing_one(
    tmp_path: Path,
) -> None:
    model, x = _model(tmp_path)
    lines: list[str] = []
    choice = auto.choose(
        model,
        tmp_path / "work",
        Data(eval={"features": x}),
        {"features": x[:32]},
        objective="size",
        candidates=("sparsity=0.95", "low-rank=energy=0.999"),
        progress=lines.append,
        timing_budget_s=1.0,
    )
    rows = {r.label: r for r in choice.rows}
    assert list(rows) == ["original", "sparsity=0.95", "low-rank=energy=0.999"]
    assert not rows["sparsity=0.95"].float_passed and "dropped" in rows["sparsity=0.95"].verdict
    kept = rows["low-rank=energy=0.999"]
    original = rows["original"]
    assert kept.int8_passed and kept.int8_bytes is not None and original.int8_bytes is not None
    assert kept.int8_bytes < 0.5 * original.int8_bytes and "chosen" in kept.verdict
    assert choice.chosen == "low-rank=energy=0.999" and choice.model.is_file()
    # the engine gets the factorised model: a rank-8 pair in place of the 2048 x 2048 weight
    shapes = [tuple(i.dims) for i in onnx.load(str(choice.model)).graph.initializer]
    assert (2048, 2048) not in shapes
    step = choice.provenance[0]
    assert step.kind == "auto_compress" and step.settings["chosen"] == "low-rank=energy=0.999"
    assert "int8" in step.settings["candidate low-rank=energy=0.999"]
    assert choice.provenance[1].kind == "low_rank"
    # every model printed with size, host latency and the gate against the original
    table = [line for line in lines if line.startswith("compress auto: ") and " B " in line]
    assert len(table) == 3 and all(" ms" in line for line in table if "float" in line and "int8" in line)


def test_choose_keeps_the_original_when_no_variant_beats_the_quantized_baseline(tmp_path: Path) -> None:
    model, x = _model(tmp_path)
    choice = auto.choose(
        model,
        tmp_path / "work",
        Data(eval={"features": x}),
        {"features": x[:32]},
        objective="size",
        candidates=("sparsity=0.95",),
        timing_budget_s=1.0,
    )
    assert choice.chosen == "original" and choice.model == model
    assert [s.kind for s in choice.provenance] == ["auto_compress"]


def test_compress_auto_is_given_alone() -> None:
    assert auto.is_auto(["auto"]) and not auto.is_auto(["prune-channels=0.5"])
    with pytest.raises(ConfigError, match="alone"):
        auto.is_auto(["auto", "low-rank=0.5"])


@pytest.mark.slow
def test_package_compress_auto_packages_the_chosen_variant_and_records_every_candidate(
    tmp_path: Path, keypair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from edgekit import package

    model, x = _model(tmp_path)
    np.savez(tmp_path / "eval.npz", features=x)
    np.savez(tmp_path / "calib.npz", features=x[:48])
    monkeypatch.setattr(auto, "CANDIDATES", ("sparsity=0.95", "low-rank=energy=0.999"))
    result = package(
        model,
        targets=["cpu"],
        precision="int8",
        calib=tmp_path / "calib.npz",
        eval=tmp_path / "eval.npz",
        key=keypair[0],
        out_dir=tmp_path / "out",
        compress=["auto"],
        objective="size",
        tolerance={"min_top1_agreement": 0.95},  # INT8 of this random net agrees ~0.98 with its float self
        allow_failed=True,
    )
    manifest = result.manifests["cpu"]
    kinds = [s.kind for s in manifest.provenance]
    assert kinds[:2] == ["auto_compress", "low_rank"], manifest.provenance[0].notes
    assert set(manifest.provenance[0].settings) >= {"candidate original", "candidate sparsity=0.95"}
    assert manifest.validation.passed  # gated against the original's outputs
