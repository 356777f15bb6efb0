"""The update client: pulls desired state over MQTT, applies it through the lifecycle.

The network thread keeps an MQTT 5 session with the broker: a persistent session (clean start
off, client id = device id) and QoS 1 subscriptions to the device's desired topic, its groups'
topics and (with ``root_keys``) the fleet's keys topic, re-made on every connect so that the
broker re-sends the retained messages (one received just before a crash is not lost). It
reconnects with full-jitter exponential backoff up to ``reconnect_max_s``. Every message is
checked by ``trust.FleetTrust`` first (signature by a notice key, binding, clock skew, replay);
a refused one is logged in one line and changes nothing. No packet over ``max_packet_kb`` is
taken: the cap is asked of the broker at CONNECT, and one that arrives anyway ends the
connection unread (``connection.new_client``). A keys document that revokes a bundle key stops
the models it signed at once (``Lifecycle.apply_trust``), each reported ``rejected``. A dispatcher thread
hands each model of the fresh desired states to a worker thread of its own, so that one slow
download never holds up another model's update::

    notice -> policy.decide -> download (resumable, capped, deadline, minimum rate) -> check the
    bundle is the one announced -> lifecycle.install (verify, stage, child self-test, switch; one at
    a time, under the store lock) -> remember the notice -> the lifecycle's health verdict -> report

The client never reads or writes the store: it asks the lifecycle (``model_state``, ``install``,
``record_notice``, ``health_verdict``), which judges every switched-to version's health window
whatever installed it (``device_agents.health``).

A device whose newest valid desired state has expired reports ``frozen`` (and
``edgekit_updates_frozen 1`` on ``/metrics``), updates nothing, and keeps serving.

Every state change is published retained on ``edgekit/<fleet>/<device>/reported``; the latest
one is published again on each connect. Offline, the agent keeps serving what it has.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from device_agents.errors import SelfTestError
from device_agents.threads import NamedThread
from device_agents.updates.backoff import Backoff
from device_agents.updates.download import DownloadError, DownloadLimits, download
from device_agents.updates.policy import decide
from device_agents.updates.trust import FleetTrust, RefusedError, expired
from edgekit.bundle import read_verified_manifest
from edgekit.bundle.errors import BundleError, ConfigError, EdgekitError, ManifestError
from edgekit.bundle.fleet_connection import BrokerAddress, new_client, session_properties
from edgekit.bundle.fleet_protocol import (
    REPORTED_SCHEMA_VERSION,
    DesiredState,
    Notice,
    Reported,
    UpdateState,
    device_desired_topic,
    group_desired_topic,
    reported_topic,
)
from edgekit.bundle.manifest import parse_time, utc_now

if TYPE_CHECKING:
    from device_agents.config import AgentConfig
    from device_agents.lifecycle import Lifecycle

log = logging.getLogger("edgekit.agent.updates")

_LOOP_S = 0.5  # how often the network loop looks at the stop flag
_RETRY_BASE_S = 2.0
# Store statuses that say why the last update did not stick, as reported states.
# Errors that retrying cannot fix: the notice is remembered as handled and the reason reported.
_REJECTIONS = (BundleError, ManifestError, SelfTestError)
# "degraded": the active version did not load at start and the previous one serves for now.
_STORE_OUTCOMES: dict[str, UpdateState] = {"rolled_back": "rolled_back", "failed": "rejected", "degraded": "failed"}


class _TrustMetrics:
    """The update client's own series on the agent's registry."""

    def __init__(self, registry: Any) -> None:
        from prometheus_client import Counter, Gauge

        self.frozen = Gauge(
            "edgekit_updates_frozen",
            "1 while the newest valid desired state has expired (updates wait; models keep serving)",
            registry=registry,
        )
        self.refused = Counter(
            "edgekit_notices_refused",
            "Messages on the fleet channel refused (unsigned, wrong role, replayed, misbound)",
            registry=registry,
        )


class UpdateClient:
    """``start()`` after ``lifecycle.start()``; ``stop()`` before ``lifecycle.stop()``."""

    def __init__(self, config: AgentConfig, lifecycle: Lifecycle) -> None:
        if config.updates is None:
            raise ConfigError("agent.updates: the update client needs an [updates] table (broker, fleet, device_id)")
        self.config = config
        self.updates = u = config.updates
        self.lifecycle = lifecycle
        self.address = BrokerAddress(u.broker_tls, u.broker_host, u.broker_port, u.ca, u.cert, u.key)
        self.download_dir = Path(u.download_dir) if u.download_dir else config.store / "downloads"
        self.max_bundle_bytes = min(config.max_bundle_bytes, u.max_bundle_bytes)
        self.topics = (device_desired_topic(u.fleet, u.device_id), *(group_desired_topic(u.fleet, g) for g in u.groups))
        self.trust = FleetTrust(config)
        lifecycle.trust = self.trust.bundle_trust()  # with the keys document accepted before a restart
        self.limits = DownloadLimits(
            u.download_deadline_s, u.download_min_bytes_per_s, u.download_stall_s, allow_http=u.allow_http
        )
        self._metrics = _TrustMetrics(lifecycle.metrics.registry)
        self.reported_topic = reported_topic(u.fleet, u.device_id)
        self.connections = 0  # successful connects since start
        self.last_connected_at: float | None = None  # time.time() of the last successful connect
        self._lost_why = ""  # why the network thread ended the last connection itself, for its one log line
        self._mqtt = new_client(
            self.address, u.device_id, max_packet_bytes=u.max_packet_kb * 1024, on_oversize=self._on_oversize
        )
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
        self._states: dict[str, DesiredState] = {}  # topic -> the verified desired state on it
        self._signers: dict[str, frozenset[str]] = {}  # topic -> the notice keys that signed it
        self._dirty = False
        self._due: dict[str, float] = {}  # model name -> monotonic time before which it is left alone
        self._busy: set[str] = set()  # model names a worker thread is handling now
        self._handled: dict[str, Notice] = {}  # model name -> the notice its worker handled last
        # One model at a time touches the store (install, remember, rollback); downloads and health
        # windows of several models run side by side.
        self._store_turn = threading.Lock()
        for topic, verified in self.trust.stored_states(self.topics).items():  # acted on even while offline
            self._states[topic] = verified.state
            self._signers[topic] = verified.signers
        self._dirty = bool(self._states)
        self._frozen = ""  # why the device is frozen (reported), "" when its states are fresh
        self._retry: dict[str, Backoff] = {}
        self._threads: list[threading.Thread] = []
        self._report_lock = threading.Lock()
        self._report = self._initial_report()

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        for target, name in ((self._network, "mqtt"), (self._work, "updates")):
            thread = NamedThread(target=target, name=f"edgekit-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        log.info("updates: %s as %s, topics %s", self.address.url, self.updates.device_id, ", ".join(self.topics))

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        for thread in list(self._threads):
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
                    u.broker_host,
                    u.broker_port,
                    u.keepalive_s,
                    clean_start=False,
                    properties=session_properties(True, max_packet_bytes=u.max_packet_kb * 1024),
                )
            except OSError as exc:  # refused, unreachable, TLS handshake (ssl.SSLError is an OSError)
                self._wait_before_reconnect(f"cannot connect to {self.address.url} ({exc})")
                continue
            connections = self.connections
            self._lost_why = ""
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
            why = f"lost {self.address.url}" if lost else f"{self.address.url} refused us"
            self._wait_before_reconnect(f"{why}: {self._lost_why}" if self._lost_why else why)

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
        keys = (self.trust.keys_topic,) if self.trust.keys_topic else ()
        client.subscribe([(t, SubscribeOptions(qos=1)) for t in (*keys, *self.topics)])
        self._publish_report()

    def _on_oversize(self, size: int) -> None:
        """A packet over ``max_packet_kb`` is arriving (the broker ignored the limit asked at
        CONNECT): the connection ends unread; the reconnect line says why."""
        kb = self.updates.max_packet_kb
        self._lost_why = (
            f"it sent a packet of {size} bytes, over updates.max_packet_kb = {kb} ({kb * 1024} bytes), which "
            "was dropped unread; the broker should drop it itself (MQTT 5 Maximum Packet Size) or cap what it "
            "accepts (mosquitto: max_packet_size)"
        )

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        self._connected = False

    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        topic, payload = message.topic, bytes(message.payload)
        if topic == self.trust.keys_topic:
            self._on_keys(topic, payload)
            return
        if topic not in self.topics:
            return
        if not payload:  # a cleared topic is signed by nobody: the state held stays
            if topic in self._states:
                self._refuse(topic, "an empty message (the topic was cleared) is not a signed state; to remove a "
                             "model publish a state without it: edgekit fleet refresh --drop NAME")  # fmt: skip
            return
        try:
            verified = self.trust.check_desired(topic, payload)
        except RefusedError as exc:
            self._refuse(topic, str(exc))
            return
        state = verified.state
        self.trust.accept(topic, verified)
        names = ", ".join(f"{m.name} v{m.version}" for m in state.models) or "no models"
        log.info("updates: desired state on %s issued %s, fresh until %s: %s", topic, state.issued, state.expires,
                 names)  # fmt: skip
        with self._cond:
            self._states[topic] = state
            self._signers[topic] = verified.signers
            self._dirty = True
            self._cond.notify_all()

    def _on_keys(self, topic: str, payload: bytes) -> None:
        if not payload:
            return
        try:
            doc = self.trust.accept_keys(payload)
        except RefusedError as exc:
            self._refuse(topic, str(exc))
            return
        if doc is None:
            return
        # models signed by a key revoked now stop serving before this returns (then roll back)
        stopped = self.lifecycle.apply_trust(self.trust.bundle_trust())
        log.warning(
            "updates: keys document v%d accepted: %d notice key(s), %d bundle key(s) added; revoked: %s",
            doc.version,
            len(doc.notice_keys),
            len(doc.bundle_keys),
            ", ".join(doc.revoked) or "none",
        )
        for name, why in stopped:  # the fleet sees it: its bundle is refused now
            report = self._make_report("rejected", name=name, error=f"keys document v{doc.version}: {why}")
            with self._report_lock:
                self._report = report
            log.info("updates: reported rejected (%s: %s)", name, report.error)
            self._publish_report()
        with self._cond:  # states signed by a key revoked now no longer count
            self._dirty = True
            self._cond.notify_all()

    def _refuse(self, topic: str, why: str) -> None:
        """One line per refused message; the states, the high-water marks and the report stay as they were."""
        log.error("updates: refused the message on %s: %s", topic, why)
        self._metrics.refused.inc()

    # -- worker thread ------------------------------------------------------------------------
    def _work(self) -> None:
        """The dispatcher: starts a worker per model that is due and not being handled already."""
        while not self._stop.is_set():
            with self._cond:
                # one wait, then look again: a state may have expired (frozen) even if nothing else changed
                if not self._stop.is_set() and not self._dirty and not self._anything_due():
                    self._cond.wait(self._seconds_to_next_event())
                self._dirty = False
                desired = self._desired()
                for name in set(self._due) - set(desired):
                    del self._due[name]  # no fresh state lists it now (dropped, or expired: frozen) ...
                    self._handled.pop(name, None)  # ... so it is handled afresh if it comes back
                now = time.monotonic()
                # a model is handled again when its notice changed, or when a retry or deferral is due
                start = [
                    n
                    for name, n in desired.items()
                    if name not in self._busy
                    and (self._due[name] <= now if name in self._due else self._handled.get(name) != n)
                ]
                for n in start:
                    self._due.pop(n.name, None)
                    self._busy.add(n.name)
            self._update_frozen()
            for notice in start:
                if self._stop.is_set():
                    break
                thread = NamedThread(
                    target=self._run_one, args=(notice,), name=f"edgekit-update-{notice.name}", daemon=True
                )
                self._threads = [t for t in self._threads if t.is_alive()] + [thread]
                thread.start()

    def _run_one(self, notice: Notice) -> None:
        try:
            self._handle(notice)
        except Exception as exc:  # supervisor of an update thread: report, retry, go on
            log.exception("updates: %s v%d failed unexpectedly", notice.name, notice.version)
            self._retry_later(notice, f"unexpected {type(exc).__name__}: {exc}")
        finally:
            with self._cond:
                self._handled[notice.name] = notice
                self._busy.discard(notice.name)
                self._dirty = True  # its state may have changed meanwhile: look again
                self._cond.notify_all()

    def _anything_due(self) -> bool:
        now = time.monotonic()
        return any(t <= now for name, t in self._due.items() if name not in self._busy)

    def _seconds_to_next_event(self) -> float | None:
        """Until the next retry is due or the next fresh state expires (None: nothing to wait for)."""
        waits = [t - time.monotonic() for name, t in self._due.items() if name not in self._busy]
        now = datetime.now(timezone.utc)
        waits += [(parse_time(s.expires) - now).total_seconds() for s in self._states.values() if not expired(s, now)]
        if not waits:
            return None
        return max(0.0, min(waits)) + 0.01

    def _fresh_states(self) -> list[tuple[str, DesiredState]]:
        """(topic, state) of the states that are fresh and still verify (a key may have been revoked since)."""
        now = datetime.now(timezone.utc)
        revoked = self.trust.revoked()
        return [
            (t, s)
            for t, s in self._states.items()
            if not expired(s, now) and not self._signers.get(t, frozenset()) <= revoked
        ]

    def _desired(self) -> dict[str, Notice]:
        """Model name -> notice to act on, from the fresh states only (they are the allowlist): the
        highest version among groups, overridden by the device topic."""
        fresh = dict(self._fresh_states())
        chosen: dict[str, Notice] = {}
        for topic in self.topics[1:]:
            state = fresh.get(topic)
            for n in state.models if state is not None else ():
                if n.name not in chosen or n.version > chosen[n.name].version:
                    chosen[n.name] = n
        own = fresh.get(self.topics[0])
        for n in own.models if own is not None else ():
            chosen[n.name] = n
        return chosen

    def _update_frozen(self) -> None:
        """Report ``frozen`` while the newest valid state of a topic has expired; ``idle`` once fresh again."""
        now = datetime.now(timezone.utc)
        with self._cond:
            stale = sorted((t, s.expires) for t, s in self._states.items() if expired(s, now))
        why = "; ".join(f"the desired state on {t} expired at {e}" for t, e in stale)
        if why:
            why += (
                " (the publisher must refresh it: edgekit fleet refresh, or publish again); "
                "updates wait, the models keep serving"
            )
        if why == self._frozen:
            return
        self._frozen = why
        self._metrics.frozen.set(1 if why else 0)
        if why:
            log.warning("updates: frozen: %s", why)
            self._set_report("frozen", detail=why)
        elif self._report.state == "frozen":
            self._set_report("idle", detail="the desired state is fresh again")

    def _handle(self, notice: Notice) -> None:
        model = self.lifecycle.model_state(notice.name)
        decision = decide(
            notice,
            model,
            updates=self.updates,
            max_bundle_bytes=self.max_bundle_bytes,
            on_battery=self.lifecycle.budgets.on_battery() if self.updates.defer_on_battery else None,
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
            with self._cond:
                self._due[notice.name] = time.monotonic() + (decision.retry_in_s or 0.0)
            self._set_report("deferred", notice, detail=decision.reason)
        elif notice.version == self.lifecycle.models().get(notice.name) and (
            self._report.notice_id != notice.notice_id or self._report.state not in ("checking", "serving")
        ):
            self._set_report("serving", notice)  # e.g. switched in just before a restart

    def _apply(self, notice: Notice) -> None:
        self._set_report("downloading", notice)
        self._drop_other_downloads()
        start = time.monotonic()
        try:
            path = download(
                notice, self.download_dir, max_bytes=self.max_bundle_bytes, ca=self.updates.ca, limits=self.limits
            )
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
        start = time.monotonic()
        try:
            with self._store_turn:
                result = self.lifecycle.install(path, origin=f"mqtt notice {notice.notice_id}")
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
        self._check_health(notice, metrics)

    def _check_health(self, notice: Notice, metrics: dict[str, float]) -> None:
        """After the switch: report ``checking``, then the lifecycle's verdict on the health window."""
        self._set_report("checking", notice, metrics=metrics)
        verdict = self.lifecycle.health_verdict(notice.name, notice.version, self._stop)
        if self._stop.is_set() or verdict.outcome == "stopped":  # no verdict to report
            return
        if verdict.outcome == "rolled_back":
            self._set_report("rolled_back", notice, error=verdict.reason, metrics=metrics)
        elif verdict.outcome == "rollback_failed":
            self._set_report("failed", notice, error=verdict.reason, metrics=metrics)
        else:  # healthy; unjudged (nothing to go back to); replaced meanwhile: nothing of ours to judge
            self._set_report("serving", notice, metrics=metrics)

    def _check_announced(self, notice: Notice, path: Path) -> None:
        """The downloaded bundle must be the one the notice announced (verified manifest)."""
        m = read_verified_manifest(path, self.lifecycle.trust, max_bundle_bytes=self.max_bundle_bytes).manifest
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
        with self._cond:
            self._due[notice.name] = time.monotonic() + delay
        self._set_report("failed", notice, error=why)

    def _remember(self, notice: Notice) -> None:
        """Record ``notice`` as handled (the replay guard of ``policy.decide``), durably."""
        with self._store_turn:
            self.lifecycle.record_notice(notice.name, notice.notice_id, notice.issued)

    def _drop_other_downloads(self) -> None:
        """Partial downloads of bundles no fresh state asks for will not be resumed: free their space.
        (Those of other models in progress are kept: each model downloads in its own thread.)"""
        if not self.download_dir.is_dir():
            return
        with self._cond:
            wanted = {n.sha256 for n in self._desired().values()}
        for p in self.download_dir.iterdir():
            if p.is_file() and p.suffix in (".part", ".ekb") and p.stem not in wanted:
                with contextlib.suppress(OSError):
                    p.unlink()

    # -- reporting ----------------------------------------------------------------------------
    def _initial_report(self) -> Reported:
        """What the store says after start: the latest rollback or rejection, else idle."""
        states = self.lifecycle.model_states()
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
        models = self.lifecycle.models()
        u = self.updates
        return Reported(
            REPORTED_SCHEMA_VERSION, u.device_id, u.fleet, state, utc_now(), name=name, version=models.get(name, 0),
            desired_version=desired_version, notice_id=notice_id, error=error, detail=detail, models=models,
            metrics={**self.lifecycle.budgets.report(), **(metrics or {})},  # the budget state, and the update's
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
