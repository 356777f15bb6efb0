"""The store's crash safety: extracted files are durable before a slot names them, and a full disk
during extraction is a store error (try again later), not a verdict on the bundle."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from device_agents.errors import StoreError
from device_agents.platforms.compatibility import check_compatible
from device_agents.store import STATE_VERSION, Store
from edgekit.bundle import TrustStore
from tests.updates.bundles import bundle, padded_classifier
from tests.updates.tmpfs import resize, small_tmpfs


def test_stage_fsyncs_every_extracted_file_before_the_state_names_it(
    tmp_path: Path, keypair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    ekb = bundle(tmp_path / "tiny-1.ekb", keypair[0], 1)
    store = Store(tmp_path / "store")
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    staged = store.stage(ekb, TrustStore.from_files([keypair[1]]), compatible=check_compatible)

    model_dir = store.model_dir(staged.slot).resolve()
    files = sorted(str(p) for p in model_dir.rglob("*") if p.is_file())
    assert files and str(model_dir / "manifest.json") in files
    state_written = synced.index(str(store.root.resolve() / ".state.json.tmp"))
    for f in files:
        assert f in synced[:state_written], f"{f} was not fsync'd before state.json named its slot"
    assert str(model_dir) in synced[:state_written]  # and the directory entries themselves


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path / "store", "1536k") as mount_point:
        yield mount_point


def test_disk_full_while_extracting_is_a_store_error_and_staging_works_once_there_is_space(
    tmp_path: Path, keypair: tuple[Path, Path], small_disk: Path
) -> None:
    # ~1 MiB of incompressible weights: the bundle copy fits on the 1.5 MiB disk, its extraction does not
    model = padded_classifier(tmp_path / "big.onnx", 1024 * 1024)
    ekb = bundle(tmp_path / "tiny-1.ekb", keypair[0], 1, model=model)
    store, trust = Store(small_disk), TrustStore.from_files([keypair[1]])

    with pytest.raises(StoreError, match="no space left"):  # a BundleError would reject the update for good
        store.stage(ekb, trust, compatible=check_compatible)
    assert store.load_state().models == {}
    assert not any((small_disk / "models").rglob("*.onnx"))  # no partial extraction left behind

    resize(small_disk, "4m")
    staged = store.stage(ekb, trust, compatible=check_compatible)
    assert store.model_state("tiny").candidate == staged.slot


def test_a_version_1_state_file_is_migrated_keeping_which_active_versions_are_still_watched(tmp_path: Path) -> None:
    slot = {"version": 2, "sha256": "ab" * 32, "path": "models/m/2-abababababab"}
    v1 = {
        "schema_version": 1,
        "models": {
            "watched": {"max_version": 2, "active": slot, "status": "serving", "boots_since_switch": 1},
            "confirmed": {"max_version": 2, "active": slot, "status": "healthy"},
            "rolled": {"max_version": 3, "active": slot, "status": "rolled_back"},
        },
    }
    (tmp_path / "state.json").write_text(json.dumps(v1))
    state = Store(tmp_path).load_state()
    assert state.schema_version == STATE_VERSION == 2
    assert {n: ms.active_healthy for n, ms in state.models.items()} == {
        "watched": False,
        "confirmed": True,
        "rolled": True,
    }
    assert state.models["watched"].boots_since_switch == 1


def test_a_state_file_from_a_newer_agent_is_refused_with_what_to_do(tmp_path: Path) -> None:
    (tmp_path / "state.json").write_text(json.dumps({"schema_version": 99, "models": {}}))
    with pytest.raises(StoreError, match="upgrade edgekit-agent"):
        Store(tmp_path).load_state()
