"""The memory budget: admission of model loads against ``[budgets] memory_mb``.

The budget is the agent process's whole resident memory, its own baseline (interpreter,
libraries, server) measured when the budget is created, before any model loads, plus each
runtime SDK's import, measured before that runtime's first load. What a model
needs is, best first: the RSS peak of its load measured on this device before (kept per model,
version and runtime in ``<store>/footprints.json`` with what the load left resident, which the
model holds while loaded; the largest seen: a load that reuses pages an unloaded model left in
the allocator must not make it look smaller), else the manifest's
``estimates`` (``peak_memory_mb``, else ``memory_mb``: the packager's measurement on the host),
else nothing known (admitted while anything is free, and measured).

A load that does not fit is refused with ``MemoryBudgetError`` (a 503 with Retry-After for a
request; an error for an install) naming the numbers, unless ``when_full = "unload_idle"``: then
the least recently used loaded model is unloaded first (``evict``, the registry's), as many as
it takes: an idle one, else a busy one once its running calls end (its later requests load it
again), so that two models that do not fit together take turns instead of refusing. A model
unloaded this way is loaded again by its next request (``reload = "on_request"``, unloading
another if need be) or only once it fits without unloading anything (``reload =
"retry_after"``: else that request gets the 503).

The RSS the process holds beyond the baseline and the models' footprints (request buffers,
allocator fragmentation) counts as "other" against the budget: it is on RSS as measured.

Loads are serialized (one at a time), so that each RSS delta is one model's. A budget at or
below the baseline admits no model; the agent still serves health, metrics and status.
"""

from __future__ import annotations

import ctypes
import json
import logging
import threading
from collections.abc import Callable, Container
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from device_agents.budgets.knobs import Room
from device_agents.errors import StoreError, UnavailableError
from device_agents.runtimes import ServedModel, runner_class
from device_agents.runtimes.base import np_dtype
from device_agents.store import atomic_write
from edgekit.bundle.errors import EdgekitError
from edgekit.bundle.manifest import Manifest

log = logging.getLogger("edgekit.agent")

_MB = 1024 * 1024
FOOTPRINTS_NAME = "footprints.json"
WHEN_FULL = ("refuse", "unload_idle")
RELOAD = ("on_request", "retry_after")
# How long a load waits for the running calls of a busy model it unloads (when none is idle).
DRAIN_S = 5.0
PEAK = "peak"  # a footprint key's suffix for the load's peak
_OTHER = ""  # the key of memory held by neither the agent's baseline nor a model


class MemoryBudgetError(UnavailableError):
    """A model does not fit the memory budget (503 + Retry-After for a request)."""

    def __init__(self, message: str, *, retry_after_s: int | None = None) -> None:
        super().__init__(message, reason="memory", retry_after_s=retry_after_s)


