"""The edgekit demo: package the embedded digits model for every target, then serve it.

    python -m examples.demo            (or: python examples/demo.py)

1. makes a signing key in a scratch folder (``.edgekit-demo/``, git-ignored, wiped at start);
2. packages ``examples/digits/model.onnx`` for all five targets in one ``edgekit.package`` call
   (int8, except ``apple``: 4-bit palettized weights there, its smallest artifact),
   calibrated on ``calib.npz`` and validated on the held-out split with its labels;
3. prints the validation table (size, top-1 and host p50 latency, each against FP32);
4. starts the real agent (``edgekit-agent run``) on a free loopback port, installs the ``cpu``
   bundle into it (``edgekit-agent install``), sends a few held-out images with
   ``tritonclient.http`` and prints predicted vs true digits, then stops the agent.

Nothing is downloaded. Exit code 0 when every step worked, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from edgekit.errors import EdgekitError

REPO = Path(__file__).resolve().parents[1]
DEFAULT_WORKDIR = REPO / ".edgekit-demo"
MARKER = ".edgekit-demo-scratch"  # only a folder holding this file is ever wiped
MODEL_NAME = "digits"
# apple: of its compressions, 4-bit palettization made the digits model smallest (0.13x fp32; int8 W8A8
# and int8-weights about 0.26x) with top-1 unchanged on the held-out digits.
DEFAULT_PRECISIONS = {"*": "int8", "apple": "palettize4"}


class DemoError(EdgekitError):
    """A demo step failed; the message says which and what to do."""


def importable_targets() -> tuple[list[str], list[str]]:
    """Targets whose module imports; and why the others are left out.

    Precisions are not filtered here: a target that cannot build the one asked for fails in
    ``edgekit.package`` with the precisions it builds, rather than being dropped quietly.
    """
    from edgekit.targets import TARGETS

    chosen, skipped = [], []
    for name, spec in TARGETS.items():
        module, _cls = spec.split(":")
        try:
            importlib.import_module(module)
        except ImportError as exc:
            skipped.append(f"{name}: not available in this checkout ({exc})")
            continue
        chosen.append(name)
    return chosen, skipped


def scratch_dir(path: Path) -> Path:
    """A fresh scratch folder; refuses to wipe a folder the demo did not make."""
    if path.exists():
        if not (path / MARKER).is_file() and any(path.iterdir()):
            raise DemoError(f"{path} exists and was not made by the demo; pass another --workdir")
        shutil.rmtree(path)
    path.mkdir(parents=True)
    (path / MARKER).write_text("scratch folder of `python -m examples.demo`; removed on the next run\n")
    return path


def step(n: int, total: int, text: str) -> None:
    print(f"\n[{n}/{total}] {text}", flush=True)


def query_agent(host_port: str, images: np.ndarray, labels: np.ndarray) -> int:
    """Send each image in its own v2 request; print predicted vs true; return how many were right."""
    import tritonclient.http as httpclient

    from examples.digits import INPUT_NAME, OUTPUT_NAME

    client = httpclient.InferenceServerClient(url=host_port)
    right = 0
    try:
        for i, (image, label) in enumerate(zip(images, labels, strict=True)):
            batch = image[None]
            inp = httpclient.InferInput(INPUT_NAME, list(batch.shape), "FP32")
            inp.set_data_from_numpy(batch, binary_data=True)
            t0 = time.perf_counter()
            result = client.infer(MODEL_NAME, [inp], outputs=[httpclient.InferRequestedOutput(OUTPUT_NAME)])
            ms = (time.perf_counter() - t0) * 1000
            logits = result.as_numpy(OUTPUT_NAME)
            if logits is None:
                raise DemoError(f"the agent's answer has no {OUTPUT_NAME!r} output")
            predicted = int(np.argmax(logits[0]))
            right += predicted == int(label)
            mark = "ok" if predicted == int(label) else "WRONG"
            print(f"    image {i}: predicted {predicted}, true {int(label)}  {mark:5s}  ({ms:.1f} ms round trip)")
    finally:
        client.close()
    return right


def run(targets: Sequence[str] | None, precision: str | Mapping[str, str] | None, workdir: Path, samples: int) -> int:
    """The demo's four steps; ``precision`` None: ``DEFAULT_PRECISIONS`` for the targets packaged."""
    import edgekit
    from edgekit.bundle import generate_keypair
    from edgekit.packaging.result import PackageValidationError
    from edgekit.targets.precisions import resolve_precisions
    from examples.agent_process import RunningAgent
    from examples.digits import INPUT_NAME, load

    started = time.perf_counter()
    total = 4
    step(1, total, "example and signing key")
    example = load()
    print(
        f"    model {example.model.relative_to(REPO)} ({example.model.stat().st_size / 1024:.0f} KB), "
        f"{len(example.eval_labels)} held-out digits with labels"
    )
    work = scratch_dir(workdir)
    key, pub = generate_keypair(work / "keys", "demo")
    print(f"    signing key {key} (public: {pub.name})")

    if targets is None:
        targets, skipped = importable_targets()
        for line in skipped:
            print(f"    skipping {line}")
    if not targets:
        raise DemoError("no target to package for; pass --targets")
    if precision is None:
        precision = {t: p for t, p in DEFAULT_PRECISIONS.items() if t == "*" or t in targets}
    per_target = resolve_precisions(precision, list(targets))
    chosen = ", ".join(f"{t} {p}" for t, p in per_target.items())
    step(2, total, f"packaging {MODEL_NAME} for {chosen} (one edgekit.package call)")
    try:
        result = edgekit.package(
            example.model,
            targets=list(targets),
            precision=precision,
            calib=example.calib,
            eval={INPUT_NAME: example.eval_inputs},
            labels=example.eval_labels,
            key=key,
            name=MODEL_NAME,
            version=1,
            out_dir=work / "bundles",
            progress=lambda msg: print(f"    {msg}", flush=True),
        )
        failure = ""
    except PackageValidationError as exc:  # other targets' bundles were written: show them all
        result, failure = exc.result, str(exc)

    step(3, total, "validation table (against the FP32 source model on the held-out digits)")
    print("\n".join(f"    {line}" for line in result.table().splitlines()))
    if failure:
        print(f"\n    {failure}")
    if "cpu" not in result.bundles:
        raise DemoError("no cpu bundle was written, so the agent has nothing to serve (include cpu in --targets)")

    step(4, total, "serving the cpu bundle with edgekit-agent, queried with tritonclient.http")
    with RunningAgent(work / "agent", [pub]) as agent:
        print(f"    agent listening on {agent.url} (config {agent.config})")
        print(f"    {agent.install(result.bundles['cpu'])}")
        agent.wait_model_ready(MODEL_NAME)
        pick = np.random.default_rng(0).choice(len(example.eval_labels), size=samples, replace=False)
        right = query_agent(agent.host_port, example.eval_inputs[pick], example.eval_labels[pick])
        print(f"    {right}/{samples} right")
    print("    agent stopped")
    print(f"\ndone in {time.perf_counter() - started:.0f} s; bundles in {work / 'bundles'}")
    return 0 if not failure else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Package the embedded digits model for every target and serve it.")
    parser.add_argument("--targets", help="comma-separated targets (default: every target this checkout has)")
    parser.add_argument(
        "--precision",
        metavar="P[,TARGET=P...]",
        help="a default precision, then per-target ones (default: int8,apple=palettize4)",
    )
    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help="scratch folder (wiped at start)")
    parser.add_argument("--samples", type=int, default=8, help="held-out images to send to the agent")
    args = parser.parse_args(argv)
    if not 1 <= args.samples <= 100:
        parser.error("--samples must be between 1 and 100")
    try:
        from edgekit.targets import parse_targets
        from edgekit.targets.precisions import parse_precision_arg

        targets = parse_targets(args.targets) if args.targets else None
        precision = parse_precision_arg(args.precision) if args.precision else None
        return run(targets, precision, args.workdir.resolve(), args.samples)
    except EdgekitError as exc:
        print(f"\ndemo: error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
