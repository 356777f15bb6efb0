"""What a device trusts on its fleet channel: roles, freshness and the newest state per topic.

Rules taken from TUF/Uptane, applied to every message before anything else looks at it:

- a desired state must carry a valid signature by a *notice* key (``updates.notice_keys`` plus
  those a keys document added, minus every revoked id); a bundle or root key does not do;
- it must be bound to this fleet and to the topic it came on (a state for ``cam-08`` or for
  another group, copied onto this device's topic, is refused);
- its ``issued`` may be at most ``clock_skew_s`` in the future, and not earlier than the newest
  state accepted on that topic (a replay of an older signed state is refused);
- a state whose ``expires`` has passed is not acted on: the device reports ``frozen``. Only a
  fresh state moves the per-topic high-water mark, so a refused or expired message changes nothing.

The keys document (``edgekit/<fleet>/keys``) is signed by ``root_threshold`` of the device's
``root_keys``; its ``version`` only goes up. It adds notice and bundle keys and revokes key ids.
What was accepted is kept in ``<store>/fleet-trust.json`` (write-fsync-rename), so a restart
does not forget it.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from device_agents.config import AgentConfig
from device_agents.errors import StoreError
from device_agents.store import atomic_write
from edgekit.bundle.codec import from_data, to_data
from edgekit.bundle.errors import EdgekitError, SignatureError
from edgekit.bundle.fleet_protocol import (
    DesiredState,
    KeysDocument,
    NoticeError,
    keys_topic,
    parse_desired,
    parse_keys,
    parse_signed,
)
from edgekit.bundle.manifest import parse_time
from edgekit.bundle.signing import RoleKeys, TrustStore, key_id, load_public_key, public_key_from_text

log = logging.getLogger("edgekit.agent.updates")

RECORD_NAME = "fleet-trust.json"
RECORD_VERSION = 1


class RefusedError(EdgekitError):
    """A message on the fleet channel was refused: unsigned, wrongly signed, replayed, misbound."""


@dataclass(frozen=True)
class TrustRecord:
    """What the device accepted, on disk: the keys document and each topic's newest issued time."""

    schema_version: int = RECORD_VERSION
    keys: str = ""  # the accepted keys document's envelope, as received
    desired: dict[str, str] = field(default_factory=dict)  # topic -> issued of the newest fresh state
    states: dict[str, str] = field(default_factory=dict)  # topic -> that state's envelope, as received


def load_record(path: Path) -> TrustRecord:
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        return TrustRecord()
    except ValueError as exc:
        raise StoreError(
            f"{path} is not valid JSON ({exc}); remove it to start over (the device re-learns its keys)"
        ) from exc
    record: TrustRecord = from_data(TrustRecord, data, "fleet-trust", StoreError)
    return record


def _load_keys_document(config: AgentConfig, envelope_text: str) -> KeysDocument | None:
    """The stored keys document, verified again against the configured root keys (None if none)."""
    u = config.updates
    if u is None or not u.root_keys or not envelope_text:
        return None
    envelope = parse_signed(envelope_text.encode())
    root = RoleKeys.from_files("root", u.root_keys, threshold=u.root_threshold)
    root.verify(envelope.payload, envelope.signature_dicts(), "the stored keys document")
    return parse_keys(envelope)


def bundle_trust(config: AgentConfig, keys: KeysDocument | None = None) -> TrustStore:
    """The bundle-signing keys: ``trusted_keys`` and ``[[trusted]]`` of the config, plus the keys
    document's bundle keys, minus ``revoked_key_ids`` and the document's revoked ids.

    Without ``keys``, the document stored under the config's store (if any) is used, so a local
    ``edgekit-agent install`` honours a revocation the daemon received.
    """
    if keys is None and config.updates is not None and config.updates.root_keys:
        path = Path(config.store) / RECORD_NAME
        if path.exists():
            keys = _load_keys_document(config, load_record(path).keys)
    base = TrustStore.from_files(
        config.trusted_keys, config.revoked_key_ids, [(t.key, t.names) for t in config.trusted]
    )
    if keys is None:
        return base
    added = dict(base.keys)
    names = dict(base.names)
    for entry in keys.bundle_keys:
        pub = public_key_from_text(entry.key)
        kid = key_id(pub)
        if kid in added and kid not in names:
            continue  # already trusted for any name
        added[kid] = pub
        if entry.names:
            names[kid] = entry.names
        else:
            names.pop(kid, None)
    return TrustStore(added, base.revoked | frozenset(keys.revoked), names)


@dataclass(frozen=True)
class VerifiedState:
    state: DesiredState
    signers: frozenset[str]  # the notice key ids whose signatures verified
    payload: str = ""  # the envelope as received (kept on disk once accepted)


