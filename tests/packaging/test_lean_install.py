"""`pip install '.[agent]'` into a fresh venv: no host SDKs, <= 40 MB beyond onnxruntime and numpy, the agent serves.

Sizes are the bytes of each distribution's installed files (its RECORD), measured in that venv;
pip and setuptools (the venv's own) are not counted.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.agent.conftest import Bundles, write_config
from tests.packaging.notify import NotifyListener

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "requirements" / "lock.txt"
BUDGET_BYTES = 40 * 1000 * 1000
NOT_COUNTED = {"pip", "setuptools"}
RUNTIME = {"onnxruntime", "numpy"}
HOST_ONLY = {"torch", "tensorflow", "tensorflow-cpu", "onnx", "onnx2tf", "openvino", "nncf", "coremltools", "onnxslim"}

SIZES = """
import importlib.metadata as md, json, os
sizes = {}
for dist in md.distributions():
    total = 0
    for f in dist.files or ():
        p = dist.locate_file(f)
        if os.path.isfile(p):
            total += os.path.getsize(p)
    sizes[dist.metadata["Name"].lower().replace("_", "-")] = total
print(json.dumps(sizes))
"""

IMPORTS = """
import json, sys
import edgekit, device_agents, device_agents.cli
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
"""


def _sizes(python: str, env: dict[str, str]) -> dict[str, int]:
    done = subprocess.run([python, "-c", SIZES], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def _mb(n: int) -> str:
    return f"{n / 1e6:8.1f} MB"


@pytest.mark.slow
def test_agent_only_install_adds_at_most_40_mb_beyond_onnxruntime_and_numpy_and_serves(
    tmp_path: Path, keypair: tuple[Path, Path], bundles: Bundles
) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    src = tmp_path / "src"  # a copy: pip builds in the source tree, which must not be the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, src / name)
    for package in ("edgekit", "device_agents"):
        shutil.copytree(REPO / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    venv = tmp_path / "agent-venv"
    made = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "-c", str(LOCK), f"{src}[agent]"]
    done = subprocess.run(pip, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]

    sizes = _sizes(python, env)
    counted = {name: n for name, n in sizes.items() if name not in NOT_COUNTED}
    added = sum(n for name, n in counted.items() if name not in RUNTIME)
    host = _sizes(sys.executable, {**env, "PYTHONPATH": ""})
    host_total = sum(n for name, n in host.items() if name not in NOT_COUNTED)
    lines = [f"  {name:<24}{_mb(n)}" for name, n in sorted(counted.items(), key=lambda kv: -kv[1])]
    print("\nagent-only install (pip install '.[agent]', fresh venv, pip/setuptools not counted):", *lines, sep="\n")
    print(f"  {'onnxruntime + numpy':<24}{_mb(sum(counted.get(n, 0) for n in RUNTIME))}")
    print(f"  {'everything else':<24}{_mb(added)}  (budget {_mb(BUDGET_BYTES).strip()})")
    print(f"  {'total':<24}{_mb(sum(counted.values()))}")
    print(f"host install ({sys.prefix}): {_mb(host_total).strip()} in {len(host)} distributions")

    assert not HOST_ONLY & set(sizes), f"the agent install pulled host SDKs: {sorted(HOST_ONLY & set(sizes))}"
    assert RUNTIME <= set(sizes)
    assert added <= BUDGET_BYTES, f"agent-only install adds {added / 1e6:.1f} MB beyond onnxruntime and numpy"

    # `import edgekit` / `import device_agents` load no ML runtime
    done = subprocess.run([python, "-c", IMPORTS], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert not {"onnxruntime", *HOST_ONLY} & set(json.loads(done.stdout))

    # the installed agent installs a bundle (its self-test runs in this venv) and serves it
    config = write_config(tmp_path / "agent", keypair[1])
    agent = str(venv / "bin" / "edgekit-agent")
    install = [agent, "install", str(bundles.v1), "--config", str(config)]
    done = subprocess.run(install, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    listener = NotifyListener(tmp_path / "notify.sock")
    proc = subprocess.Popen(
        [agent, "run", "--config", str(config)], env={**env, "NOTIFY_SOCKET": str(listener.path)}, cwd=tmp_path
    )
    try:
        listener.wait_for("READY", "1", timeout_s=120)
        url = json.loads((config.parent / "store" / "daemon.json").read_text())["url"]
        with urllib.request.urlopen(url + "/v2/models/tiny/ready", timeout=10) as resp:
            assert resp.status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        listener.close()
