"""Split inference: the planner on the embedded digits example, the example colour detector,
PP-OCRv4's pretrained text detector (a conv detector the tests did not build) and a synthetic
network with an early strong bottleneck, at 1-1000 Mbit/s.

For each model: ``edgekit split plan`` (host times measured here with ONNX Runtime, interleaved;
the server assumed 10x faster than this host; RTT 20 ms), its table and its latency-vs-bandwidth
PNG; then every head and tail timed AGAIN in a second independent interleaved run (both runs: CPU
time of one-thread sessions, ``--timing cpu``, the planner's default):

- prediction error: per segment, |planned - re-measured| / re-measured, median over segments;
- regret: per bandwidth, the planned choice's end-to-end latency under the re-measured times
  against the best option's under them (0% = the plan chose the best);
- split gain: per bandwidth, with the device slowed by a factor MEASURED here (the model's full
  run in a one-thread session, its wall-clock time under a cgroup CPU quota of a tenth of one
  core against its CPU time, interleaved; where no cgroup v1 ``cpu`` controller is writable,
  ``DEVICE_SLOWDOWN`` is assumed and the note says so), the best option against the better of
  all-local and all-remote;
- shape: why the model allows a >= 2x gain over both or not. Against all-remote a cut saves at
  most the input's bytes over the cut's (``bytes ratio`` = cut / input); against all-local at
  most the device's compute after the cut (``head share`` = head / full). Only a cut with both
  well under one half can be 2x faster than both at one bandwidth; the row names the cut with
  the smallest larger of the two, and the best gain over 0.5-2000 Mbit/s.

Network time is computed from the bytes (the shaped-link test in tests/split/test_netns.py runs a
real one); compute times are measured. Inputs are sent as float32, as the agent sends them (a
device sending a JPEG instead would make all-remote cheaper). Run alone:
``python -m bench.split [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/split.py`: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.registry import BenchContext, Measurement

BANDWIDTHS_MBPS = (1.0, 10.0, 100.0, 1000.0)
RTT_MS = 20.0
SERVER_SPEEDUP = 10.0
DEVICE_SLOWDOWN = 5.0  # assumed only where the cgroup quota cannot be set
DEVICE_CPU_SHARE = 0.1  # the slower device: this host's process under a tenth of one core
RESULTS = Path(__file__).resolve().parent / "results"
CGROUP_CPU = Path("/sys/fs/cgroup/cpu")


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
    models.append(
        (
            "bottleneck-stem-256",
            bottleneck_convnet(work / "bottleneck.onnx"),
            {},
            "synthetic: an 8x8/8 stem to 4 channels (1/48 of the input's bytes), then eight 192-channel 3x3 convs "
            "(random weights: latency does not depend on them)",
        )
    )
    return models


def bottleneck_convnet(path: Path, *, size: int = 256, width: int = 192, depth: int = 8, seed: int = 0) -> Path:
    """A network with an early strong bottleneck: Conv(3->4, k8 s8) Relu to 4 x size/8 x size/8,
    ``depth`` ``width``-channel 3x3 convs at that size (nearly all the compute), then GAP,
    Gemm(width->10), Softmax."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)

    def init(name: str, shape: tuple[int, ...], scale: float) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    nodes = [
        helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], kernel_shape=[8, 8], strides=[8, 8], name="stem"),
        helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
    ]
    inits = [init("w0", (4, 3, 8, 8), 0.1), init("b0", (4,), 0.01)]
    prev, channels = "r0", 4
    for k in range(1, depth + 1):
        nodes.append(helper.make_node("Conv", [prev, f"w{k}", f"b{k}"], [f"c{k}"], pads=[1, 1, 1, 1], name=f"conv{k}"))
        nodes.append(helper.make_node("Relu", [f"c{k}"], [f"r{k}"], name=f"relu{k}"))
        inits += [init(f"w{k}", (width, channels, 3, 3), (2.0 / (channels * 9)) ** 0.5), init(f"b{k}", (width,), 0.01)]
        prev, channels = f"r{k}", width
    nodes += [
        helper.make_node("GlobalAveragePool", [prev], ["gap"], name="gap"),
        helper.make_node("Flatten", ["gap"], ["flat"], axis=1, name="flatten"),
        helper.make_node("Gemm", ["flat", "wf", "bf"], ["logits"], transB=1, name="fc"),
        helper.make_node("Softmax", ["logits"], ["probs"], axis=1, name="softmax"),
    ]
    inits += [init("wf", (10, width), 0.1), init("bf", (10,), 0.01)]
    graph = helper.make_graph(
        nodes,
        "bottleneck_convnet",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, size, size])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [1, 10])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


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
    from edgekit.split.plan import make_plan
    from edgekit.split.planner import plan_model, sample_feeds
    from edgekit.split.plot import plot
    from edgekit.validate.ort_runner import ort_open

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
    shares = []  # each segment's time as a share of its own run's full model: the load's level cancels
    for first, second in zip(run.measured.cuts, again.cuts, strict=True):
        for planned_ms, actual_ms in ((first.head_ms, second.head_ms), (first.tail_ms, second.tail_ms)):
            errors.append(abs(planned_ms - actual_ms) / actual_ms)
            planned_share, actual_share = planned_ms / run.measured.full_ms, actual_ms / again.full_ms
            shares.append(abs(planned_share - actual_share) / actual_share)
    remeasured = make_plan(
        replace(again, input_bytes_per_sample=run.measured.input_bytes_per_sample),
        BANDWIDTHS_MBPS,
        RTT_MS,
        server_speedup=SERVER_SPEEDUP,
    )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    rows = [
        Measurement(
            name, f"{label}: segment latency", "median |planned - re-measured| / re-measured", "%",
            "planned", "re-measured", 0.0, 100.0 * statistics.median(errors),
            note=f"{len(errors)} segments (full, heads, tails), two independent interleaved runs of "
            f"{run.measured.calls_per_function} and {again.calls_per_function} rounds on this host "
            f"(CPU time of one-thread sessions; load average {load:.1f} on {os.cpu_count()} CPUs); the full "
            f"model {run.measured.full_ms:.2f} ms planned, {again.full_ms:.2f} ms re-measured",
        ),
        Measurement(
            name, f"{label}: segment share of the full model", "median |planned - re-measured| / re-measured", "%",
            "planned", "re-measured", 0.0, 100.0 * statistics.median(shares) if shares else None,
            note="each head's and tail's time over its own run's full model: what is left when the host's load "
            "level moves between the runs" if shares else "no cut",
        ),
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
    full = ort_open(work / "model.onnx")(1)  # one thread, as the segments were timed
    factor, how = measured_slowdown(lambda: full(feeds[0]))
    ctx.progress(f"{name}: {label}: the slower device runs it {factor:.2f}x slower ({how})")
    png_slow = out / f"split-{label}-slower-device.png"
    rows += _slow_device_rows(name, label, run, factor, how, again, png=png_slow)
    ctx.progress(f"{name}: wrote {png_slow}")
    return rows


def _slow_device_rows(
    name: str, label: str, run: Any, factor: float, how: str, again: Any = None, png: Path | None = None
) -> list[Measurement]:
    """The best option against local/remote on the device ``factor`` times slower; with ``again``
    (the re-measured times), the planned choice's regret there too; ``png``: its curves."""
    import numpy as np

    from edgekit.split.plan import LOCAL, REMOTE, make_plan
    from edgekit.split.profile import Profile, SegmentTimes

    def slow_plan(m: Any) -> Any:
        slower = Profile(
            f"this host's times x{factor:.2f} (a slower device: {how})",
            m.full_ms * factor,
            {c.cut.id: SegmentTimes(c.cut.tensors, c.head_ms * factor, None) for c in m.cuts},
        )
        return make_plan(m, BANDWIDTHS_MBPS, RTT_MS, device=slower, server_speedup=SERVER_SPEEDUP)

    m = run.measured
    slow = slow_plan(m)
    if png is not None:
        from edgekit.split.plot import plot

        plot(slow, png, title=f"{label}, device x{factor:.1f} slower (RTT {RTT_MS:g} ms)")
    checked = slow_plan(replace(again, input_bytes_per_sample=m.input_bytes_per_sample)) if again is not None else None
    rows = []
    for c in slow.choices:
        other = min(c.local_ms, c.remote_ms)
        regret = ""
        if checked is not None:
            actual = next(a for a in checked.choices if a.bandwidth_mbps == c.bandwidth_mbps)
            chosen_ms = checked.option(c.best).latency_ms(c.bandwidth_mbps, RTT_MS)
            regret = f"; re-measured best {actual.best}, regret {100 * (chosen_ms / actual.best_ms - 1):.1f}%"
        rows.append(
            Measurement(
                name, f"{label} at {c.bandwidth_mbps:g} Mbit/s, device x{factor:.2f} slower: best vs l/r",
                "end-to-end ms per sample", "ms", LOCAL if c.local_ms <= c.remote_ms else REMOTE,
                f"best ({c.best})", other, c.best_ms,
                note=f"best cut {c.best_cut or '-'} at {c.best_cut_ms or 0:.2f} ms; gain {other / c.best_ms:.2f}x"
                + regret,
            )
        )  # fmt: skip
    # the shape: what any cut could save against remote (bytes) and against local (compute)
    grid = np.geomspace(0.5, 2000.0, 80)
    local, remote = slow.option(LOCAL), slow.option(REMOTE)
    gain, at_mbps = 1.0, float(grid[0])
    for bw in grid:
        best_cut = min((o.latency_ms(bw, RTT_MS) for o in slow.cuts), default=float("inf"))
        g = min(local.latency_ms(bw, RTT_MS), remote.latency_ms(bw, RTT_MS)) / best_cut
        if g > gain:
            gain, at_mbps = g, float(bw)
    if not m.cuts:
        rows.append(
            Measurement(
                name, f"{label}: shape", "cut bytes / input bytes; head share of compute", "%",
                "bytes ratio", "head share", None, None,
                note="no cut where one tensor crosses (every layer feeds a later one past it): nothing to split",
            )
        )  # fmt: skip
        return rows
    ratios = {c.cut.id: (c.bytes_per_sample / m.input_bytes_per_sample, c.head_ms / m.full_ms) for c in m.cuts}
    cut_id = min(ratios, key=lambda k: max(ratios[k]))
    r, h = ratios[cut_id]
    verdict = (
        f"allows >= 2x: the best cut is {gain:.2f}x faster than both at {at_mbps:.3g} Mbit/s"
        if gain >= 2.0
        else f"does not allow 2x: at best {gain:.2f}x (at {at_mbps:.3g} Mbit/s)"
    )
    others = "; ".join(f"{k} {100 * a:.0f}% / {100 * b:.0f}%" for k, (a, b) in ratios.items() if k != cut_id)
    rows.append(
        Measurement(
            name, f"{label}: shape ({cut_id})", "cut bytes / input bytes; head share of compute", "%",
            "bytes ratio", "head share", 100.0 * r, 100.0 * h,
            note=f"{verdict} over 0.5-2000 Mbit/s, device x{factor:.2f} slower, server {SERVER_SPEEDUP:g}x faster; "
            f"a 2x gain over both needs a cut well under 50% on both"
            + (f"; other cuts (bytes / head): {others}" if others else ""),
        )
    )  # fmt: skip
    return rows


def measured_slowdown(
    run_once: Callable[[], object], *, share: float = DEVICE_CPU_SHARE, rounds: int = 3, calls: int = 2
) -> tuple[float, str]:
    """How many times longer ``run_once`` (one thread) takes in this process under a cgroup v1 CPU
    quota of ``share`` of one core (wall-clock) than the CPU time it needs (``time.thread_time``,
    as the segments are timed), in and out of the quota in turn (the process moves between the
    groups); the median of the rounds' ratios. Without a writable ``cpu`` controller:
    ``DEVICE_SLOWDOWN``, said to be assumed."""
    if not (CGROUP_CPU / "cpu.cfs_quota_us").is_file() or not os.access(CGROUP_CPU, os.W_OK):
        return DEVICE_SLOWDOWN, f"ASSUMED {DEVICE_SLOWDOWN:g}x: no writable cgroup v1 cpu controller here"
    home = CGROUP_CPU / _own_cpu_group().lstrip("/")
    group = CGROUP_CPU / f"edgekit-bench-split-{os.getpid()}"
    group.mkdir(exist_ok=True)
    pid = str(os.getpid())
    try:
        # a 10 ms period (1 ms of CPU per period at a tenth): throttled finely; a call shorter than
        # the quota may still run unthrottled, as on a quota-limited device
        (group / "cpu.cfs_period_us").write_text("10000")
        (group / "cpu.cfs_quota_us").write_text(str(max(1000, int(10000 * share))))
        run_once()
        ratios = []
        for _ in range(rounds):
            free = _median_ms(run_once, calls, time.thread_time)
            (group / "cgroup.procs").write_text(pid)
            try:
                quota = _median_ms(run_once, calls, time.perf_counter)
            finally:
                (home / "cgroup.procs").write_text(pid)
            ratios.append(quota / free)
    finally:
        (home / "cgroup.procs").write_text(pid)
        group.rmdir()
    return statistics.median(ratios), (
        f"measured: the full model's wall-clock time in this process under a cgroup CPU quota of {share:g} of one "
        f"core against its CPU time, {rounds} interleaved rounds"
    )


def _own_cpu_group() -> str:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, where = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return where
    return "/"


def _median_ms(fn: Callable[[], object], calls: int, clock: Callable[[], float]) -> float:
    times = []
    for _ in range(calls):
        t0 = clock()
        fn()
        times.append((clock() - t0) * 1000.0)
    return statistics.median(times)


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
    parser.add_argument("--models", help="comma-separated labels to run (default: all)")
    args = parser.parse_args(argv)
    print(machine.one_line(machine.describe()))
    with tempfile.TemporaryDirectory() as tmp:
        key, pub = generate_keypair(Path(tmp), "bench")
        ctx = BenchContext(Path(tmp), key, pub, repeats=5 if args.quick else 20, budget_s=3.0 if args.quick else 15.0)
        if args.models:
            wanted = {m.strip() for m in args.models.split(",")}
            rows = []
            for label, path, shapes, note in _models(ctx.workdir):
                if label in wanted:
                    ctx.progress(f"split.plan: planning {label} ({note})")
                    rows += _one(ctx, "split.plan", label, path, shapes, args.out)
        else:
            rows = run(ctx, name="split.plan", out=args.out)
    print(report.format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
