"""Split inference across a real shaped link: two network namespaces joined by a veth pair made
here, the tail server (``edgekit serve-tail``) in one, the agent in the other under a CPU quota
(a slower device), both serving the bundles ``edgekit package --split`` wrote; bandwidth shaped
with ``tc tbf`` on both ends. The cut the agent picks follows the bandwidth: the cheap head at
100 Mbit/s, local at 1 Mbit/s, the head again at 100 Mbit/s.

Needs root and iproute2 (skipped elsewhere). Every namespace, link and cgroup made here is
removed in a ``finally``; test traffic stays inside the two namespaces.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgekit.cli import main as cli_main
from edgekit.split import graph
from tests.split.models import HEAVY_SIZE, heavy_middle_convnet
from tests.split.servers import ROOT, _end, _env

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="needs root and iproute2 (ip netns, tc) to make namespaces and shape the link",
)

TAG = f"eks{os.getpid() % 100000}"
DEV_NS, TAIL_NS = f"{TAG}d", f"{TAG}t"
DEV_IF, TAIL_IF = f"{TAG}a", f"{TAG}b"
NET = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
CGROUP = Path("/sys/fs/cgroup/cpu") / TAG
PORT = 8600


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def _shape(rate_mbit: float) -> None:
    """tbf on each end's egress; the burst at least an MTU, and what the rate needs per timer tick."""
    burst = "64kb" if rate_mbit >= 50 else "4kb"
    for ns, dev in ((DEV_NS, DEV_IF), (TAIL_NS, TAIL_IF)):
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
             "rate", f"{rate_mbit}mbit", "burst", burst, "latency", "200ms")  # fmt: skip


@contextmanager
def _namespaces() -> Iterator[None]:
    try:
        _run("ip", "netns", "add", DEV_NS)
        _run("ip", "netns", "add", TAIL_NS)
        _run("ip", "link", "add", DEV_IF, "netns", DEV_NS, "type", "veth", "peer", "name", TAIL_IF, "netns", TAIL_NS)
        for ns, dev, host in ((DEV_NS, DEV_IF, 1), (TAIL_NS, TAIL_IF, 2)):
            _run("ip", "-n", ns, "addr", "add", f"{NET}.{host}/24", "dev", dev)
            _run("ip", "-n", ns, "link", "set", dev, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        yield
    finally:
        for ns in (DEV_NS, TAIL_NS):  # deleting a namespace deletes its end of the veth pair, and the pair
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)


@contextmanager
def _cpu_quota(pid: int, share: float) -> Iterator[None]:
    """cgroup v1 ``cpu``: ``pid`` may use ``share`` of one CPU (a slower device)."""
    if not (CGROUP.parent / "cpu.cfs_quota_us").exists():
        yield  # no cgroup v1 cpu controller here: the device profile alone says the device is slow
        return
    CGROUP.mkdir()
    try:
        (CGROUP / "cpu.cfs_period_us").write_text("20000")
        (CGROUP / "cpu.cfs_quota_us").write_text(str(int(20000 * share)))
        (CGROUP / "cgroup.procs").write_text(str(pid))
        yield
    finally:
        for _ in range(100):  # a thread started meanwhile keeps the group busy: move it too
            for task in (CGROUP / "tasks").read_text().split():
                try:
                    (CGROUP.parent / "tasks").write_text(task)
                except OSError:
                    pass  # the task ended meanwhile
            try:
                CGROUP.rmdir()
                break
            except OSError:
                time.sleep(0.05)


def _profiles(directory: Path, model: Path) -> tuple[Path, Path]:
    """The device: 60 ms for the whole model, 1 ms for the stem, 58-60 ms for the longer heads; the server:
    5 ms for any tail."""
    cuts = graph.enumerate_cuts(graph.load_model(model))
    head_ms = {c.id: (1.0 if c.tensors[0] in ("c1", "r1") else 58.0 + 2.0 * c.position / c.nodes) for c in cuts}
    device = {"format": "edgekit-split-profile/1", "full_ms": 60.0, "cuts": {}}
    server = {"format": "edgekit-split-profile/1", "full_ms": 5.0, "cuts": {}}
    for c in cuts:
        device["cuts"][c.id] = {"tensors": list(c.tensors), "head_ms": head_ms[c.id]}  # type: ignore[index]
        server["cuts"][c.id] = {"tensors": list(c.tensors), "tail_ms": 5.0}  # type: ignore[index]
    (directory / "device.json").write_text(json.dumps(device))
    (directory / "server.json").write_text(json.dumps(server))
    return directory / "device.json", directory / "server.json"


