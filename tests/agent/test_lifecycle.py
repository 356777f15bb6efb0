"""The lifecycle in-process: install, reject, switch under load, rollback, recovery after crashes."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from device_agents.config import load_config
from device_agents.errors import IncompatibleError, ModelNotFoundError, SelfTestError
from device_agents.lifecycle import Lifecycle
from device_agents.store import Store
from edgekit.bundle.errors import BundleError, ExpiredError, RollbackError, SignatureError
from tests.agent.bundles import read_manifest, rebundle
from tests.agent.conftest import Bundles, agent_cli, write_config
from tests.factories import sample_inputs


@pytest.fixture()
def manager(config_path: Path) -> Iterator[Lifecycle]:
    m = Lifecycle(load_config(config_path))
    m.start()
    yield m
    m.stop()


def _restart(config_path: Path) -> Lifecycle:
    m = Lifecycle(load_config(config_path))
    m.start()
    return m


X = sample_inputs(1, seed=3)


def _run(lifecycle: Lifecycle) -> dict[str, np.ndarray]:
    with lifecycle.registry.lease("tiny") as lease:
        return lease.model.infer({"input": X})


def test_install_switches_and_keeps_the_previous_slot(manager: Lifecycle, bundles: Bundles) -> None:
    first = manager.install(bundles.v1)
    assert (first.name, first.version, first.changed, first.previous_version) == ("tiny", 1, True, None)
    assert first.selftest is not None and first.selftest.passed and first.selftest.latency_p50_ms
    old_model = manager.registry.get("tiny")
    second = manager.install(bundles.v2)
    assert (second.version, second.previous_version) == (2, 1)
    assert manager.models() == {"tiny": 2}
    held = manager.registry._probation["tiny"]  # v1 stays loaded through v2's health window
    assert held.model is old_model and old_model.runner.session is not None
    manager.registry.end_probation("tiny")  # what the window's end does
    assert old_model.runner.session is None  # the old runtime was closed once idle
    st = manager.status()["tiny"]
    assert (st["serving"], st["active"], st["previous"], st["candidate"], st["status"]) == (2, 2, 1, None, "serving")
    report = manager.selftest_report("tiny")
    assert report is not None and report.passed and report.outputs[0].cosine > 0.999
    assert _run(manager)["probs"].shape == (1, 10)


def test_reinstalling_the_active_version_is_a_no_op(manager: Lifecycle, bundles: Bundles) -> None:
    manager.install(bundles.v1)
    served = manager.registry.get("tiny")
    again = manager.install(bundles.v1)
    assert not again.changed and manager.registry.get("tiny") is served
    with pytest.raises(SelfTestError):
        manager.install(bundles.v3_bad_golden)  # fails its self-test: the counter (raised at commit) stays at 1
    assert not manager.install(bundles.v1).changed  # still a no-op, not "older than v3"


@pytest.mark.parametrize(
    ("which", "error", "message"),
    [
        ("tampered_artifact", BundleError, "model.onnx: sha256 does not match the manifest"),
        ("tampered_manifest", SignatureError, "does not match the manifest: the bundle was altered"),
        ("untrusted", SignatureError, "signed by untrusted key"),
        ("expired", ExpiredError, "expired at 2001-01-01T00:00:00Z"),
        ("v1", RollbackError, "tiny v1 is older than installed v2"),
        ("wrong_arch", IncompatibleError, "is built for riscv64; this device is"),
        ("unknown_runtime", IncompatibleError, "no runtime 'hailort' in this agent"),
        ("v3_bad_golden", SelfTestError, "v3 failed its self-test: output 'probs' does not match the golden vectors"),
        ("runtime_fails", SelfTestError, "v5 failed its self-test"),
    ],
)
def test_bad_bundles_are_refused_and_the_previous_version_keeps_serving(
    manager: Lifecycle, bundles: Bundles, which: str, error: type[Exception], message: str
) -> None:
    manager.install(bundles.v2)
    expected = _run(manager)["probs"]
    before = {p.name for p in (manager.store.root / "models" / "tiny").iterdir()}
    with pytest.raises(error) as err:
        manager.install(getattr(bundles, which))
    assert message in str(err.value)
    assert manager.models() == {"tiny": 2}
    np.testing.assert_array_equal(_run(manager)["probs"], expected)
    ms = manager.store.model_state("tiny")
    assert ms.active is not None and ms.active.version == 2 and ms.candidate is None
    if error is not SelfTestError:  # refused before extraction: no runtime ever saw a byte of it
        assert {p.name for p in (manager.store.root / "models" / "tiny").iterdir()} == before


def test_revoked_key_is_refused(tmp_path: Path, keypair: tuple[Path, Path], bundles: Bundles) -> None:
    from edgekit.bundle import key_id, load_public_key

    kid = key_id(load_public_key(keypair[1]))
    cfg = write_config(tmp_path / "a", keypair[1])
    cfg.write_text(cfg.read_text().replace("[runtimes.", f'revoked_key_ids = ["{kid}"]\n[runtimes.', 1))
    m = _restart(cfg)
    with pytest.raises(SignatureError, match="revoked key"):
        m.install(bundles.v1)


def test_latency_gate_ignores_the_host_p50_on_a_first_install(
    tmp_path: Path, keypair: tuple[Path, Path], bundles: Bundles
) -> None:
    """The packaging host is another machine: a device slower than it must still take a first
    install; the host's p50 is the report's baseline for information only."""
    cfg = write_config(tmp_path / "a", keypair[1], "[selftest]\nlatency_floor_ms = 0.0\n")
    m = _restart(cfg)
    src = bundles.v1
    fast = read_manifest(src).validation
    claimed = rebundle(src, keypair[0], tmp_path / "fast.ekb", validation=replace(fast, latency_p50_ms=1e-6))
    m.install(claimed)
    assert m.models() == {"tiny": 1}
    report = m.selftest_report("tiny")
    assert report is not None and report.passed
    assert (report.baseline_source, report.baseline_p50_ms) == ("host", 1e-6)


def test_switch_under_load_fails_no_request(manager: Lifecycle, bundles: Bundles) -> None:
    manager.install(bundles.v1)
    errors: list[BaseException] = []
    seen: set[int] = set()
    stop = threading.Event()

    def hammer() -> None:
        while not stop.is_set():
            try:
                with manager.registry.lease("tiny") as lease:
                    lease.model.infer({"input": X})
                    seen.add(lease.version)
            except BaseException as exc:  # any failure is what this test looks for
                errors.append(exc)

    threads = [threading.Thread(target=hammer) for _ in range(3)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave the threads finely, so that a switch lands mid-request
    for t in threads:
        t.start()
    try:
        manager.install(bundles.v2)
        manager.install(bundles.v4)
    finally:
        stop.set()
        for t in threads:
            t.join()
        sys.setswitchinterval(interval)
    assert errors == []
    assert 4 in seen


def test_a_request_holding_the_old_version_finishes_on_it(manager: Lifecycle, bundles: Bundles) -> None:
    manager.install(bundles.v1)
    lease = manager.registry.lease("tiny")  # a request in flight on v1
    installer = threading.Thread(target=manager.install, args=(bundles.v2,))
    installer.start()
    deadline = time.monotonic() + 60
    while manager.models() != {"tiny": 2} and time.monotonic() < deadline:
        time.sleep(0.01)
    assert manager.models() == {"tiny": 2}  # new requests already go to v2
    assert lease.version == 1
    assert lease.model.infer({"input": X})["probs"].shape == (1, 10)  # v1 is still open for this one
    installer.join(timeout=60)  # v1 is held through v2's health window: install does not wait for it
    closer = threading.Thread(target=manager.registry.end_probation, args=("tiny",))  # the window's end
    closer.start()
    time.sleep(0.2)
    assert closer.is_alive()  # closing v1 waits for the request holding it
    assert lease.model.infer({"input": X})["probs"].shape == (1, 10)
    lease.release()
    closer.join(timeout=60)
    assert not closer.is_alive()
    assert lease.model.runner.session is None


def test_rollback_serves_the_previous_version(manager: Lifecycle, bundles: Bundles) -> None:
    manager.install(bundles.v1)
    manager.install(bundles.v2)
    ms = manager.rollback("tiny", "health check failed: p50 doubled")
    assert manager.models() == {"tiny": 1}
    assert (ms.status, ms.error) == ("rolled_back", "health check failed: p50 doubled")
    with pytest.raises(ModelNotFoundError, match="version 2 is not served"):
        manager.registry.get("tiny", 2)


@pytest.mark.parametrize("status", ["staged", "testing", "switching"])
def test_start_drops_an_install_interrupted_before_promote(
    config_path: Path, bundles: Bundles, keypair: tuple[Path, Path], status: str
) -> None:
    m = _restart(config_path)
    m.install(bundles.v1)
    m.stop()
    store = Store(load_config(config_path).store)
    store.stage(bundles.v2, m.trust)  # what a crash after staging leaves behind
    store.update_model("tiny", lambda s: replace(s, status=status))
    m = _restart(config_path)
    ms = store.model_state("tiny")
    assert m.models() == {"tiny": 1}
    assert ms.candidate is None and ms.status == "failed"
    assert f"interrupted while {status} v2" in ms.error
    m.stop()


def test_crash_loop_rolls_back_after_crash_loop_boots_starts(config_path: Path, bundles: Bundles) -> None:
    m = _restart(config_path)
    m.install(bundles.v1)
    m.mark_healthy("tiny")
    m.install(bundles.v2)
    m.stop(clean=False)  # as if the agent died before v2 ran through its health window
    for boot in (1, 2):
        m = _restart(config_path)
        assert m.models() == {"tiny": 2}
        assert m.store.model_state("tiny").boots_since_switch == boot
        m.stop(clean=False)
    m = _restart(config_path)  # third start within the window: crash_loop_boots = 3
    ms = m.store.model_state("tiny")
    assert m.models() == {"tiny": 1}
    assert ms.status == "rolled_back" and "crash loop" in ms.error
    m.stop()


def test_a_rejected_candidate_does_not_end_the_crash_loop_watch_of_the_active_version(
    config_path: Path, bundles: Bundles
) -> None:
    m = _restart(config_path)
    m.install(bundles.v1)
    m.mark_healthy("tiny")
    m.install(bundles.v2)  # v2 is in its health window ...
    with pytest.raises(SelfTestError):
        m.install(bundles.v3_bad_golden)  # ... when a bad v3 is rejected
    assert m.store.model_state("tiny").status == "failed"
    m.stop(clean=False)
    for _ in range(2):
        m = _restart(config_path)
        assert m.models() == {"tiny": 2}
        m.stop(clean=False)
    m = _restart(config_path)  # v2 keeps crashing the agent: still rolled back
    assert m.models() == {"tiny": 1} and "crash loop" in m.store.model_state("tiny").error
    m.stop()


def test_clean_stops_inside_the_health_window_do_not_count_as_crashes(config_path: Path, bundles: Bundles) -> None:
    m = _restart(config_path)
    m.install(bundles.v1)
    m.mark_healthy("tiny")
    m.install(bundles.v2)
    m.stop()  # SIGTERM before v2 ran through its health window
    for _ in range(4):
        m = _restart(config_path)
        assert m.models() == {"tiny": 2}
        assert m.store.model_state("tiny").boots_since_switch == 1
        m.stop()
    assert m.store.model_state("tiny").status == "serving"


def test_a_healthy_version_is_not_rolled_back_by_restarts(config_path: Path, bundles: Bundles) -> None:
    m = _restart(config_path)
    m.install(bundles.v1)
    m.install(bundles.v2)
    m.mark_healthy("tiny")
    m.stop()
    for _ in range(4):
        m = _restart(config_path)
        assert m.models() == {"tiny": 2}
        m.stop()


def test_an_active_version_that_no_longer_loads_falls_back_to_previous(config_path: Path, bundles: Bundles) -> None:
    m = _restart(config_path)
    m.install(bundles.v1)
    m.install(bundles.v2)
    m.stop()
    ms = m.store.model_state("tiny")
    assert ms.active is not None
    (m.store.model_dir(ms.active) / "model.onnx").write_bytes(b"bit rot")
    m = _restart(config_path)
    assert m.models() == {"tiny": 1}
    assert "v2 failed verification at rest" in m.store.model_state("tiny").error
    m.stop()


def test_when_neither_slot_loads_the_model_is_not_served_and_the_agent_starts(
    config_path: Path, bundles: Bundles
) -> None:
    m = _restart(config_path)
    m.install(bundles.v1)
    m.install(bundles.v2)
    m.stop()
    ms = m.store.model_state("tiny")
    for slot in (ms.active, ms.previous):
        assert slot is not None
        (m.store.model_dir(slot) / "model.onnx").write_bytes(b"bit rot")
    m = _restart(config_path)
    assert m.models() == {} and m.ready
    ms = m.store.model_state("tiny")
    assert ms.status == "failed" and "v1 fails too" in ms.error
    m.stop()


@pytest.mark.parametrize(
    ("point", "serving", "status"),
    [
        ("verify", 1, "serving"),
        ("stage", 1, "failed"),
        ("selftest", 1, "failed"),
        ("switch", 1, "failed"),
        ("commit", 2, "serving"),
        ("cleanup", 2, "serving"),
    ],
)
def test_fault_points_kill_the_installer_and_start_recovers(
    config_path: Path, bundles: Bundles, point: str, serving: int, status: str
) -> None:
    assert agent_cli("install", str(bundles.v1), "--config", str(config_path)).returncode == 0
    done = agent_cli("install", str(bundles.v2), "--config", str(config_path), env={"EDGEKIT_FAULT": point})
    assert done.returncode == -9, done.stderr  # SIGKILL at the named point
    m = _restart(config_path)
    assert m.models() == {"tiny": serving}
    assert m.store.model_state("tiny").status == status
    assert m.store.model_state("tiny").candidate is None
    assert list((m.store.root / "tmp").iterdir()) == []  # debris removed
    m.stop()
