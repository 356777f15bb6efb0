"""device_agents.cpus: the CPUs the agent may use (affinity, cgroup quota), which a runtime whose
``threads`` is 0 sizes its pool to."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from device_agents import cpus
from tests.agent.conftest import needs_two_cpus, one_cpu


def _tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text + "\n")


def test_cgroup_v2_quota_is_the_smallest_on_the_path_up_to_the_root(tmp_path: Path) -> None:
    _tree(tmp_path / "fs", {"a/cpu.max": "50000 100000", "a/b/cpu.max": "max 100000", "cpu.max": "400000 100000"})
    (tmp_path / "cgroup").write_text("0::/a/b\n")
    assert cpus.cgroup_cpu_quota(tmp_path / "cgroup", tmp_path / "fs") == 0.5


def test_cgroup_v1_quota_is_read_from_the_mount_root_when_the_path_is_not_under_it(tmp_path: Path) -> None:
    # a container without a cgroup namespace: /proc/self/cgroup names the host's path, the mount is its own
    _tree(tmp_path / "fs", {"cpu,cpuacct/cpu.cfs_quota_us": "150000", "cpu,cpuacct/cpu.cfs_period_us": "100000"})
    (tmp_path / "cgroup").write_text("5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n")
    assert cpus.cgroup_cpu_quota(tmp_path / "cgroup", tmp_path / "fs") == 1.5


@pytest.mark.parametrize(
    "files",
    [
        {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"},  # v1: no quota
        {"cpu.max": "max 100000"},  # v2: no quota
        {"cpu.max": "garbage"},
        {},
    ],
    ids=["v1-unlimited", "v2-unlimited", "unreadable", "no-files"],
)
def test_cgroup_quota_is_none_where_there_is_none(tmp_path: Path, files: dict[str, str]) -> None:
    _tree(tmp_path / "fs", files)
    (tmp_path / "cgroup").write_text("1:cpu:/\n0::/\n")
    assert cpus.cgroup_cpu_quota(tmp_path / "cgroup", tmp_path / "fs") is None
    assert cpus.cgroup_cpu_quota(tmp_path / "missing", tmp_path / "fs") is None


@needs_two_cpus
def test_default_threads_leaves_the_sdk_default_unless_the_process_may_use_fewer_cpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cpus, "cgroup_cpu_quota", lambda: None)
    if len(os.sched_getaffinity(0)) == os.cpu_count():
        assert cpus.default_threads() is None
    with one_cpu():
        assert cpus.usable_cores()[0] == 1 and cpus.default_threads() == 1
    monkeypatch.setattr(cpus, "cgroup_cpu_quota", lambda: 1.2)  # rounded up, never above the affinity's cores
    assert cpus.usable_cores()[0] == min(2, cpus.physical_cores(cpus.affinity_cpus()))
    monkeypatch.setattr(cpus, "cgroup_cpu_quota", lambda: 0.25)
    assert cpus.usable_cores()[0] == 1


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.access("/sys/fs/cgroup/cpu", os.W_OK) or (os.cpu_count() or 1) < 2,
    reason="needs root, a writable cgroup v1 cpu controller and two CPUs",
)
def test_a_process_in_a_cgroup_with_a_one_cpu_quota_sizes_its_threads_to_one() -> None:
    group = Path(f"/sys/fs/cgroup/cpu/edgekit-test-{os.getpid()}")
    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text("100000")
        code = (
            f"import os; open('{group}/cgroup.procs', 'w').write(str(os.getpid()));"
            "from device_agents import cpus; print(cpus.cgroup_cpu_quota(), cpus.default_threads())"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        assert out.stdout.split() == ["1.0", "1"], out.stderr
    finally:
        group.rmdir()  # its one process has exited


def test_physical_cores_count_hyperthread_siblings_once(tmp_path: Path) -> None:
    # 4 cores with 2 threads each: cpuN and cpuN+4 are siblings (a typical x86 numbering)
    for cpu in range(8):
        _tree(tmp_path, {f"cpu{cpu}/topology/thread_siblings_list": f"{cpu % 4},{cpu % 4 + 4}"})
    assert cpus.physical_cores(set(range(8)), tmp_path) == 4
    assert cpus.physical_cores({0, 4}, tmp_path) == 1
    assert cpus.physical_cores({0, 1, 9}, tmp_path) == 3  # cpu9 has no topology: its own core