def test_chosen_cut_follows_the_shaped_bandwidth_between_namespaces(tmp_path: Path, keypair: tuple[Path, Path]) -> None:
    model = heavy_middle_convnet(tmp_path / "m.onnx")
    device, server = _profiles(tmp_path, model)
    calib = np.random.default_rng(3).standard_normal((64, 3, HEAVY_SIZE, HEAVY_SIZE)).astype(np.float32)
    np.savez(tmp_path / "calib.npz", x=calib)
    # the bundles as a user makes them: ``edgekit package --split`` (device bundle + signed tails)
    args = [
        "package", str(model), "--calib", str(tmp_path / "calib.npz"), "--target", "cpu", "--precision", "fp32",
        "--split", "--key", str(keypair[0]), "--name", "m", "--version", "1", "-o", str(tmp_path / "bundles"), "-q",
        "--split-device-profile", str(device), "--server-profile", str(server), "--bandwidth-mbps", "1,100",
        "--rtt-ms", "1", "--split-budget-s", "0.3", "--split-dir", str(tmp_path / "plan"),
    ]  # fmt: skip
    assert cli_main(args) == 0
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert [c["best"] for c in plan["choices"]] == ["local", "cut1"]  # the plan: local at 1, the stem at 100
    device_bundle = tmp_path / "bundles" / "m-cpu-v1.ekb"
    tails = sorted((tmp_path / "bundles").glob("m-tail-*-cpu-v1.ekb"))
    assert device_bundle.is_file() and tails
    config = tmp_path / "agent.toml"
    config.write_text(
        f'store = "{tmp_path / "store"}"\ntrusted_keys = ["{keypair[1]}"]\n'
        "[runtimes.onnxruntime]\nthreads = 1\n"
        f'[split]\ntail_url = "http://{NET}.2:{PORT}"\ndeadline_ms = 5000\nprobe_interval_s = 0.5\n'
        "retry_after_s = 2\newma_alpha = 0.3\nbandwidth_mbps = 10\n"
    )
    with _namespaces():
        _shape(100)
        tail = _spawn(
            TAIL_NS, "-m", "edgekit", "serve-tail", *map(str, tails), "--trust", str(keypair[1]),
            "--listen", f"{NET}.2:{PORT}",
        )  # fmt: skip
        agent: subprocess.Popen[str] | None = None
        try:
            _expect(tail, lambda line: "serving" in line, 180, "the tail server to start")
            agent = _spawn(DEV_NS, str(ROOT / "tests" / "split" / "netns_driver.py"), str(config), str(device_bundle))
            with _cpu_quota(agent.pid, 0.25):
                lines = _json_lines(agent)
                at_100 = _until(lines, lambda s: s["chosen"] == "cut1", 5, 120)
                _shape(1)
                at_1 = _until(lines, lambda s: s["chosen"] == "local", 5, 180)
                _shape(100)
                again = _until(lines, lambda s: s["chosen"] == "cut1", 5, 180)
            (tmp_path / "states.json").write_text(json.dumps({"100": at_100, "1": at_1, "100 again": again}, indent=1))
            for state in (*at_100, *at_1, *again):
                assert state["status"] == 200  # every request answered, whichever way it went
            # the bandwidth estimate fell with the link and rose again with it (the RTT estimate rises too at
            # 1 Mbit/s: probes queue behind a cut tensor in the shaper, and either can make local the cheaper)
            low = min(s["bandwidth_mbps"] for s in at_1)
            assert low < at_100[-1]["bandwidth_mbps"] and low < max(s["bandwidth_mbps"] for s in again)
        finally:
            if agent is not None and agent.stdin is not None:
                agent.stdin.close()
                _end(agent)
            _end(tail)


def _spawn(ns: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env=_env(),
    )


def _reader(proc: subprocess.Popen[str]) -> queue.Queue[str | None]:
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _expect(proc: subprocess.Popen[str], ok: Callable[[str], bool], timeout_s: float, what: str) -> None:
    lines = _reader(proc)
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        if line is None:
            break
        seen.append(line)
        if ok(line):
            return
    raise AssertionError(f"waited for {what}:\n{''.join(seen[-40:])}")


class _Lines:
    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.queue = _reader(proc)
        self.other: list[str] = []

    def next(self, deadline: float) -> dict[str, Any] | None:
        while time.monotonic() < deadline:
            try:
                line = self.queue.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError("the driver exited:\n" + "".join(self.other[-40:]))
            if line.startswith("{"):
                state: dict[str, Any] = json.loads(line)
                return state
            self.other.append(line)
        return None


def _json_lines(proc: subprocess.Popen[str]) -> _Lines:
    return _Lines(proc)


def _until(
    lines: _Lines, ok: Callable[[dict[str, Any]], bool], in_a_row: int, timeout_s: float
) -> list[dict[str, Any]]:
    """The states read until ``in_a_row`` consecutive ones satisfy ``ok``."""
    states: list[dict[str, Any]] = []
    streak = 0
    deadline = time.monotonic() + timeout_s
    while streak < in_a_row:
        state = lines.next(deadline)
        if state is None:
            raise AssertionError(f"no {in_a_row} such requests in a row within {timeout_s} s; last: {states[-10:]}")
        states.append(state)
        streak = streak + 1 if ok(state) else 0
    return states
