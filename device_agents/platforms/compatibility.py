"""Can this device run a bundle? Checked before any byte of the artifact is extracted."""

from __future__ import annotations

from device_agents.errors import IncompatibleError
from device_agents.platforms.probe import PlatformInfo, normalize_arch, probe
from device_agents.runtimes import runner_class
from edgekit.bundle.errors import MissingSDKError
from edgekit.bundle.manifest import Manifest

# Accelerators the probe can see; a manifest naming another one (e.g. an OpenVINO "npu") is
# left to its runtime, which fails the self-test if the device lacks it.
DETECTABLE_ACCELERATORS = ("cuda", "edgetpu", "ane")


def check_compatible(manifest: Manifest, info: PlatformInfo | None = None) -> None:
    """Raise ``IncompatibleError`` unless this device has the bundle's runtime, arch and accelerator."""
    c = manifest.compatibility
    what = f"bundle {manifest.name} v{manifest.version} (target {manifest.target})"
    try:
        runner_class(c.runtime)  # imports the runtime module, which imports its SDK
    except MissingSDKError as exc:
        raise IncompatibleError(f"{what} needs runtime {c.runtime}: {exc}") from exc
    except ImportError as exc:
        raise IncompatibleError(f"{what} needs runtime {c.runtime}, which this agent cannot load ({exc})") from exc
    info = info or probe()
    wanted = {normalize_arch(a) for a in c.arch}
    if wanted and info.arch not in wanted:
        raise IncompatibleError(
            f"{what} is built for {', '.join(sorted(wanted))}; this device is {info.arch}: package it for {info.arch}"
        )
    if c.accelerator in DETECTABLE_ACCELERATORS and c.accelerator not in info.accelerators:
        found = ", ".join(info.accelerators) or "none"
        raise IncompatibleError(
            f"{what} needs accelerator {c.accelerator}; this device has {found}: ship the cpu target instead"
        )
