"""The health window of a version just switched to, judged by the requests it serves on this
device, whatever installed it (``edgekit-agent install``, the HTTP install route, an MQTT notice).

Before the switch the lifecycle's self-test already compared the candidate's golden outputs and
p50 latency with the previous version's on this device. What it cannot see is real traffic: a
model that passes its golden vectors but fails on inputs met in the field. During the health
window (``updates.health_window_s``, or ``DEFAULT_HEALTH_WINDOW_S`` without an ``[updates]``
table) the new version's failed requests are compared with the previous version's, from the
agent's own counters, and the lifecycle rolls back when the new version fails clearly more
often. Only failures the previous version did not have count: a request the runtime fails to run
(an HTTP 500: the runtime raised or hung) is replayed on the replaced version, kept loaded
through the window (``Registry.count_failure``), and counted (``edgekit_model_failures``) only
when that one runs it; a hung call counts without a replay. 503/504/429 (queue full, deadline
passed, draining) and 4xx (bad input) say nothing about the model and never count.

A window that runs out with the version still serving ends its probation: the replaced version
is closed and the version is recorded healthy (the crash-loop watch ends). The update client
asks for the verdict (``HealthWindows.wait``) to report it; it judges nothing itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from device_agents.metrics import AgentMetrics
from device_agents.threads import NamedThread
from edgekit.bundle.errors import EdgekitError

log = logging.getLogger("edgekit.agent")

# Roll back once the new version has failed at least this many requests ...
MIN_FAILED_REQUESTS = 3
# ... and its failure rate is this much above the previous version's (0.05 = 5 points).
MAX_FAILURE_RATE_INCREASE = 0.05
POLL_S = 0.2  # a read of the agent's own counters: cheap


@dataclass(frozen=True)
class Traffic:
    """Request counters of one model since some moment (a difference of two snapshots)."""

    requests: int = 0
    failed: int = 0  # failed to run, and counted against the version (edgekit_model_failures)

    def since(self, earlier: Traffic) -> Traffic:
        return Traffic(self.requests - earlier.requests, self.failed - earlier.failed)

    @property
    def failure_rate(self) -> float:
        return self.failed / self.requests if self.requests else 0.0


def traffic(metrics: AgentMetrics, name: str) -> Traffic:
    """Inference requests served for model ``name`` since the agent started, and its failures
    that count against the version serving them."""
    requests = failed = 0
    for family in metrics.registry.collect():
        if family.name not in ("edgekit_requests", "edgekit_model_failures"):
            continue
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.labels.get("model") == name:
                if family.name == "edgekit_requests":
                    requests += int(sample.value)
                else:
                    failed += int(sample.value)
    return Traffic(requests, failed)


def failure_verdict(new: Traffic, old: Traffic, new_version: int, old_version: int | None) -> str:
    """Why ``new`` (the switched-to version's traffic) is unhealthy against ``old``, or ""."""
    if new.failed < MIN_FAILED_REQUESTS:
        return ""
    if new.failure_rate <= old.failure_rate + MAX_FAILURE_RATE_INCREASE:
        return ""
    before = f"v{old_version} failed {old.failed} of {old.requests}" if old_version else "no previous traffic"
    return (
        f"v{new_version} failed {new.failed} of {new.requests} requests in its health window "
        f"({new.failure_rate:.0%}; {before})"
    )


# healthy: served through its window; rolled_back: failed on traffic, the previous version serves;
# rollback_failed: failed on traffic, but could not be rolled back (``reason`` says both);
# unjudged: nothing to compare with (no previous version, or restarted inside its window);
# replaced: another version serves now (a later install, a crash-loop rollback); stopped: the agent stopped.
Outcome = Literal["healthy", "rolled_back", "rollback_failed", "unjudged", "replaced", "stopped"]


@dataclass(frozen=True)
class Verdict:
    name: str
    version: int
    outcome: Outcome
    reason: str = ""


class _Window:
    __slots__ = ("before", "done", "name", "previous_version", "started", "verdict", "version")

    def __init__(self, name: str, version: int, previous_version: int | None, before: Traffic, started: Traffic):
        self.name, self.version, self.previous_version = name, version, previous_version
        self.before = before  # the previous version's traffic, from its own switch to this one
        self.started = started  # the counters when this window opened
        self.done = threading.Event()
        self.verdict: Verdict | None = None


class HealthWindows:
    """One health window per model name at a time, each watched by a thread of its own
    (``health-<name>``). ``serving(name)`` is the version serving now; ``rollback(name, why)``
    serves the previous version again (raises ``EdgekitError`` when it cannot); ``healthy(name)``
    ends the window of a version that ran through it."""

    def __init__(
        self,
        metrics: AgentMetrics,
        window_s: float,
        *,
        serving: Callable[[str], int | None],
        rollback: Callable[[str, str], object],
        healthy: Callable[[str], None],
        poll_s: float = POLL_S,
    ) -> None:
        self.metrics = metrics
        self.window_s = window_s
        self.serving = serving
        self.rollback = rollback
        self.healthy = healthy
        self.poll_s = poll_s
        self._lock = threading.Lock()
        self._windows: dict[str, _Window] = {}
        self._switched: dict[str, Traffic] = {}  # model name -> its counters at its last switch
        self._stop = threading.Event()

    def open(self, name: str, version: int, previous_version: int | None) -> None:
        """``name`` now serves ``version`` (installed, or restarted inside its window when
        ``previous_version`` is None: only the window's end is watched, nothing is compared)."""
        now = traffic(self.metrics, name)
        with self._lock:
            before = now.since(self._switched.get(name, Traffic()))
            self._switched[name] = now
            older = self._windows.get(name)
            window = self._windows[name] = _Window(name, version, previous_version, before, now)
        if older is not None and not older.done.is_set():
            self._end(older, Verdict(name, older.version, "replaced"))
        if previous_version is not None:
            log.info("%s: v%d switched in (was v%d); health window %g s", name, version, previous_version,
                     self.window_s)  # fmt: skip
        NamedThread(target=self._watch, args=(window,), name=f"health-{name}", daemon=True).start()

    def switched(self, name: str) -> None:
        """``name`` switched outside an install (a rollback): its traffic counts from now."""
        with self._lock:
            self._switched[name] = traffic(self.metrics, name)

    def wait(self, name: str, version: int, stop: threading.Event | None = None) -> Verdict:
        """The verdict on ``name`` v``version``'s window, once there is one (at once when nothing is
        compared in it); ``stopped`` if ``stop`` is set first or the windows are stopped."""
        with self._lock:
            window = self._windows.get(name)
        if window is None or window.version != version:
            return Verdict(name, version, "replaced")
        if window.previous_version is None:
            return Verdict(name, version, "unjudged")
        while not window.done.wait(self.poll_s):
            if (stop is not None and stop.is_set()) or self._stop.is_set():
                return Verdict(name, version, "stopped")
        return window.verdict or Verdict(name, version, "stopped")

    def stop(self) -> None:
        self._stop.set()

    def _watch(self, window: _Window) -> None:
        name, version = window.name, window.version
        deadline = time.monotonic() + self.window_s
        while not self._stop.wait(min(self.poll_s, max(0.0, deadline - time.monotonic()))):
            if window.done.is_set():
                return  # replaced by a newer window
            if self.serving(name) != version:
                self._end(window, Verdict(name, version, "replaced"))
                return
            if window.previous_version is not None:
                now = traffic(self.metrics, name).since(window.started)
                why = failure_verdict(now, window.before, version, window.previous_version)
                if why:
                    self._end(window, self._roll_back(window, why))
                    return
            if time.monotonic() >= deadline:
                try:
                    self.healthy(name)
                except EdgekitError as exc:
                    log.error("%s: cannot record v%d as healthy: %s", name, version, exc)
                except OSError as exc:  # no descriptor left (EMFILE), an I/O error: the window stays open
                    log.warning("%s: cannot record v%d as healthy yet (%s); trying again", name, version, exc)
                    if self._stop.wait(self.poll_s):
                        break
                    continue
                self._end(window, Verdict(name, version, "healthy"))
                return
        self._end(window, Verdict(name, version, "stopped"))

    def _roll_back(self, window: _Window, why: str) -> Verdict:
        name, version = window.name, window.version
        try:
            self.rollback(name, why)
        except EdgekitError as exc:
            log.error("%s: v%d is unhealthy (%s) but cannot be rolled back: %s", name, version, why, exc)
            return Verdict(name, version, "rollback_failed", f"{why}; rollback failed: {exc}")
        return Verdict(name, version, "rolled_back", why)

    def _end(self, window: _Window, verdict: Verdict) -> None:
        with self._lock:
            if window.done.is_set():
                return
            window.verdict = verdict
            window.done.set()
