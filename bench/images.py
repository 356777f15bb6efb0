"""JPEG in, boxes out: a YOLO-style detector at 320x320 behind the agent, against the model alone.

The detector (``examples.detector.colour_detector``) has a conv backbone of a small real
detector's compute (about 2.7 GFLOP at 320x320) and a head whose boxes are a known function of
the pixels (a score per colour, sharpened), so the photo gives tens of candidates past the score
threshold and about 25 boxes after NMS, as a busy street scene would. It is packaged as an fp32 ``cpu``
bundle with ``--preprocess size=320x320,fit=letterbox,pad=114,scale=255``, ``--postprocess
boxes=yolo,score=0.25,iou=0.45`` and a labels file, and installed into a real agent.

Cases, each interleaved (A and B in the same loop):

- ``e2e``: A is ``session.run`` of the same model in this process on the pre-processed tensor
  (the model's own p50); B a 1280x720 JPEG photo sent over HTTP (tritonclient, binary BYTES) and
  boxes, scores, classes and labels read back. The agent's own stage times (from /metrics, over
  the B calls) say what pre- and post-processing cost beside its runtime call;
- ``decode``: A is Pillow decoding that JPEG, B simplejpeg (full size, and the 1/4-scale decode
  that a 320x320 letterbox lets the agent use).
"""

from __future__ import annotations

import io
import re
import urllib.request

import numpy as np

from bench.registry import BenchContext, BenchError, Measurement

SIZE = 320
MODEL_NAME = "detector"
_STAGE_LINE = re.compile(r'^edgekit_stage_seconds_(sum|count)\{model="detector",stage="([a-z_]+)"\} (\S+)$')


