"""The host's ONNX Runtime runner opens its session through the device runtime's own set-up."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgekit.validate.ort_runner import ort_open
from tests.factories import sample_inputs, tiny_dense


def test_ort_open_runs_the_device_runtimes_session_at_the_asked_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import device_agents.runtimes.onnxruntime as device_ort

    model = tiny_dense(tmp_path / "dense.onnx")
    opened = []
    real = device_ort.open_session

    def recording(path: Path, options: device_ort.OnnxRuntimeOptions) -> object:
        session = real(path, options)
        opened.append((path, options, session.get_session_options().intra_op_num_threads))
        return session

    monkeypatch.setattr(device_ort, "open_session", recording)
    x = sample_inputs(2)
    outputs = ort_open(model)(1)({"image": x})
    assert [(p, o.threads, o.providers, n) for p, o, n in opened] == [(model, 1, (), 1)]
    direct = real(model, device_ort.OnnxRuntimeOptions()).run(None, {"image": x})
    np.testing.assert_allclose(outputs["mask"], direct[0], rtol=1e-5, atol=1e-6)
