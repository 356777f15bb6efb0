"""The embedded digits example: the committed files, and the training script that makes them."""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

import numpy as np
import pytest

from examples.digits import HERE, INPUT_NAME, OUTPUT_NAME, load


def test_digits_example_files_have_the_documented_signature_and_data() -> None:
    import onnx

    example = load()
    model = onnx.load(str(example.model))
    (inp,), (out,) = model.graph.input, model.graph.output
    dims = lambda vi: [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]  # noqa: E731 - local shorthand
    assert (inp.name, dims(inp)) == (INPUT_NAME, ["batch", 1, 32, 32])
    assert (out.name, dims(out)) == (OUTPUT_NAME, ["batch", 10])
    assert model.opset_import[0].version == 17
    assert not [n for n in model.graph.node if n.op_type == "BatchNormalization"], "BN must be folded at export"
    assert example.model.stat().st_size < 4 * 1024 * 1024
    assert example.eval_inputs.shape == (450, 1, 32, 32) and example.eval_inputs.dtype == np.float32
    assert 0.0 <= example.eval_inputs.min() and example.eval_inputs.max() <= 1.0
    counts = np.bincount(example.eval_labels, minlength=10)
    assert len(counts) == 10 and counts.min() >= 43 and counts.max() <= 46  # stratified: about 45 of each digit
    calib = example.calib_arrays()
    assert list(calib) == [INPUT_NAME] and calib[INPUT_NAME].shape == (300, 1, 32, 32)


def test_digits_model_accuracy_matches_readme_and_is_at_least_97_percent() -> None:
    import onnxruntime as ort

    example = load()
    session = ort.InferenceSession(str(example.model), providers=["CPUExecutionProvider"])
    logits = session.run([OUTPUT_NAME], {INPUT_NAME: example.eval_inputs})[0]
    correct = int((logits.argmax(1) == example.eval_labels).sum())
    assert correct / len(example.eval_labels) >= 0.97
    readme = (HERE / "README.md").read_text()
    match = re.search(r"held-out top-1 accuracy \| [\d.]+% \((\d+)/(\d+)\)", readme)
    assert match is not None, "README.md must state the measured accuracy"
    assert (int(match[1]), int(match[2])) == (correct, len(example.eval_labels))


def test_load_names_the_rebuild_command_when_a_file_is_missing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"train\.py"):
        load(tmp_path)


def test_save_npz_is_byte_reproducible_and_loadable(tmp_path: Path) -> None:
    from examples.digits.train import save_npz

    arrays = {"image": np.arange(24, dtype=np.float32).reshape(2, 3, 4)}
    save_npz(tmp_path / "a.npz", arrays)
    with zipfile.ZipFile(tmp_path / "a.npz") as zf:
        assert [i.date_time for i in zf.infolist()] == [(1980, 1, 1, 0, 0, 0)]  # np.savez stamps "now"
        assert zf.infolist()[0].compress_type == zipfile.ZIP_DEFLATED
    with np.load(tmp_path / "a.npz") as data:
        np.testing.assert_array_equal(data["image"], arrays["image"])


def test_prepare_data_upsamples_to_32x32_and_splits_stratified() -> None:
    from examples.digits.train import TrainConfig, prepare_data

    split = prepare_data(TrainConfig())
    assert split.train_x.shape[1:] == split.eval_x.shape[1:] == (1, 32, 32)
    assert len(split.train_x) + len(split.eval_x) == 1797
    share = np.bincount(split.eval_y, minlength=10) / np.bincount(np.concatenate([split.train_y, split.eval_y]))
    assert np.all(np.abs(share - 0.25) < 0.02)
    assert split.train_x.min() >= 0.0 and split.train_x.max() <= 1.0


def test_fold_batchnorm_keeps_outputs_and_leaves_no_batchnorm() -> None:
    import torch

    from examples.digits.train import build_net, fold_batchnorm

    torch.manual_seed(0)
    net = build_net()
    for m in net.modules():  # non-trivial running statistics, so that folding has work to do
        if isinstance(m, torch.nn.BatchNorm2d):
            assert m.running_mean is not None and m.running_var is not None  # track_running_stats is on
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
    x = torch.rand(3, 1, 32, 32)
    with torch.no_grad():
        expected = net.eval()(x)
        fused = fold_batchnorm(net)
        got = fused(x)
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in fused.modules())
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert 500_000 <= sum(p.numel() for p in fused.parameters()) <= 1_000_000


def test_training_is_deterministic_for_the_same_seed() -> None:
    import torch

    from examples.digits.train import THREADS, Split, TrainConfig, prepare_data, train

    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)
    full = prepare_data(TrainConfig())
    small = Split(full.train_x[:96], full.train_y[:96], full.eval_x[:8], full.eval_y[:8])
    cfg = TrainConfig(epochs=1, batch_size=32)
    first = train(small, cfg, log=lambda _msg: None).state_dict()
    second = train(small, cfg, log=lambda _msg: None).state_dict()
    assert first.keys() == second.keys()
    for k in first:
        assert torch.equal(first[k], second[k]), k
