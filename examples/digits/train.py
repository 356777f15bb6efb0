"""Train the embedded default example: a small CNN on scikit-learn's digits, exported to ONNX.

Reproducible: ``python examples/digits/train.py --out examples/digits`` rewrites exactly the
committed files (same torch version, CPU build): fixed seeds, deterministic algorithms, a fixed
thread count, and npz archives written with a fixed timestamp.

Data: ``sklearn.datasets.load_digits`` (1797 real 8x8 scans, shipped inside scikit-learn, no
download), scaled to [0, 1] and upsampled to 32x32 (bilinear) here in the data prep, so that the
model is compute-bound enough for quantization to matter (an 8x8 net is too small for INT8 to
pay). Split: stratified, 25% held out, fixed seed.

Model: three Conv-BN-ReLU x2 + MaxPool stages (32/64/128 channels) and a two-layer head, about
0.8M parameters; BatchNorm is folded into the convolutions before export. The ONNX model takes
``image`` float32 [batch, 1, 32, 32] (NCHW, values in [0, 1]) and returns ``logits`` float32
[batch, 10] (raw scores: argmax is the digit; apply softmax for probabilities). Logits rather
than probabilities, so that validation compares the full scores and not saturated softmax.

Writes: model.onnx, calib.npz (300 training images, 30 per class, key ``image``), eval.npz (the
held-out images, key ``image``), eval_labels.npy (int64) and README.md with the measured accuracy.
"""

from __future__ import annotations

import argparse
import io
import json
import time
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

INPUT_NAME = "image"
OUTPUT_NAME = "logits"
IMAGE_SIZE = 32
SEED = 0
THREADS = 2  # fixed: float reductions may be ordered differently with another thread count


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 12
    batch_size: int = 64
    lr: float = 3e-3
    weight_decay: float = 1e-4
    eval_fraction: float = 0.25
    calib_per_class: int = 30
    min_accuracy: float = 0.97


@dataclass(frozen=True)
class Split:
    train_x: np.ndarray
    train_y: np.ndarray
    eval_x: np.ndarray
    eval_y: np.ndarray


