"""Verification at rest and start-up that a transient cannot turn permanent: a bit flipped in an
installed artifact (found at start or by the periodic check while serving) rolls back to the
previous good slot and is reported; a slot signed by a key revoked since is refused; a file
missing at start is waited for and never demotes its version."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from device_agents.config import load_config
from device_agents.lifecycle import Lifecycle
from device_agents.store import Slot
from tests.agent.conftest import Bundles, write_config
from tests.factories import make_cpu_bundle


def _manager(config: Path) -> Lifecycle:
    m = Lifecycle(load_config(config))
    m.start()
    return m


def _two_versions(config: Path, bundles: Bundles) -> tuple[Slot, Slot]:
    m = _manager(config)
    m.install(bundles.v1)
    m.install(bundles.v2)
    m.stop()
    ms = m.store.model_state("tiny")
    assert ms.active is not None and ms.previous is not None
    return ms.active, ms.previous


def _flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_bit_flipped_at_rest_rolls_back_at_start(config_path: Path, bundles: Bundles) -> None:
    active, _ = _two_versions(config_path, bundles)
    m = _manager(config_path)
    _flip_a_bit(m.store.model_dir(active) / "model.onnx")
    m.stop()
    m = _manager(config_path)
    try:
        assert m.models() == {"tiny": 1}
        ms = m.store.model_state("tiny")
        assert ms.status == "rolled_back" and ms.active is not None and ms.active.version == 1
        assert "v2 failed verification at rest" in ms.error and "model.onnx: sha256 does not match" in ms.error
        assert m.metrics.verify_failures.labels("tiny")._value.get() == 1  # the report on /metrics
    finally:
        m.stop()


def test_a_bit_flipped_while_serving_is_found_by_the_periodic_check(
    tmp_path: Path, keypair: tuple[Path, Path], bundles: Bundles
) -> None:
    config = write_config(tmp_path / "agent", keypair[1], "")
    config.write_text("verify_interval_s = 0.2\n" + config.read_text())
    active, _ = _two_versions(config, bundles)
    m = _manager(config)
    try:
        assert m.models() == {"tiny": 2}
        _flip_a_bit(m.store.model_dir(active) / "golden.npz")
        deadline = time.monotonic() + 60  # a generous guard; the check runs every 0.2 s
        while m.models() != {"tiny": 1} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert m.models() == {"tiny": 1}
        ms = m.store.model_state("tiny")
        assert ms.status == "rolled_back" and "golden.npz: sha256 does not match" in ms.error
    finally:
        m.stop()


def test_check_at_rest_stops_serving_when_no_slot_verifies(config_path: Path, bundles: Bundles) -> None:
    active, previous = _two_versions(config_path, bundles)
    m = _manager(config_path)
    try:
        for slot in (active, previous):
            _flip_a_bit(m.store.model_dir(slot) / "model.onnx")
        assert set(m.check_at_rest()) == {"tiny"}
        assert m.models() == {}
        ms = m.store.model_state("tiny")
        assert ms.status == "failed" and "no longer served" in ms.error
    finally:
        m.stop()


def test_a_slot_signed_by_a_key_revoked_since_is_refused(
    tmp_path: Path, keypair: tuple[Path, Path], other_keypair: tuple[Path, Path], tiny_model: Path
) -> None:
    config = write_config(tmp_path / "agent", keypair[1], "")
    (tmp_path / "agent" / "keys" / "other.pub").write_bytes(other_keypair[1].read_bytes())
    text = config.read_text().replace('["keys/trusted.pub"]', '["keys/trusted.pub", "keys/other.pub"]')
    config.write_text(text)
    m = _manager(config)
    m.install(make_cpu_bundle(tmp_path / "v1.ekb", tiny_model, keypair[0], version=1))
    m.install(make_cpu_bundle(tmp_path / "v2.ekb", tiny_model, other_keypair[0], version=2))
    revoked = m.store.verify_slot(m.store.model_state("tiny").active, m.trust).key_id  # type: ignore[arg-type]  # set after an install
    m.stop()
    config.write_text(f'revoked_key_ids = ["{revoked}"]\n' + text)
    m = _manager(config)
    try:
        assert m.models() == {"tiny": 1}
        assert "revoked key" in m.store.model_state("tiny").error
    finally:
        m.stop()


def test_a_slot_from_before_signatures_were_kept_verifies_from_its_kept_bundle(
    config_path: Path, bundles: Bundles
) -> None:
    active, _ = _two_versions(config_path, bundles)
    m = Lifecycle(load_config(config_path))
    sig = m.store.model_dir(active) / "manifest.sig"
    sig.unlink()  # as an older agent extracted it
    assert m.store.verify_slot(active, m.trust).manifest.version == 2
    assert sig.is_file()  # kept from then on


def test_a_file_briefly_missing_at_start_is_waited_for_and_not_blacklisted(config_path: Path, bundles: Bundles) -> None:
    active, _ = _two_versions(config_path, bundles)
    m = Lifecycle(load_config(config_path))
    artifact = m.store.model_dir(active) / "model.onnx"
    aside = artifact.with_name("aside")
    artifact.rename(aside)  # storage not mounted yet, say
    back = threading.Timer(1.0, aside.rename, args=(artifact,))
    back.start()
    try:
        m.start()
    finally:
        back.join()
    try:
        assert m.models() == {"tiny": 2}
        ms = m.store.model_state("tiny")
        assert ms.active == active and ms.previous is not None and ms.status != "rolled_back"
    finally:
        m.stop()


def test_a_file_missing_at_every_attempt_serves_the_previous_for_now_and_keeps_the_slots(
    config_path: Path, bundles: Bundles
) -> None:
    active, previous = _two_versions(config_path, bundles)
    artifact = Lifecycle(load_config(config_path)).store.model_dir(active) / "model.onnx"
    aside = artifact.with_name("aside")
    artifact.rename(aside)
    m = _manager(config_path)
    try:
        assert m.models() == {"tiny": 1}
        ms = m.store.model_state("tiny")
        assert (ms.active, ms.previous, ms.status) == (active, previous, "degraded")
        assert "serving v1 for now" in ms.error
    finally:
        m.stop()
    aside.rename(artifact)
    m = _manager(config_path)  # the storage is back: v2 serves again, nothing was lost
    try:
        assert m.models() == {"tiny": 2}
        assert m.store.model_state("tiny").status == "serving"
    finally:
        m.stop()


@pytest.mark.parametrize("interval", [-1.0])
def test_verify_interval_must_not_be_negative(tmp_path: Path, keypair: tuple[Path, Path], interval: float) -> None:
    from edgekit.errors import ConfigError

    config = write_config(tmp_path / "a", keypair[1], "")
    config.write_text(f"verify_interval_s = {interval}\n" + config.read_text())
    with pytest.raises(ConfigError, match="verify_interval_s must be >= 0"):
        load_config(config)


def test_a_degraded_start_is_reported_as_a_failure(tmp_path: Path, keypair: tuple[Path, Path]) -> None:
    from dataclasses import replace

    from device_agents.updates.client import UpdateClient

    updates = (
        '[updates]\nbroker = "mqtt://127.0.0.1:1"\nfleet = "f"\ndevice_id = "d"\nnotice_keys = ["keys/trusted.pub"]\n'
    )
    config = write_config(tmp_path / "agent", keypair[1], updates)
    m = Lifecycle(load_config(config))
    m.store.update_model("tiny", lambda s: replace(s, status="degraded", error="v2 does not load after 5 attempts"))
    report = UpdateClient(load_config(config), m)._initial_report()  # what the device reports once connected
    assert (report.state, report.error) == ("failed", "v2 does not load after 5 attempts")
