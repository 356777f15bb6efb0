"""The README's Quick start runs as written: its bash block, line for line, in a fresh folder that
holds only a copy of ``examples/`` (what a checkout has), with the console scripts on PATH.

The first line (``pip install -e '.[host]'``) is checked, not run: the test environment already
is that install, and a test must not change the environment it runs in. Everything else runs
unchanged in one ``bash -euo pipefail`` process, so the background agent, ``curl``'s retries
and ``kill %1`` behave as they do in a user's shell.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
INSTALL = "pip install -e '.[host]'"


def quick_start_lines() -> list[str]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None, "the Quick start has no bash block"
    return block.group(1).splitlines()


def test_readme_quick_start_runs_as_written(tmp_path: Path) -> None:
    lines = quick_start_lines()
    assert lines[0].startswith(INSTALL)
    shutil.copytree(REPO / "examples", tmp_path / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    script = tmp_path / "quick_start.sh"
    script.write_text("\n".join(["set -euo pipefail", *lines[1:], "wait"]) + "\n")
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(
        ["bash", str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout.splitlines()
    assert "out/digits-cpu-v1.ekb: valid: digits v1 for cpu" in next(x for x in out if "valid:" in x)
    assert any(re.fullmatch(r"installed digits v1; self-test passed, p50 \d+\.\d{3} ms", x) for x in out)
    model = json.loads(next(x for x in out if x.startswith("{")))  # curl's answer, once the agent listened
    assert model["name"] == "digits" and model["inputs"][0]["name"] == "image"
    assert any(x.startswith("cpu ") and x.endswith("passed") for x in out)  # the validation table
    assert any(re.match(r" +32 +\d+ +\d+\.\d{3} ms", x) for x in out)  # bench at batch 32
    assert not (tmp_path / "agent-store" / "daemon.json").exists()  # the agent stopped cleanly on kill %1
