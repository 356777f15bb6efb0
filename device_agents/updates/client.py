"""The update client: pulls desired state over MQTT, applies it through the model manager.

Two threads. The network thread keeps an MQTT 5 session with the broker: a persistent session
(clean start off, client id = device id) and QoS 1 subscriptions to the device's desired topic
and its groups' topics, re-made on every connect so that the broker re-sends the retained
notices (a notice received just before a crash is not lost). It reconnects with full-jitter
exponential backoff up to ``reconnect_max_s``. The worker thread does everything slow, one model
at a time::

    notice -> policy.decide -> download (resumable, capped) -> check the bundle is the one announced
    -> manager.install (verify, stage, child self-test, switch) -> remember the notice
    -> health window (failed requests against the previous version) -> report

Every state change is published retained on ``edgekit/<fleet>/<device>/reported``; the latest
one is published again on each connect. Offline, the agent keeps serving what it has.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from device_agents.platforms import probe
from device_agents.updates.backoff import Backoff
from device_agents.updates.connection import BrokerAddress, new_client, session_properties
from device_agents.updates.download import DownloadError, download
from device_agents.updates.health import Traffic, failure_verdict, traffic
from device_agents.updates.policy import decide
from device_agents.updates.protocol import (
    REPORTED_SCHEMA_VERSION,
    Notice,
    NoticeError,
    Reported,
    UpdateState,
    device_desired_topic,
    group_desired_topic,
    parse_notice,
    reported_topic,
)
from edgekit.bundle import read_verified_manifest
from edgekit.bundle.errors import BundleError, ConfigError, EdgekitError, ManifestError, SelfTestError
from edgekit.bundle.manifest import utc_now

if TYPE_CHECKING:
    from device_agents.config import AgentConfig
    from device_agents.manager import ModelManager

log = logging.getLogger("edgekit.agent.updates")

_LOOP_S = 0.5  # how often the network loop looks at the stop flag
_HEALTH_POLL_S = 0.2  # a scrape of the agent's own counters: cheap
_RETRY_BASE_S = 2.0
# Store statuses that say why the last update did not stick, as reported states.
# Errors that retrying cannot fix: the notice is remembered as handled and the reason reported.
_REJECTIONS = (BundleError, ManifestError, SelfTestError)
_STORE_OUTCOMES: dict[str, UpdateState] = {"rolled_back": "rolled_back", "failed": "rejected"}


class UpdateClient:
    """``start()`` after ``manager.start()``; ``stop()`` before ``manager.stop()``."""

    def __init__(self, config: AgentConfig, manager: ModelManager) -> None:
        if config.updates is None:
            raise ConfigError("agent.updates: the update client needs an [updates] table (broker, fleet, device_id)")
        self.config = config
        self.updates = u = config.updates
        self.manager = manager
        self.address = BrokerAddress(u.broker_tls, u.broker_host, u.broker_port, u.ca, u.cert, u.key)
        self.download_dir = Path(u.download_dir) if u.download_dir else config.store / "downloads"
        self.max_bundle_bytes = min(config.max_bundle_bytes, u.max_bundle_bytes)
        self.topics = (device_desired_topic(u.fleet, u.device_id), *(group_desired_topic(u.fleet, g) for g in u.groups))
        self.reported_topic = reported_topic(u.fleet, u.device_id)
        self.connections = 0  # successful connects since start
        self.last_connected_at: float | None = None  # time.time() of the last successful connect
        self._mqtt = new_client(self.address, u.device_id)
        self._mqtt.on_connect = self._on_connect
        self._mqtt.on_disconnect = self._on_disconnect
        self._mqtt.on_message = self._on_message
        # An exception in a callback must not end the network thread: paho logs it and goes on.
        self._mqtt.suppress_exceptions = True
        mqtt_log = logging.getLogger("edgekit.agent.mqtt")
        mqtt_log.setLevel(logging.WARNING)  # paho's debug/info lines are per packet
        self._mqtt.enable_logger(mqtt_log)
        self._connected = False
        self._connect_backoff = Backoff(1.0, max(1.0, u.reconnect_max_s))
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._notices: dict[str, Notice] = {}  # topic -> the retained notice on it
        self._dirty = False
        self._due: dict[str, float] = {}  # model name -> monotonic time before which it is left alone
        self._retry: dict[str, Backoff] = {}
        self._switched: dict[str, Traffic] = {}  # model name -> its traffic counters at the last switch
        self._threads: list[threading.Thread] = []
        self._report_lock = threading.Lock()
        self._report = self._initial_report()

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        for target, name in ((self._network, "mqtt"), (self._work, "updates")):
            thread = threading.Thread(target=target, name=f"edgekit-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        log.info("updates: %s as %s, topics %s", self.address.url, self.updates.device_id, ", ".join(self.topics))

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout_s)

    @property
    def connected(self) -> bool:
        return self._connected

    # -- network thread -----------------------------------------------------------------------
    def _network(self) -> None:
        u = self.updates
        while not self._stop.is_set():
            try:
                self._mqtt.connect(
                    u.broker_host, u.broker_port, u.keepalive_s, clean_start=False, properties=session_properties(True)
                )
            except OSError as exc:  # refused, unreachable, TLS handshake (ssl.SSLError is an OSError)
                self._wait_before_reconnect(f"cannot connect to {self.address.url} ({exc})")
                continue
            connections = self.connections
            while not self._stop.is_set() and self._mqtt.loop(timeout=_LOOP_S) == 0:  # 0: MQTT_ERR_SUCCESS
                pass
            if self._stop.is_set():
                if self._connected:
                    self._mqtt.disconnect()
                    if self._mqtt.socket() is not None:  # the DISCONNECT is still queued
                        self._mqtt.loop(timeout=_LOOP_S)
                self._connected = False
                break
            self._connected = False
            lost = self.connections > connections
            self._wait_before_reconnect(f"lost {self.address.url}" if lost else f"{self.address.url} refused us")

    def _wait_before_reconnect(self, why: str) -> None:
        delay = self._connect_backoff.next_delay()
        log.warning("updates: %s; reconnecting in %.1f s", why, delay)
        self._stop.wait(delay)

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        if reason.is_failure:
            log.error(
                "updates: %s refused the connection (%s); check the device certificate, its CN (%s) and the ACL",
                self.address.url,
                reason,
                self.updates.device_id,
            )
            return
        from paho.mqtt.subscribeoptions import SubscribeOptions

        self._connected = True
        self.connections += 1
        self.last_connected_at = time.time()
        self._connect_backoff.reset()
        log.info("updates: connected to %s (session present: %s)", self.address.url, flags.session_present)
        # Subscribing again makes the broker re-send the retained notices, even with a session.
        client.subscribe([(t, SubscribeOptions(qos=1)) for t in self.topics])
        self._publish_report()

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        self._connected = False

    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        topic = message.topic
        if topic not in self.topics:
            return
        with self._cond:
            if not message.payload:  # cleared: a group's notice may now be the one that counts
                if self._notices.pop(topic, None) is not None:
                    log.info("updates: desired state on %s cleared", topic)
                    self._dirty = True
                    self._cond.notify_all()
                return
            try:
                notice = parse_notice(bytes(message.payload))
            except NoticeError as exc:
                log.error("updates: ignoring the message on %s: %s", topic, exc)
                self._set_report("rejected", error=f"malformed notice on {topic}: {exc}")
                return
            log.info("updates: notice %s on %s: %s v%d", notice.notice_id, topic, notice.name, notice.version)
            self._notices[topic] = notice
            self._dirty = True
            self._cond.notify_all()

    # -- worker thread ------------------------------------------------------------------------
    def _work(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                while not self._stop.is_set() and not self._dirty and not self._anything_due():
                    self._cond.wait(self._seconds_to_next_due())
                self._dirty = False
                desired = self._desired()
            for name in set(self._due) - {n.name for n in desired.values()}:
                del self._due[name]  # its notice was cleared or replaced by one for another model
            for notice in desired.values():
                if self._stop.is_set():
                    break
                if self._due.get(notice.name, 0.0) > time.monotonic():
                    continue
                self._due.pop(notice.name, None)
                try:
                    self._handle(notice)
                except Exception as exc:  # supervisor of the update thread: report, retry, go on
                    log.exception("updates: %s v%d failed unexpectedly", notice.name, notice.version)
                    self._retry_later(notice, f"unexpected {type(exc).__name__}: {exc}")

    def _anything_due(self) -> bool:
        now = time.monotonic()
        return any(t <= now for t in self._due.values())

    def _seconds_to_next_due(self) -> float | None:
        if not self._due:
            return None
        return max(0.0, min(self._due.values()) - time.monotonic())

    def _desired(self) -> dict[str, Notice]:
        """Model name -> notice to act on: the highest version among groups, overridden by the device topic."""
        chosen: dict[str, Notice] = {}
        for topic in self.topics[1:]:
            n = self._notices.get(topic)
            if n is not None and (n.name not in chosen or n.version > chosen[n.name].version):
                chosen[n.name] = n
        own = self._notices.get(self.topics[0])
        if own is not None:
            chosen[own.name] = own
        return chosen

    def _handle(self, notice: Notice) -> None:
        model = self.manager.store.model_state(notice.name)
        decision = decide(
            notice,
            model,
            updates=self.updates,
            max_bundle_bytes=self.max_bundle_bytes,
            on_battery=probe().on_battery if self.updates.defer_on_battery else None,
        )
        if decision.action == "apply":
            self._apply(notice)
            return
        log.info("updates: %s: %s", decision.action, decision.reason)
        if decision.remember:
            self._remember(notice)
        if decision.action == "reject":
            self._set_report("rejected", notice, error=decision.reason)
        elif decision.action == "skip":
            self._set_report("skipped", notice, detail=decision.reason)
        elif decision.action == "defer":
            self._due[notice.name] = time.monotonic() + (decision.retry_in_s or 0.0)
            self._set_report("deferred", notice, detail=decision.reason)
        elif notice.version == self.manager.models().get(notice.name) and (
            self._report.notice_id != notice.notice_id or self._report.state not in ("checking", "serving")
        ):
            self._set_report("serving", notice)  # e.g. switched in just before a restart

    def _apply(self, notice: Notice) -> None:
        self._set_report("downloading", notice)
        self._drop_other_downloads(notice)
        start = time.monotonic()
        try:
            path = download(notice, self.download_dir, max_bytes=self.max_bundle_bytes, ca=self.updates.ca)
        except DownloadError as exc:
            if exc.permanent:
                self._reject(notice, str(exc))
            else:
                self._retry_later(notice, str(exc))
            return
        download_s = time.monotonic() - start
        try:
            self._check_announced(notice, path)
        except _REJECTIONS as exc:
            self._reject(notice, str(exc), path)
            return
        self._set_report("installing", notice)
        before = traffic(self.manager.metrics, notice.name).since(self._switched.get(notice.name, Traffic()))
        start = time.monotonic()
        try:
            result = self.manager.install(path, origin=f"mqtt notice {notice.notice_id}")
        except _REJECTIONS as exc:
            self._reject(notice, str(exc), path)
            return
        except EdgekitError as exc:  # StoreError (disk full, lock held) and the like: may pass
            self._retry_later(notice, str(exc))
            return
        self._remember(notice)
        path.unlink(missing_ok=True)
        self._retry.pop(notice.name, None)
        metrics = {"download_s": round(download_s, 3), "install_s": round(time.monotonic() - start, 3)}
        if result.selftest is not None:
            for key in ("latency_p50_ms", "baseline_p50_ms"):
                value = getattr(result.selftest, key)
                if value is not None:
                    metrics[f"selftest_{key}"] = value
        if not result.changed:
            self._set_report("serving", notice, metrics=metrics)
            return
        self._check_health(notice, before, result.previous_version, metrics)

    def _check_health(
        self, notice: Notice, before: Traffic, previous_version: int | None, metrics: dict[str, float]
    ) -> None:
        """After the switch: watch the health window, roll back if the new version fails, report."""
        what = f"{notice.name} v{notice.version}"
        log.info(
            "updates: %s switched in (was v%s); health window %g s",
            what,
            previous_version,
            self.updates.health_window_s,
        )
        self._switched[notice.name] = traffic(self.manager.metrics, notice.name)
        self._set_report("checking", notice, metrics=metrics)
        why = self._watch_health(notice, before, previous_version)
        if self._stop.is_set():  # the agent stops inside the health window: no verdict to report
            return
        if why:
            try:
                self.manager.rollback(notice.name, why)
            except EdgekitError as exc:
                log.error("updates: %s is unhealthy (%s) but cannot be rolled back: %s", what, why, exc)
                self._set_report("failed", notice, error=f"{why}; rollback failed: {exc}", metrics=metrics)
                return
            self._switched[notice.name] = traffic(self.manager.metrics, notice.name)
            self._set_report("rolled_back", notice, error=why, metrics=metrics)
            return
        self._set_report("serving", notice, metrics=metrics)

    def _watch_health(self, notice: Notice, before: Traffic, previous_version: int | None) -> str:
        """Watch the switched-to version for the health window; return why to roll back, or ""."""
        if previous_version is None:
            return ""  # nothing to go back to
        deadline = time.monotonic() + self.updates.health_window_s
        while not self._stop.wait(_HEALTH_POLL_S):
            if self.manager.models().get(notice.name) != notice.version:
                return ""  # replaced meanwhile (a sideload, a crash-loop rollback): nothing of ours to judge
            now = traffic(self.manager.metrics, notice.name).since(self._switched[notice.name])
            why = failure_verdict(now, before, notice.version, previous_version)
            if why:
                return why
            if time.monotonic() >= deadline:
                return ""
        return ""

    def _check_announced(self, notice: Notice, path: Path) -> None:
        """The downloaded bundle must be the one the notice announced (verified manifest)."""
        m = read_verified_manifest(path, self.manager.trust, max_bundle_bytes=self.max_bundle_bytes).manifest
        if (m.name, m.version) != (notice.name, notice.version):
            raise BundleError(
                f"{notice.url} holds {m.name} v{m.version}, but the notice announced {notice.name} v{notice.version}; "
                "publish the notice again from the bundle"
            )

    def _reject(self, notice: Notice, why: str, path: Path | None = None) -> None:
        log.error("updates: %s v%d rejected: %s", notice.name, notice.version, why)
        self._remember(notice)
        self._retry.pop(notice.name, None)
        if path is not None:
            path.unlink(missing_ok=True)
        self._set_report("rejected", notice, error=why)

    def _retry_later(self, notice: Notice, why: str) -> None:
        backoff = self._retry.setdefault(
            notice.name, Backoff(_RETRY_BASE_S, max(_RETRY_BASE_S, self.updates.reconnect_max_s))
        )
        delay = backoff.next_delay()
        log.warning("updates: %s v%d: %s; retrying in %.1f s", notice.name, notice.version, why, delay)
        self._due[notice.name] = time.monotonic() + delay
        self._set_report("failed", notice, error=why)

    def _remember(self, notice: Notice) -> None:
        """Record ``notice`` as handled (the replay guard of ``policy.decide``), durably."""
        store = self.manager.store
        if store.model_state(notice.name).last_notice_id == notice.notice_id:
            return
        with store.lock():
            store.update_model(
                notice.name, lambda s: replace(s, last_notice_id=notice.notice_id, last_notice_issued=notice.issued)
            )

    def _drop_other_downloads(self, notice: Notice) -> None:
        """Partial downloads of other bundles will not be resumed: free their space."""
        if not self.download_dir.is_dir():
            return
        for p in self.download_dir.iterdir():
            if p.is_file() and p.suffix in (".part", ".ekb") and p.stem != notice.sha256:
                with contextlib.suppress(OSError):
                    p.unlink()

    # -- reporting ----------------------------------------------------------------------------
    def _initial_report(self) -> Reported:
        """What the store says after start: the latest rollback or rejection, else idle."""
        states = self.manager.store.load_state().models
        latest = max(states.items(), key=lambda kv: kv[1].updated, default=None)
        state: UpdateState = "idle"
        name, error = "", ""
        if latest is not None:
            name = latest[0]
            if latest[1].status in _STORE_OUTCOMES:
                state, error = _STORE_OUTCOMES[latest[1].status], latest[1].error
        return self._make_report(state, name=name, error=error)

    def _make_report(
        self,
        state: UpdateState,
        *,
        name: str,
        desired_version: int = 0,
        notice_id: str = "",
        error: str = "",
        detail: str = "",
        metrics: dict[str, float] | None = None,
    ) -> Reported:
        models = self.manager.models()
        u = self.updates
        return Reported(
            REPORTED_SCHEMA_VERSION, u.device_id, u.fleet, state, utc_now(), name=name, version=models.get(name, 0),
            desired_version=desired_version, notice_id=notice_id, error=error, detail=detail, models=models,
            metrics=metrics or {},
        )  # fmt: skip

    def _set_report(
        self,
        state: UpdateState,
        notice: Notice | None = None,
        *,
        error: str = "",
        detail: str = "",
        metrics: dict[str, float] | None = None,
    ) -> None:
        last = self._report
        report = self._make_report(
            state,
            name=notice.name if notice is not None else last.name,
            desired_version=notice.version if notice is not None else last.desired_version,
            notice_id=notice.notice_id if notice is not None else last.notice_id,
            error=error,
            detail=detail,
            metrics=metrics,
        )
        with self._report_lock:
            self._report = report
        log.info(
            "updates: reported %s (%s: v%d serves, v%d desired)%s",
            state,
            report.name or "-",
            report.version,
            report.desired_version,
            f": {error or detail}" if error or detail else "",
        )
        self._publish_report()

    def _publish_report(self) -> None:
        with self._report_lock:
            payload = self._report.to_json()
        if self._connected:
            self._mqtt.publish(self.reported_topic, payload, qos=1, retain=True)

    @property
    def report(self) -> Reported:
        return self._report
