"""Verification at rest: installed slots checked again against their signed manifests.

A slot's files were hashed when it was staged; a flipped bit on disk, an edited file or a key
revoked since then would otherwise go unnoticed until the model serves garbage. ``check_slot``
re-checks the signature over the slot's ``manifest.json`` with today's trust store (revoked
keys refused) and every listed file's length and SHA-256, and says whether a failure is
*definitive* (content or trust changed: the slot is bad) or *transient* (a file missing or
unreadable: storage not mounted yet, an I/O error; it may come back, and must never demote a
version by itself). The lifecycle runs it at start and every ``verify_interval_s``
(``PeriodicCheck``); ``retry_delays`` spaces its retries of a transient failure at start.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from device_agents.errors import StoreError
from device_agents.store import ModelState, Slot, State, Store
from device_agents.threads import NamedThread
from edgekit.bundle import TrustStore
from edgekit.bundle.errors import BundleError, ManifestError
from edgekit.bundle.manifest import utc_now

log = logging.getLogger("edgekit.agent")


@dataclass(frozen=True)
class AtRest:
    """The outcome of ``check_slot``: ``ok``, or why not and whether it may pass on its own."""

    ok: bool
    transient: bool = False
    why: str = ""


def check_slot(store: Store, slot: Slot, trust: TrustStore) -> AtRest:
    """Verify ``slot``'s files and signature at rest (see the module docstring)."""
    try:
        store.verify_slot(slot, trust)
    except BundleError as exc:  # SignatureError included: a bad or revoked signature is definitive
        return AtRest(False, _caused_by_os_error(exc), str(exc))
    except ManifestError as exc:  # signed, yet not a manifest this agent reads: definitive too
        return AtRest(False, False, str(exc))
    except (OSError, StoreError) as exc:
        return AtRest(False, True, str(exc))
    return AtRest(True)


def rebuild_state(store: Store, trust: TrustStore) -> tuple[State, list[str]]:
    """A state for ``store`` from the slots on its disk, when ``state.json`` and its backup are
    both unreadable: every slot is verified at rest (signature by a key ``trust`` still accepts,
    every file's length and hash); per model the newest verified version is active and the next
    newest previous. Returns the state and one line per slot on what was done with it.

    What the lost file knew and the disk does not is noted in each model's ``error``: the
    anti-rollback counter restarts at the highest version a trusted key signed for the model on
    disk (a slot whose files changed still has its signed manifest: an older version is not let
    back in by the loss), and the active version's health is taken as confirmed (it is the newest
    that verifies, so the crash-loop guard has nothing known better to go back to)."""
    found: dict[str, list[Slot]] = {}
    signed: dict[str, int] = {}  # model -> highest version with a valid signature, files or not
    notes = []
    for slot in store.slot_dirs():
        name = Path(slot.path).parent.name
        with contextlib.suppress(BundleError, ManifestError, OSError):
            store.verify_slot_signature(slot, trust)
            if store.manifest_of(slot).name == name:
                signed[name] = max(signed.get(name, 0), slot.version)
        check = check_slot(store, slot, trust)
        if not check.ok:
            notes.append(f"{slot.path}: left out, it does not verify ({check.why})")
            continue
        m = store.manifest_of(slot)
        if (m.name, m.version) != (name, slot.version):
            notes.append(f"{slot.path}: left out, it holds {m.name} v{m.version}")
            continue
        found.setdefault(name, []).append(slot)
    models = {}
    for name, slots in sorted(found.items()):
        newest = sorted(slots, key=lambda s: s.version, reverse=True)
        active = newest[0]
        previous = next((s for s in newest[1:] if s.version < active.version), None)
        counter = max(active.version, signed.get(name, 0))
        why = (
            f"state rebuilt from the verified slots on disk: v{active.version} active"
            + (f", v{previous.version} previous" if previous else "")
            + f"; the anti-rollback counter restarts at v{counter}, the highest version signed for it on disk"
        )
        models[name] = ModelState(
            max_version=counter, active=active, previous=previous, status="rebuilt", error=why,
            updated=utc_now(), active_healthy=True,
        )  # fmt: skip
        notes.append(f"{name}: {why}")
    return State(models=models), notes


def _caused_by_os_error(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError):
            return True
        seen = seen.__cause__
    return False


def retry_delays(attempts: int, base_s: float, max_s: float, rng: random.Random | None = None) -> Iterator[float]:
    """``attempts - 1`` delays, doubling from ``base_s`` up to ``max_s``, each jittered over its
    upper half ("equal jitter": never near zero, so the retries span at least half the ladder)."""
    rng = rng or random.Random()
    for i in range(attempts - 1):
        ceiling = min(max_s, base_s * 2**i)
        yield ceiling / 2 + rng.uniform(0.0, ceiling / 2)


class PeriodicCheck:
    """A daemon thread calling ``fn`` every ``interval_s`` until ``stop``; ``fn`` must not raise
    on purpose, and whatever it raises is logged (the thread goes on: a supervisor loop)."""

    def __init__(self, interval_s: float, fn: Callable[[], object], name: str = "edgekit-verify-at-rest") -> None:
        self.interval_s = interval_s
        self._fn = fn
        self._stop = threading.Event()
        self._thread = NamedThread(target=self._run, name=name, daemon=True)

    def start(self) -> PeriodicCheck:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._fn()
            except Exception:  # supervisor loop: one failed round must not end the checks
                log.exception("verification at rest failed; trying again in %g s", self.interval_s)
