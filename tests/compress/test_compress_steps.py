"""Compression steps (edgekit.compress.steps): each writes an ONNX model with the original's
interface that is really smaller (or sparser), measured and gated against the original."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch_pruning")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from edgekit.compress.prune import sparsity_mask, sparsity_masks  # noqa: E402
from edgekit.compress.share import kmeans_1d  # noqa: E402
from edgekit.compress.steps import Data, compress, parse_step  # noqa: E402
from edgekit.compress.training import TrainSettings  # noqa: E402
from edgekit.errors import CalibrationDataError, ConfigError  # noqa: E402


class _ResidualNet(torch.nn.Module):
    """Conv-BN-ReLU, a residual block (add), a depthwise conv and a linear head: the structures
    structured pruning must rewire together."""

    def __init__(self, classes: int = 4, dense: bool = False) -> None:
        super().__init__()
        self.dense = dense
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU())
        self.block = torch.nn.Sequential(
            torch.nn.Conv2d(32, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(), torch.nn.Conv2d(32, 32, 1)
        )
        self.depthwise = torch.nn.Conv2d(32, 32, 3, padding=1, groups=32)
        self.head = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(32 * 4 * 4, 64), torch.nn.ReLU())
        self.classifier = torch.nn.Linear(64, classes)

    def forward(self, x):  # type: ignore[no-untyped-def]
        x = self.stem(x)
        x = torch.relu(x + self.block(x))
        x = torch.nn.functional.adaptive_avg_pool2d(torch.relu(self.depthwise(x)), 4)
        return x if self.dense else self.classifier(self.head(x))


def _export(tmp_path: Path, dense: bool = False) -> tuple[Path, np.ndarray, np.ndarray]:
    """The net as ONNX (class scores, or with ``dense`` its [N, 32, 4, 4] feature map), and data."""
    torch.manual_seed(0)
    net = _ResidualNet(dense=dense).eval()
    for bn in (m for m in net.modules() if isinstance(m, torch.nn.BatchNorm2d)):  # non-trivial statistics
        bn.running_mean.uniform_(-0.1, 0.1)
        bn.running_var.uniform_(0.5, 1.5)
    path = tmp_path / "net.onnx"
    x = torch.zeros(1, 3, 16, 16)
    torch.onnx.export(
        net,
        (x,),
        str(path),
        input_names=["pixels"],
        output_names=["scores"],
        dynamic_axes={"pixels": {0: "batch"}, "scores": {0: "batch"}},
        opset_version=17,
        dynamo=False,
    )
    rng = np.random.default_rng(1)
    train = rng.random((96, 3, 16, 16), dtype=np.float32)
    evaluation = rng.random((48, 3, 16, 16), dtype=np.float32)
    return path, train, evaluation


def _interface(path: Path) -> tuple[list[str], list[str], list[object]]:
    model = onnx.load(str(path))
    dims = [d.dim_param or d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    return [i.name for i in model.graph.input], [o.name for o in model.graph.output], dims


def _params(path: Path) -> int:
    return sum(int(np.prod(i.dims)) for i in onnx.load(str(path)).graph.initializer)


def test_prune_channels_shrinks_a_residual_net_and_keeps_its_interface(tmp_path: Path) -> None:
    model, _, evaluation = _export(tmp_path)
    out = tmp_path / "pruned.onnx"
    result = compress(model, [parse_step("prune-channels=0.5:l1:uniform")], out, Data(eval={"pixels": evaluation}))
    assert _interface(out) == _interface(model)  # names, and the batch axis still dynamic
    assert _params(out) < 0.6 * _params(model)
    shapes = sorted(tuple(i.dims) for i in onnx.load(str(out)).graph.initializer if len(i.dims) == 4)
    # the residual block's inner conv lost half its output channels and its consumer its inputs
    assert (16, 32, 3, 3) in shapes and (32, 16, 1, 1) in shapes
    session = ort.InferenceSession(str(out))
    got = session.run(None, {"pixels": evaluation[:5]})[0]
    assert got.shape == (5, 4)  # the classifier's channels are the outputs: kept whole
    outcome = result.final
    assert outcome.provenance.kind == "prune_channels"
    assert outcome.provenance.settings["input_sha256"] != outcome.provenance.settings["output_sha256"]
    assert "classifier" in outcome.details


def test_prune_channels_fine_tuning_brings_agreement_back_when_data_is_given(tmp_path: Path) -> None:
    model, train, evaluation = _export(tmp_path)
    data = Data(eval={"pixels": evaluation}, train={"pixels": train})
    step = parse_step("prune-channels=0.6:l1:uniform")
    bare = compress(model, [step], tmp_path / "a.onnx", Data(eval={"pixels": evaluation}))
    tuned = compress(model, [step], tmp_path / "b.onnx", data, settings=TrainSettings(epochs=15, lr=3e-3))
    assert "fine-tuned" in tuned.final.details and "not fine-tuned" in bare.final.details
    assert tuned.final.comparison.cosine is not None and bare.final.comparison.cosine is not None
    # judged on --eval, which training never saw (early stopping watches a slice of --train)
    assert tuned.final.comparison.cosine > bare.final.comparison.cosine


def test_allocate_cuts_less_where_a_layer_costs_more_divergence_per_parameter() -> None:
    from edgekit.compress.prune import LayerSensitivity, allocate

    found = [
        LayerSensitivity("cheap", macs_removed=1000, divergence=0.01),
        LayerSensitivity("costly", macs_removed=1000, divergence=1.0),
        LayerSensitivity("free", macs_removed=10, divergence=0.0),
    ]
    ratios = allocate(found, 0.3)
    assert ratios["costly"] < 0.3 < ratios["cheap"] <= ratios["free"]
    # as many parameters go as a uniform cut at 0.3 would take
    removed = sum(s.macs_removed * ratios[s.layer] / 0.3 for s in found)
    assert abs(removed - sum(s.macs_removed for s in found)) < 1e-3 * removed


def test_prune_channels_with_data_refits_the_kept_layers_to_the_original_outputs(tmp_path: Path) -> None:
    from edgekit.compress.prune import _divergence, prune_channels
    from edgekit.compress.torch_bridge import load_module

    model, train, evaluation = _export(tmp_path, dense=True)
    x, held = torch.from_numpy(train), torch.from_numpy(evaluation)
    with torch.no_grad():
        reference = load_module(model)(held)
    errors = {}
    for refit in (False, True):
        module = load_module(model)
        report = prune_channels(module, (x[:1],), 0.5, data=(x,) if refit else None, by_sensitivity=False)
        with torch.no_grad():
            errors[refit] = _divergence(reference, module(held))
        assert report.refitted_layers == (4 if refit else 0)  # stem, block (2), depthwise: not those left whole
    # judged on inputs the refit never saw
    assert errors[True] < 0.5 * errors[False]


def test_prune_channels_by_sensitivity_records_per_layer_ratios(tmp_path: Path) -> None:
    model, train, evaluation = _export(tmp_path)
    result = compress(
        model,
        [parse_step("prune-channels=0.5")],
        tmp_path / "p.onnx",
        Data(eval={"pixels": evaluation}, train={"pixels": train}),
        settings=TrainSettings(epochs=0),
    )
    assert "per-layer ratios by sensitivity measured on --train" in result.final.details
    assert result.final.provenance.settings["allocation"] == "sensitivity"


def test_prune_channels_keeps_every_pruned_layer_at_a_multiple_of_eight_channels(tmp_path: Path) -> None:
    # runtimes block channels for their SIMD width: 31 or 63 channels took a slower path than the
    # unpruned model. By sensitivity the layers get uneven ratios; each kept count is rounded.
    model, train, evaluation = _export(tmp_path)
    out = tmp_path / "p.onnx"
    result = compress(
        model,
        [parse_step("prune-channels=0.3")],
        out,
        Data(eval={"pixels": evaluation}, train={"pixels": train}),
        settings=TrainSettings(epochs=0),
    )
    assert result.final.provenance.settings["channel_multiple"] == "8"
    assert "channels kept in multiples of 8" in result.final.details
    convs = [tuple(i.dims) for i in onnx.load(str(out)).graph.initializer if len(i.dims) == 4]
    assert all(dims[0] % 8 == 0 for dims in convs), convs
    assert _params(out) < _params(model)  # 0.3 of 32 channels rounds to 24 kept, not to nothing pruned


def test_rounded_ratio_keeps_at_least_one_multiple_and_the_nearest_count() -> None:
    from edgekit.compress.prune import _rounded_ratio

    layer = torch.nn.Conv2d(3, 32, 3)
    # Torch-Pruning keeps int(channels x (1 - ratio)) channels
    kept = {r: int(32 * (1 - _rounded_ratio(layer, r))) for r in (0.05, 0.25, 0.3, 0.5, 0.95)}
    assert kept == {0.05: 32, 0.25: 24, 0.3: 24, 0.5: 16, 0.95: 8}
    assert int(12 * (1 - _rounded_ratio(torch.nn.Linear(4, 12), 0.5))) == 8  # under 16 channels: a multiple of 4
    assert _rounded_ratio(torch.nn.Linear(4, 6), 0.5) == 0.5  # fewer than 8 channels: as asked


def test_distill_redraws_image_batches_and_asks_the_teacher_about_them() -> None:
    from edgekit.compress.training import distill, redraw

    rng = np.random.default_rng(0)
    x = rng.random((40, 1, 8, 8), dtype=np.float32)
    moved = redraw(x, np.random.default_rng(1), mix=True)
    assert moved.shape == x.shape and moved.dtype == x.dtype and not np.allclose(moved, x)
    weights = rng.normal(size=(64, 3)).astype(np.float32)
    asked: list[np.ndarray] = []

    def teacher(inputs: Sequence[np.ndarray]) -> np.ndarray:
        asked.append(inputs[0])
        return inputs[0].reshape(len(inputs[0]), -1) @ weights

    student = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 3))
    report = distill(
        student,
        [x[:32]],
        teacher([x[:32]]),
        labels=None,
        eval_inputs=[x[32:]],
        eval_teacher=teacher([x[32:]]),
        settings=TrainSettings(epochs=2),
        teacher_fn=teacher,
    )
    assert report.epochs_run == 2
    seen = {a.tobytes() for a in x}
    # besides the two calls above: the held-out copies, then every training batch, all redrawn
    redrawn = [a for batch in asked[2:] for a in batch]
    assert len(redrawn) >= 8 * 3 + 32 * 2 and not any(a.tobytes() in seen for a in redrawn[8:])


def test_low_rank_factorises_layers_and_stays_close_at_high_energy(tmp_path: Path) -> None:
    from edgekit.compress.lowrank import LowRankSpec, factorise
    from edgekit.compress.torch_bridge import load_module

    model, _, evaluation = _export(tmp_path)
    module = load_module(model)
    head = next(m for m in module.modules() if isinstance(m, torch.nn.Linear) and m.in_features == 512)
    with torch.no_grad():  # a rank-4 layer: its spectrum is 4 values, the rest ~0
        head.weight.copy_(torch.randn(64, 4) @ torch.randn(4, 512) * 0.05)
    x = torch.from_numpy(evaluation[:8])
    with torch.no_grad():
        before = module(x).numpy()
    decisions = factorise(module, (x[:1],), LowRankSpec(keep_energy=0.999), measure=False)
    with torch.no_grad():
        after = module(x).numpy()
    assert [d.rank for d in decisions if d.factorised and "512" in d.shape] == [4]
    assert np.allclose(before, after, atol=1e-2 * float(np.abs(before).max()))
    done = [d for d in decisions if d.factorised]
    assert all(d.params_after < d.params_before for d in done)
    # a parameter budget picks the rank from the layer's shape: r (rows + cols) <= keep * rows * cols
    spec = LowRankSpec.parse("0.5")
    assert spec.rank(np.ones(64), 64, 512) == int(0.5 * 64 * 512 / (64 + 512))


def test_sparsity_masks_keep_the_largest_weights_and_the_two_of_four_pattern() -> None:
    w = np.random.default_rng(0).normal(size=(8, 16, 3, 3)).astype(np.float32)
    keep = sparsity_mask(w, 0.75, 1)
    assert abs(1 - keep.mean() - 0.75) < 0.01
    assert np.abs(w[keep]).min() >= np.abs(w[~keep]).max()
    two = sparsity_mask(w, "2:4", 1)
    groups = np.moveaxis(two, 1, -1).reshape(8, 3, 3, 4, 4)
    assert (groups.sum(-1) == 2).all()  # exactly 2 of every 4 input channels kept


def test_unstructured_sparsity_is_global_and_leaves_depthwise_and_small_tensors_dense() -> None:
    """One threshold over the eligible tensors on magnitudes relative to each tensor's RMS: a layer
    whose weights are mostly near zero gives up more than one whose weights are alike, whatever
    each layer's scale (BatchNorm folded into the weights); a depthwise conv and a tensor under
    1024 weights stay dense (80 % per tensor zeroed MobileNetV3's depthwise filters and took its
    accuracy from 0.945 to 0.455; raw global magnitude zeroed 99 % of its smallest-scale layer)."""
    rng = np.random.default_rng(0)
    small_valued = (0.01 * rng.laplace(0, 1, (64, 32, 3, 3))).astype(np.float32)  # heavy-tailed, tiny scale
    large_valued = rng.uniform(0.5, 1.5, (64, 64, 1, 1)).astype(np.float32) * rng.choice([-1, 1], (64, 64, 1, 1))
    depthwise = rng.normal(0, 0.001, (64, 1, 3, 3)).astype(np.float32)
    first = rng.normal(0, 0.001, (8, 3, 3, 3)).astype(np.float32)  # 216 weights
    masks = sparsity_masks([(small_valued, 1), (large_valued, 1), (depthwise, 1), (first, 1)], 0.8)
    assert masks[2] is None and masks[3] is None
    kept = [m for m in masks if m is not None]
    zeros = sum(int((~m).sum()) for m in kept) / sum(m.size for m in kept)
    assert abs(zeros - 0.8) < 0.01  # the asked fraction of the eligible weights
    # not the same ratio in every layer, and the tiny-scale layer is not wiped out
    assert 0.75 < (~masks[0]).mean() < 0.95 and (~masks[1]).mean() < (~masks[0]).mean()
    two = sparsity_masks([(small_valued, 1), (depthwise, 1)], "2:4")
    assert two[1] is None and two[0] is not None and two[0].mean() == 0.5


def test_sparsity_step_writes_zeros_and_reports_the_compressed_size(tmp_path: Path) -> None:
    model, _, evaluation = _export(tmp_path)
    out = tmp_path / "sparse.onnx"
    result = compress(model, [parse_step("sparsity=0.5")], out, Data(eval={"pixels": evaluation}))
    weights = [onnx.numpy_helper.to_array(i) for i in onnx.load(str(out)).graph.initializer if len(i.dims) >= 2]
    zeros = sum(int((w == 0).sum()) for w in weights) / sum(w.size for w in weights)
    assert zeros >= 0.45
    assert "zlib-compressed" in result.final.details and "same speed" in result.final.details


def test_share_weights_leaves_k_values_per_tensor(tmp_path: Path) -> None:
    model, _, evaluation = _export(tmp_path)
    out = tmp_path / "shared.onnx"
    result = compress(model, [parse_step("share-weights=8")], out, Data(eval={"pixels": evaluation}))
    for init in onnx.load(str(out)).graph.initializer:
        if len(init.dims) == 4 and init.dims[1] > 1:  # a dense conv weight
            assert len(np.unique(onnx.numpy_helper.to_array(init))) <= 8
    assert "3-bit indices" in result.final.details
    centroids, index = kmeans_1d(np.array([0.0, 0.1, 0.2, 5.0, 5.1]), 2)
    assert np.allclose(sorted(centroids), [0.1, 5.05]) and list(index) == [0, 0, 0, 1, 1]


def test_distill_needs_training_data_and_parse_step_suggests_the_nearest_kind(tmp_path: Path) -> None:
    model, _, evaluation = _export(tmp_path)
    with pytest.raises(CalibrationDataError, match="--train"):
        compress(model, [parse_step("distill=width=0.5")], tmp_path / "s.onnx", Data(eval={"pixels": evaluation}))
    with pytest.raises(ConfigError, match="did you mean prune-channels"):
        parse_step("prune-channel=0.5")
    with pytest.raises(ConfigError, match="between 0 and 1"):
        compress(model, [parse_step("prune-channels=1.5")], tmp_path / "p.onnx", Data(eval={"pixels": evaluation}))


def test_distill_trains_a_narrower_student_that_agrees_with_the_teacher(tmp_path: Path) -> None:
    model, train, evaluation = _export(tmp_path)
    out = tmp_path / "student.onnx"
    result = compress(
        model,
        [parse_step("distill=width=0.5")],
        out,
        Data(eval={"pixels": evaluation}, train={"pixels": train}),
        settings=TrainSettings(epochs=15, lr=3e-3),
    )
    assert _params(out) < 0.6 * _params(model)
    assert result.final.comparison.cosine is not None and result.final.comparison.cosine > 0.9
    assert _interface(out) == _interface(model)


def test_compress_cli_prints_one_row_per_step_and_exits_3_when_the_gate_fails(tmp_path: Path) -> None:
    model, _, evaluation = _export(tmp_path, dense=True)  # judged by cosine: zeroing 95% of weights shows
    np.savez(tmp_path / "eval.npz", pixels=evaluation)
    cmd = [
        sys.executable,
        "-m",
        "edgekit",
        "compress",
        str(model),
        "--sparsity",
        "0.95",
        "--low-rank",
        "0.9",
        "--eval",
        str(tmp_path / "eval.npz"),
        "-o",
        str(tmp_path / "out.onnx"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("sparsity=", "low-rank="))]
    assert [r.split()[0] for r in rows] == ["sparsity=0.95", "low-rank=0.9"]  # in command-line order
    assert "FAILED" in rows[-1] and "Traceback" not in proc.stderr


def test_package_compress_records_the_steps_and_gates_against_the_original(
    tmp_path: Path, keypair: tuple[Path, Path]
) -> None:
    from edgekit.packaging.result import PackageValidationError
    from tests.factories import package_small_data as package

    model, _, evaluation = _export(tmp_path, dense=True)
    data = tmp_path / "eval.npz"
    np.savez(data, pixels=evaluation)
    kept = package(
        model,
        targets=["cpu"],
        precision="fp32",
        eval=data,
        key=keypair[0],
        out_dir=tmp_path / "a",
        compress=["prune-channels=0.25"],
        allow_failed=True,
    )
    steps = kept.manifests["cpu"].provenance
    assert steps[0].kind == "prune_channels" and steps[0].tool == "torch-pruning"
    assert steps[0].settings["input_sha256"] != steps[0].settings["output_sha256"]
    # fp32 of the pruned model differs from the original: the gate saw the original's outputs
    assert kept.manifests["cpu"].validation.cosine is not None and kept.manifests["cpu"].validation.cosine < 0.9999
    # zeroing 95% of the weights keeps fp32 equal to itself, not to the original: the gate must fail
    with pytest.raises(PackageValidationError):
        package(
            model,
            targets=["cpu"],
            precision="fp32",
            eval=data,
            key=keypair[0],
            out_dir=tmp_path / "b",
            compress=["sparsity=0.95"],
        )


def test_share_weights_takes_weights_written_as_constant_nodes(tmp_path: Path) -> None:
    from onnx import helper

    from edgekit.compress.share import share_weights

    model, _, _ = _export(tmp_path)
    graph = onnx.load(str(model))
    constants = [helper.make_node("Constant", [], [i.name], value=i) for i in graph.graph.initializer]
    del graph.graph.initializer[:]
    nodes = list(graph.graph.node)
    del graph.graph.node[:]
    graph.graph.node.extend(constants + nodes)  # as paddle2onnx writes them
    source = tmp_path / "constants.onnx"
    onnx.save(graph, str(source))
    report = share_weights(source, tmp_path / "shared.onnx", 8)
    assert report.tensors >= 4
    out = ort.InferenceSession(str(tmp_path / "shared.onnx")).run(
        None, {"pixels": np.zeros((1, 3, 16, 16), np.float32)}
    )
    assert out[0].shape == (1, 4)
