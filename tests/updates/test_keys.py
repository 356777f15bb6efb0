"""Key roles without a broker: name-limited bundle keys, the root threshold, the keys document,
and what the device keeps of it (its trust record)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from device_agents.config import config_from_data
from device_agents.updates.trust import FleetTrust, RefusedError, bundle_trust
from edgekit.bundle import (
    TrustStore,
    generate_keypair,
    key_id,
    load_private_key,
    load_public_key,
    read_verified_manifest,
)
from edgekit.bundle.errors import ConfigError, SignatureError
from edgekit.bundle.fleet_protocol import keys_topic, sign_document
from edgekit.fleet.keys import build_keys_document
from tests.updates.bundles import bundle
from tests.updates.conftest import Keys
from tests.updates.states import signed_state


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[Path, Path]]:
    d = tmp_path_factory.mktemp("roots")
    return [generate_keypair(d, f"root-{i}") for i in range(3)]


def _config(tmp_path: Path, keys: Keys, **updates: object) -> dict[str, object]:
    return {
        "store": str(tmp_path / "store"),
        "trusted_keys": [str(keys.public)],
        "updates": {"broker": "mqtt://127.0.0.1:1883", "fleet": "f", "device_id": "dev-1",
                    "notice_keys": [str(keys.notice_public)], **updates},
    }  # fmt: skip


def test_a_trusted_key_limited_to_names_signs_only_those(
    tmp_path: Path, keys: Keys, tiny_bundles: dict[int, Path]
) -> None:
    limited = TrustStore.from_files([], limited=[(keys.public, ("det-*", "seg-*"))])
    with pytest.raises(SignatureError, match=r"bundle 'tiny' is signed by key \w+, which may sign only det-\*, seg-\*"):
        read_verified_manifest(tiny_bundles[2], limited)
    assert read_verified_manifest(tiny_bundles[2], TrustStore.from_files([], limited=[(keys.public, ("ti*",))]))
    # in agent.toml: [[trusted]] key/names; a key also in trusted_keys keeps its wider grant
    data = {"store": str(tmp_path / "s"), "trusted": [{"key": str(keys.public), "names": ["det-*"]}]}
    trust = bundle_trust(config_from_data(data, base=tmp_path))
    with pytest.raises(SignatureError, match="may sign only det-"):
        read_verified_manifest(tiny_bundles[2], trust)
    both = bundle_trust(config_from_data({**data, "trusted_keys": [str(keys.public)]}, base=tmp_path))
    assert read_verified_manifest(tiny_bundles[2], both).manifest.name == "tiny"
    with pytest.raises(ConfigError, match=r"names of .* is empty"):
        config_from_data({**data, "trusted": [{"key": str(keys.public), "names": []}]}, base=tmp_path)


def test_updates_without_notice_keys_say_how_to_make_one(tmp_path: Path, keys: Keys) -> None:
    with pytest.raises(
        ConfigError, match=r"agent\.updates: notice_keys is empty: .*edgekit keygen --out keys --name fleet"
    ):
        config_from_data(_config(tmp_path, keys, notice_keys=[]), base=tmp_path)
    with pytest.raises(ConfigError, match="root_threshold 2 is more than the 1 root_keys"):
        config_from_data(_config(tmp_path, keys, root_keys=[str(keys.root_public)], root_threshold=2), base=tmp_path)


def test_keys_document_needs_the_root_threshold_and_only_moves_forward(
    tmp_path: Path, keys: Keys, roots: list[tuple[Path, Path]], tiny_bundles: dict[int, Path]
) -> None:
    config = config_from_data(
        _config(tmp_path, keys, root_keys=[str(p) for _, p in roots], root_threshold=2), base=tmp_path
    )
    trust = FleetTrust(config)
    assert trust.keys_topic == keys_topic("f")
    signers = [load_private_key(k) for k, _ in roots]
    new_notice = generate_keypair(tmp_path / "k", "fleet-2")
    bundle_kid = key_id(load_public_key(keys.public))
    doc = build_keys_document("f", None, add_notice=(new_notice[1],), revoke=(bundle_kid,))
    with pytest.raises(RefusedError, match=r"needs 2 valid root signature\(s\), has 1"):
        trust.accept_keys(sign_document(doc.to_json(), signers[:1]).to_json())
    with pytest.raises(RefusedError, match=r"has 1 "):  # the same key twice counts once
        trust.accept_keys(sign_document(doc.to_json(), [signers[0], signers[0]]).to_json())
    payload = sign_document(doc.to_json(), signers[1:]).to_json()
    assert trust.accept_keys(payload) == doc
    assert trust.accept_keys(payload) is None  # the one held already
    # the revoked bundle key no longer verifies bundles, also for a manager started later
    with pytest.raises(SignatureError, match="revoked key"):
        read_verified_manifest(tiny_bundles[2], trust.bundle_trust())
    with pytest.raises(SignatureError, match="revoked key"):
        read_verified_manifest(tiny_bundles[2], bundle_trust(config))
    # a new notice key signs desired states now; the state on disk survives a restart
    restarted = FleetTrust(config)
    assert key_id(load_public_key(new_notice[1])) in restarted.notice_role().keys
    state = signed_state(new_notice[0], "f", (), device="dev-1")
    assert restarted.check_desired("edgekit/f/dev-1/desired", state).state.device == "dev-1"
    # a replay of an older keys document (version 1 again, other content) is refused
    older = build_keys_document("f", None, revoke=("0" * 16,))
    with pytest.raises(RefusedError, match="not above v1, the keys document held: a replay"):
        restarted.accept_keys(sign_document(older.to_json(), signers[:2]).to_json())
    # a bundle key added for some names only: the untrusted "other" key may now sign det-* models, not tiny
    limited = build_keys_document("f", doc, add_bundle=((keys.other_public, ("det-*",)),))
    restarted.accept_keys(sign_document(limited.to_json(), signers[:2]).to_json())
    other_tiny = bundle(tmp_path / "tiny-other.ekb", keys.other_private, 2)
    with pytest.raises(SignatureError, match=r"may sign only det-\*"):
        read_verified_manifest(other_tiny, restarted.bundle_trust())
    doc = limited
    later = build_keys_document("f", doc, revoke=(key_id(load_public_key(new_notice[1])),))
    assert later.version == 3 and later.notice_keys == ()  # a revoked key leaves the lists
    restarted.accept_keys(sign_document(later.to_json(), signers[:2]).to_json())
    with pytest.raises(RefusedError, match="is revoked"):
        restarted.check_desired("edgekit/f/dev-1/desired", state)


def test_desired_state_checks_without_a_broker(tmp_path: Path, keys: Keys) -> None:
    trust = FleetTrust(config_from_data(_config(tmp_path, keys), base=tmp_path))
    topic = "edgekit/f/dev-1/desired"
    other_fleet = signed_state(keys.notice_private, "g", (), device="dev-1")
    with pytest.raises(RefusedError, match="bound to device dev-1 of fleet g"):
        trust.check_desired(topic, other_fleet)
    with pytest.raises(RefusedError, match="carries no signature"):
        trust.check_desired(topic, signed_state(None, "f", (), device="dev-1"))
    with pytest.raises(RefusedError, match="is not a notice key"):
        trust.check_desired(topic, signed_state(keys.other_private, "f", (), device="dev-1"))
    now = datetime.now(timezone.utc)
    skewed = signed_state(keys.notice_private, "f", (), device="dev-1", issued=now + timedelta(seconds=200))
    assert trust.check_desired(topic, skewed)  # within clock_skew_s (300 s)
    newer = trust.check_desired(topic, signed_state(keys.notice_private, "f", (), device="dev-1"))
    trust.accept(topic, newer)
    restarted = FleetTrust(trust.config)  # the accepted state is kept
    assert restarted.stored_states((topic,))[topic].state == newer.state
    old = signed_state(keys.notice_private, "f", (), device="dev-1", issued=now - timedelta(minutes=5))
    with pytest.raises(RefusedError, match="a replay"):
        trust.check_desired(topic, old)
    expired = signed_state(keys.notice_private, "f", (), device="dev-1", issued=now + timedelta(seconds=1),
                           fresh_for=timedelta(seconds=1))  # fmt: skip
    record = (tmp_path / "store" / "fleet-trust.json").read_text()
    trust.accept(topic, trust.check_desired(topic, expired), now=now + timedelta(seconds=5))
    assert (tmp_path / "store" / "fleet-trust.json").read_text() == record  # an expired state moves nothing
