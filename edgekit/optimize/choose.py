"""Choosing among measured candidates: by objective, within the accuracy budget, never slower than
the target's FP32 when the choice is the engine's (``auto``).

Latencies within ``SPEED_TIE`` of the fastest count as equal (noise on a busy host); among equals
the smaller artifact wins, then the more accurate. The ``size`` objective is the same with the
roles swapped. A candidate whose latency is not measurable here is compared by size and accuracy
only, and only when no candidate has a latency.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

from edgekit.validate.metrics import Comparison

SPEED_TIE = 0.03
SIZE_TIE = 0.02


class Measured(Protocol):
    """What the choice reads of a measured candidate (the engine's ``Outcome``): described here
    so that the rule does not depend on the engine that calls it."""

    @property
    def name(self) -> str: ...
    @property
    def comparison(self) -> Comparison | None: ...
    @property
    def size_bytes(self) -> int: ...
    @property
    def device_rank(self) -> int | None: ...
    @property
    def p50_ms(self) -> float | None: ...


OutcomeT = TypeVar("OutcomeT", bound=Measured)


def accuracy_key(o: Measured) -> tuple[float, float]:
    c = o.comparison
    if c is None:
        return (-1.0, -1.0)
    agreement = c.top1_agreement if c.top1_agreement is not None else 0.0
    if c.predicted_top1_agreement is not None:  # saturated agreement on easy samples ranks by the prediction
        agreement = min(agreement, c.predicted_top1_agreement)
    return (agreement, c.cosine or 0.0)


def choose(outcomes: Sequence[OutcomeT], objective: str, auto: bool, baseline: OutcomeT | None) -> tuple[OutcomeT, str]:
    """The outcome to ship and one line saying why. ``outcomes``: the choosable ones (the
    requested precision, or every candidate under ``auto``), built and measured or failed."""
    built = [o for o in outcomes if o.comparison is not None]
    if not built:
        raise ValueError("no candidate was built")
    passing = [o for o in built if o.comparison is not None and o.comparison.passed]
    if not passing:
        best = max(built, key=accuracy_key)
        return best, "no candidate met the accuracy budget on the selection samples: the most accurate one"
    pool = passing
    why = ""
    if auto and baseline is not None and baseline.p50_ms is not None:
        limit = baseline.p50_ms
        faster = [o for o in pool if (o.p50_ms is not None and o.p50_ms <= limit) or o is baseline]
        dropped = len(pool) - len(faster)
        pool = faster or [baseline]
        if dropped:
            why = f"; {dropped} passing candidate(s) slower than {baseline.name} left out"
    timed = [o for o in pool if o.p50_ms is not None]
    ranked = [o for o in pool if o.device_rank is not None]
    if objective == "latency" and not timed and ranked:
        first = min(o.device_rank for o in ranked if o.device_rank is not None)
        same = [o for o in ranked if o.device_rank == first]
        # one rank is one speed class: sizes within SIZE_TIE are equal, and the accuracy margin
        # over the budget decides (a candidate just at the gate on the selection samples may miss
        # it on the held-out ones), then the smaller
        smallest = min(o.size_bytes for o in same)
        near = [o for o in same if o.size_bytes <= smallest * (1 + SIZE_TIE)]
        pick = min(near, key=lambda o: (tuple(-x for x in accuracy_key(o)), o.size_bytes))
        return pick, (
            "expected fastest on the device within the budget (latency not measured here: "
            f"the target's order from the vendor's documentation, rank {first}; sizes within {SIZE_TIE:.0%} "
            f"tie, won by the more accurate){why}"
        )
    if objective == "size" or not timed:
        smallest = min(o.size_bytes for o in pool)
        near = [o for o in pool if o.size_bytes <= smallest * (1 + SIZE_TIE)]
        pick = min(near, key=lambda o: (o.p50_ms if o.p50_ms is not None else float("inf"), -accuracy_key(o)[0]))
        basis = "smallest" if timed else "smallest (latency not measured here)"
        return pick, f"{basis} within the budget (sizes within {SIZE_TIE:.0%} tie, won by the faster){why}"
    fastest = min(o.p50_ms for o in timed if o.p50_ms is not None)
    near = [o for o in timed if o.p50_ms is not None and o.p50_ms <= fastest * (1 + SPEED_TIE)]
    # within the speed tie the smaller wins only when it is smaller by more than the size tie:
    # two layouts of one model (per-tensor vs per-channel: 1 % apart) go to the faster
    smallest = min(o.size_bytes for o in near)
    small = [o for o in near if o.size_bytes <= smallest * (1 + SIZE_TIE)]
    pick = min(small, key=lambda o: (o.p50_ms or 0.0, tuple(-x for x in accuracy_key(o))))
    return pick, (
        f"fastest within the budget (p50 within {SPEED_TIE:.0%} tie, won by the smaller; sizes within "
        f"{SIZE_TIE:.0%} tie, won by the faster){why}"
    )
