"""The child-process self-test: golden vectors, latency, and the bounds that protect the daemon."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest

from device_agents.runtimes.options import OnnxRuntimeOptions, RuntimesConfig
from device_agents.selftest import (
    LOG_CAP_BYTES,
    REPORT_LOG_BYTES,
    ContainedChild,
    SelfTestReport,
    compare_outputs,
    latency_verdict,
    run_selftest,
)
from device_agents.store import Store
from edgekit.bundle import TrustStore
from edgekit.bundle.manifest import Golden
from tests.agent.conftest import Bundles


def _extracted(tmp_path: Path, bundle: Path, pub: Path) -> Path:
    store = Store(tmp_path / "store")
    staged = store.stage(bundle, TrustStore.from_files([pub]))
    return store.model_dir(staged.slot)


def _run(model_dir: Path, tmp_path: Path, *, timeout_s: float = 60, memory_mb: int = 2048) -> SelfTestReport:
    return run_selftest(
        model_dir,
        timeout_s=timeout_s,
        memory_mb=memory_mb,
        options=RuntimesConfig(onnxruntime=OnnxRuntimeOptions(threads=1)),
        work_dir=tmp_path / "work",
    )


def test_selftest_passes_and_measures_latency(tmp_path: Path, bundles: Bundles, keypair: tuple[Path, Path]) -> None:
    report = _run(_extracted(tmp_path, bundles.v1, keypair[1]), tmp_path)
    assert report.passed, report.reason
    assert report.latency_p50_ms > 0
    assert report.runtime["runtime"] == "onnxruntime"
    assert report.peak_rss_mb > 10  # the watchdog saw the child
    assert list((tmp_path / "work").iterdir()) == []  # report and log files removed


def test_selftest_fails_on_wrong_golden_outputs(tmp_path: Path, bundles: Bundles, keypair: tuple[Path, Path]) -> None:
    report = _run(_extracted(tmp_path, bundles.v3_bad_golden, keypair[1]), tmp_path)
    assert not report.passed
    assert "output 'probs' does not match the golden vectors" in report.reason


def test_selftest_kills_a_child_over_its_memory_bound(
    tmp_path: Path, bundles: Bundles, keypair: tuple[Path, Path]
) -> None:
    report = _run(_extracted(tmp_path, bundles.v1, keypair[1]), tmp_path, memory_mb=8)  # Python alone needs more
    assert not report.passed
    assert "over selftest.memory_mb = 8" in report.reason


def test_selftest_kills_a_child_past_its_timeout(tmp_path: Path, bundles: Bundles, keypair: tuple[Path, Path]) -> None:
    report = _run(_extracted(tmp_path, bundles.v1, keypair[1]), tmp_path, timeout_s=0.01)
    assert not report.passed
    assert "did not finish within selftest.timeout_s = 0.01 s" in report.reason


def test_selftest_reports_a_child_that_dies(
    tmp_path: Path, bundles: Bundles, keypair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EDGEKIT_FAULT", "selftest_child")  # the child SIGKILLs itself after reading the manifest
    report = _run(_extracted(tmp_path, bundles.v1, keypair[1]), tmp_path)
    assert not report.passed
    assert "the self-test process was killed by signal 9 without a report" in report.reason


def test_selftest_reports_a_runtime_that_cannot_load(
    tmp_path: Path, bundles: Bundles, keypair: tuple[Path, Path]
) -> None:
    report = _run(_extracted(tmp_path, bundles.runtime_fails, keypair[1]), tmp_path)
    assert not report.passed
    assert "InvalidProtobuf" in report.reason or "INVALID_PROTOBUF" in report.reason


@pytest.mark.parametrize(
    ("p50", "baseline", "slack", "floor", "refused"),
    [
        (5.0, 1.0, 3.0, 0.0, True),
        (2.9, 1.0, 3.0, 0.0, False),
        (5.0, 1.0, 3.0, 10.0, False),  # under the noise floor
        (5.0, 1.0, 0.0, 0.0, False),  # gate off
        (5.0, None, 3.0, 0.0, False),  # nothing to compare with
    ],
)
def test_latency_verdict(p50: float, baseline: float | None, slack: float, floor: float, refused: bool) -> None:
    assert bool(latency_verdict(p50, baseline, slack, floor)) is refused


def test_compare_outputs_checks_cosine_tolerance_and_top1() -> None:
    want = np.array([[0.1, 0.7, 0.2], [0.5, 0.3, 0.2]], np.float32)
    golden = Golden(file="g.npz", count=2, min_cosine=0.99, atol=1e-3, rtol=1e-2, min_top1_agreement=1.0)
    (same,) = compare_outputs({"p": want.copy()}, {"p": want}, golden)
    assert same.passed and same.top1_agreement == 1.0
    (swapped,) = compare_outputs({"p": want[:, [1, 0, 2]]}, {"p": want}, golden)
    assert not swapped.passed and swapped.top1_agreement == 0.0
    (wrong_shape,) = compare_outputs({"p": want[:1]}, {"p": want}, golden)
    assert not wrong_shape.passed


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_selftest_flooding_child_keeps_a_capped_log_and_leaves_no_orphans(
    tmp_path: Path, bundles: Bundles, keypair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import re

    monkeypatch.setenv("EDGEKIT_FAULT", "selftest_flood")  # grandchildren (one setsid'd), then endless output
    report = _run(_extracted(tmp_path, bundles.v1, keypair[1]), tmp_path, timeout_s=3)
    assert not report.passed
    assert "did not finish within selftest.timeout_s = 3 s" in report.reason
    found = re.search(r"flood helpers=(\d+),(\d+)", report.reason)
    assert found, report.reason  # the output's tail reached the report
    for pid in map(int, found.groups()):
        assert not _alive(pid), f"grandchild {pid} outlived the self-test"
    assert len(report.log_tail.encode()) <= REPORT_LOG_BYTES
    assert list((tmp_path / "work").iterdir()) == []  # no log file grows on disk


def test_contained_child_keeps_only_the_tail_of_its_output(tmp_path: Path) -> None:
    flood = "import os\nfor i in range(400): os.write(1, (str(i).rjust(8) + 'y' * 8183 + '\\n').encode())\n"
    child = ContainedChild([sys.executable, "-c", flood])
    try:
        while child.poll() is None:
            time.sleep(0.01)
        child.kill_all()
        while child.log_bytes < 400 * 8192:  # what was left in the pipe
            before = child.log_bytes
            child.poll()
            if child.log_bytes == before:
                break
    finally:
        child.close()
    assert child.log_bytes == 400 * 8192
    assert len(child.log) == LOG_CAP_BYTES
    assert bytes(child.log).endswith(b"     399" + b"y" * 8183 + b"\n")


def test_selftest_times_the_serving_version_side_by_side(
    tmp_path: Path, bundles: Bundles, keypair: tuple[Path, Path]
) -> None:
    store = Store(tmp_path / "store")
    trust = TrustStore.from_files([keypair[1]])
    serving = store.model_dir(store.stage(bundles.v1, trust).slot)
    candidate = store.model_dir(store.stage(bundles.v2, trust).slot)
    report = run_selftest(
        candidate,
        timeout_s=60,
        memory_mb=2048,
        options=RuntimesConfig(onnxruntime=OnnxRuntimeOptions(threads=1)),
        work_dir=tmp_path / "work",
        baseline_dir=serving,
    )
    assert report.passed, report.reason
    assert report.baseline_source == "side_by_side", report.baseline_note
    assert report.latency_p50_ms is not None and report.latency_p50_ms > 0
    assert report.baseline_p50_ms is not None and report.baseline_p50_ms > 0
    assert report.latency_window_s is None  # nothing left to compare with live traffic


def test_selftest_without_room_for_the_serving_version_reports_its_timing_window(
    tmp_path: Path, bundles: Bundles, keypair: tuple[Path, Path]
) -> None:
    broken = _extracted(tmp_path / "a", bundles.runtime_fails, keypair[1])  # does not load
    candidate = _extracted(tmp_path / "b", bundles.v1, keypair[1])
    report = run_selftest(
        candidate,
        timeout_s=60,
        memory_mb=2048,
        options=RuntimesConfig(onnxruntime=OnnxRuntimeOptions(threads=1)),
        work_dir=tmp_path / "work",
        baseline_dir=broken,
    )
    assert report.passed, report.reason  # the serving version's trouble is not the candidate's
    assert report.baseline_source == "" and report.baseline_p50_ms is None
    assert "the serving version does not load beside the candidate" in report.baseline_note
    assert report.latency_window_s is not None
    start, end = report.latency_window_s
    assert start < end <= time.monotonic()  # CLOCK_MONOTONIC, shared with the parent


_DAEMON = """
import sys
from pathlib import Path
from device_agents.runtimes.options import OnnxRuntimeOptions, RuntimesConfig
from device_agents.selftest import run_selftest
run_selftest(Path(sys.argv[1]), timeout_s=600, memory_mb=4096,
             options=RuntimesConfig(onnxruntime=OnnxRuntimeOptions(threads=1)), work_dir=Path(sys.argv[2]))
"""


def test_selftest_child_and_its_helpers_die_with_a_killed_daemon(
    tmp_path: Path, bundles: Bundles, keypair: tuple[Path, Path]
) -> None:
    import os
    import subprocess

    import psutil

    model_dir = _extracted(tmp_path, bundles.v1, keypair[1])
    env = {**os.environ, "EDGEKIT_FAULT": "selftest_flood"}
    daemon = subprocess.Popen(
        [sys.executable, "-c", _DAEMON, str(model_dir), str(tmp_path / "work")],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        helpers: list[psutil.Process] = []
        while len(helpers) < 3 and time.monotonic() < deadline:  # the child and its two helpers
            time.sleep(0.1)
            helpers = psutil.Process(daemon.pid).children(recursive=True)
        assert len(helpers) >= 3, helpers
    finally:
        daemon.kill()  # kill -9: no finally block of run_selftest runs
        daemon.wait()
    deadline = time.monotonic() + 30  # the child notices within a second; a generous guard
    while any(_alive(p.pid) for p in helpers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p.pid for p in helpers if _alive(p.pid)]