class FleetTrust:
    """The device's trust in its fleet channel (thread-safe; one per update client)."""

    def __init__(self, config: AgentConfig) -> None:
        if config.updates is None:
            raise NoticeError("fleet trust needs an [updates] table")
        self.config = config
        self.updates = u = config.updates
        self.path = Path(config.store) / RECORD_NAME
        self._lock = threading.Lock()
        self._notice_config = {key_id(k): k for k in (load_public_key(p) for p in u.notice_keys)}
        self._root = RoleKeys.from_files("root", u.root_keys, threshold=u.root_threshold) if u.root_keys else None
        self._record = load_record(self.path)
        try:
            self._keys = _load_keys_document(config, self._record.keys)
        except (SignatureError, NoticeError):
            # the root keys changed in the config since it was stored: forget it, the retained one comes again
            self._keys = None
            self._record = replace(self._record, keys="")
        self._roles()

    # -- roles --------------------------------------------------------------------------------
    def revoked(self) -> frozenset[str]:
        return frozenset(self.config.revoked_key_ids) | frozenset(self._keys.revoked if self._keys else ())

    def _roles(self) -> None:
        """Work out the notice role and the bundle trust (at start and after each keys document)."""
        self._bundle_trust = (
            bundle_trust(self.config, self._keys) if self._keys is not None else bundle_trust(self.config)
        )
        keys: dict[str, Ed25519PublicKey] = dict(self._notice_config)
        if self._keys is not None:
            for text in self._keys.notice_keys:
                pub = public_key_from_text(text)
                keys[key_id(pub)] = pub
        others = {kid: "bundle" for kid in self._bundle_trust.keys}
        if self._root is not None:
            others.update({kid: "root" for kid in self._root.keys})
        self._notice_role = RoleKeys("notice", keys, revoked=self.revoked(), other_roles=others)

    def notice_role(self) -> RoleKeys:
        return self._notice_role

    def bundle_trust(self) -> TrustStore:
        return self._bundle_trust

    # -- desired state ------------------------------------------------------------------------
    def check_desired(self, topic: str, payload: bytes, now: datetime | None = None) -> VerifiedState:
        """The verified state on ``topic``, or ``RefusedError`` saying why it is refused.

        An expired state is returned (the caller reports ``frozen``); ``accept`` records it.
        """
        now = now or datetime.now(timezone.utc)
        try:
            envelope = parse_signed(payload)
            signers = self.notice_role().verify(envelope.payload, envelope.signature_dicts(), "the desired state")
            state = parse_desired(envelope)
        except (NoticeError, SignatureError) as exc:
            raise RefusedError(str(exc)) from exc
        u = self.updates
        if state.fleet != u.fleet or state.topic != topic:
            raise RefusedError(
                f"it is bound to {state.bound_to} of fleet {state.fleet}, not to this topic: a state copied from "
                "elsewhere"
            )
        self._check_issued(state.issued, now)
        with self._lock:
            newest = self._record.desired.get(topic)
        if newest and parse_time(state.issued) < parse_time(newest):
            raise RefusedError(
                f"it was issued {state.issued}, before {newest}, the newest state accepted on this topic: a replay"
            )
        return VerifiedState(state, frozenset(signers), payload.decode())

    def accept(self, topic: str, verified: VerifiedState, now: datetime | None = None) -> None:
        """Move ``topic``'s high-water mark to ``verified`` (a fresh, checked state) and keep it, durably."""
        now = now or datetime.now(timezone.utc)
        state = verified.state
        if expired(state, now):
            return
        with self._lock:
            newest = self._record.desired.get(topic)
            if newest and parse_time(newest) >= parse_time(state.issued):
                return
            self._record = replace(
                self._record,
                desired={**self._record.desired, topic: state.issued},
                states={**self._record.states, topic: verified.payload},
            )
            self._save()

    def stored_states(self, topics: tuple[str, ...]) -> dict[str, VerifiedState]:
        """The states accepted before a restart, for ``topics``, checked again (a key may be revoked since).

        The device acts on them while the broker is away, and an empty (cleared) retained message,
        which nobody signed, does not take them away.
        """
        with self._lock:
            kept = {t: text for t, text in self._record.states.items() if t in topics}
        found = {}
        for topic, text in kept.items():
            try:
                found[topic] = self.check_desired(topic, text.encode())
            except RefusedError as exc:
                log.warning("updates: the stored desired state of %s no longer verifies (%s); dropped", topic, exc)
        return found

    # -- keys document ------------------------------------------------------------------------
    @property
    def keys_topic(self) -> str | None:
        return keys_topic(self.updates.fleet) if self._root is not None else None

    def accept_keys(self, payload: bytes, now: datetime | None = None) -> KeysDocument | None:
        """Verify and keep a keys document; None when it is the one held already."""
        now = now or datetime.now(timezone.utc)
        if self._root is None:
            raise RefusedError("no root_keys are configured, so no keys document is trusted")
        try:
            envelope = parse_signed(payload)
            self._root.verify(envelope.payload, envelope.signature_dicts(), "the keys document")
            doc = parse_keys(envelope)
        except (NoticeError, SignatureError) as exc:
            raise RefusedError(str(exc)) from exc
        if doc.fleet != self.updates.fleet:
            raise RefusedError(f"it is for fleet {doc.fleet}, not {self.updates.fleet}")
        self._check_issued(doc.issued, now)
        text = payload.decode()
        with self._lock:
            current = self._keys
            if current is not None and doc.version <= current.version:
                if doc.version == current.version and text == self._record.keys:
                    return None
                raise RefusedError(
                    f"its version {doc.version} is not above v{current.version}, the keys document held: a replay"
                )
            self._keys = doc
            self._record = replace(self._record, keys=text)
            self._save()
            self._roles()
        return doc

    # -- helpers ------------------------------------------------------------------------------
    def _check_issued(self, issued: str, now: datetime) -> None:
        skew = timedelta(seconds=self.updates.clock_skew_s)
        if parse_time(issued) > now + skew:
            raise RefusedError(
                f"it is issued {issued}, in the future by more than clock_skew_s ({self.updates.clock_skew_s:g} s) "
                f"from this device's clock ({now.isoformat(timespec='seconds')}); check both clocks"
            )

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(self.path, json.dumps(to_data(self._record), indent=1).encode() + b"\n")


def expired(state: DesiredState, now: datetime | None = None) -> bool:
    return parse_time(state.expires) <= (now or datetime.now(timezone.utc))
