"""TensorRT check on a machine with an NVIDIA GPU: build, cache and run the jetson bundles.

For each of fp32, fp16 and int8 this packages the example model for the ``jetson`` target with
``edgekit.package``, verifies and extracts the bundle, and opens it with the device runtime
(``device_agents.runtimes.tensorrt``: engine built on first load, cached per GPU). It then checks

- the second load hits the engine cache (no rebuild),
- top-1 agreement and cosine of each engine's outputs with ONNX Runtime FP32 on the held-out set,
- TensorRT's own layer report (written next to the engines),

and prints p50 latency at batch 1 of the three engines and ONNX Runtime FP32 (CPU), interleaved.
It installs nothing and downloads nothing. Exit status 1 when an engine is outside its gate.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
# Agreement with ORT FP32 each engine must reach on the held-out set (the packager's default gate).
MIN_AGREEMENT = {"fp32": 0.99, "fp16": 0.98, "int8": 0.98}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    digits = ROOT / "examples" / "digits"
    parser.add_argument("--model", type=Path, default=digits / "model.onnx")
    parser.add_argument("--calib", type=Path, default=digits / "calib.npz")
    parser.add_argument("--eval", type=Path, default=digits / "eval.npz")
    parser.add_argument("--workdir", type=Path, default=None, help="keep bundles, engines and layer reports here")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args(argv)

    try:
        import tensorrt
        import torch
    except ImportError as exc:
        print(f"check_tensorrt: {exc}; install tensorrt and a CUDA build of torch first (nothing is installed here)")
        return 2
    if not torch.cuda.is_available():
        print("check_tensorrt: torch sees no CUDA GPU")
        return 2
    print(f"TensorRT {tensorrt.__version__}, torch {torch.__version__}, GPU {torch.cuda.get_device_name()}")
    with tempfile.TemporaryDirectory(prefix="edgekit-trt-") as tmp:
        return _check(args, Path(args.workdir or tmp))


def _check(args: argparse.Namespace, work: Path) -> int:
    import onnxruntime as ort

    from device_agents.runtimes import load_model
    from device_agents.runtimes.options import TensorRtOptions
    from edgekit import package
    from edgekit.bundle import TrustStore, extract, generate_keypair, read_verified_manifest
    from edgekit.validate.latency import p50_side_by_side

    work.mkdir(parents=True, exist_ok=True)
    key, pub = generate_keypair(work / "keys", "hil-gpu")
    trust = TrustStore.from_files([pub])
    with np.load(args.eval) as data:
        eval_arrays = {k: data[k] for k in data.files}
    name = next(iter(eval_arrays))
    x = eval_arrays[name]
    session = ort.InferenceSession(str(args.model), providers=["CPUExecutionProvider"])
    out_name = session.get_outputs()[0].name
    reference = session.run([out_name], {name: x})[0]
    options = TensorRtOptions(cache_dir=work / "engines", workspace_mb=1024)
    served, failed = {}, []
    try:
        for precision in ("fp32", "fp16", "int8"):
            result = package(
                args.model,
                targets=["jetson"],
                precision=precision,
                calib=args.calib,
                eval=args.eval,
                key=key,
                name=f"check-{precision}",
                out_dir=work / "bundles",
                allow_failed=True,
            )
            bundle = result.bundles["jetson"]
            verified = read_verified_manifest(bundle, trust)
            dest = work / f"extracted-{precision}"
            shutil.rmtree(dest, ignore_errors=True)  # a reused --workdir
            model_dir = extract(bundle, verified, dest)
            first = load_model(model_dir, verified.manifest, options)
            built = first.runner.describe()
            first.close()
            model = load_model(model_dir, verified.manifest, options)
            described = model.runner.describe()
            served[precision] = model
            runner: Any = model.runner  # the TensorRtRunner, which reports TensorRT's own layer information
            layers = runner.layer_information() or {}
            (work / f"layers-{precision}.json").write_text(json.dumps(layers, indent=1))
            got = np.concatenate([model.infer({name: x[i : i + 1]})[out_name] for i in range(len(x))])
            agreement = float(np.mean(got.argmax(1) == reference.argmax(1)))
            cosine = float(np.mean(_cosine_rows(got, reference)))
            ok = agreement >= MIN_AGREEMENT[precision] and described["engine_cache"] == "hit"
            verdict = "ok" if ok else "FAILED"
            print(
                f"{precision}: first load {built['engine_cache']}, second load {described['engine_cache']}; flags "
                f"{described['builder_flags']}, {described['layers']} layers; top-1 agreement with ORT FP32 "
                f"{agreement:.4f} (gate {MIN_AGREEMENT[precision]}), cosine {cosine:.5f} [{verdict}]; host "
                f"validation: {verified.manifest.validation.measured_on}"
            )
            if not ok:
                failed.append(precision)
        one = {name: x[:1]}
        fns: dict[str, Callable[[], object]] = {p: _bound(m.infer, one) for p, m in served.items()}
        fns["onnxruntime fp32 (cpu)"] = _bound(lambda feed: session.run([out_name], feed), one)
        p50 = p50_side_by_side(fns, repeats=args.repeats, budget_s=30.0)
        for label, ms in p50.items():
            print(f"p50 latency, batch 1: {label:24s} {ms:8.3f} ms  ({p50['fp32'] / ms:5.2f}x vs TensorRT fp32)")
    finally:
        for model in served.values():
            model.close()
    if failed:
        print(f"check_tensorrt: FAILED for {', '.join(failed)}")
        return 1
    print("check_tensorrt: ok")
    return 0


def _bound(fn: Callable[[dict[str, np.ndarray]], object], feed: dict[str, np.ndarray]) -> Callable[[], object]:
    return lambda: fn(feed)


def _cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.reshape(len(a), -1).astype(np.float64), b.reshape(len(b), -1).astype(np.float64)
    return (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-12)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
