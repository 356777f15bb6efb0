"""TUF's attacks on the fleet channel, against a real agent, Mosquitto and file server on loopback:
poisoned and replayed notices, unlisted models, wrong roles, expired (frozen) state, key rotation,
a slow download, and a broken build with a huge version."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from edgekit.bundle import TrustStore, generate_keypair, key_id, load_public_key, read_verified_manifest
from edgekit.bundle.fleet_connection import BrokerAddress
from edgekit.bundle.fleet_protocol import device_desired_topic, parse_signed
from edgekit.fleet.publish import build_notice, bundle_url, copy_bundle
from edgekit.fleet.session import FleetSession
from tests.factories import make_cpu_bundle, tiny_classifier
from tests.updates.bundles import bundle
from tests.updates.conftest import FLEET, AgentFactory, Keys, edgekit, publish
from tests.updates.services import Agent, FileServer, Mosquitto, SlowFileServer, Watcher, wait_for
from tests.updates.states import signed_state

DESIRED = device_desired_topic(FLEET, "dev-1")
REPORTED = f"edgekit/{FLEET}/dev-1/reported"


def _send(broker: Mosquitto, topic: str, payload: bytes) -> None:
    with FleetSession(BrokerAddress(False, "127.0.0.1", broker.port)) as session:
        session.publish_retained(topic, payload)


def _retained(broker: Mosquitto, topic: str = DESIRED) -> bytes:
    with FleetSession(BrokerAddress(False, "127.0.0.1", broker.port)) as session:
        return session.read_retained(topic)


def _refusals(agent: Agent, topic: str = DESIRED) -> list[str]:
    return re.findall(rf"refused the message on {re.escape(topic)}: (.*)", agent.log())


def _wait_refused(agent: Agent, count: int, topic: str = DESIRED) -> str:
    found = wait_for(lambda: _refusals(agent, topic)[count - 1 :], 20, f"refusal {count} on {topic}")
    return str(found[0])


def _trust_record(agent: Agent) -> str:
    path = agent.spec.store / "fleet-trust.json"
    return path.read_text() if path.exists() else ""


def _gets(files: FileServer, name: str) -> list[str]:
    return [r for r in files.requests() if r.startswith(f"GET /{name} ")]


@pytest.fixture(scope="session")
def other_v1(tmp_path_factory: pytest.TempPathFactory, keys: Keys) -> Path:
    """Model ``other`` v1, signed by the trusted bundle key: a real bundle this device never had."""
    out = tmp_path_factory.mktemp("other")
    return make_cpu_bundle(out / "other-v1.ekb", tiny_classifier(out / "other.onnx", seed=11), keys.private,
                           name="other", version=1)  # fmt: skip


def test_poisoned_unsigned_notice_dated_2999_then_a_signed_v2_installs(
    broker: Mosquitto, files: FileServer, agents: AgentFactory, keys: Keys, tiny_bundles: dict[int, Path]
) -> None:
    agent = agents(broker.url(), "dev-1").start()
    copy_bundle(tiny_bundles[3], files.dir)
    poison = {
        "schema_version": 1,
        "notice_id": "evil",
        "issued": "2999-01-01T00:00:00Z",
        "name": "tiny",
        "version": 3,
        "sha256": "0" * 64,
        "size_bytes": 10,
        "url": bundle_url(files.base_url, tiny_bundles[3]),
    }
    _send(broker, DESIRED, json.dumps(poison).encode())  # fmt: skip
    assert "it is not signed" in _wait_refused(agent, 1)
    # a fast-clock publisher's state, properly signed, issued a year ahead: refused as well
    trust = TrustStore.from_files([keys.public])
    v3 = build_notice(tiny_bundles[3], read_verified_manifest(tiny_bundles[3], trust),
                      bundle_url(files.base_url, tiny_bundles[3]))  # fmt: skip
    ahead = datetime.now(timezone.utc) + timedelta(days=365)
    v3_ahead = replace(v3, issued=ahead.isoformat())
    _send(broker, DESIRED, signed_state(keys.notice_private, FLEET, (v3_ahead,), device="dev-1", issued=ahead))
    assert "in the future by more than clock_skew_s" in _wait_refused(agent, 2)
    assert _trust_record(agent) == ""  # no high-water mark moved
    assert not _gets(files, tiny_bundles[3].name) and agent.served_version("tiny") == 1

    publish(tiny_bundles[2], broker.url(), files, keys.public, "--device", "dev-1")
    agent.wait_version("tiny", 2)
    agent.stop()
    agent.start()  # nothing of the poison survives a restart either
    assert agent.served_version("tiny") == 2
    assert "2999" not in _trust_record(agent)
    publish(tiny_bundles[3], broker.url(), files, keys.public, "--device", "dev-1")
    agent.wait_version("tiny", 3)


def test_notice_for_an_unlisted_model_is_refused(
    broker: Mosquitto, files: FileServer, agents: AgentFactory, keys: Keys, other_v1: Path
) -> None:
    agent = agents(broker.url(), "dev-1", groups=("cams",)).start()
    # other's genuine, signed state for dev-2 (listing "other"), copied onto dev-1's and the group's topics
    publish(other_v1, broker.url(), files, keys.public, "--device", "dev-2")
    theirs = _retained(broker, device_desired_topic(FLEET, "dev-2"))
    _send(broker, DESIRED, theirs)
    assert "bound to device dev-2" in _wait_refused(agent, 1)
    cams = f"edgekit/{FLEET}/group/cams/desired"
    _send(broker, cams, theirs)
    assert "bound to device dev-2" in _wait_refused(agent, 1, cams)
    # dev-1's own state with "other" spliced into the signed text: the signature no longer matches
    publish(other_v1, broker.url(), files, keys.public, "--device", "dev-3")
    envelope = parse_signed(_retained(broker, device_desired_topic(FLEET, "dev-3")))
    forged = envelope.signed.replace('"device": "dev-3"', '"device": "dev-1"')
    _send(broker, DESIRED, json.dumps({**json.loads(envelope.to_json()), "signed": forged}).encode())
    assert "does not match: the document was altered" in _wait_refused(agent, 2)
    assert agent.served_version("other") is None and not _gets(files, other_v1.name)
    assert agent.metric("edgekit_notices_refused_total") == 3


def test_state_signed_by_a_bundle_key_is_refused(
    broker: Mosquitto, files: FileServer, agents: AgentFactory, keys: Keys, tiny_bundles: dict[int, Path]
) -> None:
    agent = agents(broker.url(), "dev-1").start()
    # the bundle key signs a perfectly formed state: wrong role
    publish(tiny_bundles[2], broker.url(), files, keys.public, "--device", "dev-1", notice_key=keys.private)
    why = _wait_refused(agent, 1)
    assert f"key {key_id(load_public_key(keys.public))} is a bundle key, not a notice key" in why
    assert agent.served_version("tiny") == 1 and not _gets(files, tiny_bundles[2].name)
    publish(tiny_bundles[2], broker.url(), files, keys.public, "--device", "dev-1")  # the notice key: fine
    agent.wait_version("tiny", 2)


def test_replayed_old_signed_state_is_refused_also_after_a_restart(
    broker: Mosquitto, files: FileServer, agents: AgentFactory, keys: Keys, tiny_bundles: dict[int, Path]
) -> None:
    agent = agents(broker.url(), "dev-1", seed=None).start()
    publish(tiny_bundles[1], broker.url(), files, keys.public, "--device", "dev-1")
    agent.wait_version("tiny", 1)
    old = _retained(broker)
    publish(tiny_bundles[2], broker.url(), files, keys.public, "--device", "dev-1")
    agent.wait_version("tiny", 2)
    record = _trust_record(agent)
    _send(broker, DESIRED, old)  # an attacker holding yesterday's state replays it (retained, so it stays)
    assert "a replay" in _wait_refused(agent, 1)
    assert _trust_record(agent) == record
    agent.stop()
    agent.start()
    assert "a replay" in _wait_refused(agent, 2)  # the high-water mark survived the restart
    assert agent.served_version("tiny") == 2


def test_expired_desired_state_reports_frozen_and_the_model_keeps_serving(
    broker: Mosquitto, files: FileServer, agents: AgentFactory, keys: Keys, tiny_bundles: dict[int, Path]
) -> None:
    agent = agents(broker.url(), "dev-1").start()
    watcher = Watcher(broker.port, [REPORTED])
    try:
        publish(tiny_bundles[2], broker.url(), files, keys.public, "--device", "dev-1")
        watcher.wait(lambda r: r["state"] == "serving" and r["version"] == 2, 30, "v2 serving")
        assert agent.metric("edgekit_updates_frozen") == 0
        args = ["fleet", "refresh", "--broker", broker.url(), "--fleet", FLEET, "--device", "dev-1",
                "--notice-key", str(keys.notice_private)]  # fmt: skip
        out = edgekit(*args, "--fresh-for", "2s")  # the publisher stops refreshing: 2 s later it is stale
        assert "refreshed edgekit/test-fleet/dev-1/desired: tiny v2; fresh until" in out
        frozen = watcher.wait(lambda r: r["state"] == "frozen", 30, "a frozen report")
        assert "expired at" in frozen["detail"] and frozen["models"] == {"tiny": 2}
        assert agent.metric("edgekit_updates_frozen") == 1
        assert agent.served_version("tiny") == 2
        # an update in a state that is expired on arrival (signed long ago) is not applied
        trust = TrustStore.from_files([keys.public])
        url = bundle_url(files.base_url, copy_bundle(tiny_bundles[3], files.dir))
        long_ago = datetime.now(timezone.utc) - timedelta(hours=2)
        v3 = build_notice(tiny_bundles[3], read_verified_manifest(tiny_bundles[3], trust), url,
                          issued=long_ago.isoformat())  # fmt: skip
        _send(broker, DESIRED, signed_state(keys.notice_private, FLEET, (v3,), device="dev-1", issued=long_ago))
        wait_for(lambda: agent.log().count("desired state on " + DESIRED) >= 3, 20, "the stale state to arrive")
        assert agent.served_version("tiny") == 2 and not _gets(files, tiny_bundles[3].name)
        edgekit(*args)  # fresh again (24 h): idle, and the model keeps its version
        watcher.wait(lambda r: r["state"] == "idle" and "fresh again" in r["detail"], 30, "unfrozen")
        assert agent.metric("edgekit_updates_frozen") == 0
    finally:
        watcher.close()


def test_key_rotation_then_an_old_key_notice_is_refused(
    broker: Mosquitto, files: FileServer, agents: AgentFactory, keys: Keys, tiny_bundles: dict[int, Path],
    tmp_path: Path,
) -> None:  # fmt: skip
    new_key, new_pub = generate_keypair(tmp_path / "keys", "fleet-2026")
    agent = agents(broker.url(), "dev-1", extra_updates={"root_keys": [str(keys.root_public)]}).start()
    fleet = ["--broker", broker.url(), "--fleet", FLEET]
    # a keys document signed by the notice key is not signed by root: refused
    edgekit("fleet", "keys", *fleet, "--root-key", str(keys.notice_private), "--add-notice-key", str(new_pub))
    assert "is not a root key" in _wait_refused(agent, 1, f"edgekit/{FLEET}/keys")
    _send(broker, f"edgekit/{FLEET}/keys", b"")
    old_id = key_id(load_public_key(keys.notice_public))
    out = edgekit("fleet", "keys", *fleet, "--root-key", str(keys.root_private),
                  "--add-notice-key", str(new_pub), "--revoke", old_id)  # fmt: skip
    assert f"published keys v1 on edgekit/{FLEET}/keys: 1 notice key(s), 0 bundle key(s), revoked: {old_id}" in out
    wait_for(lambda: "keys document v1 accepted" in agent.log(), 20, "the keys document")

    publish(tiny_bundles[2], broker.url(), files, keys.public, "--device", "dev-1")  # the old notice key
    assert f"key {old_id} is revoked" in _wait_refused(agent, 1)
    publish(tiny_bundles[2], broker.url(), files, keys.public, "--device", "dev-1", notice_key=new_key)
    agent.wait_version("tiny", 2)
    agent.stop()
    agent.start()  # the rotation is remembered: the old key stays refused without the broker's help
    publish(tiny_bundles[3], broker.url(), files, keys.public, "--device", "dev-1")
    assert f"key {old_id} is revoked" in _wait_refused(agent, 2)
    assert agent.served_version("tiny") == 2


def test_slow_download_does_not_block_another_models_update(
    broker: Mosquitto, files: FileServer, agents: AgentFactory, keys: Keys, padded_v2: Path, other_v1: Path,
    tmp_path: Path,
) -> None:  # fmt: skip
    slow = SlowFileServer(tmp_path / "slow-www", tmp_path / "slow.log", bytes_per_s=20_000).start()
    try:
        # tiny's download is judged after 20 s: other's whole update must fit in that time
        limits = {"download_min_bytes_per_s": 100_000, "download_stall_s": 20.0, "download_deadline_s": 120.0}
        agent = agents(broker.url(), "dev-1", extra_updates=limits).start()
        watcher = Watcher(broker.port, [REPORTED])
        try:
            publish(padded_v2, broker.url(), slow, keys.public, "--device", "dev-1")  # 1 MB at 20 kB/s: 50 s
            watcher.wait(lambda r: r["state"] == "downloading" and r["name"] == "tiny", 20, "tiny downloading")
            publish(other_v1, broker.url(), files, keys.public, "--device", "dev-1")  # the same state, one more model
            agent.wait_version("other", 1, timeout_s=30)
            tiny_reports = [r["state"] for r in watcher.payloads() if r["name"] == "tiny"]
            assert tiny_reports[-1] == "downloading" and "failed" not in tiny_reports  # still on its slow link
            failed = watcher.wait(lambda r: r["state"] == "failed" and r["name"] == "tiny", 60, "tiny given up")
            assert "too slow" in failed["error"] and "download_min_bytes_per_s (100000)" in failed["error"], failed
            assert agent.served_version("tiny") == 1  # and it is retried later, resuming its partial file
        finally:
            watcher.close()
    finally:
        slow.kill()


def test_build_failing_selftest_with_a_huge_version_does_not_block_the_next_release(
    broker: Mosquitto, files: FileServer, agents: AgentFactory, keys: Keys, tiny_bundles: dict[int, Path],
    tmp_path: Path,
) -> None:  # fmt: skip
    broken = bundle(tmp_path / "tiny-v1000-broken.ekb", keys.private, 1000, corrupt_golden=True)
    agent = agents(broker.url(), "dev-1").start()
    watcher = Watcher(broker.port, [REPORTED])
    try:
        notice = publish(broken, broker.url(), files, keys.public, "--device", "dev-1")
        report = watcher.wait(lambda r: r["notice_id"] == notice and r["state"] == "rejected", 60, "v1000 refused")
        assert "self-test" in report["error"]
        state = json.loads((agent.spec.store / "state.json").read_text())["models"]["tiny"]
        assert state["max_version"] == 1  # the counter rises at commit, not at staging
        publish(tiny_bundles[2], broker.url(), files, keys.public, "--device", "dev-1")
        agent.wait_version("tiny", 2)
    finally:
        watcher.close()


def test_the_accepted_state_is_kept_so_an_offline_restart_still_knows_it_is_frozen(
    broker: Mosquitto, files: FileServer, agents: AgentFactory, keys: Keys, tiny_bundles: dict[int, Path]
) -> None:
    agent = agents(broker.url(), "dev-1").start()
    publish(tiny_bundles[2], broker.url(), files, keys.public, "--device", "dev-1", fresh_for="8s")
    agent.wait_version("tiny", 2)
    agent.stop()
    broker.kill()  # no broker, so no retained state, after the restart
    agent.start()
    wait_for(lambda: agent.metric("edgekit_updates_frozen") == 1, 30, "frozen from the stored state alone")
    assert "frozen: the desired state on " + DESIRED in agent.log() and agent.served_version("tiny") == 2