def current_rss_bytes() -> int:
    """This process's resident set size (psutil: /proc/self/statm on Linux)."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def return_freed_memory() -> None:
    """Hand the heap pages a closed model freed back to the OS (glibc's ``malloc_trim``; nothing
    where the C library has none). glibc keeps them otherwise: measured here, closing an ONNX
    Runtime session of 16 MB of weights left RSS 29 MB up (-7 MB with the trim), and the next
    load reused those pages, so RSS neither fell at an unload nor rose at a load."""
    global _trim
    if _trim is None:
        try:
            _trim = ctypes.CDLL(None).malloc_trim
        except (AttributeError, OSError):
            _trim = False
    if _trim:
        _trim(0)


_trim: Any = None  # libc's malloc_trim once looked up; False where there is none
_M_ARENA_MAX = -8  # glibc's mallopt parameters
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1 << 20


def limit_malloc_arenas(arenas: int = 2) -> None:
    """Cap glibc's per-thread malloc arenas (default 8 per core): models loaded and unloaded from
    request threads otherwise spread over arenas whose free pages are returned apart, and RSS
    creeps up swap after swap. Applies to arenas created after the call (call it at start)."""
    try:
        ctypes.CDLL(None).mallopt(_M_ARENA_MAX, arenas)
    except (AttributeError, OSError):  # not glibc
        pass


def fix_mmap_threshold(threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> None:
    """Serve every allocation of ``threshold_bytes`` or more with its own mapping, returned to the OS
    when freed. glibc otherwise raises the threshold to the largest block freed so far, after which
    a runtime's large tensors (a big batch's activations, ONNX Runtime without its arena) stay on
    the heap once freed: measured here, +32 MB of RSS kept after one batch of 2048 rows through six
    1024 x 1024 MatMuls, +0 MB with the threshold fixed at 1 MB."""
    try:
        ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, threshold_bytes)
    except (AttributeError, OSError):  # not glibc
        pass


def first_inference(model: ServedModel) -> None:
    """Run ``model`` once on zeros (dynamic dims 1), so that its load is measured with what its
    first inference allocates (as the packager's estimate is), and warm it up. Best effort: a
    model that takes no such input is measured at its load alone."""
    try:
        inputs = {
            s.name: np.zeros(tuple(d if isinstance(d, int) and d > 0 else 1 for d in s.shape), np_dtype(s.dtype))
            for s in model.inputs
        }
        model.infer(inputs)
    except Exception as exc:  # any runtime error: the measurement is of the load only
        log.debug("%s: no warm-up inference (%s)", model.manifest.name, exc)


class PeakRss:
    """The highest RSS seen while the ``with`` block runs (polled every ``interval_s`` by a
    thread): a model's load peaks above what it keeps (the file read, the parsed graph)."""

    def __init__(self, rss: Callable[[], int], interval_s: float = 0.002) -> None:
        self.rss = rss
        self.interval_s = interval_s
        self.bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="peak-rss", daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.bytes = max(self.bytes, self.rss())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> PeakRss:
        self.bytes = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.bytes = max(self.bytes, self.rss())


def footprint_key(manifest: Manifest) -> str:
    return f"{manifest.name} v{manifest.version} {manifest.compatibility.runtime}"


class Footprints:
    """Measured RSS deltas per model, version and runtime, kept in the store directory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._known: dict[str, int] = {}
        try:
            data = json.loads(path.read_bytes())
            if isinstance(data, dict):
                self._known = {str(k): int(v) for k, v in data.items() if isinstance(v, int) and v >= 0}
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as exc:
            log.warning("%s unreadable (%s); model memory is measured again at the next loads", path, exc)

    def get(self, key: str) -> int | None:
        return self._known.get(key)

    def record(self, key: str, measured_bytes: int) -> int:
        """Keep ``measured_bytes`` for ``key`` if larger than what was known; what is kept now."""
        with self._lock:
            kept = max(measured_bytes, self._known.get(key, 0))
            if self._known.get(key) == kept:
                return kept
            self._known[key] = kept
            data = json.dumps(self._known, indent=1, sort_keys=True).encode()
        try:
            atomic_write(self.path, data)
        except StoreError as exc:  # a full disk: the number is kept in memory, measured again after a restart
            log.warning("could not record a model's measured memory: %s", exc)
        return kept


@dataclass(frozen=True)
class Holding:
    name: str
    version: int
    bytes: int


@dataclass(frozen=True)
class MemoryState:
    budget_bytes: int
    baseline_bytes: int
    held_bytes: int  # by loaded models, as measured at their load
    rss_bytes: int  # measured now
    held_by: dict[str, int]  # model name -> bytes
    unloads: int  # models unloaded to make room (LRU swaps)
    refusals: int  # loads refused


class MemoryBudget:
    """Admission of model loads (``load``) and the bookkeeping of what loaded models hold."""

    def __init__(
        self,
        budget_bytes: int,
        *,
        footprints: Footprints | None = None,
        when_full: str = "refuse",
        reload: str = "on_request",
        retry_after_s: int = 1,
        rss: Callable[[], int] = current_rss_bytes,
        baseline_bytes: int | None = None,
    ) -> None:
        if when_full not in WHEN_FULL or reload not in RELOAD:
            raise ValueError(f"when_full must be one of {WHEN_FULL} and reload one of {RELOAD}")
        self.budget_bytes = budget_bytes
        self.footprints = footprints
        self.when_full = when_full
        self.reload = reload
        self.retry_after_s = retry_after_s
        self.rss = rss
        limit_malloc_arenas()
        fix_mmap_threshold()
        self.baseline_bytes = rss() if baseline_bytes is None else baseline_bytes
        # Unloads the least recently used model not in ``keep``, an idle one first, else a busy one
        # once its running calls end (up to the seconds given); its name, or None. Set by the
        # registry's owner (``Registry.unload_lru``).
        self.evict: Callable[[Container[str], float], str | None] | None = None
        self._load_lock = threading.Lock()
        self._lock = threading.Lock()
        self._held: dict[int, Holding] = {}  # id(model) -> what it holds
        self._runtimes: set[str] = set()  # whose SDK is imported (counted in the baseline)
        self.unloads = 0
        self.refusals = 0

    # -- what a model needs --------------------------------------------------------------
    def need(self, manifest: Manifest) -> tuple[int, str]:
        """(bytes, where the number comes from: "measured", "estimate" or "unknown")."""
        if self.footprints is not None:
            key = footprint_key(manifest)
            measured = self.footprints.get(f"{key} {PEAK}")
            if measured is None:
                measured = self.footprints.get(key)
            if measured is not None:
                return measured, "measured"
        est = manifest.estimates
        mb = None if est is None else (est.peak_memory_mb or est.memory_mb)
        if mb:
            return int(mb * _MB), "estimate"
        return 0, "unknown"

    def check_installable(self, manifest: Manifest) -> None:
        """``MemoryBudgetError`` when ``manifest``'s model cannot be loaded under the budget: it
        does not fit even alone, or (``when_full = "refuse"``) not beside the other models loaded
        now (its own name's version, replaced by the install, not counted)."""
        need, source = self.need(manifest)
        others = self._held_by(exclude=manifest.name)
        if self._fits(need, 0):
            if self.when_full == "unload_idle" or self._fits(need, sum(others.values())):
                return
            self._refuse(manifest, need, source, others, retry=False)
        self._refuse(manifest, need, source, {}, retry=False)

    def fits_now(self, manifest: Manifest) -> bool:
        """Whether ``manifest``'s model could be loaded now without unloading another."""
        held = self._held_by()
        others = sum(v for k, v in held.items() if k != manifest.name)
        other = max(0, self.rss() - self.baseline_bytes - sum(held.values()))
        return self._fits(self.need(manifest)[0], others + other)

    def room(self, manifest: Manifest) -> Room:
        """What the budget leaves for ``manifest``'s model now (the other models, the agent itself and
        what else the process holds taken off), and what it needs: the runtime settings of its load
        follow it (``knobs.follow_budget``)."""
        held = self._held_by()
        others = sum(v for k, v in held.items() if k != manifest.name)
        other = max(0, self.rss() - self.baseline_bytes - sum(held.values()))
        free = max(0, self.budget_bytes - self.baseline_bytes - others - other)
        return Room(free, self.need(manifest)[0])

    # -- loading ---------------------------------------------------------------------------
    def load(self, manifest: Manifest, loader: Callable[[], ServedModel], *, on_demand: bool = False) -> ServedModel:
        """Admit ``manifest``'s model, unloading idle ones if the policy allows, and load it with
        ``loader``; its RSS delta is measured and held until the model is closed. ``on_demand``:
        a load a request asked for (``reload`` applies)."""
        with self._load_lock:
            self._count_runtime(manifest.compatibility.runtime)
            need, source = self.need(manifest)
            self._make_room(manifest, need, source, may_unload=self._may_unload(on_demand))
            return_freed_memory()  # measured from a trimmed heap: what the load itself makes resident
            before = self.rss()
            with PeakRss(self.rss) as peak:
                model = loader()
                first_inference(model)
            after = self.rss()
            delta = max(0, after - before)
            peak_delta = max(delta, peak.bytes - before)
            # held: the largest load of this model measured on this device (this one's may be less:
            # a load that reuses free heap pages shows less than it holds once they are used again);
            # needed before the next load: the largest peak (a load reads and parses the weights
            # besides what it keeps)
            kept = delta
            if self.footprints is not None:
                kept = self.footprints.record(footprint_key(manifest), delta)
                self.footprints.record(f"{footprint_key(manifest)} {PEAK}", peak_delta)
            key = id(model)
            with self._lock:
                self._held[key] = Holding(manifest.name, manifest.version, kept)
            model.on_close = lambda: self._release(key)
            log.info(
                "%s v%d loaded: %.1f MB, peak %.1f MB (%s %.1f MB); %.1f of %.1f MB budget held, RSS %.1f MB",
                manifest.name,
                manifest.version,
                delta / _MB,
                peak_delta / _MB,
                source,
                need / _MB,
                (self.baseline_bytes + self.held_bytes()) / _MB,
                self.budget_bytes / _MB,
                after / _MB,
            )
            return model

    def _count_runtime(self, runtime: str) -> None:
        """Import ``runtime``'s SDK before the first load that uses it, and count what that takes as
        the agent's own memory (a library, loaded once), not as that model's."""
        if runtime in self._runtimes:
            return
        self._runtimes.add(runtime)
        before = self.rss()
        try:
            runner_class(runtime)
        except EdgekitError:  # no such runtime or SDK: the load says so
            return
        self.baseline_bytes += max(0, self.rss() - before)

    def _may_unload(self, on_demand: bool) -> bool:
        if self.when_full != "unload_idle":
            return False
        return not on_demand or self.reload == "on_request"

    def _make_room(self, manifest: Manifest, need: int, source: str, *, may_unload: bool) -> None:
        while True:
            held = self._held_by()
            others = {k: v for k, v in held.items() if k != manifest.name}
            # what the process holds beyond the agent and its models (request buffers, caches,
            # fragmentation) counts too: the budget is on RSS as measured, not as accounted
            other = max(0, self.rss() - self.baseline_bytes - sum(held.values()))
            if other >= _MB:
                others[_OTHER] = other
            if self._fits(need, sum(others.values())):
                return
            if not self._fits(need, others.get(_OTHER, 0)):  # not even alone: nothing to unload helps
                self._refuse(manifest, need, source, others, retry=False)
            if not may_unload or self.evict is None:
                self._refuse(manifest, need, source, others, retry=True)
            victim = self.evict({manifest.name}, DRAIN_S)
            if victim is None:  # nothing else loaded, or its calls did not end within DRAIN_S
                self._refuse(manifest, need, source, others, retry=True, busy=True)
            self.unloads += 1
            log.info("%s: unloaded (least recently used) to make room for %s", victim, manifest.name)

    def _fits(self, need: int, held: int) -> bool:
        return self.budget_bytes > self.baseline_bytes and self.baseline_bytes + held + need <= self.budget_bytes

    def _refuse(
        self,
        manifest: Manifest,
        need: int,
        source: str,
        others: dict[str, int],
        *,
        retry: bool,
        busy: bool = False,
    ) -> NoReturn:
        self.refusals += 1
        models = sorted(k for k in others if k != _OTHER)
        by = f", {sum(others[k] for k in models) / _MB:.0f} MB held by {', '.join(models)}" if models else ""
        if _OTHER in others:
            by += f", {others[_OTHER] / _MB:.0f} MB other"
        needs = "needs an unknown amount" if source == "unknown" else f"needs ~{need / _MB:.0f} MB ({source})"
        message = (
            f"{manifest.name} v{manifest.version} {needs}, memory budget {self.budget_bytes / _MB:.0f} MB: "
            f"{self.baseline_bytes / _MB:.0f} MB the agent itself{by}"
        )
        if self.budget_bytes <= self.baseline_bytes:
            message += (
                "; the budget is at or below the agent's own memory, so no model is admitted: raise [budgets] memory_mb"
            )
        elif busy:
            message += "; the other models' calls did not end in time: retry shortly"
        elif retry:
            message += (
                '; set [budgets] when_full = "unload_idle" to unload idle models for it, or raise [budgets] memory_mb'
                if self.when_full == "refuse"
                else "; it fits once others are unloaded: retry shortly"
            )
        else:
            message += "; raise [budgets] memory_mb or ship a smaller model"
        raise MemoryBudgetError(message, retry_after_s=self.retry_after_s if retry else None)

    def _release(self, key: int) -> None:
        with self._lock:
            gone = self._held.pop(key, None)
        if gone is not None:
            return_freed_memory()

    # -- what is held ------------------------------------------------------------------------
    def _held_by(self, exclude: str = "") -> dict[str, int]:
        out: dict[str, int] = {}
        with self._lock:
            for h in self._held.values():
                if h.name != exclude:
                    out[h.name] = out.get(h.name, 0) + h.bytes
        return out

    def held_bytes(self) -> int:
        with self._lock:
            return sum(h.bytes for h in self._held.values())

    def state(self) -> MemoryState:
        held_by = self._held_by()
        return MemoryState(
            self.budget_bytes,
            self.baseline_bytes,
            sum(held_by.values()),
            self.rss(),
            held_by,
            self.unloads,
            self.refusals,
        )

    def describe(self) -> dict[str, Any]:
        s = self.state()
        return {
            "budget_mb": round(s.budget_bytes / _MB, 1),
            "baseline_mb": round(s.baseline_bytes / _MB, 1),
            "held_mb": {k: round(v / _MB, 1) for k, v in sorted(s.held_by.items())},
            "rss_mb": round(s.rss_bytes / _MB, 1),
            "unloads": s.unloads,
            "refusals": s.refusals,
        }
