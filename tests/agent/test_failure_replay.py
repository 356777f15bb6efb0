"""Failures that only the model can cause: a request the new version fails to run counts
against it only when the version it replaced (kept loaded through the health window when the
update client judges it) runs the same request."""

from __future__ import annotations

from pathlib import Path

import pytest

from device_agents.config import load_config
from device_agents.errors import RuntimeFailure
from device_agents.lifecycle import Lifecycle
from device_agents.pipeline import Request
from device_agents.service import AgentService
from tests.agent.conftest import write_config
from tests.factories import make_cpu_bundle, sample_inputs, tiny_classifier
from tests.updates.bundles import fragile_classifier

UPDATES = (
    '[updates]\nbroker = "mqtt://127.0.0.1:1"\nfleet = "f"\ndevice_id = "d"\n'
    'notice_keys = ["keys/trusted.pub"]\nhealth_window_s = 600.0\n'
)
FIELD = {"input": sample_inputs(1, seed=5) * 20}  # the fragile model's Gather goes out of range


def _installed(tmp_path: Path, key: Path, pub: Path, v1_model: Path, extra: str) -> Lifecycle:
    m = Lifecycle(load_config(write_config(tmp_path / "agent", pub, extra)))
    m.start()
    m.install(make_cpu_bundle(tmp_path / "v1.ekb", v1_model, key, version=1))
    m.install(make_cpu_bundle(tmp_path / "v2.ekb", fragile_classifier(tmp_path / "f2.onnx", seed=2), key, version=2))
    return m


def test_a_failure_the_previous_version_shares_does_not_count(tmp_path: Path, keypair: tuple[Path, Path]) -> None:
    m = _installed(tmp_path, *keypair, fragile_classifier(tmp_path / "f1.onnx", seed=1), UPDATES)
    try:
        assert m.registry.count_failure("tiny", 2, FIELD) is False
        assert m.metrics.model_failures.labels("tiny")._value.get() == 0
    finally:
        m.stop()


def test_a_failure_the_previous_version_does_not_have_counts(tmp_path: Path, keypair: tuple[Path, Path]) -> None:
    m = _installed(tmp_path, *keypair, tiny_classifier(tmp_path / "t1.onnx", seed=1), UPDATES)
    try:
        assert m.registry.count_failure("tiny", 2, FIELD) is True
        assert m.metrics.model_failures.labels("tiny")._value.get() == 1
        m.rollback("tiny", "unhealthy")  # the replaced version, still loaded, serves at once
        assert m.models() == {"tiny": 1}
    finally:
        m.stop()


def test_without_an_update_client_the_replaced_version_is_still_replayed_on(
    tmp_path: Path, keypair: tuple[Path, Path]
) -> None:
    m = _installed(tmp_path, *keypair, fragile_classifier(tmp_path / "f1.onnx", seed=1), "")
    try:
        # a sideload has a health window too: v1, held, fails on the same input, so it does not count
        assert m.registry.count_failure("tiny", 2, FIELD) is False
    finally:
        m.stop()


@pytest.mark.parametrize(("v1_fragile", "counted"), [(True, 0), (False, 1)])
def test_a_runtime_failure_in_the_pipeline_is_replayed_and_counted(
    tmp_path: Path, keypair: tuple[Path, Path], v1_fragile: bool, counted: int
) -> None:
    v1 = (
        fragile_classifier(tmp_path / "f1.onnx", seed=1)
        if v1_fragile
        else tiny_classifier(tmp_path / "t1.onnx", seed=1)
    )
    m = _installed(tmp_path, *keypair, v1, UPDATES)
    service = AgentService(m.config, m)
    try:
        with pytest.raises(RuntimeFailure):  # an HTTP 500
            service.infer("tiny", None, lambda model: Request("tiny", dict(FIELD)), lambda r: r.outputs)
        assert m.metrics.model_failures.labels("tiny")._value.get() == counted
    finally:
        service.drain()
        m.stop()
