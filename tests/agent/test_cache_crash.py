"""The result cache under a killed writer and a full disk.

A writer process is SIGKILLed at its Nth write step (the counted fault point ``cache_write``,
N = 1..200: every step of the writes it does), like a power cut stops it; the file must then pass
``PRAGMA integrity_check`` and hold every entry acknowledged before the kill. The writer is a
fork of the test process (a fresh interpreter per N would take minutes on a small machine).
A full disk is a real size-limited tmpfs (root; skipped otherwise).
"""

from __future__ import annotations

import os
import signal
import sqlite3
from pathlib import Path

import numpy as np

from device_agents.cache.key import KeyMaker
from device_agents.cache.store import DB_NAME, ResultCache
from device_agents.faults import FAULT_AT_ENV, FAULT_ENV
from device_agents.metrics import AgentMetrics
from tests.updates.tmpfs import fill, resize, small_tmpfs

MB = 1024 * 1024
WRITES = 90  # entries the writer stores: more write steps than the largest N


def _entry(i: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(i)
    return rng.random((1, 4, 16, 16)).astype(np.float32), rng.random((1, 10)).astype(np.float32)


def _maker() -> KeyMaker:
    return KeyMaker("det", "det", 1, "d" * 64)


def _writer(directory: Path, acks: int) -> None:
    """Store WRITES entries, one transaction each or three at a time; write the index of every
    entry whose transaction committed to fd ``acks``. Ends with SIGKILL at the armed point."""
    cache = ResultCache(directory, max_bytes=64 * MB, memory_max_bytes=MB)
    maker = _maker()
    i = 0
    while i < WRITES:
        if i % 10 == 9:  # a batch: three queued, one flush
            batch = [i, i + 1, i + 2]
            for j in batch:
                x, y = _entry(j)
                cache.put(maker.key({"x": x}), {"y": y}, model="det", version=1, ttl_s=3600)
            if cache.flush():
                os.write(acks, "".join(f"{j}\n" for j in batch).encode())
            i += 3
        else:
            x, y = _entry(i)
            if cache.put(maker.key({"x": x}), {"y": y}, model="det", version=1, ttl_s=3600, wait=True):
                os.write(acks, f"{i}\n".encode())
            i += 1


def _run_writer(directory: Path, n: int) -> tuple[int, list[int]]:
    """Fork a writer armed to die at its nth write step; (its wait status, acknowledged indexes)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(read_fd)
            os.environ[FAULT_ENV] = "cache_write"
            os.environ[FAULT_AT_ENV] = str(n)
            _writer(directory, write_fd)
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    chunks = []
    while chunk := os.read(read_fd, 65536):
        chunks.append(chunk)
    os.close(read_fd)
    _, status = os.waitpid(pid, 0)
    return status, [int(line) for line in b"".join(chunks).decode().split()]


def test_cache_killed_at_every_write_step_keeps_integrity_and_acknowledged_entries(tmp_path: Path) -> None:
    for n in range(1, 201):
        directory = tmp_path / f"kill-{n}"
        status, acked = _run_writer(directory, n)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
            f"N={n}: the writer was not killed at its write step (status {status})"
        )
        db = directory / DB_NAME
        if db.exists():
            with sqlite3.connect(db) as conn:
                assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",), f"N={n}"
        cache = ResultCache(directory, max_bytes=64 * MB, memory_max_bytes=MB)
        try:
            assert cache.state == "ok", f"N={n}"
            assert not list(directory.glob(f"{DB_NAME}.corrupt-*")), f"N={n}: the file was found corrupt"
            maker = _maker()
            for i in acked:
                x, y = _entry(i)
                hit = cache.get(maker.key({"x": x}), "det")
                assert hit is not None and hit.tier == "disk", f"N={n}: acknowledged entry {i} is missing"
                np.testing.assert_array_equal(hit.outputs["y"], y)
            assert cache.entries() >= len(acked)
        finally:
            cache.close()
    # the last runs got far: the kill points cover many writes, not only the first
    assert len(acked) >= 40


def test_cache_pauses_disk_writes_when_full_and_resumes_when_space_returns(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]  # pytest's caplog fixture
    metrics = AgentMetrics()
    with small_tmpfs(tmp_path / "disk", "2m") as disk:
        cache = ResultCache(
            disk / "cache", max_bytes=64 * MB, memory_max_bytes=64 * MB, series=metrics.cache, retry_s=0
        )
        maker = _maker()
        x, y = _entry(0)
        assert cache.put(maker.key({"x": x}), {"y": y}, model="det", version=1, ttl_s=60, wait=True)
        fill(disk)
        caplog.clear()
        stored = []
        for i in range(1, 40):  # more than the space left: writes fail, serving goes on
            x, y = _entry(i)
            key = maker.key({"x": x})
            stored.append(cache.put(key, {"y": y}, model="det", version=1, ttl_s=60, wait=True))
            assert cache.get(key, "det") is not None  # the memory tier still answers
        assert cache.state == "paused" and cache.pause_reason == "disk_full"
        assert False in stored
        lines = [r.getMessage() for r in caplog.records if "disk is full" in r.getMessage()]
        assert len(lines) == 1, lines  # one line, not one per write
        assert b"edgekit_cache_paused 1.0" in metrics.exposition()
        (disk / "filler").unlink()
        resize(disk, "8m")
        x, y = _entry(100)
        assert cache.put(maker.key({"x": x}), {"y": y}, model="det", version=1, ttl_s=60, wait=True)
        assert cache.state == "ok"
        assert b"edgekit_cache_paused 0.0" in metrics.exposition()
        assert b"edgekit_cache_pauses_total 1.0" in metrics.exposition()
        assert any("writing to" in r.getMessage() and "again" in r.getMessage() for r in caplog.records)
        cache.close()
        with sqlite3.connect(disk / "cache" / DB_NAME) as conn:
            assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
