"""`python -m build`: an sdist and a wheel, with the LICENSE, both console scripts and the agent extras."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_build_makes_an_sdist_and_a_wheel_with_license_scripts_and_agent_extras(tmp_path: Path) -> None:
    if importlib.util.find_spec("build") is None:
        pytest.skip("`build` is not installed (it is in the dev extra)")
    src = tmp_path / "src"  # a copy: the build writes egg-info next to the sources
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, src / name)
    for package in ("edgekit", "device_agents"):
        shutil.copytree(REPO / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "dist"
    done = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(src)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (wheel,) = out.glob("edgekit-*-py3-none-any.whl")
    (sdist,) = out.glob("edgekit-*.tar.gz")

    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        metadata = z.read(f"{dist_info}/METADATA").decode()
        scripts = z.read(f"{dist_info}/entry_points.txt").decode()
    assert f"{dist_info}/licenses/LICENSE" in names
    assert {"edgekit/doctor.py", "device_agents/cli.py", "device_agents/platforms/systemd.py"} <= names
    assert not [n for n in names if n.startswith("tests/")]
    assert "License-Expression: Apache-2.0" in metadata
    for extra in ("agent", "agent-coral", "host"):
        assert f"Provides-Extra: {extra}\n" in metadata
    assert "edgekit = edgekit.cli:main" in scripts and "edgekit-agent = device_agents.cli:main" in scripts
    with tarfile.open(sdist) as t:
        members = {m.name.split("/", 1)[1] for m in t.getmembers() if "/" in m.name}
    assert {"LICENSE", "pyproject.toml", "edgekit/doctor.py"} <= members
    print(f"\n{wheel.name}: {wheel.stat().st_size / 1e3:.0f} kB; {sdist.name}: {sdist.stat().st_size / 1e3:.0f} kB")