def photo_jpeg(width: int = 1280, height: int = 720, quality: int = 90) -> bytes:
    """A real photograph (matplotlib's sample portrait) scaled to a camera frame and JPEG-encoded."""
    from matplotlib import cbook
    from PIL import Image

    with Image.open(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)) as img:
        frame = img.convert("RGB").resize((width, height), Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    frame.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def _stage_means_ms(url: str) -> dict[str, tuple[float, float]]:
    """stage -> (sum seconds, count) of the detector's edgekit_stage_seconds."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    found: dict[str, list[float]] = {}
    for line in text.splitlines():
        m = _STAGE_LINE.match(line)
        if m:
            kind, stage, value = m.groups()
            found.setdefault(stage, [0.0, 0.0])[0 if kind == "sum" else 1] = float(value)
    return {k: (v[0], v[1]) for k, v in found.items()}


def run(ctx: BenchContext, *, name: str) -> list[Measurement]:
    import onnxruntime as ort
    import simplejpeg
    import tritonclient.http as httpclient
    from PIL import Image

    import edgekit
    from device_agents.processing.pre import Preprocessor
    from edgekit.validate.latency import p50_side_by_side
    from examples.agent_process import RunningAgent
    from examples.detector import colour_detector

    work = ctx.workdir / "images"
    (work / "eval").mkdir(parents=True, exist_ok=True)
    model = colour_detector(work / "detector.onnx", size=SIZE, backbone=8, width=96, sharpness=8)
    jpeg = photo_jpeg()
    for i, (w, h) in enumerate([(1280, 720), (640, 480), (720, 1280), (800, 800)]):
        (work / "eval" / f"{i}.jpg").write_bytes(photo_jpeg(w, h))
    labels = work / "classes.txt"
    labels.write_text("red\ngreen\nblue\n")
    ctx.progress(f"{name}: packaging a {SIZE}x{SIZE} YOLO-style detector with pre/post-processing")
    result = edgekit.package(
        model,
        targets=["cpu"],
        precision="fp32",
        eval=str(work / "eval"),
        key=ctx.key,
        name=MODEL_NAME,
        out_dir=work / "bundles",
        preprocess=f"size={SIZE}x{SIZE},fit=letterbox,pad=114,scale=255",
        postprocess="boxes=yolo,score=0.25,iou=0.45",
        allow_small_eval=True,  # four photos: the benchmark times image requests, not the gate
        labels_file=labels,
    )
    manifest = result.manifests["cpu"]
    pre = Preprocessor(manifest.preprocess, manifest.signature.inputs[0])
    tensor, _ = pre.from_bytes(jpeg)
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    with RunningAgent(work / "agent", [ctx.pub]) as agent:
        agent.install(result.bundles["cpu"])
        agent.wait_model_ready(MODEL_NAME)
        client = httpclient.InferenceServerClient(url=agent.host_port)
        try:

            def over_http() -> object:
                inp = httpclient.InferInput("images", [1], "BYTES")
                inp.set_data_from_numpy(np.array([jpeg], dtype=object), binary_data=True)
                outs = [httpclient.InferRequestedOutput(n, binary_data=True) for n in ("boxes", "scores", "labels")]
                return client.infer(MODEL_NAME, [inp], outputs=outs)

            answer = over_http()
            boxes = answer.as_numpy("boxes")  # type: ignore[attr-defined]  # tritonclient's InferResult
            if boxes is None or boxes.ndim != 2 or boxes.shape[1] != 4 or len(boxes) == 0:
                raise BenchError(f"the agent answered no boxes for the photo: {boxes!r}")
            if float(boxes[:, 2].max()) <= SIZE:  # mapped back into the 1280x720 frame, not left at 320
                raise BenchError("the boxes are not in the photo's pixels")
            ctx.progress(f"{name}: {len(boxes)} boxes per photo; timing HTTP JPEG->boxes interleaved with session.run")
            before = _stage_means_ms(agent.url)
            p50 = p50_side_by_side(
                {"session.run": lambda: session.run(None, {"images": tensor}), "http": over_http},
                repeats=ctx.repeats * 3,
                budget_s=ctx.budget_s,
                warmup=5,
            )
            after = _stage_means_ms(agent.url)
        finally:
            client.close()
    stage_ms = {}
    for stage in ("decode", "preprocess", "infer", "postprocess", "encode"):
        s0, n0 = before.get(stage, (0.0, 0.0))
        s1, n1 = after.get(stage, (0.0, 0.0))
        stage_ms[stage] = 1e3 * (s1 - s0) / (n1 - n0) if n1 > n0 else float("nan")
    processing = stage_ms["preprocess"] + stage_ms["postprocess"]

    def decode_pillow() -> object:
        with Image.open(io.BytesIO(jpeg)) as img:
            return np.asarray(img.convert("RGB"))

    def decode_pillow_scaled() -> object:
        with Image.open(io.BytesIO(jpeg)) as img:
            img.draft("RGB", (SIZE, SIZE * 720 // 1280))
            return np.asarray(img.convert("RGB"))

    decode = p50_side_by_side(
        {
            "pillow": decode_pillow,
            "simplejpeg": lambda: simplejpeg.decode_jpeg(jpeg, "RGB"),
            "pillow 1/4": decode_pillow_scaled,
            "simplejpeg 1/4": lambda: simplejpeg.decode_jpeg(jpeg, "RGB", min_height=180, min_width=SIZE),
        },
        repeats=ctx.repeats * 3,
        budget_s=ctx.budget_s,
        warmup=3,
    )
    photo = f"1280x720 JPEG ({len(jpeg) // 1024} KB)"
    stages = ", ".join(f"{k} {v:.2f}" for k, v in stage_ms.items())
    return [
        Measurement(name, "e2e: JPEG in, boxes out over HTTP vs the model alone", "p50 latency", "ms",
                    "session.run (320x320 tensor)", "agent HTTP JPEG->boxes", p50["session.run"], p50["http"],
                    f"{photo}; agent stage means ms: {stages}"),
        Measurement(name, "pre+post processing vs the runtime call", "mean per request", "ms", "infer stage",
                    "preprocess + postprocess stages", stage_ms["infer"], processing,
                    f"from the agent's edgekit_stage_seconds over the timed requests: {stages}"),
        Measurement(name, "decode: simplejpeg vs Pillow, full size", "p50 latency", "ms", "Pillow", "simplejpeg",
                    decode["pillow"], decode["simplejpeg"], photo),
        Measurement(name, "decode: simplejpeg vs Pillow, 1/4 scale (320 letterbox)", "p50 latency", "ms",
                    "Pillow draft", "simplejpeg min size", decode["pillow 1/4"], decode["simplejpeg 1/4"], photo),
    ]  # fmt: skip