def prepare_data(cfg: TrainConfig) -> Split:
    """Digits scaled to [0, 1], upsampled to 32x32 (bilinear), stratified split."""
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.images.astype(np.float32) / 16.0)[:, None, :, :]
    up = F.interpolate(torch.from_numpy(x), size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", align_corners=False)
    x = np.clip(up.numpy(), 0.0, 1.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    tx, ex, ty, ey = train_test_split(x, y, test_size=cfg.eval_fraction, stratify=y, random_state=SEED)
    return Split(np.ascontiguousarray(tx), ty, np.ascontiguousarray(ex), ey)


def build_net():  # type: ignore[no-untyped-def]  # returns torch.nn.Module; torch is imported lazily
    import torch.nn as nn

    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

    return nn.Sequential(
        *block(1, 32), *block(32, 32), nn.MaxPool2d(2),  # 16x16
        *block(32, 64), *block(64, 64), nn.MaxPool2d(2),  # 8x8
        *block(64, 128), *block(128, 128), nn.MaxPool2d(2),  # 4x4
        nn.Flatten(),
        nn.Linear(128 * 4 * 4, 192),
        nn.ReLU(),
        nn.Linear(192, 10),
    )  # fmt: skip


def fold_batchnorm(net):  # type: ignore[no-untyped-def]
    """Return an eval-mode copy with every Conv-BN pair folded into one Conv (with bias)."""
    import torch.nn as nn
    from torch.nn.utils.fusion import fuse_conv_bn_eval

    layers = list(net.eval())
    out: list[nn.Module] = []
    i = 0
    while i < len(layers):
        if isinstance(layers[i], nn.Conv2d) and i + 1 < len(layers) and isinstance(layers[i + 1], nn.BatchNorm2d):
            out.append(fuse_conv_bn_eval(layers[i], layers[i + 1]))
            i += 2
        else:
            out.append(layers[i])
            i += 1
    return nn.Sequential(*out).eval()


def train(split: Split, cfg: TrainConfig, log=print):  # type: ignore[no-untyped-def]
    import torch
    import torch.nn.functional as F

    torch.manual_seed(SEED)
    net = build_net()
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps_per_epoch = -(-len(split.train_x) // cfg.batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=cfg.epochs * steps_per_epoch)
    gen = torch.Generator().manual_seed(SEED)
    x_all, y_all = torch.from_numpy(split.train_x), torch.from_numpy(split.train_y)
    for epoch in range(cfg.epochs):
        net.train()
        perm = torch.randperm(len(x_all), generator=gen)
        total = 0.0
        for start in range(0, len(perm), cfg.batch_size):
            idx = perm[start : start + cfg.batch_size]
            xb = x_all[idx]
            # small random shifts (up to 2 px) so the net does not memorise pixel positions
            dx, dy = (int(v) for v in torch.randint(-2, 3, (2,), generator=gen))
            xb = torch.roll(xb, shifts=(dy, dx), dims=(2, 3))
            loss = F.cross_entropy(net(xb), y_all[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total += float(loss.detach()) * len(idx)
        log(f"  epoch {epoch + 1:2d}/{cfg.epochs}  loss {total / len(x_all):.4f}")
    return net.eval()


def predict(net, x: np.ndarray) -> np.ndarray:  # type: ignore[no-untyped-def]
    import torch

    with torch.no_grad():
        return net(torch.from_numpy(x)).numpy()


def export_onnx(net, path: Path) -> None:  # type: ignore[no-untyped-def]
    import onnx
    import torch

    dummy = torch.zeros(1, 1, IMAGE_SIZE, IMAGE_SIZE)
    with warnings.catch_warnings():
        # the TorchScript exporter is deprecated in torch >= 2.9 but still exact for this plain
        # conv net and yields a simpler opset-17 graph than the dynamo exporter
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            net,
            (dummy,),
            str(path),
            dynamo=False,
            opset_version=17,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
            do_constant_folding=True,
        )
    model = onnx.load(str(path))
    model.producer_name = "edgekit-examples-digits"
    onnx.checker.check_model(model)
    bn = [n.name for n in model.graph.node if n.op_type == "BatchNormalization"]
    if bn:
        raise RuntimeError(f"BatchNormalization left in the exported graph: {bn}")
    path.write_bytes(model.SerializeToString())


def save_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Like ``np.savez_compressed`` but byte-reproducible (numpy stamps members with the current time)."""
    with zipfile.ZipFile(path, "w", compresslevel=9) as zf:
        for key, arr in arrays.items():
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED  # a ZipInfo does not take the archive's setting
            data = io.BytesIO()
            np.lib.format.write_array(data, np.ascontiguousarray(arr), allow_pickle=False)
            zf.writestr(info, data.getvalue())


def calibration_subset(split: Split, per_class: int) -> np.ndarray:
    rng = np.random.default_rng(SEED)
    idx = np.concatenate([rng.choice(np.flatnonzero(split.train_y == c), per_class, replace=False) for c in range(10)])
    return split.train_x[np.sort(idx)]


def write_readme(out: Path, stats: dict[str, object]) -> None:
    model_row = (
        f"| `model.onnx` | opset 17, input `{INPUT_NAME}` float32 [batch, 1, 32, 32] NCHW in [0, 1], "
        f"output `{OUTPUT_NAME}` float32 [batch, 10] (raw scores; argmax = digit, softmax for probabilities); "
        "BatchNorm folded |"
    )
    text = f"""# digits: the embedded default example

A small CNN trained on scikit-learn's digits (1797 real 8x8 handwritten digit scans that ship
inside scikit-learn: no download), made by `train.py` in this folder:

    python examples/digits/train.py --out examples/digits

Training is deterministic (fixed seeds, `torch.use_deterministic_algorithms`, {THREADS} threads,
torch {stats["torch"]} CPU build): the command rewrites these files byte for byte.

| file | what |
| --- | --- |
{model_row}
| `calib.npz` | {stats["calib"]} training images (30 per class), key `{INPUT_NAME}`: calibration data |
| `eval.npz` | {stats["eval"]} held-out images (stratified 25% split, seed {SEED}), key `{INPUT_NAME}` |
| `eval_labels.npy` | their labels, int64 |

Inputs are upsampled from 8x8 to 32x32 (bilinear) in the data prep so that the net is
compute-bound enough for quantization to show; an 8x8 net is too small for INT8 to pay.

Measured by `train.py` (PyTorch FP32 after folding BatchNorm, and the exported model under ONNX Runtime):

| | value |
| --- | --- |
| parameters | {stats["parameters"]:,} |
| model.onnx size | {stats["onnx_bytes"]:,} bytes |
| training images | {stats["train"]} |
| held-out top-1 accuracy | {stats["accuracy"]:.2%} ({stats["correct"]}/{stats["eval"]}) |
| ONNX Runtime vs PyTorch top-1 agreement | {stats["onnx_agreement"]:.2%} |
"""
    (out / "README.md").write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent, help="output folder")
    parser.add_argument("--epochs", type=int, default=TrainConfig.epochs)
    args = parser.parse_args(argv)
    cfg = TrainConfig(epochs=args.epochs)

    import onnxruntime as ort
    import torch

    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)
    t0 = time.perf_counter()
    split = prepare_data(cfg)
    print(f"data: {len(split.train_x)} train / {len(split.eval_x)} held-out, 1x{IMAGE_SIZE}x{IMAGE_SIZE}")
    net = train(split, cfg)
    fused = fold_batchnorm(net)
    logits = predict(fused, split.eval_x)
    correct = int((logits.argmax(1) == split.eval_y).sum())
    accuracy = correct / len(split.eval_y)
    print(f"held-out top-1 accuracy {accuracy:.2%} ({correct}/{len(split.eval_y)})")
    if accuracy < cfg.min_accuracy:
        raise SystemExit(f"accuracy {accuracy:.2%} is under {cfg.min_accuracy:.0%}; not writing the example")

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    export_onnx(fused, out / "model.onnx")
    sess = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    ort_logits = sess.run([OUTPUT_NAME], {INPUT_NAME: split.eval_x})[0]
    agreement = float((ort_logits.argmax(1) == logits.argmax(1)).mean())
    calib = calibration_subset(split, cfg.calib_per_class)
    save_npz(out / "calib.npz", {INPUT_NAME: calib})
    save_npz(out / "eval.npz", {INPUT_NAME: split.eval_x})
    np.save(out / "eval_labels.npy", split.eval_y)
    stats = {
        "torch": torch.__version__.split("+")[0],
        "parameters": sum(p.numel() for p in fused.parameters()),
        "onnx_bytes": (out / "model.onnx").stat().st_size,
        "train": len(split.train_x),
        "eval": len(split.eval_x),
        "calib": len(calib),
        "correct": correct,
        "accuracy": accuracy,
        "onnx_agreement": agreement,
    }
    write_readme(out, stats)
    print(json.dumps(stats))
    print(f"wrote {out} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
