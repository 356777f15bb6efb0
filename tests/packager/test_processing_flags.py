"""``edgekit package --preprocess ... --postprocess ... --labels-file ...``: the steps land in the
manifest, typed and checked against the model's output shapes before any conversion, and the
labels file travels in the bundle (listed in its files)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgekit.errors import ConfigError
from edgekit.validate.postprocess import Postprocess
from examples.detector import colour_detector
from tests.factories import tiny_classifier


@pytest.fixture(scope="module")
def detector(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return colour_detector(tmp_path_factory.mktemp("det") / "det.onnx")


def _images(n: int, size: int = 64) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"images": rng.uniform(0, 1, (n, 3, size, size)).astype(np.float32)}


def test_package_detector_records_letterbox_boxes_and_labels(
    detector: Path, keypair: tuple[Path, Path], tmp_path: Path
) -> None:
    from edgekit.bundle import TrustStore, key_id, load_public_key, read_verified_manifest
    from tests.factories import package_small_data as package

    labels = tmp_path / "classes.txt"
    labels.write_text("red\ngreen\nblue\n")
    result = package(
        detector,
        targets=["cpu"],
        precision="fp32",
        eval=_images(4),
        key=keypair[0],
        name="det",
        out_dir=tmp_path / "out",
        preprocess="size=64x64,fit=letterbox,pad=114,scale=255",
        postprocess="boxes=yolo,score=0.25,iou=0.45",
        labels_file=labels,
    )
    m = result.manifests["cpu"]
    assert [s.op for s in m.preprocess] == ["letterbox", "scale", "layout", "cast"]
    assert m.preprocess[0].pad_value == 114 and m.preprocess[0].size == (64, 64)
    (boxes,) = m.postprocess
    assert (boxes.op, boxes.box_format, boxes.axis) == ("boxes", "yolo", 1)
    assert (boxes.score_threshold, boxes.iou_threshold, boxes.labels_file) == (0.25, 0.45, "labels.txt")
    assert m.file("labels.txt").role == "labels"
    public = load_public_key(keypair[1])
    trust = TrustStore({key_id(public): public})
    signed = read_verified_manifest(result.bundles["cpu"], trust).manifest
    assert signed.postprocess == m.postprocess and signed.file("labels.txt").size_bytes == 15


def test_package_classifier_topk_softmax_decided_on_its_outputs(keypair: tuple[Path, Path], tmp_path: Path) -> None:
    from tests.factories import package_small_data as package

    model = tiny_classifier(tmp_path / "cls.onnx", classes=4)  # ends in Softmax: already probabilities
    lines: list[str] = []
    result = package(
        model,
        targets=["cpu"],
        precision="fp32",
        eval={"input": np.random.default_rng(1).standard_normal((5, 3, 16, 16)).astype(np.float32)},
        key=keypair[0],
        name="cls",
        out_dir=tmp_path / "out",
        postprocess="topk=2",
        progress=lines.append,
    )
    (topk,) = result.manifests["cpu"].postprocess  # no softmax on top of the model's own
    assert (topk.op, topk.k, topk.labels_file) == ("topk", 2, None)
    assert any("already sums to 1" in line for line in lines)


@pytest.mark.parametrize(
    ("post", "labels", "message"),
    [
        ("topk=500", None, "topk=500: output 'output0' [1, 7, 64] scores 448 classes"),
        ("boxes=yolo", "a\nb\n", "2 labels, but output 'output0' [1, 7, 64] has no axis of 4 + 2 = 6 values"),
        ("boxes=yolov5", None, "--postprocess boxes=yolov5: choose from yolo"),
        ("box=yolo", None, "did you mean 'boxes'?"),
        ("topk=2,boxes=yolo", None, "one of them"),
    ],
)
def test_postprocess_checked_against_the_model_outputs(post: str, labels: str | None, message: str) -> None:
    from edgekit.bundle.manifest import Signature, TensorSpec

    served = Signature(
        inputs=(TensorSpec("images", "float32", (1, 3, 64, 64)),),
        outputs=(TensorSpec("output0", "float32", (1, 7, 64)),),
    )
    names = tuple(labels.splitlines()) if labels else None
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]").replace("+", r"\+")):
        Postprocess.parse(post).to_steps(served, names)


def test_labels_file_without_postprocess_is_refused_before_any_work(
    detector: Path, keypair: tuple[Path, Path], tmp_path: Path
) -> None:
    from tests.factories import package_small_data as package

    labels = tmp_path / "classes.txt"
    labels.write_text("red\ngreen\nblue\n")
    with pytest.raises(ConfigError, match="--labels-file names the classes of --postprocess"):
        package(
            detector,
            targets=["cpu"],
            precision="fp32",
            eval=_images(2),
            key=keypair[0],
            out_dir=tmp_path,
            labels_file=labels,
        )
