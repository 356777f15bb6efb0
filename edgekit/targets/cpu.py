"""``cpu`` target: an ONNX model for ONNX Runtime on any x86_64 / arm64 CPU.

INT8 is ORT static quantization calibrated on the calibration data. Which settings are fastest
depends on the CPU (FIELD_NOTES: on AVX-512 VNNI, signed int8 activations made conv nets slower
than FP32 while uint8 activations were faster), so the target builds a small bounded set of
configurations, validates each against FP32, measures them side by side with FP32, and keeps the
fastest one that passes (within 5 % counts as a tie, won by the more accurate). Calibration methods
other than MinMax are tried only when accuracy fails. The choice and every candidate tried are
recorded in ``Precision.method`` and ``Validation.notes``.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np

from edgekit.bundle.codec import to_data
from edgekit.bundle.manifest import Compatibility, Precision
from edgekit.compress.ort_quant import (
    StaticQuantConfig,
    quantize_static_int8,
    quantize_weights_int4,
    quantize_weights_int8,
)
from edgekit.errors import MissingSDKError
from edgekit.targets.base import BuildContext, BuildResult
from edgekit.validate.calib import fixed_batch, sample_count, take
from edgekit.validate.latency import call_with, p50_side_by_side
from edgekit.validate.metrics import Comparison, compare, output_kind, run_all
from edgekit.validate.ort_runner import ort_cpu_runner
from edgekit.validate.placement import ort_op_placement

ARTIFACT = "model.onnx"
SPEED_TIE = 0.05  # INT8 candidates within 5 % of the fastest p50 count as equally fast


@dataclass(frozen=True)
class CpuOptions:
    """Settings of the ``cpu`` target (``--option cpu.KEY=VALUE``). ``auto`` = let the search choose."""

    activations: Literal["auto", "uint8", "int8"] = "auto"
    per_channel: Literal["auto", "on", "off"] = "auto"
    quant_format: Literal["auto", "qdq", "qoperator"] = "auto"
    calibration: Literal["auto", "minmax", "percentile", "entropy"] = "auto"
    reduce_range: bool = False  # 7-bit weights, for x86 CPUs without VNNI
    percentile: float = 99.999  # for calibration=percentile (needs > 1e5 activation values to clip one outlier)
    max_candidates: int = 6  # bound on INT8 configurations built and validated
    max_calib_samples: int = 512  # calibration uses at most this many samples (the first ones)
    latency_repeats: int = 15  # interleaved rounds when timing INT8 candidates against FP32
    int4_block_size: int = 32  # MatMulNBits block size for int4-weights

    def __post_init__(self) -> None:
        for name in ("max_candidates", "max_calib_samples", "latency_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.percentile <= 100:
            raise ValueError(f"percentile must be in (0, 100], got {self.percentile}")
        if self.int4_block_size < 16 or self.int4_block_size & (self.int4_block_size - 1):
            raise ValueError(f"int4_block_size must be a power of two >= 16, got {self.int4_block_size}")


@dataclass(frozen=True)
class _Candidate:
    config: StaticQuantConfig
    path: Path
    comparison: Comparison
    p50_ms: float | None = None


class CpuTarget:
    name: ClassVar[str] = "cpu"
    runtime: ClassVar[str] = "onnxruntime"
    precisions: ClassVar[tuple[str, ...]] = ("fp32", "fp16", "int8", "int8-weights", "int4-weights")
    Options: ClassVar[type] = CpuOptions
    static_shapes: ClassVar[bool] = False

    def check_model(self, model_path: Path) -> None:
        """ONNX Runtime's CPU provider runs every standard ONNX op; nothing to refuse up front."""
        _onnxruntime()

    def build(self, ctx: BuildContext) -> BuildResult:
        ort = _onnxruntime()
        opts: CpuOptions = ctx.options
        out = ctx.out_dir / ARTIFACT
        notes: tuple[str, ...] = ()
        if ctx.precision == "fp32":
            shutil.copyfile(ctx.model_path, out)
            precision = Precision("fp32", "fp32", "onnx fp32, prepared (see notes)")
        elif ctx.precision == "fp16":
            _to_fp16(ctx.model_path, out)
            precision = Precision("fp16", "fp16", "onnxruntime float16 converter, float32 inputs/outputs kept")
        elif ctx.precision == "int8":
            chosen, notes = self._search_int8(ctx, opts)
            shutil.copyfile(chosen.path, out)
            precision = Precision("int8", chosen.config.activations, chosen.config.label)
        elif ctx.precision == "int8-weights":
            quantize_weights_int8(ctx.model_path, out)
            precision = Precision("int8", "uint8", "ort-dynamic MatMul/Gemm int8 weights, uint8 activations per call")
        elif ctx.precision == "int4-weights":
            quantize_weights_int4(ctx.model_path, out, block_size=opts.int4_block_size)
            precision = Precision(
                "int4", "fp32", f"ort MatMulNBits 4-bit symmetric, block {opts.int4_block_size} (MatMul/Gemm weights)"
            )
        else:  # the packager checks precisions first; this guards direct callers
            raise ValueError(f"cpu target cannot build precision {ctx.precision!r}")
        feed = take(ctx.calib, 0, fixed_batch(ctx.served) or 1)
        return BuildResult(
            files={ARTIFACT: "artifact"},
            compatibility=Compatibility(runtime="onnxruntime", runtime_version=ort.__version__),
            artifact_signature=ctx.served,
            mapping=(),
            precision=precision,
            runnable_here=True,
            op_placement=ort_op_placement(out, feed),
            notes=notes,
            target_options=to_data(opts),
        )

    # -- INT8 search ------------------------------------------------------------------------
    def _search_int8(self, ctx: BuildContext, opts: CpuOptions) -> tuple[_Candidate, tuple[str, ...]]:
        evaluate = ctx.evaluate or _calib_evaluator(ctx)
        calib = ctx.calib
        n = sample_count(calib)
        notes = []
        if n > opts.max_calib_samples:
            calib = take(calib, 0, opts.max_calib_samples)
            notes.append(f"calibrated on the first {opts.max_calib_samples} of {n} samples (cpu.max_calib_samples)")
        batch = fixed_batch(ctx.served) or min(16, sample_count(calib))
        configs = candidate_configs(opts)
        built: list[_Candidate] = []

        def attempt(config: StaticQuantConfig) -> None:
            path = ctx.work_dir / f"int8-{len(built)}.onnx"
            quantize_static_int8(ctx.model_path, path, calib, config, ctx.work_dir, batch)
            built.append(_Candidate(config, path, evaluate(ort_cpu_runner(path))))

        for i, config in enumerate(configs):
            ctx.progress(f"[cpu] int8 candidate {i + 1}/{len(configs)}: {config.label}")
            attempt(config)
        # Accuracy failed everywhere: try the other calibration methods on the most accurate layout.
        fallbacks = [] if opts.calibration != "auto" else ["percentile", "entropy"]
        while not any(c.comparison.passed for c in built) and fallbacks and len(built) < opts.max_candidates:
            best = max(built, key=lambda c: _accuracy_key(c.comparison))
            config = replace(best.config, calibration=fallbacks.pop(0))  # type: ignore[arg-type]  # a CalibrationName literal
            ctx.progress(f"[cpu] accuracy short of tolerance; trying {config.label}")
            attempt(config)
        passing = self._time(ctx, [c for c in built if c.comparison.passed], opts)
        timed = {c.path: c for c in passing}
        for c in built:
            c = timed.get(c.path, c)
            verdict = "passed" if c.comparison.passed else "failed: " + "; ".join(c.comparison.failures)
            speed = f", p50 {c.p50_ms:.3f} ms" if c.p50_ms is not None else ""
            notes.append(f"tried {c.config.label}: {c.comparison.summary()}{speed} ({verdict})")
        chosen = choose(passing or built)
        notes.append(f"chose {chosen.config.label}")
        return chosen, tuple(notes)

    def _time(self, ctx: BuildContext, cands: list[_Candidate], opts: CpuOptions) -> list[_Candidate]:
        if not cands:
            return []
        feed = take(ctx.calib, 0, fixed_batch(ctx.served) or 1)
        runs: dict[str, Callable[[], object]] = {"fp32": call_with(ort_cpu_runner(ctx.model_path), feed)}
        for i, c in enumerate(cands):
            runs[str(i)] = call_with(ort_cpu_runner(c.path), feed)
        ctx.progress(f"[cpu] timing {len(cands)} int8 candidate(s) side by side with fp32")
        p50 = p50_side_by_side(runs, repeats=opts.latency_repeats)
        timed = [replace(c, p50_ms=p50[str(i)]) for i, c in enumerate(cands)]
        if min(c.p50_ms or 0.0 for c in timed) > p50["fp32"]:
            ctx.progress(f"[cpu] note: every int8 candidate is slower than fp32 here ({p50['fp32']:.3f} ms)")
        return timed


