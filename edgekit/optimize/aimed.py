"""Mixed precision aimed at the measure that failed: the layer groups the local sensitivity ranks
highest, re-ranked by what keeping each one alone in float does to that measure.

The local ranking (``optimize.sensitivity``: each layer's own added error on calibration samples)
is a proxy. Where the gate failed on a task measure, the decoded detections' F1 (a boxes
post-processing or a recognised YOLO head), a DBNet map's mask IoU, or the worst live channel of a
dense output, the layer with the largest error of its own is not always the one that moves that
measure: a crushed channel that only nudges a box, next to a class logit a few hundredths off
that drops every score under the threshold. So the ``MAX_MEASURED_GROUPS`` highest groups are each
kept in float alone, the candidate rebuilt and judged with the gate's own ``compare`` (same
tolerance, tasks and post-processing, on the selection samples); the groups that improve the
failing measure come first (one that meets the whole budget before one that does not, then the
larger improvement), the others keep their local order. The measuring stops after
``MEASURE_BUDGET_S`` seconds or at the first group that meets the budget alone.

Where the failure is the mean cosine or the relative error, the local ranking already measures
that error and nothing is rebuilt.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass

from edgekit.validate.heads import DETECTION_F1, MASK_IOU
from edgekit.validate.metrics import Comparison

MAX_MEASURED_GROUPS = 12  # each is one rebuild and one accuracy run on the selection samples
MEASURE_BUDGET_S = 120.0  # no further group is measured once this much time went to measuring

Ranked = list[tuple[tuple[str, ...], float]]

_CHANNEL = re.compile(r"output .* channel \d+ cosine ")  # validate.metrics.compare's worst-channel failure


@dataclass(frozen=True)
class Aim:
    """The failed measure a ranking is aimed at: ``name`` for the record, ``value`` of a comparison
    (higher is better; None where the comparison does not hold it)."""

    name: str
    value: Callable[[Comparison], float | None]


@dataclass(frozen=True)
class AimedRanking:
    ranked: Ranked  # the groups, the improving measured ones first
    aim: Aim
    measured: tuple[tuple[tuple[str, ...], float | None, bool], ...]  # (group, value, met the budget)
    base: float
    elapsed_s: float
    errors: int  # groups whose rebuild or run raised (left in their local place)
    stopped: str  # why fewer than the bound were measured, or ""

    def text(self) -> str:
        """One line: the measure, how many groups and how long, and the measured values."""
        values = ", ".join(
            f"{'+'.join(g)} {v:.3g}" + (" (meets the budget)" if ok else "")
            for g, v, ok in self.measured
            if v is not None
        )
        extra = f"; {self.errors} failed to build or run" if self.errors else ""
        extra += f"; {self.stopped}" if self.stopped else ""
        return (
            f"layers ranked by {self.aim.name} ({len(self.measured)} groups measured, {self.elapsed_s:.0f} s{extra}; "
            f"{self.base:.3g} with none in float): {values}"
        )

    def reason(self) -> str:
        """How the layers were chosen, for the manifest's ``excluded_reason``."""
        return (
            f"layers ranked by {self.aim.name} on the selection samples ({len(self.measured)} of the groups with the "
            "highest per-layer sensitivity measured, each kept in float alone), the rest by per-layer sensitivity "
            "(fewest layers that meet the budget)"
        )


def aim_of(comparison: Comparison | None) -> Aim | None:
    """The task measure ``comparison`` failed on: the detections' F1 or a mask's IoU where either
    failed, the worst channel's cosine where it is the only failure; else None (the mean cosine,
    the relative error: what the local ranking measures already)."""
    if comparison is None or comparison.passed:
        return None
    for measure in (DETECTION_F1, MASK_IOU):
        if any(m == measure and not met for _, m, _, met in comparison.task_measures):
            return Aim(measure, functools.partial(_lowest, measure))
    if all(_CHANNEL.match(f) for f in comparison.failures):  # with cosine and relative error within the budget
        return Aim("worst channel cosine", lambda c: c.channel_cosine)
    return None


def _lowest(measure: str, c: Comparison) -> float | None:
    """The lowest ``measure`` ``compare`` recorded of the decoded outputs."""
    found = [value for _, m, value, _ in c.task_measures if m == measure]
    return min(found) if found else None


def aimed_ranking(
    ranked: Ranked,
    aim: Aim,
    base: Comparison,
    measure: Callable[[tuple[str, ...]], Comparison],
    clock: Callable[[], float],
    bound: int = MAX_MEASURED_GROUPS,
    budget_s: float = MEASURE_BUDGET_S,
) -> AimedRanking:
    """``ranked`` (local order) re-ranked by ``aim`` measured with ``measure`` (a group -> the
    gate's comparison of the candidate with that group kept in float) on its first ``bound``
    groups (``clock``: seconds, for ``budget_s``)."""
    start = clock()
    before = aim.value(base)
    base_value = before if before is not None else 0.0
    measured: list[tuple[tuple[str, ...], float | None, bool]] = []
    errors = 0
    stopped = ""
    for group, _score in ranked[:bound]:
        if measured and clock() - start > budget_s:
            stopped = f"stopped after {budget_s:.0f} s"
            break
        try:
            got = measure(group)
        except Exception:  # a rebuild that raises leaves the group in its local place; the rescue goes on
            errors += 1
            continue
        measured.append((group, aim.value(got), got.passed))
        if got.passed:
            stopped = f"{'+'.join(group)} meets the budget alone"
            break
    better = {
        g: (ok, v) for g, v, ok in measured if v is not None and (v > base_value or ok)
    }  # improving ones only: the rest keep their local order
    first = sorted(
        (i for i, (g, _s) in enumerate(ranked) if g in better),
        key=lambda i: (not better[ranked[i][0]][0], -better[ranked[i][0]][1], i),
    )
    order = [ranked[i] for i in first] + [r for r in ranked if r[0] not in better]
    return AimedRanking(order, aim, tuple(measured), base_value, clock() - start, errors, stopped)
