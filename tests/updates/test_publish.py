"""The host side: the notice built from a bundle, --copy-to, option checks, the status table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgekit.bundle import TrustStore, read_verified_manifest
from edgekit.bundle.fleet_connection import BrokerAddress
from edgekit.bundle.fleet_protocol import parse_desired, parse_signed
from edgekit.bundle.manifest import sha256_file
from edgekit.errors import ConfigError, SignatureError
from edgekit.fleet.publish import PublishOptions, build_notice, bundle_url, copy_bundle, publish
from edgekit.fleet.session import FleetSession
from edgekit.fleet.status import DeviceStatus, format_json, format_table
from tests.updates.bundles import bundle
from tests.updates.conftest import FLEET, Keys, edgekit
from tests.updates.services import FileServer, Mosquitto

BROKER = BrokerAddress(False, "127.0.0.1", 1883)


def test_notice_is_built_from_the_verified_manifest(keys: Keys, tiny_bundles: dict[int, Path]) -> None:
    b = tiny_bundles[2]
    verified = read_verified_manifest(b, TrustStore.from_files([keys.public]))
    notice = build_notice(b, verified, bundle_url("https://cdn.example/fleet/", b), rollout_percent=30)
    assert (notice.name, notice.version, notice.rollout_percent, notice.target) == ("tiny", 2, 30, "cpu")
    assert notice.sha256 == sha256_file(b) and notice.size_bytes == b.stat().st_size
    assert notice.url == "https://cdn.example/fleet/tiny-v2.ekb"
    assert notice.signer_key_id == verified.key_id
    again = build_notice(b, verified, notice.url)
    assert again.notice_id != notice.notice_id  # every publish is a new notice


def test_copy_bundle_is_idempotent_and_never_replaces_other_content(
    tmp_path: Path, tiny_bundles: dict[int, Path]
) -> None:
    www = tmp_path / "www"
    placed = copy_bundle(tiny_bundles[2], www)
    assert placed.read_bytes() == tiny_bundles[2].read_bytes()
    assert copy_bundle(tiny_bundles[2], www) == placed
    impostor = tmp_path / "elsewhere" / tiny_bundles[2].name
    impostor.parent.mkdir()
    impostor.write_bytes(tiny_bundles[3].read_bytes())
    with pytest.raises(ConfigError, match="exists with other content"):
        copy_bundle(impostor, www)
    assert [p.name for p in www.iterdir()] == [tiny_bundles[2].name]  # no temporary file left


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "--device ID or --group NAME"),
        ({"devices": ("a",), "base_url": "ftp://x"}, "must start with http"),
        ({"devices": ("a",), "rollout_percent": 150}, "must be 0-100"),
        ({"devices": ("a",), "trusted_keys": ()}, "--trusted-key PUB is required"),
        ({"devices": ("a",), "notice_key": None}, "--notice-key KEY is required"),
        ({"devices": ("a",), "fresh_for_s": 0.0}, "--fresh-for must be > 0"),
    ],
)
def test_publish_options_refuse_bad_combinations(fields: dict[str, object], message: str, keys: Keys) -> None:
    base: dict[str, object] = {
        "broker": BROKER, "fleet": "f", "base_url": "http://x", "trusted_keys": (keys.public,),
        "notice_key": keys.notice_private,
    }  # fmt: skip
    with pytest.raises(ConfigError, match=message):
        PublishOptions(**{**base, **fields})  # type: ignore[arg-type]  # field values as given


def test_publish_refuses_a_bundle_the_host_does_not_trust_before_touching_the_broker(
    keys: Keys, tmp_path: Path
) -> None:
    foreign = bundle(tmp_path / "tiny-v2-foreign.ekb", keys.other_private, 2)
    options = PublishOptions(
        BROKER, "f", "http://x", (keys.public,), devices=("a",), copy_to=tmp_path / "www",
        notice_key=keys.notice_private,
    )  # fmt: skip
    with pytest.raises(SignatureError, match="untrusted key"):
        publish(foreign, options)
    assert not (tmp_path / "www").exists()


def test_broker_address_checks_the_tls_options(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="must be mqtt://HOST:PORT"):
        BrokerAddress.parse("http://broker:1883")
    with pytest.raises(ConfigError, match="is plain MQTT"):
        BrokerAddress.parse("mqtt://broker:1883", ca=tmp_path / "ca.crt")
    with pytest.raises(ConfigError, match="go together"):
        BrokerAddress.parse("mqtts://broker:8883", cert=tmp_path / "c.crt")
    with pytest.raises(ConfigError, match="does not exist"):
        BrokerAddress.parse("mqtts://broker:8883", ca=tmp_path / "missing.crt")
    assert BrokerAddress.parse("mqtts://broker:8883").url == "mqtts://broker:8883"


def test_status_table_has_one_aligned_row_per_device() -> None:
    rows = [
        DeviceStatus("cam-01", "tiny", 2, 2, "serving", "2026-03-04T12:00:00Z"),
        DeviceStatus("cam-02", "tiny", 1, 2, "rejected", "2026-03-04T12:00:05Z", "tiny v2 expired"),
        DeviceStatus("gateway-7", state="idle"),
    ]
    assert format_table(rows) == (
        "DEVICE     MODEL  VERSION  DESIRED  STATE     UPDATED               REASON\n"
        "cam-01     tiny   2        2        serving   2026-03-04T12:00:00Z\n"
        "cam-02     tiny   1        2        rejected  2026-03-04T12:00:05Z  tiny v2 expired\n"
        "gateway-7  -      -        -        idle      -"
    )
    assert json.loads(format_json(rows))[1] == {
        "device": "cam-02", "model": "tiny", "version": 1, "desired_version": 2, "state": "rejected",
        "updated": "2026-03-04T12:00:05Z", "reason": "tiny v2 expired",
    }  # fmt: skip


def test_publish_keeps_the_other_models_of_a_state_and_carries_them_over_a_rotation(
    broker: Mosquitto, files: FileServer, keys: Keys, tiny_bundles: dict[int, Path], tmp_path: Path
) -> None:
    from edgekit.bundle import generate_keypair
    from tests.factories import make_cpu_bundle, tiny_classifier
    from tests.updates.conftest import publish as cli_publish

    other = make_cpu_bundle(tmp_path / "other-v1.ekb", tiny_classifier(tmp_path / "o.onnx", seed=5), keys.private,
                            name="other", version=1)  # fmt: skip
    topic = f"edgekit/{FLEET}/dev-1/desired"

    def models() -> dict[str, int]:
        with FleetSession(BrokerAddress(False, "127.0.0.1", broker.port)) as session:
            state = parse_desired(parse_signed(session.read_retained(topic)))
        return {m.name: m.version for m in state.models}

    cli_publish(tiny_bundles[2], broker.url(), files, keys.public, "--device", "dev-1")
    cli_publish(other, broker.url(), files, keys.public, "--device", "dev-1")
    assert models() == {"tiny": 2, "other": 1}  # the allowlist grows with each publish
    cli_publish(tiny_bundles[3], broker.url(), files, keys.public, "--device", "dev-1")
    assert models() == {"tiny": 3, "other": 1}
    new_key, _ = generate_keypair(tmp_path / "k", "fleet-2")
    args = ["publish", str(tiny_bundles[4]), "--broker", broker.url(), "--fleet", FLEET, "--device", "dev-1",
            "--base-url", files.base_url, "--copy-to", str(files.dir), "--trusted-key", str(keys.public),
            "--notice-key", str(new_key)]  # fmt: skip
    out = edgekit(*args, "--previous-notice-key", str(keys.notice_public))
    assert "warning" not in out and models() == {"tiny": 4, "other": 1}  # carried over the rotation
    out = edgekit(*args[:-1], str(keys.notice_private))  # the old key again: it cannot verify the new state
    assert "is not a state signed by this notice key" in out and models() == {"tiny": 4}
