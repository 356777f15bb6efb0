"""An update under steady client load installs: the self-test times the candidate and the
serving version side by side in its child, so the load weighs on both, where a baseline
measured at the previous (idle) install made a busy device refuse an identical model."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import tritonclient.http as triton

from device_agents.selftest import REPORT_NAME, SelfTestReport
from device_agents.store import Store
from tests.agent.conftest import AgentFactory, RunningAgent, agent_cli, write_config
from tests.factories import make_cpu_bundle, tiny_classifier

# Tighter than the default (3): an idle baseline against a loaded candidate misses it by far,
# two identical models timed side by side do not.
SLACK = "[selftest]\nlatency_slack = 1.5\nlatency_floor_ms = 0.0\n"
SIZE = 320  # a p50 of milliseconds on one thread: long enough for load to show in a median
CLIENTS = 3  # concurrent requests: with the self-test child, more runnable threads than 2 cores


def _steady_client(agent: RunningAgent, stop: threading.Event, served: list[int]) -> None:
    client = triton.InferenceServerClient(agent.address)
    x = np.ones((1, 3, SIZE, SIZE), np.float32)
    while not stop.is_set():
        inp = triton.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        client.infer("tiny", [inp])
        served.append(1)


def test_update_under_steady_client_load_installs(
    tmp_path: Path, keypair: tuple[Path, Path], agent_factory: AgentFactory
) -> None:
    model = tiny_classifier(tmp_path / "m.onnx", size=SIZE)
    v1, v2 = (make_cpu_bundle(tmp_path / f"v{v}.ekb", model, keypair[0], version=v) for v in (1, 2))
    config = write_config(tmp_path / "agent", keypair[1], SLACK)
    assert agent_cli("install", str(v1), "--config", str(config)).returncode == 0  # idle
    agent = agent_factory(config)
    stop, served = threading.Event(), []
    clients = [threading.Thread(target=_steady_client, args=(agent, stop, served)) for _ in range(CLIENTS)]
    for t in clients:
        t.start()
    try:
        while len(served) < 50 and all(t.is_alive() for t in clients):
            stop.wait(0.05)
        done = agent_cli("install", str(v2), "--config", str(config))
        during = len(served)
    finally:
        stop.set()
        for t in clients:
            t.join(timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("installed tiny v2 (was v1); self-test passed")
    assert during > 50  # the load ran through the install
    store = Store(tmp_path / "agent" / "store")
    active = store.model_state("tiny").active
    assert active is not None and active.version == 2
    report = SelfTestReport.from_json((store.model_dir(active) / REPORT_NAME).read_bytes())
    assert report.baseline_source == "side_by_side", report
    print(f"side-by-side ratio under load: {report.latency_p50_ms / report.baseline_p50_ms:.3f}")  # type: ignore[operator]  # both set side by side
