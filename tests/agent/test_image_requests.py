"""Images in, boxes or labels out, tried as a new user would: ``edgekit package`` with
``--preprocess``, ``--postprocess`` and ``--labels-file``, ``edgekit-agent install`` into a real
agent, and a JPEG sent over plain HTTP (the JSON ``curl -d @request.json`` would send, and the
binary tensor extension). The detector's boxes are checked against an independent reference
written here: Pillow's decoder, a letterbox on a Pillow canvas, the model's function in numpy,
YOLO decoding and a brute-force class-wise NMS, mapped back to the original image by hand."""

from __future__ import annotations

import base64
import io
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from examples.detector import colour_detector, reference_outputs
from tests.agent.conftest import agent_cli, write_config
from tests.factories import tiny_classifier

Image = pytest.importorskip("PIL.Image")

SIZE = 96  # the detector's input; the photo is 768 x 576: a 1/8 JPEG decode is exactly 96 x 72
CLASSES = ("red", "green", "blue")


def _edgekit(*args: str) -> None:
    from edgekit.cli import main

    assert main(list(args)) == 0


def _photo() -> bytes:
    """A 768 x 576 JPEG of soft coloured blobs on a dark background (one per class, two red)."""
    h, w = 576, 768
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
    img = np.full((h, w, 3), 10.0)
    for (cy, cx, sigma), channel in zip(
        [(150, 200, 40), (400, 560, 55), (420, 150, 35), (120, 600, 30)], [0, 1, 2, 0], strict=True
    ):
        img[..., channel] += 240 * np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * sigma**2))
    buf = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=92)
    return buf.getvalue()


