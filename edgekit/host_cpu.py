"""What this host's CPU can do, in the words people compare devices by (``x86_64 AVX-512 VNNI AMX``):
``edgekit package`` times candidates here, and says so, because a host with AVX-512 VNNI or AMX
runs int8 much faster than the device's CPU may."""

from __future__ import annotations

import platform
from pathlib import Path

# /proc/cpuinfo flag -> the name people use; in this order, the first of a group only
_FEATURES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("avx512f",), "AVX-512"),
    (("avx2",), "AVX2"),  # shown only without AVX-512
    (("avx512_vnni", "avx_vnni"), "VNNI"),
    (("avx512_bf16", "amx_bf16"), "BF16"),
    (("amx_tile",), "AMX"),
    (("asimd",), "NEON"),
    (("asimddp",), "dot-product"),
    (("asimdhp", "fphp"), "FP16"),
    (("sve",), "SVE"),
)


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The first processor's flags (``flags`` on x86, ``Features`` on Arm); empty when unreadable."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def describe_host_cpu(flags: set[str] | None = None, machine: str | None = None) -> str:
    """``x86_64 AVX-512 VNNI AMX``: the machine and the vector features that decide int8 and fp16 speed."""
    flags = cpu_flags() if flags is None else flags
    names = [name for keys, name in _FEATURES if any(k in flags for k in keys)]
    if "AVX-512" in names and "AVX2" in names:
        names.remove("AVX2")
    return " ".join([machine or platform.machine(), *names])
