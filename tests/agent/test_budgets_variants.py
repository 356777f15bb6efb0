"""A variant set in a real agent: the best variant answers, the last one once the power budget's
``variant`` step is on, a faster one when the request's deadline is shorter than the best one's
p50; each answer says which variant gave it."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from device_agents.config import config_from_data
from edgekit.bundle.errors import ConfigError
from tests.agent.conftest import AgentFactory, RunningAgent, agent_cli, write_config
from tests.factories import make_cpu_bundle

N = 4096  # the full variant a 4096 x 4096 MatMul: milliseconds, far above the scaling variant
X = np.ones((1, N), np.float32)


def _infer(agent: RunningAgent, parameters: dict[str, object] | None = None) -> tuple[int, dict[str, object]]:
    body: dict[str, object] = {
        "inputs": [{"name": "x", "shape": list(X.shape), "datatype": "FP32", "data": X.ravel().tolist()}]
    }
    if parameters:
        body["parameters"] = parameters
    request = urllib.request.Request(f"{agent.url}/v2/models/det/infer", data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {"error": exc.read().decode()}


def _metric(agent: RunningAgent, series: str) -> float:
    with urllib.request.urlopen(f"{agent.url}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(series + " "):
                return float(line.split()[-1])
    raise AssertionError(f"no {series}")


def _model(path: Path, *, big: bool = False) -> Path:
    """``y = x @ w`` (N x N weights: milliseconds a call) or ``y = x * 0.5`` (microseconds), both [batch, N]."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    if big:
        weights = (np.random.default_rng(0).standard_normal((N, N)) * 0.01).astype(np.float32)
        node, init = helper.make_node("MatMul", ["x", "w"], ["y"]), numpy_helper.from_array(weights, "w")
    else:
        node, init = helper.make_node("Mul", ["x", "w"], ["y"]), numpy_helper.from_array(np.array(0.5, np.float32), "w")
    graph = helper.make_graph(
        [node],
        "variant",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", N])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", N])],
        [init],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def _level(agent: RunningAgent) -> float:
    with urllib.request.urlopen(f"{agent.url}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("edgekit_degradation_level "):
                return float(line.split()[1])
    raise AssertionError("no edgekit_degradation_level")


def _wait_for_level(agent: RunningAgent, level: int) -> None:
    deadline = time.monotonic() + 60
    while _level(agent) != level:
        assert time.monotonic() < deadline, f"degradation level never reached {level}"
        time.sleep(0.05)


def test_variant_set_answers_with_the_best_variant_that_fits_power_and_deadline(
    tmp_path: Path, keypair: tuple[Path, Path], agent_factory: AgentFactory
) -> None:
    root = tmp_path / "sysfs"
    zone = root / "sys/class/powercap/intel-rapl:0"
    zone.mkdir(parents=True)
    (zone / "name").write_text("package-0\n")
    (zone / "max_energy_range_uj").write_text("262143328850\n")
    counter = zone / "energy_uj"
    counter.write_text("1000000\n")
    config = write_config(
        tmp_path / "agent",
        keypair[1],
        '[models.det]\nvariants = ["det-fp32", "det-small"]\n'
        "[budgets]\npower_w = 1.0\npower_window_s = 2.0\nsample_interval_s = 0.05\nmin_dwell_s = 3.0\n"
        f'degrade = ["variant", "shed"]\nsysfs_root = "{root}"\n',
    )
    # the same interface; the best variant a MatMul of N x N weights, the last one a scaling
    for name, model in (
        ("det-fp32", _model(tmp_path / "big.onnx", big=True)),
        ("det-small", _model(tmp_path / "s.onnx")),
    ):
        bundle = make_cpu_bundle(tmp_path / f"{name}.ekb", model, keypair[0], name=name, golden_inputs=X)
        done = agent_cli("install", str(bundle), "--config", str(config))
        assert done.returncode == 0, done.stderr
    agent = agent_factory(config)
    code, body = _infer(agent)
    assert code == 200 and body["parameters"] == {"variant": "det-fp32"}, body
    total, count = (
        'edgekit_stage_seconds_sum{model="det-fp32",stage="infer"}',
        ('edgekit_stage_seconds_count{model="det-fp32",stage="infer"}'),
    )
    for _ in range(4):  # past the first calls, which are slower (the runtime warms up)
        _infer(agent)
    before = _metric(agent, total), _metric(agent, count)
    for _ in range(8):
        _infer(agent)
    infer_s = (_metric(agent, total) - before[0]) / (_metric(agent, count) - before[1])
    # the agent keeps the median runtime call; a warm mean is near it (the cold first call, many
    # times slower, would put half the all-calls mean above the median on a loaded machine)
    # a deadline of half det-fp32's runtime here: the last variant answers in it
    code, body = _infer(agent, {"timeout": int(infer_s / 2 * 1e6)})
    assert code == 200 and body["parameters"] == {"variant": "det-small"}, (code, body, infer_s)
    counter.write_text("11000000\n")  # 10 J at once against 1 W over 2 s: the variant step, then shedding
    _wait_for_level(agent, 2)
    assert _infer(agent)[0] == 503
    _wait_for_level(agent, 1)
    code, body = _infer(agent)
    assert code == 200 and body["parameters"] == {"variant": "det-small"}, body
    _wait_for_level(agent, 0)
    code, body = _infer(agent)
    assert code == 200 and body["parameters"] == {"variant": "det-fp32"}, body
    assert agent.stop() == 0


def test_variants_name_two_or_more_served_models(tmp_path: Path) -> None:
    base = {"store": "s", "trusted_keys": ["k.pub"]}
    with pytest.raises(ConfigError, match=r"agent.models.det: variants lists \['a'\]: name two or more"):
        config_from_data({**base, "models": {"det": {"variants": ["a"]}}}, tmp_path)
    config = config_from_data({**base, "models": {"det": {"variants": ["a", "b"]}}}, tmp_path)
    assert config.model("det").variants == ("a", "b")
