"""The memory budget in a real agent (``edgekit-agent run``) with tiny ONNX models that weigh
tens of MB: two models that do not both fit swap under concurrent requests (least recently
used idle one unloaded, reloaded by its next request) and every request is answered correctly
by an open model; a budget below the agent's own memory refuses models with the numbers and
the agent still serves health, metrics and status."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from tests.agent.conftest import AgentFactory, RunningAgent, agent_cli, write_config
from tests.factories import make_cpu_bundle, sample_inputs

N = 3072  # a MatMul of N x N float32 weights: 36 MB, ~60-110 MB resident once loaded
MB = 1024 * 1024


def weighty(path: Path, seed: int) -> tuple[Path, np.ndarray]:
    """``y = x @ w`` with ``w`` [N, N]: big enough for its load to show in the process's RSS."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = (np.random.default_rng(seed).standard_normal((N, N)) * 0.01).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="matmul")],
        "weighty",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", N])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", N])],
        [numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path, w


@pytest.fixture(scope="module")
def two_models(
    tmp_path_factory: pytest.TempPathFactory, keypair: tuple[Path, Path]
) -> dict[str, tuple[Path, np.ndarray]]:
    d = tmp_path_factory.mktemp("weighty")
    out = {}
    for seed, name in enumerate(("a", "b")):
        onnx_path, w = weighty(d / f"{name}.onnx", seed)
        golden = np.ones((1, N), np.float32)
        out[name] = (make_cpu_bundle(d / f"{name}.ekb", onnx_path, keypair[0], name=name, golden_inputs=golden), w)
    return out


def infer(agent: RunningAgent, name: str, x: np.ndarray) -> tuple[int, np.ndarray | str, dict[str, str]]:
    body = json.dumps(
        {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
    ).encode()
    request = urllib.request.Request(f"{agent.url}/v2/models/{name}/infer", data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            out = json.loads(r.read())["outputs"][0]
            return r.status, np.asarray(out["data"], np.float32).reshape(out["shape"]), dict(r.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), dict(exc.headers)


def metric(agent: RunningAgent, name: str, labels: str = "") -> float:
    with urllib.request.urlopen(f"{agent.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    if m is None:
        raise AssertionError(f"{name}{labels} not in /metrics")
    return float(m.group(1))


def models_loaded(agent: RunningAgent) -> list[str]:
    with urllib.request.urlopen(f"{agent.url}/metrics", timeout=10) as r:
        return re.findall(r'^edgekit_budget_model_memory_bytes\{model="([^"]+)"\}', r.read().decode(), re.M)


def _install(config: Path, bundle: Path) -> None:
    done = agent_cli("install", str(bundle), "--config", str(config))
    assert done.returncode == 0, done.stdout + done.stderr


def learned_budget(
    tmp_path: Path,
    keypair: tuple[Path, Path],
    agent_factory: AgentFactory,
    two_models: dict[str, tuple[Path, np.ndarray]],
) -> tuple[Path, int]:
    """An agent config with both models installed and a ``[budgets] memory_mb`` that holds the
    bigger one's load and what the process holds besides, not both (``when_full = "unload_idle"``).

    The footprints are learned first (kept in the store): loads at start, then reloads under a
    tight budget. A reload from a trimmed heap makes more resident than a process's first loads
    (measured: ~52 MB against ~26 MB for 16 MB of weights); the budget keeps the largest seen, and
    the peak of a load (the weights read and parsed) besides what it keeps."""
    config = write_config(tmp_path / "agent", keypair[1], "[budgets]\nmemory_mb = 100000\n")
    for bundle, _ in two_models.values():
        _install(config, bundle)
    agent = agent_factory(config)
    both_rss = metric(agent, "edgekit_rss_bytes")
    held = {n: metric(agent, "edgekit_budget_model_memory_bytes", f'{{model="{n}"}}') for n in ("a", "b")}
    agent.stop()
    assert min(held.values()) > 20 * MB, held  # each load measured (36 MB of weights)
    tight = int((both_rss - 0.25 * min(held.values())) / MB)
    config.write_text(
        config.read_text().replace("memory_mb = 100000", f'memory_mb = {tight}\nwhen_full = "unload_idle"')
    )
    agent = agent_factory(config)
    for name in "abab":
        infer(agent, name, np.ones((1, N), np.float32))
    baseline = metric(agent, "edgekit_budget_baseline_bytes")
    loaded = sum(metric(agent, "edgekit_budget_model_memory_bytes", f'{{model="{n}"}}') for n in models_loaded(agent))
    other = max(0.0, metric(agent, "edgekit_rss_bytes") - baseline - loaded)
    agent.stop()
    footprints = json.loads((config.parent / "store" / "footprints.json").read_text())
    peak = max(v for k, v in footprints.items() if k.endswith(" peak"))
    kept = min(v for k, v in footprints.items() if not k.endswith(" peak"))
    budget_mb = int((baseline + peak + other + kept / 2) / MB)
    print(f"footprints {footprints}; agent {baseline / MB:.0f} MB, other {other / MB:.0f} MB: budget {budget_mb} MB")
    config.write_text(config.read_text().replace(f"memory_mb = {tight}", f"memory_mb = {budget_mb}"))
    return config, budget_mb


def test_agent_swaps_two_models_that_do_not_both_fit_under_concurrent_requests(
    tmp_path: Path,
    keypair: tuple[Path, Path],
    agent_factory: AgentFactory,
    two_models: dict[str, tuple[Path, np.ndarray]],
) -> None:
    config, budget_mb = learned_budget(tmp_path, keypair, agent_factory, two_models)
    agent = agent_factory(config)
    assert metric(agent, "edgekit_budget_unloads_total") == 1  # at start: b's load unloaded a

    results: list[tuple[str, int, bool | str, str | None]] = []
    x = np.random.default_rng(3).standard_normal((1, N)).astype(np.float32)

    def client(name: str, w: np.ndarray) -> None:
        want = x @ w
        for _ in range(12):
            code, got, headers = infer(agent, name, x)
            right = code == 200 and np.allclose(got, want, atol=1e-4)  # an array on 200
            results.append((name, code, right if code == 200 else str(got), headers.get("Retry-After")))

    threads = [threading.Thread(target=client, args=(n, w)) for n, (_, w) in two_models.items() for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert len(results) == 48
    # Every request is answered right by an open model, or refused for memory with a Retry-After
    # (the other model's calls still running): never a 500 (a closed model), a 404 or a wrong answer.
    served = [r for r in results if r[1] == 200]
    assert all(r[2] is True for r in served)
    refused = [r for r in results if r[1] != 200]
    assert all(r[1] == 503 and "memory budget" in str(r[2]) for r in refused), refused
    assert {r[0] for r in served} == {"a", "b"}
    unloads = metric(agent, "edgekit_budget_unloads_total")
    rss = metric(agent, "edgekit_rss_bytes")
    for why in sorted({re.sub(r"\d+", "N", str(r[2]))[:200] for r in refused}):
        print("refused:", why)
    print(
        f"LRU swaps under 4 clients: {unloads:.0f}; {len(served)} served, {len(refused)} refused (503); "
        f"RSS {rss / MB:.0f} MB, budget {budget_mb} MB"
    )
    assert unloads >= 2  # both models served in turn: a swap back and forth at least
    assert agent.stop() == 0


def test_agent_answers_503_with_retry_after_for_an_unloaded_model_when_reload_waits(
    tmp_path: Path,
    keypair: tuple[Path, Path],
    agent_factory: AgentFactory,
    two_models: dict[str, tuple[Path, np.ndarray]],
) -> None:
    config, _ = learned_budget(tmp_path, keypair, agent_factory, two_models)
    config.write_text(
        config.read_text().replace('when_full = "unload_idle"', 'when_full = "unload_idle"\nreload = "retry_after"')
    )
    agent = agent_factory(config)
    x = np.ones((1, N), np.float32)
    assert infer(agent, "b", x)[0] == 200  # loaded at start (a was unloaded for it)
    code, body, headers = infer(agent, "a", x)
    assert code == 503 and headers.get("Retry-After") == "1", (code, body)
    assert "a v1 needs ~" in str(body) and "fits once others are unloaded" in str(body)
    assert infer(agent, "b", x)[0] == 200


def test_agent_under_a_budget_below_itself_refuses_models_and_still_serves_health_metrics_status(
    tmp_path: Path,
    keypair: tuple[Path, Path],
    agent_factory: AgentFactory,
    two_models: dict[str, tuple[Path, np.ndarray]],
) -> None:
    config = write_config(tmp_path / "agent", keypair[1])
    _install(config, two_models["a"][0])  # installed before the budget was set
    config.write_text(config.read_text() + "[budgets]\nmemory_mb = 16\n")
    refused = agent_cli("install", str(two_models["b"][0]), "--config", str(config))
    assert refused.returncode != 0
    assert re.search(r"b v1 needs an unknown amount, memory budget 16 MB: \d+ MB the agent itself", refused.stderr)
    agent = agent_factory(config)
    with urllib.request.urlopen(f"{agent.url}/v2/health/live", timeout=10) as r:
        assert r.status == 200
    assert metric(agent, "edgekit_budget_memory_bytes") == 16 * MB
    assert metric(agent, "edgekit_rss_bytes") > 16 * MB
    assert metric(agent, "edgekit_degradation_level") == 0
    code, body, _ = infer(agent, "a", np.ones((1, N), np.float32))
    assert code == 503 and "memory budget 16 MB" in str(body) and "no model is admitted" in str(body)
    status = agent_cli("status", "--config", str(config))
    assert status.returncode == 0 and "a" in status.stdout
    stats = agent_cli("stats", "--config", str(config), "--count", "1")
    assert stats.returncode == 0, stats.stderr
    line = next(x for x in stats.stdout.splitlines() if x.startswith("budgets:"))
    assert re.fullmatch(r"budgets: power (-|\S+ W) \([\w+]+\); level 0; memory \d+/16 MB \(no model; 0 unloads\)", line)
    assert agent.stop() == 0


def _wait_for_level(agent: RunningAgent, level: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while metric(agent, "edgekit_degradation_level") != level:
        assert time.monotonic() < deadline, f"degradation level never reached {level}"
        time.sleep(0.05)


def _infer_tiny(agent: RunningAgent, parameters: dict[str, object] | None = None) -> tuple[int, str, dict[str, str]]:
    x = sample_inputs(1, seed=5)
    body: dict[str, object] = {
        "inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]
    }
    if parameters:
        body["parameters"] = parameters
    request = urllib.request.Request(f"{agent.url}/v2/models/tiny/infer", data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.read().decode(), dict(r.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), dict(exc.headers)


def test_agent_sheds_then_drops_droppable_requests_over_the_power_budget_and_recovers(
    tmp_path: Path, keypair: tuple[Path, Path], agent_factory: AgentFactory, tiny_model: Path
) -> None:
    # The device's energy counter is a powercap fixture tree the test advances as a board would.
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
        # a level is left only after 3 s past its band: time to see each level from outside
        "[budgets]\npower_w = 1.0\npower_window_s = 2.0\nsample_interval_s = 0.05\nmin_dwell_s = 3.0\n"
        f'sysfs_root = "{root}"\n',
    )
    _install(config, make_cpu_bundle(tmp_path / "tiny.ekb", tiny_model, keypair[0]))
    agent = agent_factory(config)
    assert _infer_tiny(agent)[0] == 200
    assert (
        metric(agent, "edgekit_budget_reader", '{detail="intel-rapl:0 package-0",modelled="false",reader="rapl"}') == 1
    )
    counter.write_text("11000000\n")  # 10 J at once against 1 W over 2 s
    _wait_for_level(agent, 2)
    code, body, headers = _infer_tiny(agent)
    assert code == 503 and "power/thermal budget" in body and int(headers["Retry-After"]) >= 1
    _wait_for_level(agent, 1)  # refilled past level 2's band: only droppable requests are refused
    code, body, _ = _infer_tiny(agent, {"droppable": True})
    assert code == 503 and "droppable request dropped" in body
    assert _infer_tiny(agent)[0] == 200
    _wait_for_level(agent, 0)
    assert _infer_tiny(agent, {"droppable": True})[0] == 200
    assert metric(agent, "edgekit_rejects_total", '{model="tiny",reason="power"}') >= 1
    assert metric(agent, "edgekit_rejects_total", '{model="tiny",reason="dropped"}') >= 1
    assert metric(agent, "edgekit_energy_joules_total", '{reader="rapl"}') == 10.0
    assert agent.stop() == 0
