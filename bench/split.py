"""Split inference: the planner on the embedded digits example, the example colour detector and
PP-OCRv4's pretrained text detector (a conv detector the tests did not build), at 1-1000 Mbit/s.

For each model: ``edgekit split plan`` (host times measured here with ONNX Runtime, interleaved;
the server assumed 10x faster than this host; RTT 20 ms), its table and its latency-vs-bandwidth
PNG; then every head and tail timed AGAIN in a second independent side-by-side run:

- prediction error: per segment, |planned - re-measured| / re-measured, median over segments;
- regret: per bandwidth, the planned choice's end-to-end latency under the re-measured times
  against the best option's under them (0% = the plan chose the best);
- split gain: per bandwidth, with the device slowed ``DEVICE_SLOWDOWN`` times (the device a
  cgroup quota makes of this host), the best option against the better of all-local and
  all-remote (>= 2x only where the model's shape allows it: a cut much smaller than the input,
  after a cheap head, before most of the compute).

Network time is computed from the bytes (the shaped-link test in tests/split/test_netns.py runs a
real one); compute times are measured. Run alone: ``python -m bench.split [--quick]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

if __package__ in (None, ""):  # `python bench/split.py`: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.registry import BenchContext, Measurement

BANDWIDTHS_MBPS = (1.0, 10.0, 100.0, 1000.0)
RTT_MS = 20.0
SERVER_SPEEDUP = 10.0
DEVICE_SLOWDOWN = 5.0
RESULTS = Path(__file__).resolve().parent / "results"


def _models(work: Path) -> list[tuple[str, Path, dict[str, tuple[int, ...]], str]]:
    """(label, ONNX path, input shapes, note) of each model here."""
    from examples.detector import colour_detector
    from examples.digits import load

    models: list[tuple[str, Path, dict[str, tuple[int, ...]], str]] = [
        ("digits", load().model, {}, "the embedded digits example (a small CNN classifier)"),
        (
            "colour-detector-320",
            colour_detector(work / "detector.onnx", size=320, backbone=4, width=32),
            {},
            "the example colour detector at 320x320 with a 4-conv backbone",
        ),
    ]
    det = Path(sys.prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    det = det / "rapidocr_onnxruntime" / "models" / "ch_PP-OCRv4_det_infer.onnx"
    if det.is_file():
        models.append(("ppocrv4-det-320", det, {"x": (1, 3, 320, 320)}, "PP-OCRv4 text detector (pretrained)"))
    return models


def run(ctx: BenchContext, *, name: str, out: Path = RESULTS) -> list[Measurement]:
    rows: list[Measurement] = []
    for label, path, shapes, note in _models(ctx.workdir):
        ctx.progress(f"{name}: planning {label} ({note})")
        rows += _one(ctx, name, label, path, shapes, out)
    return rows


def _one(
    ctx: BenchContext, name: str, label: str, path: Path, shapes: dict[str, tuple[int, ...]], out: Path
) -> list[Measurement]:
    from edgekit.split.measure import measure
    from edgekit.split.plan import LOCAL, REMOTE, make_plan
    from edgekit.split.planner import plan_model, sample_feeds
    from edgekit.split.plot import plot
    from edgekit.split.profile import Profile, SegmentTimes

    work = ctx.workdir / f"split-{label}"
    run = plan_model(
        path,
        work,
        BANDWIDTHS_MBPS,
        rtt_ms=RTT_MS,
        input_shapes=shapes,
        samples=4,
        server_speedup=SERVER_SPEEDUP,
        budget_s=ctx.budget_s,
        plot=False,
    )
    png = plot(run.plan, out / f"split-{label}.png", title=f"{label}: latency against bandwidth (RTT {RTT_MS:g} ms)")
    ctx.progress(run.table)
    ctx.progress(f"{name}: wrote {png}")
    # the same heads and tails timed again, independently
    feeds, _ = sample_feeds(_model(path, shapes), None, 1)
    again = measure(
        work / "model.onnx",
        [(m.cut, m.head_path, m.tail_path) for m in run.measured.cuts],
        feeds,
        budget_s=ctx.budget_s,
        compress=False,
    )
    errors = [abs(run.measured.full_ms - again.full_ms) / again.full_ms]
    for first, second in zip(run.measured.cuts, again.cuts, strict=True):
        errors += [
            abs(first.head_ms - second.head_ms) / second.head_ms,
            abs(first.tail_ms - second.tail_ms) / second.tail_ms,
        ]
    remeasured = make_plan(
        replace(again, input_bytes_per_sample=run.measured.input_bytes_per_sample),
        BANDWIDTHS_MBPS,
        RTT_MS,
        server_speedup=SERVER_SPEEDUP,
    )
    rows = [
        Measurement(
            name, f"{label}: segment latency", "median |planned - re-measured| / re-measured", "%",
            "planned", "re-measured", 0.0, 100.0 * statistics.median(errors),
            note=f"{len(errors)} segments (full, heads, tails), two independent side-by-side runs on this host",
        )
    ]  # fmt: skip
    for planned, actual in zip(run.plan.choices, remeasured.choices, strict=True):
        chosen_ms = remeasured.option(planned.best).latency_ms(planned.bandwidth_mbps, RTT_MS)
        rows.append(
            Measurement(
                name, f"{label} at {planned.bandwidth_mbps:g} Mbit/s: planned choice vs best",
                "end-to-end ms per sample, re-measured times", "ms",
                f"best ({actual.best})", f"planned ({planned.best})", actual.best_ms, chosen_ms,
                note=f"regret {100.0 * (chosen_ms / actual.best_ms - 1):.1f}%; network time computed from the bytes",
            )
        )  # fmt: skip
    slower = Profile(
        f"this host's times x{DEVICE_SLOWDOWN:g} (a slower device)",
        run.measured.full_ms * DEVICE_SLOWDOWN,
        {m.cut.id: SegmentTimes(m.cut.tensors, m.head_ms * DEVICE_SLOWDOWN, None) for m in run.measured.cuts},
    )
    slow = make_plan(run.measured, BANDWIDTHS_MBPS, RTT_MS, device=slower, server_speedup=SERVER_SPEEDUP)
    for c in slow.choices:
        other = min(c.local_ms, c.remote_ms)
        rows.append(
            Measurement(
                name, f"{label} at {c.bandwidth_mbps:g} Mbit/s, device x{DEVICE_SLOWDOWN:g} slower: best vs l/r",
                "end-to-end ms per sample", "ms", LOCAL if c.local_ms <= c.remote_ms else REMOTE,
                f"best ({c.best})", other, c.best_ms,
                note=f"best cut {c.best_cut or '-'} at {c.best_cut_ms or 0:.2f} ms; gain {other / c.best_ms:.2f}x",
            )
        )  # fmt: skip
    return rows


def _model(path: Path, shapes: dict[str, tuple[int, ...]]) -> object:
    from edgekit.split.graph import load_model

    return load_model(path, shapes)


def main(argv: list[str] | None = None) -> int:
    import tempfile

    from bench import machine, report
    from edgekit.bundle.signing import generate_keypair

    parser = argparse.ArgumentParser(prog="python -m bench.split", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="less timing (noisier)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the PNGs go")
    args = parser.parse_args(argv)
    print(machine.one_line(machine.describe()))
    with tempfile.TemporaryDirectory() as tmp:
        key, pub = generate_keypair(Path(tmp), "bench")
        ctx = BenchContext(Path(tmp), key, pub, repeats=5 if args.quick else 20, budget_s=3.0 if args.quick else 15.0)
        rows = run(ctx, name="split.plan", out=args.out)
    print(report.format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
