"""The lifecycle: install transaction, self-test, switch, health window, rollback; the only
writer of the store (the update client and the CLI ask it). What is loaded and leased lives in
the registry (``device_agents.registry``); the lifecycle tells it what to serve.

``install`` takes a bundle from a sideload, the CLI or the update client through the same steps,
under the store's writer lock::

    verify + stage (store.stage: signature, hashes, version, expiry, compatibility, then extract)
    -> self-test in a child process (golden vectors, p50 latency, memory and time bounds)
    -> load in-process -> promote (durable) -> registry.serve (swap) -> retire the old one
    -> cleanup

Any failure before ``promote`` leaves the previous version serving. The swap is one dict
assignment; requests that hold the old model finish on it, and it is closed only when idle.

Named fault points (``EDGEKIT_FAULT``) sit between the steps; what the store says after each:
``verify`` nothing written; ``stage`` candidate staged; ``selftest`` status "testing";
``switch`` self-test passed, status "switching", not promoted; ``commit`` promoted (the new
version serves after a restart); ``cleanup`` promoted, old runtime closed.

After a switch, whatever installed the bundle (the CLI, the HTTP install route, an MQTT notice),
the new version serves through its health window (``device_agents.health``): the version it
replaced stays loaded, a request the new one fails to run is replayed on it, and the lifecycle
rolls back when the new version fails clearly more often on real traffic; the update client
asks for the verdict (``health_verdict``) and reports it.

``start`` recovers after a crash: an install that was interrupted before ``promote`` is dropped
(the previous version keeps serving); a version that keeps the agent from running through its
health window for ``crash_loop_boots`` starts is rolled back; a state file and backup that are
both unreadable are rebuilt from the slots on disk that verify, instead of stopping every start.
"""

from __future__ import annotations

import difflib
import logging
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NoReturn

from device_agents.budgets.knobs import options_for_load
from device_agents.budgets.memory import MemoryBudgetError
from device_agents.budgets.state import Budgets
from device_agents.config import DEFAULT_CRASH_LOOP_BOOTS, DEFAULT_HEALTH_WINDOW_S, AgentConfig
from device_agents.errors import ModelNotFoundError, SelfTestError, StoreError
from device_agents.faults import fault_point
from device_agents.health import HealthWindows, Verdict
from device_agents.integrity import PeriodicCheck, check_slot, rebuild_state, retry_delays
from device_agents.metrics import AgentMetrics
from device_agents.platforms.compatibility import check_compatible
from device_agents.registry import Loaded, Registry
from device_agents.runtimes import ServedModel, load_model
from device_agents.runtimes.runs_on import runs_on
from device_agents.selftest import REPORT_NAME, SelfTestReport, latency_verdict, run_selftest
from device_agents.store import ModelState, Slot, StateUnreadableError, Store, atomic_write
from device_agents.threads import NamedThread
from device_agents.updates.trust import bundle_trust
from device_agents.validation_mark import check_validation_mark
from edgekit.bundle import TrustStore
from edgekit.bundle.errors import BundleError, ManifestError, SignatureError
from edgekit.bundle.manifest import Manifest

log = logging.getLogger("edgekit.agent")

# Statuses set here in addition to the store's: "healthy" = ran through its health window.
INTERRUPTED = ("staged", "testing", "switching")
# A slot that may be briefly unavailable at start (storage not mounted yet, memory pressure) is
# tried BOOT_ATTEMPTS times, the delays doubling from BOOT_RETRY_BASE_S (equal jitter): 3.75-7.5 s.
BOOT_ATTEMPTS = 5
BOOT_RETRY_BASE_S = 0.5
BOOT_RETRY_MAX_S = 8.0
_MIN_LIVE_SAMPLES = 5  # live requests in the self-test's window that make a baseline


@dataclass(frozen=True)
class InstallResult:
    name: str
    version: int
    changed: bool  # False: this version was already active (re-install is a no-op)
    previous_version: int | None
    origin: str
    selftest: SelfTestReport | None = None


