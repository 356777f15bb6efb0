"""The HIL harness itself: every board file builds a labgrid target, and the virtual board runs a
few scenarios end to end through labgrid's pytest plugin (the whole suite: `pytest hil/ --lg-env
hil/boards/virtual.yaml`, a few minutes; docs/hil.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BOARDS = sorted((ROOT / "hil" / "boards").glob("*.yaml"))


@pytest.mark.parametrize("board_file", BOARDS, ids=[b.stem for b in BOARDS])
def test_board_file_builds_a_target_with_the_edgekit_strategy(board_file: Path) -> None:
    """Each board file loads, its drivers bind (nothing is activated: no board is touched)."""
    probe = (
        "import sys, labgrid\n"
        f"env = labgrid.Environment({str(board_file)!r})\n"
        "target = env.get_target()\n"
        "names = sorted(type(d).__name__ for d in target.drivers)\n"
        "print(','.join(names))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    drivers = set(done.stdout.strip().split(","))
    assert {"EdgekitStrategy", "EdgekitAgentDriver", "EdgekitConsoleDriver", "SerialDriver"} <= drivers
    assert drivers & {"ExternalPowerDriver", "ManualPowerDriver", "VirtualBoardDriver"}
    text = board_file.read_text()
    assert "# Wire" in text or board_file.stem == "virtual", "a real board file says what to wire"
    assert "# Run" in text or "pytest hil/" in text


def test_virtual_board_installs_over_serial_and_answers_golden_vectors(tmp_path: Path) -> None:
    """Two scenarios of the HIL suite on the virtual board (namespace, pty console, cgroup quota,
    tmpfs store), through labgrid's plugin, with the report written."""
    from hil.virtual_board import unsupported_reason

    reason = unsupported_reason()
    if reason is not None:
        pytest.skip(reason)  # as root on Linux the board must build: a failure to is a failure here
    board_file = tmp_path / "virtual.yaml"  # its own work dir: a concurrent full run keeps its own
    board_file.write_text(
        (ROOT / "hil" / "boards" / "virtual.yaml").read_text().replace("/tmp/edgekit-hil/virtual", str(tmp_path / "vb"))
    )
    report = tmp_path / "report"
    done = subprocess.run(
        [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "hil/", "--lg-env", str(board_file),
            "--report", str(report), "-k", "install_over_serial_only or golden_vectors", "--latency-requests", "20",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    data = json.loads((report / "report.json").read_text())
    scenarios = data["scenarios"]
    assert scenarios["install_over_serial_only"]["outcome"] == "passed"
    assert scenarios["install_over_serial_only"]["measured"]["network"] == "pulled"
    assert scenarios["golden_vectors_on_the_board"]["measured"]["paths"] == "console+network"
    assert (report / "report.md").read_text().startswith("# edgekit HIL report: virtual")
    assert not (tmp_path / "vb" / "console").exists()  # torn down: the console link is gone
    assert not os.path.ismount(tmp_path / "vb" / "store")  # the tmpfs is unmounted
    if len(os.sched_getaffinity(0)) > 1:  # the agent saw its half-core quota (device_agents.cpus)
        assert "CPUs: this agent may use 1 of" in (tmp_path / "vb" / "agent.log").read_text()


def test_virtual_board_fails_and_cleans_up_when_a_part_cannot_be_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As root on Linux a part that cannot be made (here: no cgroup CPU controller where the board
    looks) is an error naming it, never a skip; the parts already made are removed."""
    from hil import virtual_board
    from hil.virtual_board import VirtualBoard, VirtualBoardError, unsupported_reason

    reason = unsupported_reason()
    if reason is not None:
        pytest.skip(reason)
    monkeypatch.setattr(virtual_board, "CGROUP_V1_CPU", tmp_path / "no-cgroup")
    monkeypatch.setattr(virtual_board, "CGROUP_V2", tmp_path / "no-cgroup")
    board = VirtualBoard(tmp_path / "vb")
    with pytest.raises(VirtualBoardError, match="no cgroup CPU controller"):
        board.create()
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert board.netns not in namespaces.split()  # the namespace made before it is gone
    assert not os.path.ismount(tmp_path / "vb" / "store")  # and the tmpfs
