"""``edgekit fleet keys``: publish the fleet's keys document, signed by its root key(s).

Devices with ``updates.root_keys`` take from the retained ``edgekit/<fleet>/keys`` document the
notice keys and bundle keys it adds and the key ids it revokes (on top of their config), once
``root_threshold`` distinct root keys have signed it. The document is complete each time: this
command reads the current one (checked against the root keys), applies ``--add-notice-key``,
``--add-bundle-key PUB[=PATTERN,...]`` and ``--revoke KEYID``, raises its version by one and
publishes it retained. Rotating a key: add the new one and revoke the old one in one document.
"""

from __future__ import annotations

import argparse
from datetime import datetime, timezone
from pathlib import Path

from edgekit.bundle import key_id, load_private_key, load_public_key
from edgekit.bundle.errors import ConfigError, SignatureError
from edgekit.bundle.fleet_connection import BrokerAddress
from edgekit.bundle.fleet_protocol import (
    BundleKey,
    KeysDocument,
    NoticeError,
    keys_topic,
    parse_keys,
    parse_signed,
    sign_document,
)
from edgekit.bundle.signing import RoleKeys, public_key_from_text, public_key_text
from edgekit.fleet.session import FleetSession, broker_address


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--root-key", type=Path, action="append", required=True, metavar="KEY",
        help="private root key that signs the document (repeat to reach the devices' root_threshold)",
    )  # fmt: skip
    parser.add_argument("--add-notice-key", type=Path, action="append", default=[], metavar="PUB")
    parser.add_argument(
        "--add-bundle-key", action="append", default=[], metavar="PUB[=PATTERN,...]",
        help="a bundle-signing key, optionally limited to model names (keys/det.pub=det-*,seg-*)",
    )  # fmt: skip
    parser.add_argument("--revoke", action="append", default=[], metavar="KEYID", help="key id no role trusts any more")


def build_keys_document(
    fleet: str,
    current: KeysDocument | None,
    *,
    add_notice: tuple[Path, ...] = (),
    add_bundle: tuple[tuple[Path, tuple[str, ...]], ...] = (),
    revoke: tuple[str, ...] = (),
    now: datetime | None = None,
) -> KeysDocument:
    """``current`` (or an empty document) with the keys added and revoked, one version up."""
    now = now or datetime.now(timezone.utc)
    notice = list(current.notice_keys if current else ())
    bundle = {key_id(public_key_from_text(b.key)): b for b in (current.bundle_keys if current else ())}
    revoked = list(current.revoked if current else ())
    for path in add_notice:
        text = public_key_text(load_public_key(path))
        if text not in notice:
            notice.append(text)
    for path, names in add_bundle:
        pub = load_public_key(path)
        bundle[key_id(pub)] = BundleKey(public_key_text(pub), names)
    for kid in revoke:
        if kid not in revoked:
            revoked.append(kid)
    # a revoked key is also dropped from the lists, so that the document stays short
    notice = [t for t in notice if key_id(public_key_from_text(t)) not in revoked]
    bundle = {k: v for k, v in bundle.items() if k not in revoked}
    issued = now.isoformat(timespec="microseconds").replace("+00:00", "Z")
    return KeysDocument(
        "keys", fleet, (current.version + 1) if current else 1, issued,
        tuple(notice), tuple(bundle.values()), tuple(revoked),
    )  # fmt: skip


def publish_keys(
    broker: BrokerAddress,
    fleet: str,
    root_keys: tuple[Path, ...],
    *,
    add_notice: tuple[Path, ...] = (),
    add_bundle: tuple[tuple[Path, tuple[str, ...]], ...] = (),
    revoke: tuple[str, ...] = (),
    timeout_s: float = 10.0,
) -> KeysDocument:
    signers = [load_private_key(p) for p in root_keys]
    roots = RoleKeys("root", {key_id(k.public_key()): k.public_key() for k in signers}, threshold=1)
    topic = keys_topic(fleet)
    with FleetSession(broker, timeout_s=timeout_s) as session:
        current = None
        payload = session.read_retained(topic)
        if payload:
            try:
                envelope = parse_signed(payload)
                roots.verify(envelope.payload, envelope.signature_dicts(), f"the keys document on {topic}")
                current = parse_keys(envelope)
            except (NoticeError, SignatureError) as exc:
                raise ConfigError(
                    f"the retained message on {topic} is not a keys document signed by these root keys ({exc}); "
                    f"sign with the root keys the devices hold, or clear the topic first"
                ) from exc
        doc = build_keys_document(fleet, current, add_notice=add_notice, add_bundle=add_bundle, revoke=revoke)
        session.publish_retained(topic, sign_document(doc.to_json(), signers).to_json())
    return doc


def _bundle_key(text: str) -> tuple[Path, tuple[str, ...]]:
    path, _, patterns = text.partition("=")
    names = tuple(p for p in patterns.split(",") if p) if patterns else ()
    return Path(path), names


def run(args: argparse.Namespace) -> int:
    doc = publish_keys(
        broker_address(args), args.fleet, tuple(args.root_key),
        add_notice=tuple(args.add_notice_key), add_bundle=tuple(_bundle_key(t) for t in args.add_bundle_key),
        revoke=tuple(args.revoke), timeout_s=args.timeout_s,
    )  # fmt: skip
    print(
        f"published keys v{doc.version} on {keys_topic(args.fleet)}: {len(doc.notice_keys)} notice key(s), "
        f"{len(doc.bundle_keys)} bundle key(s), revoked: {', '.join(doc.revoked) or 'none'}"
    )
    return 0
