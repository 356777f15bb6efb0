"""Which notices a device acts on: replays, duplicates, stale notices, groups, rollout, and the
bundles it must refuse (tampered, wrong key, older, expired, wrong hardware, oversize)."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from device_agents.updates.policy import rollout_bucket
from edgekit.bundle import TrustStore, read_verified_manifest
from edgekit.bundle.fleet_connection import BrokerAddress
from edgekit.bundle.fleet_protocol import Notice, device_desired_topic, group_desired_topic
from edgekit.bundle.manifest import sha256_file
from edgekit.fleet.publish import build_notice, bundle_url, copy_bundle, now_iso
from edgekit.fleet.session import FleetSession
from tests.updates.bundles import bundle, padded_classifier, tamper_member, wrong_hardware
from tests.updates.conftest import FLEET, AgentFactory, Keys, edgekit, publish
from tests.updates.services import FileServer, Mosquitto, Watcher, wait_for
from tests.updates.states import signed_state

DESIRED = device_desired_topic(FLEET, "dev-1")
REPORTED = f"edgekit/{FLEET}/dev-1/reported"


def _send(broker: Mosquitto, topic: str, payload: bytes) -> None:
    with FleetSession(BrokerAddress(False, "127.0.0.1", broker.port)) as session:
        session.publish_retained(topic, payload)


def _state(keys: Keys, *models: Notice) -> bytes:
    """dev-1's desired state with ``models``, signed by the notice key: checks on the device only."""
    return signed_state(keys.notice_private, FLEET, models, device="dev-1")


def _raw_notice(bundle_path: Path, files: FileServer, **changes: object) -> Notice:
    """A notice for ``bundle_path`` (copied to the file server) built without host-side checks."""
    copy_bundle(bundle_path, files.dir)
    notice = Notice(
        notice_id=uuid.uuid4().hex,
        issued=now_iso(datetime.now(timezone.utc)),
        name="tiny",
        version=3,
        sha256=sha256_file(bundle_path),
        size_bytes=bundle_path.stat().st_size,
        url=bundle_url(files.base_url, bundle_path),
    )
    return dataclasses.replace(notice, **changes)  # type: ignore[arg-type]  # field values as given


def _gets(files: FileServer, bundle_path: Path) -> list[str]:
    return [r for r in files.requests() if r.startswith(f"GET /{bundle_path.name} ")]


def test_replayed_misbound_and_stale_notices_are_applied_once(
    broker: Mosquitto, files: FileServer, agents: AgentFactory, keys: Keys, tiny_bundles: dict[int, Path]
) -> None:
    agent = agents(broker.url(), "dev-1", groups=("cams",)).start()
    watcher = Watcher(broker.port, [REPORTED])
    try:
        publish(tiny_bundles[2], broker.url(), files, keys.public, "--device", "dev-1")
        watcher.wait(lambda r: r["state"] == "serving" and r["version"] == 2, 30, "v2 to pass its health window")
    finally:
        watcher.close()
    with FleetSession(BrokerAddress(False, "127.0.0.1", broker.port)) as session:
        payload = session.collect_retained(DESIRED, 0.3)[DESIRED]

    def received(times: int) -> bool:
        return len(re.findall(rf"desired state on {DESIRED} issued .*: tiny v2", agent.log())) >= times

    # the same state again on the device topic (a replay): accepted as the state held, nothing to do
    _send(broker, DESIRED, payload)
    wait_for(lambda: received(2), 20, "the replay to arrive")
    cams = group_desired_topic(FLEET, "cams")
    _send(broker, cams, payload)  # and on the device's group: bound to dev-1, so refused there
    wait_for(lambda: f"refused the message on {cams}: it is bound to device dev-1" in agent.log(), 20, "a refusal")
    # a notice for v3 with a new id, but issued before the one handled: stale
    trust = TrustStore.from_files([keys.public])
    stale = build_notice(tiny_bundles[3], read_verified_manifest(tiny_bundles[3], trust), "http://unused/")
    stale = dataclasses.replace(
        stale,
        url=bundle_url(files.base_url, copy_bundle(tiny_bundles[3], files.dir)),
        issued=(datetime.now(timezone.utc) - timedelta(hours=1)).isoformat(),
    )
    _send(broker, DESIRED, _state(keys, stale))
    wait_for(lambda: re.search(rf"ignore: notice {stale.notice_id} .* is stale", agent.log()), 20, "the stale notice")

    assert agent.served_version("tiny") == 2
    assert agent.metric("edgekit_installs_total", model="tiny", result="installed") == 1
    assert agent.metric("edgekit_installs_total", model="tiny", result="unchanged") == 0
    assert len(_gets(files, tiny_bundles[2])) == 1 and not _gets(files, tiny_bundles[3])


def test_device_topic_overrides_group_and_rollout_selects_by_a_stable_hash(
    broker: Mosquitto, files: FileServer, agents: AgentFactory, keys: Keys, tiny_bundles: dict[int, Path]
) -> None:
    agent = agents(broker.url(), "dev-1", groups=("cams",))
    publish(tiny_bundles[2], broker.url(), files, keys.public, "--device", "dev-1")
    publish(tiny_bundles[3], broker.url(), files, keys.public, "--group", "cams")
    watcher = Watcher(broker.port, [REPORTED])
    try:
        agent.start()  # both notices are retained: the device's own one counts
        watcher.wait(lambda r: r["state"] == "serving" and r["version"] == 2, 30, "v2 from the device topic")
        assert not _gets(files, tiny_bundles[3])

        _send(broker, DESIRED, b"")  # clearing the topic is signed by nobody: refused, nothing changes
        wait_for(lambda: f"refused the message on {DESIRED}: an empty message" in agent.log(), 20, "a refusal")
        # the device's own state without tiny (signed): the group's notice now counts
        edgekit("fleet", "refresh", "--broker", broker.url(), "--fleet", FLEET, "--device", "dev-1",
                "--drop", "tiny", "--notice-key", str(keys.notice_private))  # fmt: skip
        agent.wait_version("tiny", 3)

        bucket = rollout_bucket("dev-1")
        skipped = publish(tiny_bundles[4], broker.url(), files, keys.public, "--device", "dev-1", rollout=bucket)
        report = watcher.wait(lambda r: r["notice_id"] == skipped, 30, "the rollout decision")
        assert report["state"] == "skipped" and f"bucket {bucket}" in report["detail"]
        assert agent.served_version("tiny") == 3 and not _gets(files, tiny_bundles[4])
        publish(tiny_bundles[4], broker.url(), files, keys.public, "--device", "dev-1", rollout=bucket + 1)
        agent.wait_version("tiny", 4)
    finally:
        watcher.close()


