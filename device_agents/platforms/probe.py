"""A psutil-based probe of the device: architecture, memory, battery, accelerators.

Accelerators are detected from device nodes and sysfs only (no SDK import): ``cuda`` (NVIDIA
driver or Jetson), ``edgetpu`` (Coral PCIe ``/dev/apex_*`` or a Coral USB id), ``ane`` (Apple
Silicon under macOS).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

import psutil

_ARCH_ALIASES = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64", "armv8": "aarch64", "armv8l": "aarch64"}
# (idVendor, idProduct) of the Coral USB Accelerator before and after its firmware is loaded.
_CORAL_USB_IDS = {("1a6e", "089a"), ("18d1", "9302")}
_MB = 1024 * 1024


def normalize_arch(arch: str) -> str:
    """One spelling per architecture: ``x86_64``, ``aarch64``, ``armv7l``..."""
    a = arch.strip().lower()
    return _ARCH_ALIASES.get(a, a)


@dataclass(frozen=True)
class PlatformInfo:
    system: str  # Linux, Darwin, Windows
    arch: str  # normalized, see normalize_arch
    cpu_count: int
    memory_total_mb: int
    memory_available_mb: int
    on_battery: bool | None  # None = no battery (mains powered or unknown)
    battery_percent: float | None
    accelerators: tuple[str, ...]


def probe(sys_root: Path = Path("/")) -> PlatformInfo:
    """Probe this machine now (cheap: no SDK import, a few stat calls)."""
    mem = psutil.virtual_memory()
    battery = psutil.sensors_battery() if hasattr(psutil, "sensors_battery") else None
    system = platform.system()
    arch = normalize_arch(platform.machine())
    return PlatformInfo(
        system=system,
        arch=arch,
        cpu_count=os.cpu_count() or 1,
        memory_total_mb=mem.total // _MB,
        memory_available_mb=mem.available // _MB,
        on_battery=None if battery is None else not battery.power_plugged,
        battery_percent=None if battery is None else float(battery.percent),
        accelerators=_accelerators(sys_root, system, arch),
    )


def _accelerators(root: Path, system: str, arch: str) -> tuple[str, ...]:
    found = []
    if (root / "proc/driver/nvidia/version").exists() or (root / "dev/nvidia0").exists():
        found.append("cuda")
    elif (root / "etc/nv_tegra_release").exists():  # Jetson: integrated GPU, no /dev/nvidia0
        found.append("cuda")
    if any((root / "dev").glob("apex_*")) or _coral_usb(root / "sys/bus/usb/devices"):
        found.append("edgetpu")
    if system == "Darwin" and arch == "aarch64":
        found.append("ane")
    return tuple(found)


def _coral_usb(usb_devices: Path) -> bool:
    if not usb_devices.is_dir():
        return False
    for dev in usb_devices.iterdir():
        try:
            ids = ((dev / "idVendor").read_text().strip(), (dev / "idProduct").read_text().strip())
        except OSError:
            continue
        if ids in _CORAL_USB_IDS:
            return True
    return False
