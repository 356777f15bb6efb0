"""A size-limited tmpfs for disk-full tests (mounting needs root: the test is skipped otherwise)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_tmpfs(mount_point: Path, size: str) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` (mount's syntax: ``512k``) on ``mount_point``; ``resize`` with remount."""
    mount_point.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs for the disk-full test needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def resize(mount_point: Path, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(mount_point)], check=True)


def fill(disk: Path) -> None:
    """Write zeros to ``disk/filler`` until the file system is full (a later write of 8 KiB fails)."""
    with open(disk / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    probe = disk / "probe"
    try:
        probe.write_bytes(b"x" * 8192)
        raise AssertionError("the disk is not full")
    except OSError:
        probe.unlink(missing_ok=True)
