"""A full disk during the download aborts cleanly: nothing left behind, the old version serves,
the reason is reported, and the update goes through once there is space again."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.updates.bundles import bundle, padded_classifier
from tests.updates.conftest import FLEET, AgentFactory, Keys, publish
from tests.updates.services import FileServer, Mosquitto, Watcher, wait_for
from tests.updates.tmpfs import resize, small_tmpfs


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path / "downloads", "512k") as mount_point:
        yield mount_point


def test_disk_full_during_download_aborts_cleanly_and_retries(
    broker: Mosquitto, files: FileServer, agents: AgentFactory, keys: Keys, tmp_path: Path, small_disk: Path
) -> None:
    big = bundle(
        tmp_path / "tiny-v2-1mb.ekb", keys.private, 2, model=padded_classifier(tmp_path / "big.onnx", 1024 * 1024)
    )
    agent = agents(broker.url(), "dev-1", extra_updates={"download_dir": str(small_disk)}).start()
    watcher = Watcher(broker.port, [f"edgekit/{FLEET}/dev-1/reported"])
    try:
        notice = publish(big, broker.url(), files, keys.public, "--device", "dev-1")
        report = watcher.wait(lambda r: r["notice_id"] == notice and r["state"] == "failed", 30, "the failure")
        assert "no space left" in report["error"] and report["version"] == 1
        # each attempt removes its partial file: the small disk is seen empty between attempts
        wait_for(lambda: not any(small_disk.iterdir()), 10, "the partial download to be removed", interval_s=0.01)
        assert agent.served_version("tiny") == 1

        resize(small_disk, "4m")
        watcher.wait(lambda r: r["state"] == "checking" and r["version"] == 2, 60, "v2 to be switched in")
    finally:
        watcher.close()
    assert not any(small_disk.iterdir())  # the completed download is removed after the install
