"""What this device is (``probe``: CPU architecture, memory, power source, accelerators) and
whether a bundle can run here (``compatibility.check_compatible``, which imports the runtimes)."""

from device_agents.platforms.probe import PlatformInfo, normalize_arch, probe

__all__ = ["PlatformInfo", "normalize_arch", "probe"]
