"""The litert runtime loads ai_edge_litert, or tflite_runtime where only that is installed (older Coral images)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
GOLDEN_MANIFEST = REPO / "tests" / "golden" / "manifest_v1.json"
# tflite-runtime's last release; built against numpy 1.x, so its venv pins numpy < 2
TFLITE_RUNTIME = "tflite-runtime==2.14.0"

# Runs the agent's LiteRtRunner on MODEL.tflite with the golden coral manifest pointed at it; prints JSON.
RUN_RUNNER = """
import dataclasses, json, sys
from pathlib import Path
import numpy as np
from device_agents.runtimes import litert
from device_agents.runtimes.options import LiteRtOptions
from edgekit.bundle.manifest import Manifest

golden, model = Path(sys.argv[1]), Path(sys.argv[2])
m = Manifest.from_json(golden.read_bytes())
files = tuple(dataclasses.replace(f, path=model.name) if f.role == "artifact" else f for f in m.files)
m = dataclasses.replace(
    m, files=files, split=None, compatibility=dataclasses.replace(m.compatibility, accelerator=None)
)
runner = litert.LiteRtRunner(model.parent, m, LiteRtOptions(threads=1))
y = runner.run({"x": np.array([[1.0, -2.0, 3.0, 0.5]], np.float32)})["y"]
print(json.dumps({"package": litert.INTERPRETER_PACKAGE, "describe": runner.describe(), "y": y.tolist()}))
"""

MAKE_TFLITE = """
import os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np, tensorflow as tf

class Tiny(tf.Module):
    def __init__(self):
        self.w = tf.constant(np.arange(12, dtype=np.float32).reshape(4, 3) / 10)

    @tf.function(input_signature=[tf.TensorSpec([1, 4], tf.float32, name="x")])
    def serve(self, x):
        return {"y": tf.nn.relu(tf.matmul(x, self.w) - 0.5)}

m = Tiny()
conv = tf.lite.TFLiteConverter.from_concrete_functions([m.serve.get_concrete_function()], m)
open(sys.argv[1], "wb").write(conv.convert())
"""


def _run(python: str, script: str, *args: str, env: dict[str, str] | None = None) -> dict:
    done = subprocess.run(
        [python, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_litert_without_any_interpreter_names_the_agent_coral_extra() -> None:
    block = "import sys; sys.modules['ai_edge_litert'] = None; sys.modules['tflite_runtime'] = None\n"
    done = subprocess.run(
        [sys.executable, "-c", block + "import device_agents.runtimes.litert"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode != 0
    assert (
        "MissingSDKError: ai-edge-litert (or tflite-runtime) is not installed for the litert runtime: "
        "pip install 'edgekit[agent-coral]'"
    ) in done.stderr


@pytest.mark.slow
def test_litert_runs_on_tflite_runtime_when_ai_edge_litert_is_absent(tmp_path: Path) -> None:
    uv = shutil.which("uv") or str(Path(sys.executable).with_name("uv"))
    if not Path(uv).exists():
        pytest.skip("uv is not installed (it builds the tflite-runtime-only venv)")
    pytest.importorskip("tensorflow", reason="tensorflow builds the test's .tflite model")
    model = tmp_path / "tiny.tflite"
    done = subprocess.run([sys.executable, "-c", MAKE_TFLITE, str(model)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    venv = tmp_path / "tflite-only"
    made = subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    py = str(venv / "bin" / "python")
    installed = subprocess.run(
        [uv, "pip", "install", "-q", "--python", py, TFLITE_RUNTIME, "numpy<2", "cryptography"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if installed.returncode != 0:
        pytest.skip(f"cannot install {TFLITE_RUNTIME} from the package index here: {installed.stderr.strip()[-300:]}")

    fallback = _run(py, RUN_RUNNER, str(GOLDEN_MANIFEST), str(model))
    primary = _run(sys.executable, RUN_RUNNER, str(GOLDEN_MANIFEST), str(model))
    assert fallback["package"] == fallback["describe"]["interpreter"] == "tflite_runtime"
    assert primary["package"] == primary["describe"]["interpreter"] == "ai_edge_litert"
    assert fallback["describe"]["version"] == "2.14.0"
    expected = np.maximum(np.array([[1.0, -2.0, 3.0, 0.5]]) @ (np.arange(12).reshape(4, 3) / 10) - 0.5, 0)
    np.testing.assert_allclose(fallback["y"], expected, rtol=1e-5)
    np.testing.assert_allclose(fallback["y"], primary["y"], rtol=1e-6)