class Lifecycle:
    def __init__(self, config: AgentConfig, *, metrics: AgentMetrics | None = None) -> None:
        self.config = config
        self.store = Store(config.store)
        # the config's keys, plus the fleet's keys document where one was accepted (updates.trust)
        self.trust: TrustStore = bundle_trust(config)
        self.metrics = metrics or AgentMetrics()
        self.registry = Registry(self.store, lambda slot: self._open(slot, on_demand=True), self.metrics)
        # [budgets]: model loads are admitted by its memory budget (which unloads idle models via the registry)
        self.budgets = Budgets(config.budgets, config.store, retry_after_s=config.server.retry_after_s)
        if self.budgets.memory is not None:
            self.budgets.memory.evict = self.registry.unload_lru
        self.budgets.register(self.metrics.registry)
        self.health_window_s = config.updates.health_window_s if config.updates else DEFAULT_HEALTH_WINDOW_S
        # every switched-to version's health window, whatever installed it (health.py)
        self.health = HealthWindows(
            self.metrics,
            self.health_window_s,
            serving=lambda name: self.registry.models().get(name),
            rollback=self.rollback,
            healthy=self._end_window,
        )
        self.crash_loop_boots = config.updates.crash_loop_boots if config.updates else DEFAULT_CRASH_LOOP_BOOTS
        self.ready = False
        self._rest_checks: PeriodicCheck | None = None

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        """Recover the store after a crash and load every model's active version."""
        self.budgets.start()
        with self.store.lock():
            if not self._rebuild_unreadable_state():
                self.store.cleanup()  # (after a rebuild, nothing is removed: a slot left out may be wanted)
            for name, ms in sorted(self.store.load_state().models.items()):
                ms = self._recover(name, ms)
                if ms.active is not None:
                    self._boot(name, ms, ms.active)
        self.ready = True
        if self.config.verify_interval_s > 0:
            self._rest_checks = PeriodicCheck(self.config.verify_interval_s, self.check_at_rest).start()

    def _rebuild_unreadable_state(self) -> bool:
        """When ``state.json`` and its backup are both unreadable, set them aside and write a state
        rebuilt from the verified slots on disk (``integrity.rebuild_state``), each step logged.
        Returns whether it did."""
        try:
            self.store.load_state()
            return False
        except StateUnreadableError as exc:
            log.error("%s", exc)
        state, notes = rebuild_state(self.store, self.trust)
        moved = self.store.set_aside_state()
        self.store.save_state(state)
        for note in notes:
            log.warning("state rebuilt: %s", note)
        log.error(
            "state rebuilt from the verified slots on disk: %d model(s) (%s); the unreadable files are kept as %s",
            len(state.models),
            ", ".join(f"{n} v{ms.active.version}" for n, ms in state.models.items() if ms.active) or "none",
            ", ".join(str(p) for p in moved),
        )
        return True

    def stop(self, *, clean: bool = True) -> None:
        """Close every runtime (after its running requests finish).

        ``clean``: an orderly shutdown (SIGTERM, end of ``install``), which must not count as a
        crash against a version still in its health window: the start that counted it is taken
        back. ``clean=False`` leaves the count as a crash would (used to simulate one).
        """
        self.ready = False
        if self._rest_checks is not None:
            self._rest_checks.stop()
        self.health.stop()
        if clean:
            self._uncount_this_start()
        self.registry.close_all()
        self.budgets.stop()

    def _uncount_this_start(self) -> None:
        try:
            with self.store.lock(timeout_s=5.0):
                for name, ms in self.store.load_state().models.items():
                    if not ms.active_healthy and ms.boots_since_switch > 0:
                        self.store.update_model(name, lambda s: replace(s, boots_since_switch=s.boots_since_switch - 1))
        except StoreError as exc:  # shutting down: a crash-loop count one too high is the safe side
            log.warning("could not record the clean stop: %s", exc)

    def _recover(self, name: str, ms: ModelState) -> ModelState:
        """The state after a crash: an interrupted install dropped, a crash-looping version rolled
        back, an unconfirmed version's start counted. A write that fails (a full disk) is logged
        and the new state used in memory: the active version serves, and the next successful
        write records the rest."""
        if ms.status in INTERRUPTED and ms.candidate is not None:
            why = f"interrupted while {ms.status} v{ms.candidate.version} (agent stopped mid-install); install it again"
            log.warning("%s: %s", name, why)
            return self._write_or_keep(
                name,
                lambda: self.store.reject_candidate(name, why),
                replace(ms, candidate=None, status="failed", error=why),
            )
        if ms.active is not None and not ms.active_healthy:
            boots = ms.boots_since_switch + 1
            if boots >= self.crash_loop_boots and ms.previous is not None:
                why = (
                    f"crash loop: v{ms.active.version} did not run {self.health_window_s:g} s without the agent "
                    f"restarting ({boots} starts); rolled back to v{ms.previous.version}"
                )
                log.error("%s: %s", name, why)
                self.metrics.rollbacks.labels(name).inc()
                # in memory as Store.rollback writes it
                rolled = replace(ms, active=ms.previous, previous=None, candidate=None, status="rolled_back",
                                 error=why, active_healthy=True, boots_since_switch=0)  # fmt: skip
                return self._write_or_keep(name, lambda: self.store.rollback(name, why), rolled)
            return self._write_or_keep(
                name,
                lambda: self.store.update_model(name, lambda s: replace(s, boots_since_switch=boots)),
                replace(ms, boots_since_switch=boots),
            )
        return ms

    def _write_or_keep(self, name: str, write: Callable[[], ModelState], in_memory: ModelState) -> ModelState:
        try:
            return write()
        except StoreError as exc:
            log.error("%s: could not record the state (%s); serving goes on with it in memory", name, exc)
            return in_memory

    def _boot(self, name: str, ms: ModelState, active: Slot) -> None:
        """Serve ``active`` at start. It is verified at rest first: files changed or a signer
        revoked since the install roll back to the previous slot if that one verifies. A
        failure that may pass (a file missing or unreadable, a runtime that does not load a
        verified artifact: memory pressure, a device not ready) is retried with backoff, and
        then the previous version is served *for now*, the slots untouched: a transient never
        demotes or blacklists a version (the crash-loop guard still ends a persistent one)."""
        why = ""
        for delay in [*retry_delays(BOOT_ATTEMPTS, BOOT_RETRY_BASE_S, BOOT_RETRY_MAX_S), None]:
            check = check_slot(self.store, active, self.trust)
            if not check.ok and not check.transient:
                self._boot_refused_at_rest(name, ms, active, check.why)
                return
            if check.ok:
                try:
                    model = self._open(active)
                except MemoryBudgetError as exc:  # not transient: retrying does not free memory
                    refused = f"not loaded: {exc}"
                    log.error("%s: v%d %s", name, active.version, refused)
                    self._record(name, lambda s, why=refused: replace(s, error=why))  # type: ignore[misc]  # bound now (B023)
                    return
                except Exception as exc:  # a runtime may raise anything; retried, then the previous serves
                    why = f"does not load ({type(exc).__name__}: {exc})"
                else:
                    self.registry.serve(name, model, active.version)
                    if ms.status == "degraded":  # an earlier start served the previous version for now
                        self._record(name, lambda s: replace(s, status="serving", error=""))
                    if not ms.active_healthy:
                        self.health.open(name, active.version, None)  # restarted inside its window
                    return
            else:
                why = f"cannot be verified ({check.why})"
            if delay is None:
                break
            log.warning("%s: v%d %s; trying again in %.1f s", name, active.version, why, delay)
            time.sleep(delay)
        self._serve_previous_for_now(name, ms, active, f"v{active.version} {why} after {BOOT_ATTEMPTS} attempts")

    def _boot_refused_at_rest(self, name: str, ms: ModelState, active: Slot, problem: str) -> None:
        why = f"v{active.version} failed verification at rest ({problem})"
        log.error("%s: %s", name, why)
        self.metrics.verify_failures.labels(name).inc()
        prev = ms.previous
        prev_check = check_slot(self.store, prev, self.trust) if prev is not None else None
        if prev is None or prev_check is None or not prev_check.ok:
            also = f"v{prev.version} fails too ({prev_check.why})" if prev is not None and prev_check else "no previous"
            why = f"{why}; {also}: nothing verified to serve; install a good version"
            self.registry.pin(name, None)  # no request loads the refused slot on demand
            self._record(name, lambda s: replace(s, status="failed", error=why))
            return
        why = f"{why}; rolled back to v{prev.version}"
        self.metrics.rollbacks.labels(name).inc()
        rolled = replace(ms, active=prev, previous=None, candidate=None, status="rolled_back", error=why,
                         active_healthy=True, boots_since_switch=0)  # fmt: skip
        self._boot(name, self._write_or_keep(name, lambda: self.store.rollback(name, why), rolled), prev)

    def _serve_previous_for_now(self, name: str, ms: ModelState, active: Slot, why: str) -> None:
        prev = ms.previous
        if prev is not None and check_slot(self.store, prev, self.trust).ok:
            try:
                self.registry.serve(name, self._open(prev), prev.version)
            except Exception as exc:  # a runtime may raise anything
                why = f"{why}; v{prev.version} does not load either ({exc})"
            else:
                self.registry.pin(name, prev)  # a reload on demand (after a hung call) loads it too
                kept = f"v{active.version} stays installed: the next start tries it"
                why = f"{why}; serving v{prev.version} for now ({kept})"
                log.error("%s: %s", name, why)
                self._record(name, lambda s: replace(s, status="degraded", error=why))
                return
        why = f"{why}; nothing else to serve (v{active.version} stays installed: the next start tries it)"
        log.error("%s: %s", name, why)
        self.registry.pin(name, None)
        self._record(name, lambda s: replace(s, status="degraded", error=why))

    def check_at_rest(self) -> dict[str, str]:
        """Verify every served model's active slot at rest; a definitive failure rolls back to
        the previous slot (if it verifies) or stops serving the model. Returns model -> problem
        for the slots that failed (transient ones are only logged: the loaded model serves on)."""
        problems = {}
        for name, version in self.models().items():
            active = self.store.model_state(name).active
            if active is None or active.version != version:
                continue  # serving a previous version for now; the next start checks again
            check = check_slot(self.store, active, self.trust)
            if check.ok:
                continue
            problems[name] = check.why
            if check.transient:
                log.warning("%s: v%d cannot be verified at rest (%s); serving on", name, version, check.why)
                continue
            self._refused_at_rest_while_serving(name, active, check.why)
        return problems

    def _refused_at_rest_while_serving(self, name: str, active: Slot, problem: str) -> None:
        why = f"v{active.version} failed verification at rest ({problem})"
        log.error("%s: %s", name, why)
        self.metrics.verify_failures.labels(name).inc()
        prev = self.store.model_state(name).previous
        if prev is not None and check_slot(self.store, prev, self.trust).ok:
            try:
                self.rollback(name, f"{why}; rolled back to v{prev.version}", only_if_active=active)
                return
            except Exception as exc:  # a runtime may raise anything; stop serving the bad slot anyway
                why = f"{why}; rollback to v{prev.version} failed ({exc})"
        entry = self.registry.drop_version(name, active.version)
        if entry is None:
            return  # replaced meanwhile (an install): nothing of the bad slot serves
        self.registry.pin(name, None)  # no request loads the refused slot on demand
        self.registry.retire(entry)
        self.metrics.model_version.labels(name).set(0)
        why = f"{why}; no longer served: install a good version"
        log.error("%s: %s", name, why)
        self._record(name, lambda s: replace(s, status="failed", error=why), lock=True)

    def apply_trust(self, trust: TrustStore) -> list[tuple[str, str]]:
        """Take ``trust`` (a keys document was accepted: keys added, narrowed or revoked) and stop
        serving, at once, every installed model whose served slot it no longer accepts (the
        signature is checked, not the files: that is quick). Its requests are refused meanwhile,
        saying why; then, off the caller's thread, each such model is rolled back to its previous
        slot where that one verifies with ``trust``, else recorded as failed. Returns (model, why)
        for each model stopped."""
        self.trust = trust
        stopped: list[tuple[str, Slot, str, Loaded | None, bool]] = []
        for name, ms in sorted(self.store.load_state().models.items()):
            entry = self.registry.peek(name)
            slot = _served_slot(ms, entry.version if entry is not None else None)
            if slot is None:
                continue
            try:
                self.store.verify_slot_signature(slot, trust)
                continue
            except SignatureError as exc:
                why = f"v{slot.version} is signed by a key no longer trusted ({exc})"
            except (OSError, BundleError, ManifestError):
                continue  # unreadable now: verification at rest judges it
            unloaded = entry is None and self.registry.held_unloaded(name)  # by the operator: stays so
            self.registry.pin(name, None, f"{why}; install a version signed by a trusted key")
            dropped = self.registry.drop_version(name, slot.version) if entry is not None else None
            self.metrics.verify_failures.labels(name).inc()
            log.error("%s: %s: no longer served", name, why)
            stopped.append((name, slot, why, dropped, not unloaded))
        if stopped:
            NamedThread(target=self._after_revocation, args=(stopped,), name="edgekit-revoked", daemon=True).start()
        return [(name, why) for name, _, why, _, _ in stopped]

    def _after_revocation(self, stopped: list[tuple[str, Slot, str, Loaded | None, bool]]) -> None:
        """``apply_trust``'s second half: roll back where a previous slot verifies, record the rest
        as failed, then close what it dropped (once its running calls end)."""
        for name, slot, why, dropped, may_roll_back in stopped:
            prev = self.store.model_state(name).previous
            rolled = False
            if may_roll_back and prev is not None and prev != slot and check_slot(self.store, prev, self.trust).ok:
                try:
                    self.rollback(name, f"{why}; rolled back to v{prev.version}", only_if_active=slot)
                    rolled = True
                except Exception as exc:  # a runtime may raise anything; the model stays unserved
                    why = f"{why}; rollback to v{prev.version} failed ({exc})"
            if not rolled:
                self.registry.end_probation(name)
                self.metrics.model_version.labels(name).set(0)
                failed = f"{why}; no longer served: install a version signed by a trusted key"
                log.error("%s: %s", name, failed)
                self._record(name, lambda s, why=failed: replace(s, status="failed", error=why), lock=True)  # type: ignore[misc]  # bound now (B023)
            if dropped is not None:
                self.registry.retire(dropped)

    def _record(self, name: str, fn: Callable[[ModelState], ModelState], *, lock: bool = False) -> None:
        """A bookkeeping write to the store: logged when it fails, and serving goes on."""
        try:
            if lock:
                with self.store.lock():
                    self.store.update_model(name, fn)
            else:
                self.store.update_model(name, fn)
        except StoreError as exc:
            log.error("%s: could not record the state (%s); serving goes on", name, exc)

    # -- install ------------------------------------------------------------------------
    def install(self, bundle_path: Path, *, origin: str = "sideload") -> InstallResult:
        """Verify, self-test and switch to the bundle; raise (and keep serving the old one) on failure.

        Raises ``SignatureError``, ``ExpiredError``, ``RollbackError``, ``IncompatibleError``,
        ``BundleError`` (before anything is opened), ``SelfTestError`` (candidate rejected) or
        ``StoreError``.
        """
        bundle_path = Path(bundle_path)
        log.info("install %s (from %s)", bundle_path, origin)
        with self.store.lock():
            fault_point("verify")
            before = self.store.load_state()
            staged = self.store.stage(
                bundle_path, self.trust, compatible=self._admissible, max_bundle_bytes=self.config.max_bundle_bytes
            )
            m, slot = staged.manifest, staged.slot
            old = before.models.get(m.name, ModelState())
            if old.active is not None and slot == old.active:
                log.info("%s v%d is already installed; nothing to do", m.name, m.version)
                self.metrics.installs.labels(m.name, "unchanged").inc()
                return InstallResult(m.name, m.version, False, m.version, origin)
            fault_point("stage")
            self.store.update_model(m.name, lambda s: replace(s, status="testing"))
            fault_point("selftest")
            report = self._selftest(m.name, slot, m.validation.latency_p50_ms)
            if not report.passed:
                self._reject(m.name, f"v{m.version} failed its self-test: {report.reason}", old)
            self.store.update_model(m.name, lambda s: replace(s, status="switching"))
            try:
                model = self._load(slot, m)
            except MemoryBudgetError as exc:
                self._reject(m.name, f"v{m.version} passed its self-test but does not fit: {exc}", old)
            except Exception as exc:  # a runtime may raise anything; the old version keeps serving
                self._reject(m.name, f"v{m.version} passed its self-test but does not load in the agent: {exc}", old)
            fault_point("switch")
            try:
                self.store.promote(m.name)
            except StoreError:
                model.close()
                raise
            previous = self.registry.serve(m.name, model, m.version)
            self.metrics.installs.labels(m.name, "installed").inc()
            log.info(
                "%s: now serving v%d (was %s)", m.name, m.version, f"v{old.active.version}" if old.active else "none"
            )
            fault_point("commit")
            if previous is not None:  # held through the health window: replays, an instant rollback
                self.registry.hold_or_retire(m.name, previous, hold=True)
            fault_point("cleanup")
            self.store.cleanup()
        self.health.open(m.name, m.version, old.active.version if old.active else None)
        return InstallResult(m.name, m.version, True, old.active.version if old.active else None, origin, report)

    def _admissible(self, manifest: Manifest) -> None:
        """Run on the verified manifest before anything is extracted: this device runs it, its
        validation mark is acceptable, and its [models] table can serve it."""
        check_compatible(manifest)
        check_validation_mark(manifest, self.config.allow_failed_validation)
        self.config.model(manifest.name).check(manifest.name, manifest)
        if self.budgets.memory is not None:
            self.budgets.memory.check_installable(manifest)

    def _selftest(self, name: str, slot: Slot, host_p50_ms: float | None) -> SelfTestReport:
        cfg = self.config.selftest
        active = self.store.model_state(name).active
        report = run_selftest(
            self.store.model_dir(slot),
            timeout_s=cfg.timeout_s,
            memory_mb=cfg.memory_mb,
            options=self.config.runtimes_for(name),
            work_dir=self.store.root / "tmp",
            baseline_dir=self.store.model_dir(active) if active is not None and active != slot else None,
            containment=cfg.containment,
        )
        report = self._with_baseline(name, report, host_p50_ms)
        # Only a baseline measured on this device gates: the host that packaged the bundle is
        # another machine (often far faster than the device), so its p50 is reported, never
        # enforced; a first install has nothing on this device to compare with.
        if report.passed and report.baseline_source != "host":
            verdict = latency_verdict(
                report.latency_p50_ms, report.baseline_p50_ms, cfg.latency_slack, cfg.latency_floor_ms
            )
            if verdict:
                verdict += f" ({report.baseline_source or 'no'} baseline)"
            report = replace(report, passed=not verdict, reason=verdict)
        atomic_write(self.store.model_dir(slot) / REPORT_NAME, report.to_json())
        self.metrics.selftests.labels(name, "passed" if report.passed else "failed").inc()
        if report.latency_p50_ms is not None:
            self.metrics.selftest_p50_seconds.labels(name).set(report.latency_p50_ms / 1000)
        log.info(
            "%s v%d self-test %s (p50 %s ms, baseline %s ms %s, %.1f s)%s",
            name,
            slot.version,
            "passed" if report.passed else "FAILED",
            report.latency_p50_ms,
            report.baseline_p50_ms,
            report.baseline_source or "none",
            report.duration_s,
            f": {report.reason}" if report.reason else "",
        )
        return report

    def _with_baseline(self, name: str, report: SelfTestReport, host_p50_ms: float | None) -> SelfTestReport:
        """What the candidate's p50 is compared with, best first: the serving version timed side
        by side in the child; the serving version's live requests over the same window (when
        the child could not hold both); its self-test p50 recorded at install; the host's (shown
        in the report, not enforced)."""
        if report.baseline_source == "side_by_side" or report.latency_p50_ms is None:
            return report
        entry = self.registry.peek(name)
        if entry is not None and report.latency_window_s is not None:
            p50, count = entry.model.latency.p50_between(*report.latency_window_s)
            if p50 is not None and count >= _MIN_LIVE_SAMPLES:
                return replace(report, baseline_p50_ms=p50, baseline_source="live")
        prev = self.selftest_report(name)  # the active (about to be previous) version's, on this device
        if prev is not None and prev.latency_p50_ms:
            return replace(report, baseline_p50_ms=prev.latency_p50_ms, baseline_source="recorded")
        if host_p50_ms:
            return replace(report, baseline_p50_ms=host_p50_ms, baseline_source="host")
        return report

    def _reject(self, name: str, why: str, old: ModelState) -> NoReturn:
        self.store.reject_candidate(name, why)
        self.store.cleanup()
        self.metrics.installs.labels(name, "rejected").inc()
        keeps = f"v{old.active.version} keeps serving" if old.active else "nothing is served"
        log.error("%s: %s; %s", name, why, keeps)
        raise SelfTestError(f"{name}: {why}; {keeps}")

    # -- rollback and health ------------------------------------------------------------
    def rollback(self, name: str, reason: str, *, only_if_active: Slot | None = None) -> ModelState:
        """Serve the previous version again (e.g. after a failed health check).

        ``only_if_active``: do nothing (return the state) unless that slot is still the active
        one (a check that ran without the lock, like verification at rest, and an install since)."""
        with self.store.lock():
            current = self.store.model_state(name)
            if only_if_active is not None and current.active != only_if_active:
                return current
            target = current.previous
            if target is None:
                raise StoreError(f"{name}: no previous version to roll back to")
            check = check_slot(self.store, target, self.trust)
            if not check.ok:
                raise StoreError(f"{name}: the previous version v{target.version} fails verification ({check.why})")
            held = self.registry.take_held(name)  # the replaced version, still loaded in the health window: instant
            if held is not None and held.version != target.version:
                self.registry.retire(held)
                held = None
            model = held.model if held is not None else self._open(target)  # before the state changes
            try:
                ms = self.store.rollback(name, reason)
            except StoreError:
                if held is not None:
                    self.registry.hold_or_retire(name, held, hold=True)
                else:
                    model.close()
                raise
            previous = self.registry.serve(name, model, target.version)
        self.metrics.rollbacks.labels(name).inc()
        self.health.switched(name)
        log.warning("%s: rolled back to v%d: %s", name, target.version, reason)
        if previous is not None:
            self.registry.retire(previous)
        return ms

    def installed_state(self, name: str) -> ModelState:
        """``name``'s state if it has a version installed; else ``ModelNotFoundError`` naming the nearest."""
        models = self.store.load_state().models
        ms = models.get(name)
        if ms is not None and ms.active is not None:
            return ms
        installed = sorted(n for n, s in models.items() if s.active is not None)
        near = difflib.get_close_matches(name, installed, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ModelNotFoundError(
            f"no model named {name!r} is installed (installed: {', '.join(installed) or 'none'}){hint}"
        )

    def operator_rollback(self, name: str, *, origin: str = "cli") -> ModelState:
        """Serve ``name``'s previous slot again because the operator asked; recorded in its state."""
        ms = self.installed_state(name)
        if ms.previous is None:
            raise StoreError(
                f"{name}: v{ms.active.version if ms.active else '?'} has no previous version kept to roll back to"
            )
        return self.rollback(name, f"rolled back by the operator ({origin})")

    def uninstall(self, name: str, *, origin: str = "cli") -> ModelState:
        """Stop serving ``name`` and remove its slots and files. Its version counter stays: a later
        install of ``name`` must still be newer than anything installed before (anti-rollback)."""
        with self.store.lock():
            old = self.installed_state(name)
            why = f"uninstalled by the operator ({origin})"
            ms = self.store.update_model(
                name,
                lambda s: replace(
                    s,
                    active=None,
                    candidate=None,
                    previous=None,
                    status="uninstalled",
                    error=why,
                    active_healthy=False,
                    boots_since_switch=0,
                ),
            )
            served = self.registry.drop_version(name, old.active.version) if old.active else None
            held = self.registry.take_held(name)
            shutil.rmtree(self.store.root / "models" / name, ignore_errors=True)  # no slot references it now
            self.store.cleanup()  # and its kept bundles with it
        for entry in (served, held):
            if entry is not None:
                self.registry.retire(entry)
        log.warning("%s: v%d %s", name, old.active.version if old.active else 0, why)
        return ms

    def unload(self, name: str) -> None:
        """Stop serving ``name`` until ``load`` (or the agent's next start); it stays installed
        (Triton's unload). Running requests finish on it."""
        ms = self.installed_state(name)
        self.registry.pin(name, None)  # no request loads it again on demand
        entry = self.registry.peek(name)
        for dropped in (
            self.registry.drop_version(name, entry.version) if entry else None,
            self.registry.take_held(name),
        ):
            if dropped is not None:
                self.registry.retire(dropped)
        log.info("%s: v%d unloaded on request", name, ms.active.version if ms.active else 0)

    def load(self, name: str) -> int:
        """Serve ``name``'s active version (Triton's load): verified at rest first, loaded unless it is."""
        active = self.installed_state(name).active
        if active is None:  # installed_state returns only installed ones; says so to mypy
            raise ModelNotFoundError(f"no model named {name!r} is installed")
        loaded = self.registry.peek(name)
        if loaded is not None and loaded.version == active.version:
            return active.version
        check = check_slot(self.store, active, self.trust)
        if not check.ok:
            raise StoreError(f"{name}: v{active.version} fails verification ({check.why}); install it again")
        previous = self.registry.serve(name, self._open(active), active.version)
        if previous is not None:
            self.registry.retire(previous)
        log.info("%s: v%d loaded on request", name, active.version)
        return active.version

    def record_notice(self, name: str, notice_id: str, issued: str) -> None:
        """Remember an update notice as handled for ``name`` (the update client's replay guard), durably."""
        if self.store.model_state(name).last_notice_id == notice_id:
            return
        with self.store.lock():
            self.store.update_model(name, lambda s: replace(s, last_notice_id=notice_id, last_notice_issued=issued))

    def mark_healthy(self, name: str) -> None:
        """Confirm a switched-to version (ends its crash-loop watch)."""
        with self.store.lock():
            ms = self.store.model_state(name)
            if ms.active is not None and not ms.active_healthy:
                self.store.update_model(
                    name,
                    lambda s: replace(
                        s,
                        active_healthy=True,
                        boots_since_switch=0,
                        status="healthy" if s.status == "serving" else s.status,  # keep a later rejection's
                    ),
                )
                log.info("%s: v%s is healthy", name, ms.active.version if ms.active else "?")

    def _end_window(self, name: str) -> None:
        """A version ran through its health window: close the version it replaced, record it healthy."""
        self.registry.end_probation(name)
        self.mark_healthy(name)

    def health_verdict(self, name: str, version: int, stop: threading.Event | None = None) -> Verdict:
        """The verdict on ``name`` v``version``'s health window, once there is one (``health.py``)."""
        return self.health.wait(name, version, stop)

    def model_state(self, name: str) -> ModelState:
        """What the store records of ``name`` (for the update client, which never reads the store)."""
        return self.store.model_state(name)

    def model_states(self) -> dict[str, ModelState]:
        return dict(self.store.load_state().models)

    # -- serving ------------------------------------------------------------------------
    def models(self) -> dict[str, int]:
        """Served (loaded) model names and their versions."""
        return self.registry.models()

    def _open(self, slot: Slot, *, on_demand: bool = False) -> ServedModel:
        return self._load(slot, self.store.manifest_of(slot), on_demand=on_demand)

    def _load(self, slot: Slot, m: Manifest, *, on_demand: bool = False) -> ServedModel:
        """Load ``slot`` in-process, admitted by the memory budget where there is one
        (``MemoryBudgetError`` when it does not fit). ``on_demand``: a request's reload."""

        def load() -> ServedModel:
            options = self.config.runtime_options(m.name, m.compatibility.runtime)
            if self.budgets.memory is not None:  # the settings left to the runtime follow the budget
                options = options_for_load(options, self.budgets.memory.room(m), m.name)
            return load_model(self.store.model_dir(slot), m, options)

        model = load() if self.budgets.memory is None else self.budgets.memory.load(m, load, on_demand=on_demand)
        log.info("%s: v%d runs on %s", m.name, m.version, runs_on(model.runner.describe()))
        return model

    # -- reporting ----------------------------------------------------------------------
    def selftest_report(self, name: str, which: str = "active") -> SelfTestReport | None:
        """The self-test report of a model's ``active`` or ``previous`` slot, if one was recorded."""
        slot = getattr(self.store.model_state(name), which)
        if slot is None:
            return None
        try:
            return SelfTestReport.from_json((self.store.model_dir(slot) / REPORT_NAME).read_bytes())
        except (OSError, ValueError, SelfTestError):
            return None

    def status(self) -> dict[str, Any]:
        """Per model: the store's slots and status, plus the version actually served."""
        served = self.models()
        out: dict[str, Any] = {}
        for name, ms in sorted(self.store.load_state().models.items()):
            out[name] = {
                "serving": served.get(name),
                "active": ms.active.version if ms.active else None,
                "candidate": ms.candidate.version if ms.candidate else None,
                "previous": ms.previous.version if ms.previous else None,
                "status": ms.status,
                "error": ms.error,
                "updated": ms.updated,
            }
        return out


def _served_slot(ms: ModelState, served_version: int | None) -> Slot | None:
    """The slot ``served_version`` comes from (the active one when nothing is loaded: the next
    request would load it), or None."""
    if served_version is None:
        return ms.active
    return next((s for s in (ms.active, ms.previous) if s is not None and s.version == served_version), None)