def _reference_boxes(jpeg: bytes, score: float, iou: float) -> list[tuple[int, float, tuple[float, ...]]]:
    """(class, score, (x1, y1, x2, y2) in the photo's pixels), computed without device_agents."""
    img = Image.open(io.BytesIO(jpeg))
    width, height = img.size
    img.draft("RGB", (SIZE, SIZE * height // width))  # libjpeg's 1/8 scale: 96 x 72, as the agent decodes
    assert img.size == (96, 72)
    canvas = Image.new("RGB", (SIZE, SIZE), (114, 114, 114))
    top = (SIZE - img.size[1]) // 2
    canvas.paste(img.convert("RGB"), (0, top))
    x = np.asarray(canvas, np.float64).transpose(2, 0, 1)[None] / 255
    rows = reference_outputs(x)[0].T  # [N, 4 + C]
    found = []
    for i, row in enumerate(rows):
        c = int(np.argmax(row[4:]))
        if row[4 + c] > score:
            cx, cy, bw, bh = row[:4]
            found.append((i, c, float(row[4 + c]), (cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2)))

    def overlap(a: tuple[float, ...], b: tuple[float, ...]) -> float:
        iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
        ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
        inter = iw * ih
        return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)

    kept = []
    for c in range(len(CLASSES)):
        todo = sorted((f for f in found if f[1] == c), key=lambda f: (-f[2], f[0]))
        while todo:
            best = todo.pop(0)
            kept.append(best)
            todo = [f for f in todo if overlap(best[3], f[3]) <= iou]
    scale = SIZE / width  # letterbox: the photo shrank by this, then moved down by ``top`` rows
    out: list[tuple[int, float, tuple[float, ...]]] = []
    for _, c, s, (x1, y1, x2, y2) in kept:
        box = (x1 / scale, (y1 - top) / scale, x2 / scale, (y2 - top) / scale)
        box = (
            min(max(box[0], 0), width),
            min(max(box[1], 0), height),
            min(max(box[2], 0), width),
            min(max(box[3], 0), height),
        )
        out.append((c, s, box))
    return out


def _post(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[dict[str, Any], bytes]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(request, timeout=30) as r:
        data = r.read()
        length = r.headers.get("Inference-Header-Content-Length")
    if length is None:
        return json.loads(data), b""
    return json.loads(data[: int(length)]), data[int(length) :]


def _outputs(doc: dict[str, Any]) -> dict[str, Any]:
    return {o["name"]: o for o in doc["outputs"]}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory, keypair: tuple[Path, Path]) -> dict[str, Path]:
    """The detector and a classifier, packaged from the CLI as a user would, with a folder of images."""
    root = tmp_path_factory.mktemp("images")
    images = root / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for i in range(4):
        Image.fromarray(rng.integers(0, 256, (120, 160, 3), dtype=np.uint8)).save(images / f"{i}.jpg")
    labels = root / "classes.txt"
    labels.write_text("\n".join(CLASSES) + "\n")
    det = colour_detector(root / "det.onnx", size=SIZE)
    common = ("--target", "cpu", "--precision", "fp32", "--eval", str(images), "--key", str(keypair[0]), "-q",
              "--allow-small-eval")  # a few photos: the requests are tested here, not the gate  # fmt: skip
    _edgekit(
        "package", str(det), *common, "--name", "det", "--version", "1", "-o", str(root / "out"),
        "--preprocess", f"size={SIZE}x{SIZE},fit=letterbox,pad=114,scale=255",
        "--postprocess", "boxes=yolo,score=0.25,iou=0.45", "--labels-file", str(labels),
    )  # fmt: skip
    names = root / "animals.txt"
    names.write_text("".join(f"class{i}\n" for i in range(10)))
    cls = tiny_classifier(root / "cls.onnx", size=16, input_name="image")
    _edgekit(
        "package", str(cls), *common, "--name", "cls", "--version", "1", "-o", str(root / "out"),
        "--preprocess", "size=16x16,fit=center-crop,scale=255,mean=0.485/0.456/0.406,std=0.229/0.224/0.225",
        "--postprocess", "topk=3", "--labels-file", str(names),
    )  # fmt: skip
    return {"root": root, "det": root / "out" / "det-cpu-v1.ekb", "cls": root / "out" / "cls-cpu-v1.ekb", "onnx": cls}


@pytest.fixture(scope="module")
def agent(workspace: dict[str, Path], keypair: tuple[Path, Path]):  # type: ignore[no-untyped-def]
    from tests.agent.conftest import start_agent

    config = write_config(workspace["root"] / "agent", keypair[1])
    for bundle in ("det", "cls"):
        done = agent_cli("install", str(workspace[bundle]), "--config", str(config))
        assert done.returncode == 0, done.stderr
    running = start_agent(config)
    yield running
    running.stop()


def test_jpeg_to_a_detector_returns_boxes_in_the_photos_pixels(agent) -> None:  # type: ignore[no-untyped-def]
    jpeg = _photo()
    body = {
        "inputs": [
            {"name": "images", "datatype": "BYTES", "shape": [1], "data": [{"b64": base64.b64encode(jpeg).decode()}]}
        ]
    }
    doc, _ = _post(f"{agent.url}/v2/models/det/infer", json.dumps(body).encode())
    out = _outputs(doc)
    assert [out[k]["datatype"] for k in ("boxes", "scores", "classes", "labels")] == ["FP32", "FP32", "INT32", "BYTES"]
    n = out["scores"]["shape"][0]
    assert out["boxes"]["shape"] == [n, 4] and n >= 4
    got = sorted(
        (c, s, tuple(np.reshape(out["boxes"]["data"], (n, 4))[i]))
        for i, (c, s) in enumerate(zip(out["classes"]["data"], out["scores"]["data"], strict=True))
    )
    want = sorted(_reference_boxes(jpeg, 0.25, 0.45))
    assert [g[0] for g in got] == [w[0] for w in want]
    assert np.allclose([g[1] for g in got], [w[1] for w in want], atol=1e-5)
    assert np.allclose([g[2] for g in got], [w[2] for w in want], atol=1e-3)
    assert out["labels"]["data"] == [CLASSES[c] for c in out["classes"]["data"]]
    # the best box of each blob sits on it, in the photo's own pixels (768 x 576)
    best_red = max((g for g in got if g[0] == 0), key=lambda g: g[1])
    x1, y1, x2, y2 = best_red[2]
    assert (x1 < 200 < x2 and y1 < 150 < y2) or (x1 < 600 < x2 and y1 < 120 < y2)


def test_binary_extension_and_raw_pixels_give_the_same_boxes(agent) -> None:  # type: ignore[no-untyped-def]
    jpeg = _photo()
    header = json.dumps(
        {
            "inputs": [
                {"name": "images", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": 4 + len(jpeg)}}
            ],
            "outputs": [{"name": "boxes", "parameters": {"binary_data": True}}, {"name": "labels"}],
        }
    ).encode()
    body = header + len(jpeg).to_bytes(4, "little") + jpeg
    doc, blob = _post(f"{agent.url}/v2/models/det/infer", body, {"Inference-Header-Content-Length": str(len(header))})
    out = _outputs(doc)
    n = out["boxes"]["shape"][0]
    boxes = np.frombuffer(blob, "<f4").reshape(n, 4)
    json_doc, _ = _post(
        f"{agent.url}/v2/models/det/infer",
        json.dumps(
            {
                "inputs": [
                    {
                        "name": "images",
                        "datatype": "BYTES",
                        "shape": [1],
                        "data": [base64.b64encode(jpeg).decode()],
                        "parameters": {"content_type": "base64"},
                    }
                ]
            }
        ).encode(),
    )
    assert np.allclose(boxes, np.reshape(_outputs(json_doc)["boxes"]["data"], (n, 4)))
    assert out["labels"]["data"] == _outputs(json_doc)["labels"]["data"]
    pixels = np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"))
    raw = {
        "inputs": [
            {"name": "images", "datatype": "UINT8", "shape": list(pixels.shape), "data": pixels.ravel().tolist()}
        ]
    }
    pix_doc, _ = _post(f"{agent.url}/v2/models/det/infer", json.dumps(raw).encode())
    assert (
        _outputs(pix_doc)["labels"]["data"][:2] == out["labels"]["data"][:2]
    )  # full-size pixels: the same blobs first


def test_metadata_shows_the_processed_signature(agent) -> None:  # type: ignore[no-untyped-def]
    with urllib.request.urlopen(f"{agent.url}/v2/models/det", timeout=10) as r:
        meta = json.loads(r.read())
    assert meta["inputs"] == [{"name": "images", "datatype": "BYTES", "shape": [1]}]
    assert meta["outputs"] == [
        {"name": "boxes", "datatype": "FP32", "shape": [-1, 4]},
        {"name": "scores", "datatype": "FP32", "shape": [-1]},
        {"name": "classes", "datatype": "INT32", "shape": [-1]},
        {"name": "labels", "datatype": "BYTES", "shape": [-1]},
    ]


def test_a_photo_to_a_classifier_returns_its_labels(agent, workspace: dict[str, Path]) -> None:  # type: ignore[no-untyped-def]
    import onnxruntime as ort

    from device_agents.processing.pre import Preprocessor
    from edgekit.bundle.manifest import TensorSpec
    from edgekit.validate.preprocess import Preprocess

    photo = _photo()
    body = {
        "inputs": [
            {"name": "image", "datatype": "BYTES", "shape": [1], "data": [{"b64": base64.b64encode(photo).decode()}]}
        ]
    }
    out = _outputs(_post(f"{agent.url}/v2/models/cls/infer", json.dumps(body).encode())[0])
    assert out["labels"]["shape"] == [3] and out["classes"]["datatype"] == "INT32"
    # what the host computes for the same photo with the same steps and the source model
    spec = TensorSpec("image", "float32", (1, 3, 16, 16))
    pre = Preprocess.parse("size=16x16,fit=center-crop,scale=255,mean=0.485/0.456/0.406,std=0.229/0.224/0.225")
    x, _ = Preprocessor(pre.to_steps(spec), spec).from_bytes(photo)
    probs = ort.InferenceSession(str(workspace["onnx"])).run(None, {"image": x})[0][0]
    best = np.argsort(-probs, kind="stable")[:3]
    assert out["classes"]["data"] == best.tolist()
    assert out["labels"]["data"] == [f"class{i}" for i in best]
    assert np.allclose(out["scores"]["data"], probs[best], atol=1e-5)  # the model ends in Softmax: no second one


def test_a_corrupt_image_is_a_400_naming_the_reason(agent) -> None:  # type: ignore[no-untyped-def]
    bad = {
        "inputs": [
            {
                "name": "images",
                "datatype": "BYTES",
                "shape": [1],
                "data": [{"b64": base64.b64encode(b"\xff\xd8 no").decode()}],
            }
        ]
    }
    with pytest.raises(urllib.error.HTTPError) as info:
        _post(f"{agent.url}/v2/models/det/infer", json.dumps(bad).encode())
    assert info.value.code == 400 and "not a readable JPEG" in info.value.read().decode()


def test_golden_vectors_carry_an_image_the_self_test_checks(
    workspace: dict[str, Path], keypair: tuple[Path, Path], tmp_path: Path
) -> None:
    import tarfile

    from tests.agent.bundles import rebundle

    with tarfile.open(workspace["det"], "r:gz") as tar:
        golden = np.load(io.BytesIO(tar.extractfile("golden.npz").read()))  # type: ignore[union-attr]  # a regular file
        arrays = {k: golden[k] for k in golden.files}
    assert arrays["image_images"].dtype == np.uint8 and arrays["image_images"][:2].tobytes() == b"\xff\xd8"
    assert arrays["expected_boxes"].shape[1] == 4 and arrays["expected_labels"].dtype.kind == "S"
    # the same bundle whose host answer names another class for the best box: the device disagrees
    arrays["expected_classes"] = (arrays["expected_classes"] + 1) % len(CLASSES)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    bad = rebundle(workspace["det"], keypair[0], tmp_path / "det-bad.ekb", files={"golden.npz": buf.getvalue()})
    config = write_config(tmp_path / "agent", keypair[1])
    done = agent_cli("install", str(bad), "--config", str(config))
    assert done.returncode != 0
    assert "golden image's best class is" in done.stdout + done.stderr