def choose(cands: list[_Candidate]) -> _Candidate:
    """The candidate to ship: with timed passing candidates, the fastest, where latencies within
    ``SPEED_TIE`` of the fastest count as equal (noise on a busy host) and the most accurate of
    those wins; without timings (none passed), the most accurate. Ties keep the earliest tried."""
    timed = [c for c in cands if c.p50_ms is not None and c.comparison.passed]
    if not timed:
        return max(cands, key=lambda c: _accuracy_key(c.comparison))
    fastest = min(c.p50_ms for c in timed if c.p50_ms is not None)
    near = [c for c in timed if c.p50_ms is not None and c.p50_ms <= fastest * (1 + SPEED_TIE)]
    return max(near, key=lambda c: _accuracy_key(c.comparison))


def candidate_configs(opts: CpuOptions) -> list[StaticQuantConfig]:
    """The INT8 configurations to try first, in order, honouring the fixed options."""
    calibration = "minmax" if opts.calibration == "auto" else opts.calibration
    base = [
        StaticQuantConfig("uint8", True, "qdq"),
        StaticQuantConfig("uint8", True, "qoperator"),
        StaticQuantConfig("uint8", False, "qdq"),
        StaticQuantConfig("int8", True, "qdq"),
    ]
    out: list[StaticQuantConfig] = []
    for c in base:
        c = replace(
            c,
            activations=c.activations if opts.activations == "auto" else opts.activations,
            per_channel=c.per_channel if opts.per_channel == "auto" else opts.per_channel == "on",
            quant_format=c.quant_format if opts.quant_format == "auto" else opts.quant_format,
            calibration=calibration,
            reduce_range=opts.reduce_range,
            percentile=opts.percentile,
        )
        if c not in out:
            out.append(c)
    # leave room for the calibration fallbacks within max_candidates
    room = opts.max_candidates - (2 if opts.calibration == "auto" else 0)
    return out[: max(1, room)]


def _accuracy_key(c: Any) -> tuple[float, float]:
    return (c.top1_agreement if c.top1_agreement is not None else 0.0, c.cosine or 0.0)


def _calib_evaluator(ctx: BuildContext) -> Callable[[Callable[[dict[str, np.ndarray]], Mapping[str, np.ndarray]]], Any]:
    """Outside the packager: compare with FP32 on the calibration data under default tolerances."""
    from edgekit.bundle.manifest import Tolerance

    batch = fixed_batch(ctx.served) or 16
    reference = run_all(ort_cpu_runner(ctx.model_path), ctx.calib, batch)
    kind = output_kind(ctx.served)
    return lambda fn: compare(reference, run_all(fn, ctx.calib, batch), kind, Tolerance())


def _to_fp16(src: Path, dst: Path) -> None:
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = convert_float_to_float16(onnx.load(str(src)), keep_io_types=True)
    onnx.save(model, str(dst))


def _onnxruntime() -> Any:
    try:
        import onnxruntime
    except ImportError as exc:
        raise MissingSDKError("onnxruntime", "host", "the cpu target") from exc
    return onnxruntime


__all__ = ["CpuOptions", "CpuTarget", "candidate_configs", "choose"]
