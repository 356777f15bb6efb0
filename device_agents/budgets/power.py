"""The power budget as an energy bucket, and the degradation level it and the temperature drive.

``EnergyBucket``: a budget of ``budget_w`` watts on average over ``window_s`` is a bucket of
``budget_w x window_s`` joules that refills at ``budget_w``; measured energy drains it. A full
bucket lets a burst use a whole window's energy at once; an empty one means the device has used
more than the budget over the last window. Debt is kept down to one window below empty, so that
over any long stretch the average holds (an overshoot is paid back, not forgotten), and not
further, so that one long overload does not keep the device degraded for ever after.

``Degradation``: levels 0 (normal) to ``steps`` (the last action of the configured policy, e.g.
shed every request). The *pressure* is the bucket's fill (1 full .. 0 empty .. -1 one window in
debt) or, when nearer, the thermal headroom as a fraction of ``thermal_margin_c`` (1 at the
margin, 0 at the trip point): the agent backs off before the trip point, not at it. Level ``k``
is entered when the pressure falls to ``enter(k)`` and left only when it has risen past
``enter(k) + hysteresis`` and stayed there ``min_dwell_s``: a load that hovers at the budget
does not flap between levels. Going up is immediate; coming down is one level at a time.

Pure logic: time comes in as ``now`` (``time.monotonic()`` in the agent, a fake clock in tests).
"""

from __future__ import annotations

import math


class EnergyBucket:
    """``budget_w`` average watts over ``window_s``: ``spend`` measured joules, read ``fill``."""

    __slots__ = ("budget_w", "capacity_j", "level_j", "updated", "window_s")

    def __init__(self, budget_w: float, window_s: float, now: float) -> None:
        if not budget_w > 0 or not window_s > 0:
            raise ValueError(f"a power budget needs budget_w > 0 and window_s > 0, got {budget_w} and {window_s}")
        self.budget_w = budget_w
        self.window_s = window_s
        self.capacity_j = budget_w * window_s
        self.level_j = self.capacity_j
        self.updated = now

    def spend(self, joules: float, now: float) -> None:
        """Record ``joules`` used up to ``now`` (the bucket refills for the time since the last call)."""
        elapsed = max(0.0, now - self.updated)
        self.updated = max(self.updated, now)
        level = min(self.capacity_j, self.level_j + elapsed * self.budget_w) - max(0.0, joules)
        self.level_j = max(-self.capacity_j, level)

    @property
    def fill(self) -> float:
        """1.0 full, 0.0 empty (the budget used up), down to -1.0 (a window of debt)."""
        return self.level_j / self.capacity_j

    def seconds_to(self, fill: float) -> float:
        """How long the bucket takes to refill to ``fill`` if nothing is used meanwhile."""
        return max(0.0, (fill - self.fill) * self.capacity_j / self.budget_w)


class Degradation:
    """The degradation level with hysteresis; ``update`` it with the pressure, read ``level``."""

    __slots__ = ("_below_since", "changes", "enter_at", "hysteresis", "level", "min_dwell_s", "steps")

    def __init__(
        self, steps: int, *, first_at: float = 0.25, hysteresis: float = 0.15, min_dwell_s: float = 2.0
    ) -> None:
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        if not 0 < first_at <= 1 or not 0 < hysteresis < 1 or min_dwell_s < 0:
            raise ValueError("first_at must be in (0, 1], hysteresis in (0, 1), min_dwell_s >= 0")
        self.steps = steps
        # level k (1..steps) entered at pressure <= enter_at[k-1]: evenly from first_at down to 0
        # (the last level, e.g. shedding, only once the budget is used up)
        self.enter_at = tuple(first_at * (steps - k) / (steps - 1) if steps > 1 else 0.0 for k in range(1, steps + 1))
        self.hysteresis = hysteresis
        self.min_dwell_s = min_dwell_s
        self.level = 0
        self.changes = 0  # level changes so far (a metric: flapping shows here)
        self._below_since: float | None = None  # since when the pressure allows one level down

    def wanted(self, pressure: float) -> int:
        """The level this pressure calls for, ignoring hysteresis."""
        level = 0
        for k, at in enumerate(self.enter_at, start=1):
            if pressure <= at:
                level = k
        return level

    def update(self, pressure: float, now: float) -> int:
        """The level after seeing ``pressure`` at ``now``."""
        if math.isnan(pressure):
            return self.level
        wanted = self.wanted(pressure)
        if wanted > self.level:
            self.level = wanted
            self.changes += 1
            self._below_since = None
            return self.level
        if self.level == 0 or pressure <= self.enter_at[self.level - 1] + self.hysteresis:
            self._below_since = None
            return self.level
        if self._below_since is None:
            self._below_since = now
        if now - self._below_since >= self.min_dwell_s:
            self.level -= 1
            self.changes += 1
            self._below_since = (
                now if self.level and pressure > self.enter_at[self.level - 1] + self.hysteresis else None
            )
        return self.level

    def recover_at(self) -> float:
        """The pressure above which the current level is left (after ``min_dwell_s``)."""
        return 1.0 if self.level == 0 else min(1.0, self.enter_at[self.level - 1] + self.hysteresis)


def thermal_pressure(headroom_c: float | None, margin_c: float) -> float:
    """The thermal headroom as a pressure: 1 at ``margin_c`` below the limit (or further), 0 at it."""
    if headroom_c is None or margin_c <= 0:
        return math.inf
    return headroom_c / margin_c
