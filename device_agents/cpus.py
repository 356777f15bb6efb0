"""How many CPUs this process may use: what a runtime's thread pool is sized to by default.

A device often gives the agent fewer CPUs than it has: ``taskset``, systemd's ``CPUAffinity=``,
a container's cpuset (``docker run --cpuset-cpus``) or CPU quota (``--cpus``, a cgroup's
``cpu.max``). The runtimes' own defaults do not all see that. ONNX Runtime sizes its intra-op pool
to the machine's physical cores whatever the affinity or quota (microsoft/onnxruntime#29510;
under a cpuset it can also fail to pin its threads, #8313); OpenVINO follows the affinity but not
a quota. On a 2-core x86_64 machine (bench/serving.py's MLP, 8 rows a call) ORT's default pool
under ``taskset -c 1`` took 3.86 ms a call against 1.55 ms with one thread, and 1.97 ms under a
1-CPU cgroup quota; OpenVINO took 2 threads under that quota.

So where a runtime's ``threads`` is 0 (its default), the runner asks ``default_threads()``: None
(keep the SDK's default) when this process may use every core of the machine, else the physical
cores it may use (hyperthread siblings once, as the SDKs count), a quota rounded up. Stdlib
only: the runtimes import it with nothing but their SDK installed.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
SYSFS_CPU = Path("/sys/devices/system/cpu")
PROC_CGROUP = Path("/proc/self/cgroup")


def affinity_cpus() -> set[int]:
    """The CPUs this process may run on (its affinity mask; every CPU of the machine where there is none)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def physical_cores(cpus: set[int], sysfs: Path = SYSFS_CPU) -> int:
    """How many physical cores ``cpus`` are on: hyperthread siblings (``topology/thread_siblings_list``)
    count once, as the runtimes' defaults count cores; a CPU without topology counts as its own core."""
    cores = set()
    for cpu in cpus:
        try:
            cores.add((sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text().strip())
        except OSError:
            cores.add(f"cpu{cpu}")
    return len(cores)


def cgroup_cpu_quota(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> float | None:
    """The smallest CPU quota, in CPUs, on this process's cgroup and its ancestors (cgroup v2
    ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``); None where there is none or it
    cannot be read. A path that does not exist under the mount (a container that sees its own
    cgroup as the mount's root) is read from the root up."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    quotas: list[float] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:  # cgroup v2: one tree, files cpu.max
            quotas += _walk(root, path, _v2_quota)
        elif "cpu" in controllers.split(","):  # cgroup v1: the cpu controller's own tree
            for mount in dict.fromkeys((controllers, "cpu,cpuacct", "cpu")):
                if (root / mount).is_dir():
                    quotas += _walk(root / mount, path, _v1_quota)
                    break
    return min(quotas) if quotas else None


def usable_cores() -> tuple[int, int]:
    """(the cores this process can keep busy, the machine's cores): the physical cores of its
    affinity, capped by a cgroup quota (rounded up), against the physical cores of every CPU."""
    cores = physical_cores(affinity_cpus())
    quota = cgroup_cpu_quota()
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return cores, physical_cores(set(range(os.cpu_count() or 1)))


def default_threads() -> int | None:
    """A runtime's thread count where its config leaves it to the default: None (the SDK's own
    default) when this process may use every core of the machine, else the cores it may use."""
    usable, machine = usable_cores()
    return usable if usable < machine else None


def _walk(mount: Path, path: str, read: Callable[[Path], float | None]) -> list[float]:
    """The quotas found from ``mount/path`` up to ``mount`` (the limits of every ancestor apply)."""
    parts = [p for p in path.strip("/").split("/") if p]
    found = []
    for depth in range(len(parts), -1, -1):
        quota = read(mount.joinpath(*parts[:depth]))
        if quota is not None:
            found.append(quota)
    return found


def _number(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _v2_quota(directory: Path) -> float | None:
    text = _number(directory / "cpu.max")  # "max 100000" or "150000 100000"
    if not text:
        return None
    quota, _, period = text.partition(" ")
    if quota == "max" or not quota.isdigit() or not period.isdigit() or not int(period):
        return None
    return int(quota) / int(period)


def _v1_quota(directory: Path) -> float | None:
    quota, period = _number(directory / "cpu.cfs_quota_us"), _number(directory / "cpu.cfs_period_us")
    if quota is None or period is None or not quota.isdigit() or not period.isdigit() or not int(period):
        return None  # -1: no quota
    return int(quota) / int(period)
