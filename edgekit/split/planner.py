"""``edgekit split plan``: cut points -> head/tail files -> measurements -> the plan, its table,
its PNG and its JSON, written under one output directory::

    OUT/heads/<cut>.onnx  OUT/tails/<cut>.onnx  OUT/plan.json  OUT/plan.txt  OUT/latency.png
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.errors import CalibrationDataError, ConfigError
from edgekit.split import compression, graph
from edgekit.split.measure import Feed, Measurements, measure
from edgekit.split.plan import Plan, make_plan, table, useful_cuts, why_no_cut
from edgekit.split.profile import Profile, SegmentTimes, this_machine
from edgekit.split.profile import read as read_profile
from edgekit.split.profile import write as write_profile

TARGETS = ("cpu",)


@dataclass(frozen=True)
class PlanRun:
    measured: Measurements
    plan: Plan
    out_dir: Path
    table: str
    sample_source: str


def plan_model(
    model_path: Path,
    out_dir: Path,
    bandwidths_mbps: Sequence[float],
    *,
    target: str = "cpu",
    rtt_ms: float = 20.0,
    input_shapes: Mapping[str, tuple[int, ...]] | None = None,
    calib: Path | None = None,
    samples: int = 8,
    device_profile: Path | None = None,
    server_profile: Path | None = None,
    server_speedup: float = 10.0,
    compress: compression.Mode = "none",
    max_tensors: int = 1,
    budget_s: float = 20.0,
    save_profile: Path | None = None,
    plot: bool = True,
    all_cuts: bool = False,
    objective: str = "latency",
    device_power_w: float | None = None,
    radio_power_w: float | None = None,
    idle_power_w: float | None = None,
    timing: str = "cpu",
) -> PlanRun:
    if target not in TARGETS:
        raise ConfigError(
            f"--target {target!r}: split planning measures with ONNX Runtime and supports {', '.join(TARGETS)}; "
            "for other devices record a --device-profile on the device"
        )
    if max_tensors < 1:
        raise ConfigError(f"--max-tensors {max_tensors}: must be >= 1")
    model = graph.load_model(model_path, dict(input_shapes or {}))
    cuts = graph.enumerate_cuts(model, max_tensors=max_tensors)
    found = len(cuts)
    if not all_cuts:
        cuts = graph.undominated(model, cuts)
    out_dir.mkdir(parents=True, exist_ok=True)
    full_path = graph.save(model, out_dir / "model.onnx")
    files = []
    for cut in cuts:
        head, tail = graph.extract(model, cut)
        files.append(
            (
                cut,
                graph.save(head, out_dir / "heads" / f"{cut.id}.onnx"),
                graph.save(tail, out_dir / "tails" / f"{cut.id}.onnx"),
            )
        )
    feeds, source = sample_feeds(model, calib, samples)
    measured = measure(full_path, files, feeds, budget_s=budget_s, compress=True, timing=timing)
    device = read_profile(device_profile) if device_profile else None
    server = read_profile(server_profile) if server_profile else None
    plan = make_plan(
        measured,
        bandwidths_mbps,
        rtt_ms,
        device=device,
        server=server,
        server_speedup=server_speedup,
        compress=compress,
        objective=objective,
        device_power_w=device_power_w,
        radio_power_w=radio_power_w,
        idle_power_w=idle_power_w,
    )
    kept = "" if all_cuts else f" ({len(cuts)} send fewer bytes than the input and every earlier cut)"
    text = f"# {model_path.name}: {found} cut(s) where <= {max_tensors} tensor(s) cross{kept}; samples: {source}\n"
    text += table(plan, measured)
    if not useful_cuts(plan):
        text += "\n# " + why_no_cut(plan)
    (out_dir / "plan.txt").write_text(text + "\n")
    (out_dir / "plan.json").write_text(json.dumps(plan_json(model_path, plan, measured, source), indent=2) + "\n")
    if save_profile is not None:
        write_profile(save_profile, host_profile(measured))
    if plot:
        from edgekit.split.plot import plot as draw

        draw(plan, out_dir / "latency.png", title=f"{model_path.name}: latency against bandwidth")
    return PlanRun(measured, plan, out_dir, text, source)


def host_profile(measured: Measurements) -> Profile:
    import onnxruntime as ort

    return Profile(
        source="measured here",
        full_ms=measured.full_ms,
        cuts={m.cut.id: SegmentTimes(m.cut.tensors, m.head_ms, m.tail_ms) for m in measured.cuts},
        machine=this_machine(),
        runtime=f"onnxruntime {ort.__version__}",
    )


def sample_feeds(model: Any, calib: Path | None, samples: int) -> tuple[list[Feed], str]:
    """One batch-1 feed per sample: the first ``samples`` rows of ``calib``, else seeded
    standard-normal inputs of the model's (fixed) shapes."""
    from onnx import helper

    inputs = {i.name: i for i in model.graph.input if i.name in graph.graph_inputs(model)}
    if calib is not None:
        from edgekit.validate.calib import load_arrays

        arrays = load_arrays(calib)
        missing = sorted(set(inputs) - set(arrays))
        if missing:
            raise CalibrationDataError(f"{calib} has no array for input(s) {missing} (it has {sorted(arrays)})")
        n = min(samples, min(len(arrays[name]) for name in inputs))
        feeds = [{name: np.ascontiguousarray(arrays[name][k : k + 1]) for name in inputs} for k in range(n)]
        return feeds, f"{n} rows of {calib.name}"
    rng = np.random.default_rng(0)
    feeds = []
    for _ in range(samples):
        feed = {}
        for name, vi in inputs.items():
            dims = list(vi.type.tensor_type.shape.dim)
            shape = [d.dim_value if d.HasField("dim_value") else (1 if k == 0 else 0) for k, d in enumerate(dims)]
            if any(s < 1 for s in shape):
                raise ConfigError(
                    f"input {name!r} has dynamic dimensions besides the batch: give --input-shape {name}=1x..."
                )
            dtype = helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
            feed[name] = rng.standard_normal(shape).astype(dtype)
        feeds.append(feed)
    return feeds, f"{samples} seeded standard-normal inputs (no --calib: compression accuracy is on synthetic data)"


def plan_json(model_path: Path, plan: Plan, measured: Measurements, source: str) -> dict[str, Any]:
    return {
        "model": model_path.name,
        "samples": source,
        "compress": plan.compress,
        "objective": plan.objective,
        "power_w": asdict(plan.power) if plan.power is not None else None,
        "compression_codec": compression.CODEC,
        "assumptions": list(plan.assumptions),
        "options": [asdict(o) for o in plan.options],
        "choices": [asdict(c) for c in plan.choices],
        "useful_cuts": useful_cuts(plan),
        "no_cut_because": None if useful_cuts(plan) else why_no_cut(plan),
        "cuts": [
            {
                "id": m.cut.id,
                "tensors": list(m.cut.tensors),
                "head_file": f"heads/{m.cut.id}.onnx",
                "tail_file": f"tails/{m.cut.id}.onnx",
                "bytes_per_sample": m.bytes_per_sample,
                "compose_max_abs_error": m.max_abs_error,
                "host_head_ms": m.head_ms,
                "host_tail_ms": m.tail_ms,
                "compression": [asdict(c) for c in m.compression],
            }
            for m in measured.cuts
        ],
        "host_full_ms": measured.full_ms,
        "input_bytes_per_sample": measured.input_bytes_per_sample,
        "output_bytes_per_sample": measured.output_bytes_per_sample,
    }