@pytest.fixture
def bad_bundles(tmp_path: Path, keys: Keys, tiny_bundles: dict[int, Path]) -> dict[str, Path]:
    """v3 of ``tiny`` in the ways a device must refuse; each with its own file name."""
    d = tmp_path / "bad"
    d.mkdir()
    good = tiny_bundles[3]
    return {
        "wrong_key": bundle(d / "tiny-v3-other-key.ekb", keys.other_private, 3),
        "tampered_member": tamper_member(good, d / "tiny-v3-tampered-member.ekb"),
        "expired": bundle(d / "tiny-v3-expired.ekb", keys.private, 3, expires="2020-01-01T00:00:00Z"),
        "wrong_hardware": wrong_hardware(good, keys.private, d / "tiny-v3-riscv.ekb", keys.public),
        "oversize": bundle(
            d / "tiny-v3-big.ekb", keys.private, 3, model=padded_classifier(d / "big.onnx", 1200 * 1024, seed=3)
        ),
        "failing_selftest": bundle(d / "tiny-v3-bad-golden.ekb", keys.private, 3, corrupt_golden=True),
    }


def test_bad_bundles_are_rejected_with_the_reason_and_the_old_version_keeps_serving(
    broker: Mosquitto,
    files: FileServer,
    agents: AgentFactory,
    keys: Keys,
    tiny_bundles: dict[int, Path],
    bad_bundles: dict[str, Path],
) -> None:
    agent = agents(broker.url(), "dev-1", seed=2, extra_updates={"max_bundle_mb": 1}).start()
    assert agent.served_version("tiny") == 2
    url = broker.url()
    pub = keys.public

    def rejected(notice_id: str) -> str:
        report = watcher.wait(
            lambda r: r["notice_id"] == notice_id and r["state"] in ("rejected", "serving"), 30, "a decision"
        )
        assert report["state"] == "rejected", report
        assert agent.served_version("tiny") == 2
        return str(report["error"])

    watcher = Watcher(broker.port, [REPORTED])
    try:
        assert "older than v2" in rejected(publish(tiny_bundles[1], url, files, pub, "--device", "dev-1"))
        wrong_key = publish(bad_bundles["wrong_key"], url, files, keys.other_public, "--device", "dev-1")
        assert "untrusted key" in rejected(wrong_key)
        assert "does not match the manifest" in rejected(
            publish(bad_bundles["tampered_member"], url, files, pub, "--device", "dev-1")
        )
        # altered on the server after it was announced: one byte (same size), or replaced by another file
        on_server = _raw_notice(tiny_bundles[3], files)
        served = files.dir / tiny_bundles[3].name
        data = bytearray(served.read_bytes())
        data[len(data) // 2] ^= 0xFF
        served.write_bytes(bytes(data))
        _send(broker, DESIRED, _state(keys, on_server))
        assert "does not match the notice's sha256" in rejected(on_server.notice_id)
        replaced = dataclasses.replace(
            on_server, notice_id=uuid.uuid4().hex, issued=now_iso(datetime.now(timezone.utc))
        )
        served.write_bytes(tiny_bundles[3].read_bytes() + b"appended")
        _send(broker, DESIRED, _state(keys, replaced))
        assert "the file was replaced" in rejected(replaced.notice_id)
        served.unlink()
        # the host refuses to publish an expired bundle; a notice that reaches a device anyway is refused there
        refused = subprocess.run(
            [sys.executable, "-m", "edgekit.cli", "publish", str(bad_bundles["expired"]),
             "--broker", url, "--fleet", FLEET, "--device", "dev-1",
             "--base-url", files.base_url, "--trusted-key", str(pub), "--notice-key", str(keys.notice_private)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert refused.returncode != 0 and "expired" in refused.stderr
        expired = _raw_notice(bad_bundles["expired"], files)
        _send(broker, DESIRED, _state(keys, expired))
        assert "expired" in rejected(expired.notice_id)
        assert "riscv64" in rejected(publish(bad_bundles["wrong_hardware"], url, files, pub, "--device", "dev-1"))
        assert "over this device's" in rejected(publish(bad_bundles["oversize"], url, files, pub, "--device", "dev-1"))
        lying = _raw_notice(tiny_bundles[3], files, size_bytes=1000, notice_id=uuid.uuid4().hex)
        _send(broker, DESIRED, _state(keys, lying))
        assert "more than the notice's 1000" in rejected(lying.notice_id)
        assert "self-test" in rejected(publish(bad_bundles["failing_selftest"], url, files, pub, "--device", "dev-1"))
        assert not _gets(files, bad_bundles["oversize"])  # refused from the notice, before downloading

        publish(tiny_bundles[3], url, files, pub, "--device", "dev-1")  # a good v3 still goes in
        agent.wait_version("tiny", 3)
    finally:
        watcher.close()
