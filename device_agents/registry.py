"""The registry: which models are installed (the store's active slots) and which are loaded
(an open runtime session), and the leases that requests hold on loaded ones.

- ``lease(name)`` holds the loaded model for one call; a lease is never handed out on a closed
  model: a model leaves the table before it is closed, and it is closed only once its last lease
  is released (``retire``). A model installed but not loaded (unloaded, or dropped after a hung
  call) is loaded on demand by the first lease.
- ``serve`` swaps the served model of a name (one dict assignment) and returns the one it
  replaced, still open; ``retire`` closes that one when idle.
- Under a memory budget, ``unload_lru`` unloads the least recently leased model, an idle one
  first (to make room for another); its next lease loads it again.
- During a new version's health window the version it replaced stays loaded (``hold``), so
  that ``count_failure`` can replay a request the new version failed to run on it, and a
  rollback is instant.
- The registry reads the store, never writes it: only the lifecycle does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Container, Mapping

import numpy as np

from device_agents.errors import ModelNotFoundError
from device_agents.metrics import AgentMetrics
from device_agents.runtimes import ServedModel
from device_agents.store import Slot, Store
from edgekit.bundle.errors import InferenceInputError

log = logging.getLogger("edgekit.agent")

_IDLE_WAIT_S = 30.0
_LOAD_ATTEMPTS = 3


class Loaded:
    """A loaded model, its version, and the number of leases held on it."""

    __slots__ = ("closed", "inflight", "last_used", "model", "retired", "version")

    def __init__(self, model: ServedModel, version: int) -> None:
        self.model = model
        self.version = version
        self.inflight = 0
        self.last_used = 0  # the lease count when it was last leased (least recently used first)
        self.retired = False  # out of the table; closed by the last release
        self.closed = False


class Lease:
    """A loaded model held for one call; ``release`` it (or use ``with``). ``model`` and
    ``version`` are its entry's (plain attributes: read a few times per request, and an entry's
    model and version never change)."""

    __slots__ = ("_entry", "_registry", "model", "version")

    def __init__(self, registry: Registry, entry: Loaded) -> None:
        self._registry, self._entry = registry, entry
        self.model: ServedModel = entry.model
        self.version: int = entry.version

    def release(self) -> None:
        self._registry._release(self._entry)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self._registry._release(self._entry)  # release(), one call less: the batcher's every call ends here


class Registry:
    """Installed vs loaded models; ``open_slot`` loads a store slot with its runtime."""

    def __init__(self, store: Store, open_slot: Callable[[Slot], ServedModel], metrics: AgentMetrics) -> None:
        self.store = store
        self.open_slot = open_slot
        self.metrics = metrics
        self._loaded: dict[str, Loaded] = {}
        # Guards _loaded and every Loaded.inflight. Held as ``with self._lock`` (a C call) rather
        # than ``with self._cond`` (Condition's __enter__/__exit__ are Python calls): a request
        # takes it twice, for its lease and its release. The same lock: notify/wait hold it.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._loading: dict[str, threading.Lock] = {}
        # The version a switch replaced, kept loaded through the new one's health window (when
        # the update client judges it) to replay the new version's failed requests: count_failure.
        self._probation: dict[str, Loaded] = {}
        # What a lease loads on demand instead of the active slot (the lifecycle serving a previous
        # version for now), or None: nothing (the active slot failed verification). ``serve`` clears it.
        self._pinned: dict[str, Slot | None] = {}
        self._refused: dict[str, str] = {}  # why a name pinned to nothing is refused (its requests' error)
        self._leases = 0  # leases taken so far: the recency of a Loaded's last_used

    # -- what is there ------------------------------------------------------------------
    def models(self) -> dict[str, int]:
        """Loaded model names and their versions."""
        with self._lock:
            return {name: e.version for name, e in sorted(self._loaded.items())}

    def installed(self) -> dict[str, int]:
        """Installed model names and their active versions (loaded or not)."""
        return {name: ms.active.version for name, ms in sorted(self.store.load_state().models.items()) if ms.active}

    # -- leases -------------------------------------------------------------------------
    def lease(self, name: str, version: int | None = None) -> Lease:
        """Hold model ``name`` (at ``version``, if given) for one call; load it if installed only."""
        lease = self._try_lease(name, version)
        if lease is not None:
            return lease
        with self._lock:
            entry = self._loaded.get(name)
        # A model another request loaded may be unloaded again (memory budget) before this one
        # leases it: load it again, a few times.
        for _ in range(_LOAD_ATTEMPTS):
            if entry is not None or name not in self.installed():
                break
            lease = self._load_on_demand(name, version)
            if lease is None:
                lease = self._try_lease(name, version)
            if lease is not None:
                return lease
            with self._lock:
                entry = self._loaded.get(name)
        if entry is None:
            with self._lock:
                refused = self._refused.get(name, "") if self._pinned.get(name, 0) is None else ""
            if refused:
                raise ModelNotFoundError(f"model {name!r} is not served: {refused}")
            known = ", ".join(self.models()) or "none"
            raise ModelNotFoundError(f"no model named {name!r} is served here (served: {known})")
        raise ModelNotFoundError(f"model {name!r} version {version} is not served (serving version {entry.version})")

    def get(self, name: str, version: int | None = None) -> ServedModel:
        """The loaded model (for metadata: not held; use ``lease`` to run it)."""
        with self.lease(name, version) as lease:
            return lease.model

    def _try_lease(self, name: str, version: int | None) -> Lease | None:
        with self._lock:
            entry = self._loaded.get(name)
            if entry is not None and (version is None or version == entry.version):
                entry.inflight += 1
                self._leases += 1
                entry.last_used = self._leases
                return Lease(self, entry)
        return None

    def _release(self, entry: Loaded) -> None:
        close = False
        with self._lock:
            entry.inflight -= 1
            if entry.inflight == 0 and entry.retired:  # only retire() waits, and only on a retired entry
                close = not entry.closed
                if close:
                    entry.closed = True
                self._cond.notify_all()
        if close:
            entry.model.close()

    # -- load / unload ------------------------------------------------------------------
    def _load_on_demand(self, name: str, version: int | None = None) -> Lease | None:
        """Load ``name``'s slot unless loaded; a lease on what it loaded when that is ``version``
        (taken with the load: nothing can unload it in between), else None."""
        with self._lock:
            lock = self._loading.setdefault(name, threading.Lock())
        with lock:
            with self._lock:
                if name in self._loaded:
                    return None
            with self._lock:
                pinned = name in self._pinned
                slot = self._pinned.get(name)
            if not pinned:
                slot = self.store.model_state(name).active
            if slot is None:
                return None
            log.info("%s: loading v%d on demand", name, slot.version)
            model = self.open_slot(slot)
            lease = None
            with self._lock:
                if name in self._loaded:  # the lifecycle served one meanwhile
                    raced = True
                else:
                    entry = self._loaded[name] = Loaded(model, slot.version)
                    raced = False
                    if version is None or version == slot.version:
                        entry.inflight += 1
                        self._leases += 1
                        entry.last_used = self._leases
                        lease = Lease(self, entry)
            if raced:
                model.close()
            else:
                self.metrics.model_version.labels(name).set(slot.version)
            return lease

    def serve(self, name: str, model: ServedModel, version: int) -> Loaded | None:
        """Make ``model`` the served one of ``name``; return the one it replaced (still open)."""
        with self._lock:
            previous = self._loaded.get(name)
            self._loaded[name] = Loaded(model, version)
            self._pinned.pop(name, None)
            self._refused.pop(name, None)
        self.metrics.model_version.labels(name).set(version)
        return previous

    def pin(self, name: str, slot: Slot | None, why: str = "") -> None:
        """Load ``slot`` on demand instead of the active one (None: load nothing) until ``serve``;
        ``why`` (with None) is what a request for ``name`` is told meanwhile."""
        with self._lock:
            self._pinned[name] = slot
            if slot is None and why:
                self._refused[name] = why
            else:
                self._refused.pop(name, None)

    def held_unloaded(self, name: str) -> bool:
        """True while nothing may load ``name`` on demand (``pin(name, None)``): unloaded or refused."""
        with self._lock:
            return name in self._pinned and self._pinned[name] is None

    def peek(self, name: str) -> Loaded | None:
        """The loaded entry of ``name``, not held (to read its latency window)."""
        with self._lock:
            return self._loaded.get(name)

    def drop_version(self, name: str, version: int) -> Loaded | None:
        """Take ``name`` out of the table (a later lease loads it again) only if ``version`` is still
        the one served; return it, still open."""
        with self._lock:
            entry = self._loaded.get(name)
            if entry is None or entry.version != version:
                return None
            return self._loaded.pop(name)

    def unload_lru(self, keep: Container[str] = (), drain_s: float = 0.0) -> str | None:
        """Unload and close the least recently leased model not in ``keep`` (to make room under
        the memory budget): one that no lease holds, else (``drain_s`` > 0) the least recently
        leased busy one, once its running calls end (up to ``drain_s``). Returns its name, or
        None when none could be taken. Out of the table, it cannot be leased meanwhile: no
        request runs on it once closed, and the next lease of its name loads it again."""
        with self._lock:
            candidates = [(e.inflight > 0, e.last_used, name) for name, e in self._loaded.items() if name not in keep]
            candidates.sort()
            if not candidates or (candidates[0][0] and drain_s <= 0):
                return None
            name = candidates[0][2]
            entry = self._loaded.pop(name)
        self.retire(entry, wait_s=drain_s)
        return name

    def drop_if(self, name: str, entry_model: ServedModel) -> Loaded | None:
        """Take ``name`` out of the table (a later lease loads it again) only if ``entry_model`` is
        still the one served (a hung call's model); return it, still open."""
        with self._lock:
            entry = self._loaded.get(name)
            if entry is None or entry.model is not entry_model:
                return None
            return self._loaded.pop(name)

    def retire(self, entry: Loaded, *, wait_s: float = _IDLE_WAIT_S) -> None:
        """Close ``entry`` (already out of the table) once no lease holds it.

        Waits up to ``wait_s`` for running calls; if some still run, the last release closes
        it: a model is never closed under a running call.
        """
        deadline = time.monotonic() + wait_s
        with self._lock:
            entry.retired = True
            while entry.inflight and time.monotonic() < deadline:
                self._cond.wait(timeout=0.5)
            close = entry.inflight == 0 and not entry.closed
            if close:
                entry.closed = True
        if close:
            entry.model.close()
        elif not entry.closed:  # (closed already: its last release did it meanwhile)
            log.warning(
                "v%d: %d calls still running after %.0f s; it is closed when the last one ends",
                entry.version,
                entry.inflight,
                wait_s,
            )

    def close_all(self, *, wait_s: float = _IDLE_WAIT_S) -> None:
        with self._lock:
            entries, self._loaded = list(self._loaded.values()), {}
            entries += list(self._probation.values())
            self._probation = {}
        for entry in entries:
            self.retire(entry, wait_s=wait_s)

    # -- the health window ------------------------------------------------------------------
    def hold_or_retire(self, name: str, replaced: Loaded, *, hold: bool) -> None:
        """Keep the replaced version loaded through the health window (for ``count_failure`` and
        an instant rollback) when ``hold`` (the lifecycle judges every switch's window); else retire it."""
        if not hold:
            self.retire(replaced)
            return
        with self._lock:
            older = self._probation.pop(name, None)
            self._probation[name] = replaced
        if older is not None:
            self.retire(older)

    def take_held(self, name: str) -> Loaded | None:
        """The replaced version held through the health window, out of probation (for a rollback)."""
        with self._lock:
            return self._probation.pop(name, None)

    def end_probation(self, name: str) -> None:
        held = self.take_held(name)
        if held is not None:
            self.retire(held)

    def count_failure(self, name: str, version: int, inputs: Mapping[str, np.ndarray]) -> bool:
        """Record that ``name`` v``version`` failed to run ``inputs`` (a runtime error, after the
        request passed the served signature). It counts against the version, in
        ``edgekit_model_failures``, unless the version it replaced, still loaded in the health
        window, fails on the same inputs too: then the input is at fault, not the update.
        Returns whether it counted."""
        with self._lock:
            held = self._probation.get(name)
            if held is not None:
                held.inflight += 1
        if held is not None:
            try:
                held.model.infer(inputs)
            except InferenceInputError:
                pass  # the previous version takes other inputs: nothing to compare, so it counts
            except Exception:  # the previous version fails on these inputs too (whatever the runtime raises)
                log.info("%s: v%d failed a request v%d fails too; not counted against it", name, version, held.version)
                return False
            finally:
                self._release(held)
        self.metrics.model_failures.labels(name).inc()
        return True
