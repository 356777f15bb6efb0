"""The agent's threads carry OS names (``top -H``, ``/proc/<pid>/task/*/comm``): device_agents.threads."""

from __future__ import annotations

import http.client
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from device_agents.stats import thread_cpu_line
from device_agents.threads import ENDED, NamedThread, ThreadCpu, os_name, os_named
from tests.agent.conftest import AgentFactory, Bundles, agent_cli, write_config

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OS thread names are read on Linux")


def _comm(pid: int | str, tid: int) -> str:
    return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()


def test_a_named_thread_is_its_python_name_to_the_os_without_the_edgekit_prefix() -> None:
    seen: list[str] = []
    thread = NamedThread(target=lambda: seen.append(_comm("self", threading.get_native_id())), name="edgekit-mqtt")
    thread.start()
    thread.join()
    long = NamedThread(target=lambda: seen.append(os_name() or ""), name="infer-a-very-long-model-name")
    long.start()
    long.join()
    assert seen == ["mqtt", "infer-a-very-lo"]  # the kernel keeps 15 bytes


def test_threads_started_inside_os_named_inherit_the_name_and_the_caller_gets_its_own_back() -> None:
    before = os_name()
    started: list[str] = []
    with os_named("rt-tiny"):
        assert os_name() == "rt-tiny"
        plain = threading.Thread(target=lambda: started.append(os_name() or ""))  # as a C++ pool thread starts
        plain.start()
        plain.join()
    assert started == ["rt-tiny"] and os_name() == before


def test_a_running_agent_names_its_accept_loop_connections_batch_worker_and_runtime_threads(
    tmp_path: Path, keypair: tuple[Path, Path], bundles: Bundles, agent_factory: AgentFactory
) -> None:
    config = write_config(tmp_path / "agent", keypair[1])
    # two intra-op threads: ONNX Runtime starts one pool thread with the session (the caller is the other)
    config.write_text(config.read_text().replace("threads = 1", "threads = 2"))
    assert agent_cli("install", str(bundles.v1), "--config", str(config)).returncode == 0
    agent = agent_factory(config)
    host, port = agent.address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = (
        b'{"inputs":[{"name":"input","shape":[1,3,16,16],"datatype":"FP32","data":'
        + str(np.ones(768).tolist()).encode()
        + b"}]}"
    )
    conn.request("POST", "/v2/models/tiny/infer", body, {"Content-Type": "application/json"})
    assert conn.getresponse().read() and conn.sock is not None  # kept open: its thread lives
    pid = agent.proc.pid
    names = sorted(_comm(pid, int(t.name)) for t in Path(f"/proc/{pid}/task").iterdir())
    conn.close()
    assert {"http", "http-conn", "rt-tiny", "infer-tiny", "hung-tiny"} <= set(names), names


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_thread_cpu_is_summed_by_thread_name_and_threads_that_ended_are_the_rest() -> None:
    before = ThreadCpu.read(os.getpid())
    assert before is not None
    burned, stop = threading.Event(), threading.Event()
    live = NamedThread(target=lambda: (_burn(0.15), burned.set(), stop.wait(30)), name="infer-burner")
    live.start()
    ended = NamedThread(target=lambda: _burn(0.15), name="http-conn")
    ended.start()
    ended.join()
    assert burned.wait(30)
    deadline = time.monotonic() + 30
    # join() returns when the thread's Python part is done; its task leaves /proc a moment later
    while Path(f"/proc/self/task/{ended.native_id}").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    after = ThreadCpu.read(os.getpid())
    stop.set()
    live.join()
    assert after is not None
    spent = after.since(before)
    assert spent["infer-burner"] >= 0.1 and spent[ENDED] >= 0.1, spent  # the ended thread: not by name
    assert "http-conn" not in spent
    line = thread_cpu_line(spent, 2.0)
    assert line.startswith("agent ") and " cores by thread: " in line and "infer-burner 0." in line, line
