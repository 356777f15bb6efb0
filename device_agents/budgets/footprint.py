"""A model's memory footprint, measured in a fresh child process: the RSS increase of its load
plus one first inference (``memory_mb``) and the peak over them (``peak_memory_mb``), both above
the process with the runtime's SDK already imported. The packager records them in the manifest's
``estimates`` for the device's memory budget (which replaces them with its own measurement after
the first load there).

    python -m device_agents.budgets.footprint MODEL_DIR MANIFEST.json   ->  {"memory_mb": .., "peak_memory_mb": ..}

A child, because the measuring process must hold nothing else: the packager's own process has
the source model, the calibration data and other targets' sessions in memory.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from edgekit.bundle.manifest import Manifest

_TIMEOUT_S = 300.0


def _reset_peak() -> bool:
    """Reset this process's resident high-water mark (``VmHWM``; Linux 4.0+); whether it was."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return _peak_bytes() is not None


def _peak_bytes() -> int | None:
    """``VmHWM`` of ``/proc/self/status``: the most this process held resident since the reset."""
    try:
        m = re.search(r"^VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


def measure(model_dir: Path, manifest: Manifest) -> dict[str, float]:
    """In this process: load ``manifest``'s model from ``model_dir``, run it once on zeros, and
    return the RSS increase and the peak over them above what it was before the load.

    The peak is the high-water mark reset just before the load where Linux allows it, else RSS
    polled every 2 ms. Not ``ru_maxrss``: it outlives ``exec``, so a child started by a
    packager holding hundreds of MB reported that as the peak of a model of a few MB."""
    from device_agents.budgets.memory import PeakRss, current_rss_bytes, first_inference, return_freed_memory
    from device_agents.runtimes import load_model, runner_class

    runner_class(manifest.compatibility.runtime)  # the SDK's import is the process's, not the model's
    return_freed_memory()
    reset = _reset_peak()
    before = current_rss_bytes()
    with PeakRss(current_rss_bytes) as polled:
        model = load_model(model_dir, manifest)
        first_inference(model)
    after = current_rss_bytes()
    peak = max(polled.bytes, (_peak_bytes() or 0) if reset else 0)
    model.close()
    mb = 1024 * 1024
    return {
        "memory_mb": round(max(0, after - before) / mb, 1),
        "peak_memory_mb": round(max(0, max(peak, after) - before) / mb, 1),
    }


def measure_in_child(model_dir: Path, manifest: Manifest, work_dir: Path) -> dict[str, float]:
    """``measure`` in a fresh Python process; raises ``RuntimeError`` with its stderr if it fails."""
    work_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = work_dir / "footprint-manifest.json"
    manifest_path.write_bytes(manifest.to_json())
    done = subprocess.run(
        [sys.executable, "-m", "device_agents.budgets.footprint", str(model_dir), str(manifest_path)],
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
        check=False,
    )
    manifest_path.unlink(missing_ok=True)
    if done.returncode != 0:
        raise RuntimeError(f"measuring the model's memory failed: {done.stderr.strip()[-500:]}")
    return {k: float(v) for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def main(argv: list[str]) -> int:
    model_dir, manifest_path = Path(argv[0]), Path(argv[1])
    print(json.dumps(measure(model_dir, Manifest.from_json(manifest_path.read_bytes()))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
