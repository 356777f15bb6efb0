"""What a packaging run answers: the validation table's rows, the bundles written, and the error
that carries them when a target missed its gate."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgekit.bundle.manifest import Manifest, Validation
from edgekit.errors import ValidationFailedError
from edgekit.validate.table import format_table, result_text


@dataclass(frozen=True)
class Row:
    """One line of the validation table (one target): what the manifest records, and the bundle."""

    target: str
    precision: str  # CLI name (int8)
    label: str  # weights/activations (w8a8)
    method: str
    validation: Validation
    failures: tuple[str, ...] = ()
    bundle: Path | None = None
    # engine targets whose FP32 baseline is another measurement than the table's fp32 (another
    # runtime, or a ratio on the other side of 1): (baseline name, its p50 / the artifact's p50),
    # the same side-by-side round; this ratio decides "slower than fp32"
    own_fp32: tuple[str, float] | None = None
    shipped: str = ""  # the candidate shipped and its runtime ("nncf int8 on openvino"); "" without a search
    timed_on: str = ""  # where the latencies were measured ("this host: x86_64 AVX-512 VNNI", a device profile)
    cpu_only: str = ""  # an accelerator target whose artifact runs on the CPU only, and why
    shapes: str = ""  # a static-shape target: the axes it froze and to what, or its TensorRT profile

    @property
    def passed(self) -> bool:
        return self.validation.passed


@dataclass(frozen=True)
class PackageResult:
    bundles: dict[str, Path]  # target -> written .ekb
    rows: tuple[Row, ...]
    manifests: dict[str, Manifest]  # target -> signed manifest (also for failed targets under allow_failed)
    timings_s: dict[str, float] = dataclasses.field(default_factory=dict)  # "prepare", then one per target
    reports: dict[str, Path] = dataclasses.field(default_factory=dict)  # target -> candidate report.md by its bundle
    # target -> why it could not be validated at all (its build raised ValidationFailedError); no row, no bundle
    errors: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """Every target met its validation gate (false when ``allow_failed`` wrote a failed bundle)."""
        return all(r.passed for r in self.rows) and not self.errors

    def table(self) -> str:
        return format_table(self.rows)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``passed``, ``bundles`` (target -> path), ``rows`` (the validation table, with each
        target's manifest ``validation`` record) and ``timings_s``."""
        from edgekit.bundle.codec import to_data

        return {
            "passed": self.passed,
            "bundles": {t: str(p) for t, p in self.bundles.items()},
            "rows": [
                {
                    "target": r.target,
                    "precision": r.precision,
                    "label": r.label,
                    "method": r.method,
                    "passed": r.passed,
                    "failures": list(r.failures),
                    "bundle": None if r.bundle is None else str(r.bundle),
                    "shipped": r.shipped or None,
                    "timed_on": r.timed_on or None,
                    "shapes": r.shapes or None,
                    "result": result_text(r),
                    "validation": to_data(r.validation),
                }
                for r in self.rows
            ],
            "timings_s": {k: round(v, 3) for k, v in self.timings_s.items()},
            **({"errors": dict(self.errors)} if self.errors else {}),
        }


class PackageValidationError(ValidationFailedError):
    """One or more targets failed the validation gate; ``result`` holds what was done."""

    def __init__(self, message: str, result: PackageResult) -> None:
        super().__init__(message)
        self.result = result
