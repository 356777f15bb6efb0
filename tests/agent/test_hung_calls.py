"""A runtime call that never ends, on a real agent on loopback: an ONNX Runtime call past
``hung_call_s`` is terminated (``RunOptions.terminate``) and its thread comes back, so no core
keeps burning; a call the runtime cannot stop is abandoned; both are counted on /metrics; and
SIGTERM while a call hangs ends the agent with exit code 0 (never SIGABRT).

The hanging model is real: an ONNX ``Loop`` whose trip count is the input's largest value times
1e12, so a zero input (the golden vectors) runs no iteration and a ones input runs for days."""

from __future__ import annotations

import http.client
import json
import os
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.agent.bundles import rebundle
from tests.agent.conftest import AgentFactory, RunningAgent, agent_cli, write_config
from tests.factories import make_cpu_bundle

_TICKS_S = os.sysconf("SC_CLK_TCK")


def loop_model(path: Path) -> Path:
    """``x[batch, 4] -> x + 0 * Loop(max(x) * 1e12 times: acc += 1)``: zeros run at once, ones for days."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("Add", ["acc_in", "one"], ["acc_out"]),
        ],
        "count",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc_in", TensorProto.FLOAT, [1]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc_out", TensorProto.FLOAT, [1]),
        ],
        [numpy_helper.from_array(np.ones(1, np.float32), "one")],
    )
    graph = helper.make_graph(
        [
            helper.make_node("ReduceMax", ["x"], ["m"], keepdims=0),
            helper.make_node("Mul", ["m", "scale"], ["ms"]),
            helper.make_node("Cast", ["ms"], ["trip"], to=TensorProto.INT64),
            helper.make_node("Loop", ["trip", "", "zero"], ["acc"], body=body),
            helper.make_node("Mul", ["acc", "zero"], ["z"]),
            helper.make_node("Add", ["x", "z"], ["y"]),
        ],
        "loop_for_days",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [
            numpy_helper.from_array(np.array(1e12, np.float32), "scale"),
            numpy_helper.from_array(np.zeros(1, np.float32), "zero"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def loop_bundle(tmp_path_factory: pytest.TempPathFactory, keypair: tuple[Path, Path]) -> Path:
    d = tmp_path_factory.mktemp("loop")
    zeros = np.zeros((2, 4), np.float32)
    return make_cpu_bundle(d / "loop-1.ekb", loop_model(d / "loop.onnx"), keypair[0], name="loop", golden_inputs=zeros)


@pytest.fixture(scope="module")
def openvino_loop_bundle(
    tmp_path_factory: pytest.TempPathFactory, keypair: tuple[Path, Path], loop_bundle: Path
) -> Path:
    """The same Loop as OpenVINO IR: a runtime that cannot stop a call (``InferRequest.cancel``
    does not stop a synchronous ``infer``)."""
    import openvino as ov

    d = tmp_path_factory.mktemp("loop-ov")
    ov.save_model(ov.convert_model(str(loop_model(d / "loop.onnx"))), str(d / "model.xml"), compress_to_fp16=False)
    files: dict[str, bytes | None] = {
        "model.onnx": None,
        "model.xml": (d / "model.xml").read_bytes(),
        "model.bin": (d / "model.bin").read_bytes(),
    }
    compat = {"runtime": "openvino", "runtime_version": ov.get_version()}
    roles = {"model.xml": "artifact", "model.bin": "artifact"}
    return rebundle(
        loop_bundle, keypair[0], d / "loop-ov-1.ekb", files=files, compat=compat, roles=roles, target="intel"
    )


def _infer(agent: RunningAgent, x: np.ndarray) -> tuple[int, dict[str, Any]]:
    host, port = agent.address.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
    try:
        conn.request("POST", "/v2/models/loop/infer", json.dumps(body))
        resp = conn.getresponse()
        raw = resp.read()
        return resp.status, json.loads(raw) if raw else {}
    finally:
        conn.close()


def _metric(agent: RunningAgent, name: str, **labels: str) -> float:
    with urllib.request.urlopen(agent.url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}}"):
            return float(line.split()[-1])
    return 0.0


def _thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of ``pid``."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / _TICKS_S
    return out


def _busiest_thread_cpu_s(pid: int, seconds: float) -> float:
    """The most CPU seconds one thread of ``pid`` used over ``seconds`` of waiting."""
    before = _thread_cpu_s(pid)
    time.sleep(seconds)
    after = _thread_cpu_s(pid)
    return max((after[t] - before.get(t, 0.0) for t in after), default=0.0)


def _start(
    tmp_path: Path, keypair: tuple[Path, Path], loop_bundle: Path, agent_factory: AgentFactory, server: str, **env: str
) -> RunningAgent:
    config = write_config(tmp_path / "a", keypair[1], f"[server]\n{server}\n")
    done = agent_cli("install", str(loop_bundle), "--config", str(config))
    assert done.returncode == 0, done.stdout + done.stderr
    return agent_factory(config, env)


def _wait_for(agent: RunningAgent, what: str, timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if what in agent.log.read_text():
            return True
        time.sleep(0.05)
    return False


def test_hung_onnxruntime_call_is_terminated_and_its_thread_stops_burning_a_core(
    tmp_path: Path, keypair: tuple[Path, Path], loop_bundle: Path, agent_factory: AgentFactory
) -> None:
    agent = _start(tmp_path, keypair, loop_bundle, agent_factory, "hung_call_s = 1.0")
    status, doc = _infer(agent, np.zeros((1, 4), np.float32))
    assert status == 200 and doc["outputs"][0]["data"] == [0.0] * 4
    status, doc = _infer(agent, np.ones((1, 4), np.float32))
    assert status == 500 and "hung: its runtime call ran over server.hung_call_s (1 s)" in doc["error"]
    # the terminated call came back: its thread is out of the runtime
    assert _wait_for(agent, "loop: the hung call returned"), agent.log.read_text()
    assert _metric(agent, "edgekit_hung_calls_total", model="loop") == 1
    assert _metric(agent, "edgekit_hung_call_stops_total", model="loop", how="terminated") == 1
    assert _metric(agent, "edgekit_hung_call_stops_total", model="loop", how="abandoned") == 0
    # no thread keeps a core busy: the Loop would run for days on one (1 CPU second per second)
    assert _busiest_thread_cpu_s(agent.proc.pid, 2.0) < 0.5
    status, doc = _infer(agent, np.zeros((2, 4), np.float32))  # reloaded, serving
    assert status == 200, doc
    assert agent.stop() == 0
    assert "runtime calls never returned" not in agent.log.read_text()  # nothing was left to abandon


def test_hung_call_the_runtime_cannot_stop_is_abandoned_counted_and_sigterm_still_exits_cleanly(
    tmp_path: Path, keypair: tuple[Path, Path], openvino_loop_bundle: Path, agent_factory: AgentFactory
) -> None:
    agent = _start(tmp_path, keypair, openvino_loop_bundle, agent_factory, "hung_call_s = 1.0\ndrain_timeout_s = 1.0")
    status, doc = _infer(agent, np.ones((1, 4), np.float32))
    assert status == 500 and "hung: its runtime call ran over server.hung_call_s (1 s)" in doc["error"]
    assert _metric(agent, "edgekit_hung_call_stops_total", model="loop", how="abandoned") == 1
    assert _metric(agent, "edgekit_hung_call_stops_total", model="loop", how="terminated") == 0
    assert "openvino cannot stop a call: its thread is left running" in agent.log.read_text()
    status, doc = _infer(agent, np.zeros((2, 4), np.float32))  # reloaded beside the stuck call
    assert status == 200, doc
    # the abandoned thread is still inside OpenVINO: the exit must not finalize under it
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(timeout=90) == 0, agent.log.read_text()[-3000:]
    assert "1 runtime calls never returned; exiting without waiting for them" in agent.log.read_text()


def test_sigterm_while_an_onnxruntime_call_hangs_exits_cleanly(
    tmp_path: Path, keypair: tuple[Path, Path], loop_bundle: Path, agent_factory: AgentFactory
) -> None:
    import threading

    # the call is running, not yet declared hung, when SIGTERM comes; the drain gives it 1 s
    agent = _start(tmp_path, keypair, loop_bundle, agent_factory, "hung_call_s = 600.0\ndrain_timeout_s = 1.0")
    answers: list[tuple[int, dict[str, Any]]] = []
    client = threading.Thread(target=lambda: answers.append(_infer(agent, np.ones((1, 4), np.float32))))
    client.start()
    deadline = time.monotonic() + 30
    while _metric(agent, "edgekit_inflight", model="loop") < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    agent.proc.send_signal(signal.SIGTERM)
    code = agent.proc.wait(timeout=60)
    client.join(30)
    assert code == 0, (code, agent.log.read_text()[-3000:])
    assert "stopped" in agent.log.read_text()


def test_hung_call_outside_the_runtime_is_abandoned_and_counted(
    tmp_path: Path, keypair: tuple[Path, Path], loop_bundle: Path, agent_factory: AgentFactory
) -> None:
    # the stall point blocks the call's thread before it reaches ONNX Runtime: nothing to terminate
    env = {"EDGEKIT_FAULT": "infer_stall", "EDGEKIT_FAULT_STALL_ONCE": "1"}
    agent = _start(tmp_path, keypair, loop_bundle, agent_factory, "hung_call_s = 1.0", **env)
    status, doc = _infer(agent, np.zeros((1, 4), np.float32))
    assert status == 500 and "hung" in doc["error"]
    assert _metric(agent, "edgekit_hung_call_stops_total", model="loop", how="abandoned") == 1
    assert _metric(agent, "edgekit_hung_call_stops_total", model="loop", how="terminated") == 0
    assert "its thread was not inside onnxruntime (nothing to terminate) and is left running" in agent.log.read_text()
    assert agent.stop() == 0
