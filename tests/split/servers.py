"""Tail servers as real processes on 127.0.0.1, started by the tests: ``edgekit serve-tail`` and
KServe's own ``ModelServer`` (``python -m edgekit.split.kserve_tail``); and a delaying TCP proxy."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serve_tail(
    tails: Sequence[Path], *, name_prefix: str | None = None, trust: Path | None = None, port: int = 0
) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """``edgekit serve-tail`` in a child process; yields (base URL, process) once it serves."""
    cmd = [sys.executable, "-m", "edgekit", "serve-tail", *map(str, tails), "--listen", f"127.0.0.1:{port}"]
    if name_prefix:
        cmd += ["--name-prefix", name_prefix]
    if trust is not None:
        cmd += ["--trust", str(trust)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=_env())
    try:
        url = _wait_line(proc, re.compile(r"serving .* at (http://\S+)"), 120)
        yield url, proc
    finally:
        _end(proc)


@contextlib.contextmanager
def kserve_tail(root: Path) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """KServe's ModelServer serving ``root/<name>/model.onnx``; yields (base URL, process) once ready."""
    port = free_port()
    cmd = [sys.executable, "-m", "edgekit.split.kserve_tail", str(root), "--http_port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=_env())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kserve ModelServer exited: {proc.stdout.read() if proc.stdout else ''}")
            try:
                with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("kserve ModelServer did not get ready in 120 s")
            time.sleep(0.2)
        yield url, proc
    finally:
        _end(proc)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    return env


def _wait_line(proc: subprocess.Popen[str], pattern: re.Pattern[str], timeout_s: float) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    seen: list[str] = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                raise RuntimeError("serve-tail exited:\n" + "".join(seen))
            continue
        seen.append(line)
        m = pattern.search(line)
        if m:
            return m.group(1)
    raise TimeoutError("serve-tail did not start:\n" + "".join(seen))


def _end(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


class DelayProxy:
    """A TCP proxy on 127.0.0.1 that holds every chunk ``delay_s`` before passing it on, each way
    (RTT + 2 x delay_s): the link's delay where ``tc netem`` is missing. ``delay_s`` may change
    while it runs; the order of the bytes never does."""

    def __init__(self, target: tuple[str, int], delay_s: float = 0.0) -> None:
        self.target = target
        self.delay_s = delay_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._closed = True
        self.listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:  # the server is gone: the client sees its connection closed
                client.close()
                continue
            for a, b in ((client, upstream), (upstream, client)):
                held: queue.Queue[tuple[float, bytes]] = queue.Queue()
                threading.Thread(target=self._read, args=(a, held), daemon=True).start()
                threading.Thread(target=self._write, args=(b, held), daemon=True).start()

    def _read(self, sock: socket.socket, held: queue.Queue[tuple[float, bytes]]) -> None:
        while True:
            try:
                data = sock.recv(65536)
            except OSError:
                data = b""
            held.put((time.monotonic() + self.delay_s, data))
            if not data:
                return

    def _write(self, sock: socket.socket, held: queue.Queue[tuple[float, bytes]]) -> None:
        while True:
            due, data = held.get()
            time.sleep(max(0.0, due - time.monotonic()))
            try:
                if not data:
                    sock.shutdown(socket.SHUT_WR)
                    return
                sock.sendall(data)
            except OSError:
                return
