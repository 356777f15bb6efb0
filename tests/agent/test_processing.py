"""The processing ops (device_agents.processing): decoding, geometry, pre-processing steps, top-k
with labels, YOLO boxes + class-wise NMS, and the host's calibration images read through them.
Each is checked against an independent computation (Pillow, brute-force loops), not itself."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
import pytest

from device_agents.processing.images import ImageDecoderMissingError, ImageInputError, decode_image
from device_agents.processing.post import Postprocessor, nms, topk
from device_agents.processing.pre import Preprocessor
from device_agents.processing.transforms import Geometry, center_crop, letterbox, resize
from edgekit.bundle.manifest import ProcessingStep, TensorSpec

Image = pytest.importorskip("PIL.Image")


def _photo(h: int, w: int, seed: int = 0) -> np.ndarray:
    """A smooth photo-like image (gradients + blobs): JPEG keeps it close, resampling is well defined."""
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    rng = np.random.default_rng(seed)
    img = np.stack([xx / w * 255, yy / h * 255, (xx + yy) / (h + w) * 255], axis=-1)
    for _ in range(5):
        cy, cx, r = rng.uniform(0, h), rng.uniform(0, w), rng.uniform(5, min(h, w) / 3)
        img += (
            np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * r * r)) * rng.uniform(-80, 80, 3)[:, None, None]
        ).transpose(1, 2, 0)
    photo: np.ndarray = np.clip(img, 0, 255).astype(np.uint8)
    return photo


def _encode(pixels: np.ndarray, fmt: str, quality: int = 95) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt, **({"quality": quality} if fmt == "JPEG" else {}))
    return buf.getvalue()


def test_resize_bilinear_upscale_matches_pillow() -> None:
    img = _photo(30, 40)
    ours = resize(img, (45, 70))
    theirs = np.asarray(Image.fromarray(img).resize((70, 45), Image.BILINEAR), dtype=np.float32)
    diff = np.abs(ours - theirs)  # Pillow works in fixed point and rounds each pass to uint8
    assert diff.max() <= 1.5 and diff.mean() < 0.3


def test_resize_big_shrink_averages_blocks_instead_of_aliasing() -> None:
    stripes = np.zeros((64, 64, 1), np.uint8)
    stripes[:, ::2] = 255  # one-pixel stripes: point sampling would give all 0 or all 255
    out = resize(stripes, (16, 16))
    assert np.allclose(out, 127.5, atol=1.0)


def test_letterbox_geometry_maps_model_pixels_back_to_the_original() -> None:
    img = np.zeros((100, 200, 3), np.uint8)
    img[20:40, 50:90] = 255  # a white rectangle at x 50..90, y 20..40
    out, geo = letterbox(img, (64, 64), 114.0, Geometry((100, 200)))
    assert out.shape == (64, 64, 3)
    assert geo.scale_x == pytest.approx(64 / 200) and geo.offset_y == pytest.approx(16)  # 32 rows of image, centred
    assert np.all(out[0, 0] == 114) and np.all(out[63, 0] == 114)
    ys, xs = np.nonzero(out[..., 0] > 200)
    found = np.array([[xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]], np.float32)
    back = geo.to_original(found)
    assert np.allclose(back, [[50, 20, 90, 40]], atol=200 / 64)  # within one model pixel


def test_center_crop_geometry_offsets_are_negative_and_clip() -> None:
    img = _photo(60, 120)
    out, geo = center_crop(img, (30, 30), Geometry((60, 120)))
    assert out.shape == (30, 30, 3)
    assert geo.scale_y == pytest.approx(0.5) and geo.offset_x == pytest.approx(-15)
    assert np.allclose(geo.to_original(np.array([[0, 0, 30, 30]], np.float32)), [[30, 0, 90, 60]])


def test_decode_jpeg_with_simplejpeg_equals_pillow() -> None:
    pytest.importorskip("simplejpeg")
    data = _encode(_photo(240, 320), "JPEG")
    ours, size = decode_image(data)
    assert size == (240, 320)
    assert np.array_equal(ours, np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))


def test_decode_jpeg_scaled_keeps_the_original_size_and_covers_the_fit() -> None:
    pytest.importorskip("simplejpeg")
    data = _encode(_photo(480, 640), "JPEG")
    pixels, size = decode_image(data, "RGB", ("letterbox", (100, 100)))
    assert size == (480, 640)
    assert pixels.shape == (120, 160, 3)  # 1/4 scale: the smallest covering 75x100


def test_decode_png_gray_and_refuses_garbage() -> None:
    pixels, size = decode_image(_encode(_photo(20, 30)[..., 0], "PNG"), "GRAY")
    assert pixels.shape == (20, 30, 1) and size == (20, 30)
    with pytest.raises(ImageInputError, match="not a readable"):
        decode_image(b"\xff\xd8 not really a jpeg")
    assert ImageInputError("x").http_status == 400


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_decode_without_decoders_is_a_400_naming_the_extra(monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    data = _encode(_photo(20, 20), fmt)
    monkeypatch.setitem(sys.modules, "simplejpeg", None)  # import fails, as on an agent without the extra
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(ImageDecoderMissingError, match=r"pip install 'edgekit\[agent-images\]'") as info:
        decode_image(data)
    assert info.value.http_status == 400


def _steps(fit: str = "letterbox") -> list[ProcessingStep]:
    geometry = {
        "letterbox": ProcessingStep(op="letterbox", size=(64, 64), pad_value=114.0),
        "resize": ProcessingStep(op="resize", size=(64, 64), interpolation="bilinear"),
    }[fit]
    return [
        geometry,
        ProcessingStep(op="scale", value=1 / 255),
        ProcessingStep(op="normalize", mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25)),
        ProcessingStep(op="layout", layout="NCHW"),
        ProcessingStep(op="cast", dtype="float32"),
    ]


def test_preprocessor_from_pixels_computes_the_steps_in_order() -> None:
    img = _photo(32, 64)
    spec = TensorSpec("images", "float32", ("batch", 3, 64, 64))
    x, geo = Preprocessor(_steps("resize"), spec).from_pixels(img)
    expected = ((resize(img, (64, 64)) / 255 - 0.5) / 0.25).transpose(2, 0, 1)[None]
    assert x.shape == (1, 3, 64, 64) and x.dtype == np.float32
    assert np.allclose(x, expected, atol=1e-5)
    assert (geo.scale_y, geo.scale_x) == (2.0, 1.0)


def test_preprocessor_refuses_pixels_of_the_wrong_kind() -> None:
    pre = Preprocessor(_steps(), TensorSpec("images", "float32", (1, 3, 64, 64)))
    with pytest.raises(ImageInputError.__mro__[1], match=r"uint8 pixels \[H, W, 3\]"):
        pre.from_pixels(np.zeros((10, 10, 3), np.float32))


def test_topk_orders_best_first_and_breaks_ties_by_index() -> None:
    idx, vals = topk(np.array([0.1, 0.5, 0.2, 0.5, 0.05], np.float32), 3)
    assert idx.tolist() == [1, 3, 2] and vals.tolist() == pytest.approx([0.5, 0.5, 0.2])


def _brute_nms(boxes: np.ndarray, scores: np.ndarray, classes: np.ndarray, iou: float) -> list[int]:
    """Per class, in plain Python: keep the best box, drop same-class boxes overlapping it by more than iou."""

    def overlap(a: np.ndarray, b: np.ndarray) -> float:
        w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
        h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
        union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - w * h
        return w * h / union if union > 0 else 0.0

    kept: list[int] = []
    for c in sorted(set(classes.tolist())):
        todo = sorted((i for i in range(len(boxes)) if classes[i] == c), key=lambda i: (-scores[i], i))
        while todo:
            best = todo.pop(0)
            kept.append(best)
            todo = [i for i in todo if overlap(boxes[best], boxes[i]) <= iou]
    return sorted(kept, key=lambda i: (-scores[i], i))


def test_nms_is_class_wise_and_matches_a_brute_force_reference() -> None:
    rng = np.random.default_rng(3)
    xy = rng.uniform(0, 80, (200, 2)).astype(np.float32)
    boxes = np.concatenate([xy, xy + rng.uniform(5, 30, (200, 2)).astype(np.float32)], axis=1)
    scores = rng.uniform(0, 1, 200).astype(np.float32)
    classes = rng.integers(0, 3, 200).astype(np.int32)
    assert nms(boxes, scores, classes, 0.45, 1000).tolist() == _brute_nms(boxes, scores, classes, 0.45)
    same = np.array([[0, 0, 10, 10], [0, 0, 10, 10]], np.float32)
    two_classes = nms(same, np.array([0.9, 0.8], np.float32), np.array([0, 1], np.int32), 0.5, 10)
    assert two_classes.tolist() == [0, 1]  # identical boxes of different classes both stay


def _yolo_output(cxcywh: np.ndarray, cls_scores: np.ndarray, axis: int) -> np.ndarray:
    rows = np.concatenate([cxcywh, cls_scores], axis=1).astype(np.float32)  # [N, 4+C]
    return (rows.T if axis == 1 else rows)[None]


@pytest.mark.parametrize("axis", [1, 2])
def test_postprocessor_yolo_boxes_come_back_in_original_pixels_with_labels(axis: int) -> None:
    cxcywh = np.array([[32, 32, 20, 10], [33, 32, 20, 10], [10, 40, 8, 8], [50, 50, 4, 4]], np.float32)
    cls = np.array([[0.9, 0.1], [0.8, 0.2], [0.05, 0.7], [0.1, 0.2]], np.float32)
    out = _yolo_output(cxcywh, cls, axis)
    spec = TensorSpec("output0", "float32", (1, 6, 4) if axis == 1 else (1, 4, 6))
    step = ProcessingStep(
        op="boxes", box_format="yolo", axis=axis, score_threshold=0.25, iou_threshold=0.45, labels_file="l.txt"
    )
    post = Postprocessor([step], [spec], lambda path: b"cat\ndog\n")
    # the original image was 100 x 200 (h x w), letterboxed into 64 x 64: scale 0.32, 16 rows of pad on top
    geo = Geometry((100, 200)).then(0.32, 0.32, 16, 0)
    got = post.run({"output0": out}, geo)
    assert got["classes"].tolist() == [0, 1] and got["labels"].tolist() == [b"cat", b"dog"]
    assert got["scores"].tolist() == pytest.approx([0.9, 0.7])
    expected = np.array([[22, 27, 42, 37], [6, 36, 14, 44]], np.float32)
    expected[:, 1::2] -= 16
    assert np.allclose(got["boxes"], expected / 0.32, atol=1e-4)
    assert [o.name for o in post.outputs()] == ["boxes", "scores", "classes", "labels"]


def test_postprocessor_refuses_a_labels_file_of_the_wrong_length() -> None:
    from edgekit.bundle.errors import ManifestError

    spec = TensorSpec("probs", "float32", ("batch", 3))
    with pytest.raises(ManifestError, match="2 labels for 3 classes"):
        Postprocessor([ProcessingStep(op="topk", k=2, labels_file="l.txt")], [spec], lambda p: b"a\nb\n")


def test_host_calibration_images_go_through_the_device_preprocessing(tmp_path: Path) -> None:
    from edgekit.validate.preprocess import Preprocess

    paths = []
    for i in range(3):
        paths.append(tmp_path / f"img{i}.jpg")
        paths[-1].write_bytes(_encode(_photo(90 + 10 * i, 160, seed=i), "JPEG"))
    spec = TensorSpec("images", "float32", ("batch", 3, 64, 64))
    host = Preprocess.parse("size=64x64,fit=letterbox,pad=114,scale=255")
    got = host.apply(paths, spec)
    pre = Preprocessor(host.to_steps(spec), TensorSpec("images", "float32", (1, 3, 64, 64)))
    for i, path in enumerate(paths):
        assert np.array_equal(got[i], pre.from_bytes(path.read_bytes())[0][0])
    assert got.shape == (3, 3, 64, 64) and np.isclose(got[0, 0, 0, 0], 114 / 255)


def test_preprocessor_nhwc_bgr_and_gray_inputs() -> None:
    img = _photo(40, 40)
    steps = [
        ProcessingStep(op="channel_order", order="BGR"),
        ProcessingStep(op="resize", size=(20, 20), interpolation="bilinear"),
        ProcessingStep(op="scale", value=1 / 255),
        ProcessingStep(op="normalize", mean=(0.1, 0.2, 0.3), std=(0.5, 0.5, 0.5)),
        ProcessingStep(op="layout", layout="NHWC"),
        ProcessingStep(op="cast", dtype="float32"),
    ]
    x, _ = Preprocessor(steps, TensorSpec("x", "float32", (1, 20, 20, 3))).from_pixels(img)
    want = ((resize(img[..., ::-1], (20, 20)) / 255 - np.array([0.1, 0.2, 0.3])) / 0.5)[None]
    assert x.shape == (1, 20, 20, 3) and np.allclose(x, want, atol=1e-5)
    gray = [ProcessingStep(op="resize", size=(20, 20)), ProcessingStep(op="layout", layout="NCHW")]
    pre = Preprocessor(gray, TensorSpec("x", "uint8", (1, 1, 20, 20)))
    g, _ = pre.from_bytes(_encode(img, "PNG"))  # a colour image to a one-channel model: decoded as gray
    expected = resize(np.asarray(Image.fromarray(img).convert("L"))[..., None], (20, 20))
    assert g.dtype == np.uint8 and g.shape == (1, 1, 20, 20)
    assert np.array_equal(g[0, 0], np.clip(np.rint(expected[..., 0]), 0, 255).astype(np.uint8))
