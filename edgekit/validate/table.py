"""The validation table printed at the end of ``edgekit package`` (one row per target)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from edgekit.bundle.manifest import Validation

NOT_HERE = "not measured here"
HEADERS = (
    "target",
    "precision",
    "size",
    "size vs fp32",
    "accuracy vs fp32",
    "p50 / p90 (IQR)",
    "speed vs fp32",
    "result",
)


def format_table(rows: Sequence[Any]) -> str:
    """Rows are ``edgekit.packaging.result.Row`` (``.validation`` is the manifest's). Speed vs fp32 is
    the ONNX Runtime FP32 source's p50 / the artifact's p50 (> 1 = faster); where the target's own
    FP32 (``Row.own_fp32``, e.g. OpenVINO FP32 IR for intel) is another measurement, its ratio
    follows in brackets, from the same side-by-side round: that one decides "slower than fp32"."""
    lines = [HEADERS]
    for r in rows:
        v = r.validation
        lines.append(
            (
                r.target,
                f"{r.precision} ({r.label})" + (f" \u2192 {r.shipped}" if getattr(r, "shipped", "") else ""),
                _size(v.size_bytes),
                f"{v.size_ratio:.2f}x" if v.size_ratio is not None else "-",
                _accuracy(v),
                _latency(v),
                _speed(v) + (f" ({r.own_fp32[1]:.2f}x vs {r.own_fp32[0]})" if getattr(r, "own_fp32", None) else ""),
                result_text(r),
            )
        )
    widths = [max(len(row[i]) for row in lines) for i in range(len(HEADERS))]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    timed = sorted({t for r in rows if (t := getattr(r, "timed_on", ""))})
    out += [f"timed on {t}" for t in timed]  # a host with AVX-512 VNNI or AMX is not the device's CPU
    out += [f"{r.target} {r.shapes}" for r in rows if getattr(r, "shapes", "")]  # frozen axes, TensorRT profile
    return "\n".join(out)


def cpu_only_reason(m: Any) -> str:
    """Why an accelerator target's bundle (a manifest) runs on the CPU only, "" when it does not: a
    coral bundle not compiled for the Edge TPU (``edgetpu_compiler`` was not on PATH when packaged)."""
    if m.target == "coral" and "edgetpu_compiler" not in m.compatibility.hardware:
        return "LiteRT CPU only: not compiled for the Edge TPU"
    return ""


def result_text(r: Any) -> str:
    """The result column: passed / FAILED, and what the user must not miss about the bundle."""
    v = r.validation
    cpu_only = getattr(r, "cpu_only", "")
    return (
        ("passed" if v.passed else "FAILED")
        + (f" ({cpu_only})" if cpu_only else "")
        + (", slower than fp32" if v.slower_than_fp32 else "")
        + ("" if r.bundle is not None else ", no bundle")
    )


def _size(n: int) -> str:
    for unit, scale in (("MB", 1024**2), ("KB", 1024)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _accuracy(r: Validation) -> str:
    if r.kind == "classifier" and r.top1_agreement is not None:
        text = f"top-1 agree {r.top1_agreement:.1%}"
        if r.top1_accuracy is not None and r.fp32_top1_accuracy is not None:
            text += f", acc {r.top1_accuracy:.1%} (fp32 {r.fp32_top1_accuracy:.1%})"
        return text
    if r.cosine is not None:
        return f"cosine {r.cosine:.4f}"
    return "-"


def _latency(v: Validation) -> str:
    if v.latency_p50_ms is None:
        return NOT_HERE
    if v.latency_p90_ms is None:
        return f"{v.latency_p50_ms:.3f} ms"
    iqr = f" ({v.latency_iqr_ms:.3f})" if v.latency_iqr_ms is not None else ""
    return f"{v.latency_p50_ms:.3f} / {v.latency_p90_ms:.3f} ms{iqr}"


def _speed(r: Validation) -> str:
    if r.latency_p50_ms is None or r.fp32_latency_p50_ms is None or r.latency_p50_ms <= 0:
        return NOT_HERE
    return f"{r.fp32_latency_p50_ms / r.latency_p50_ms:.2f}x"
