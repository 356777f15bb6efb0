"""What packaging assumes when a request leaves a setting out: the one place for its defaults.

``edgekit.packaging.PackageRequest`` (what ``edgekit.package`` and ``edgekit package`` both
build) takes its field defaults from here, and the CLI its flag defaults.

The command line's first-try defaults go further:
``-o`` is ``dist/``, ``--name`` the model file's stem, ``--version`` one more than the highest
bundle of that name in the output folder (1 when none), and without ``--signing-key`` the bundle
is signed with a development key made once under the user's config folder
(``$XDG_CONFIG_HOME/edgekit/`` or ``~/.config/edgekit/``). Devices trust no key by default, so
the development key is named in a warning: a device accepts its bundles only once its
``agent.toml`` lists the ``.pub`` in ``trusted_keys``.
"""

from __future__ import annotations

import os
import re
from datetime import timedelta
from pathlib import Path

DEFAULT_TARGETS = ("cpu",)
DEFAULT_PRECISION = "int8"  # for targets a precision mapping does not name (and no "*")
DEFAULT_OBJECTIVE = "latency"
DEFAULT_CALIB_SAMPLES = 128  # the stratified calibration subset, every target
# the packaging run's memory bound by default: this share of the memory the process may use (the
# machine's RAM, or a cgroup's limit below it); a candidate estimated to need more is skipped
# (optimize.memory) instead of the kernel's OOM killer ending the whole run
MEMORY_BOUND_SHARE = 0.75
DEFAULT_FALSE_HIT_BUDGET = 0.01  # --cache approximate
# Bundles expire by default (TUF: no metadata lives forever); `--expires-days 0` for none.
DEFAULT_EXPIRES_DAYS = 365
DEFAULT_EXPIRES = timedelta(days=DEFAULT_EXPIRES_DAYS)
# The Python API writes where it is told (``out_dir="."``) at version 1 unless told otherwise;
# the command line fills -o, --name, --version and --signing-key as below.
DEFAULT_API_OUT_DIR = Path(".")
DEFAULT_VERSION = 1

DEFAULT_OUT_DIR = Path("dist")
DEVELOPMENT_KEY_NAME = "development"


def default_name(model: Path) -> str:
    """The model file's stem, as a bundle name (``resnet18.onnx`` -> ``resnet18``)."""
    return model.stem


def next_version(out_dir: Path, name: str) -> tuple[int, Path | None]:
    """One more than the highest ``NAME-TARGET-vN.ekb`` in ``out_dir`` (1 when none), and that bundle."""
    pattern = re.compile(rf"{re.escape(name)}-[a-z0-9]+-v(\d+)\.ekb")
    found = [(int(m.group(1)), p) for p in _listing(out_dir) if (m := pattern.fullmatch(p.name))]
    if not found:
        return 1, None
    highest, path = max(found)
    return highest + 1, path


def _listing(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except OSError:  # not there yet (package makes it) or not a folder (package says so)
        return []


def config_dir() -> Path:
    """``$XDG_CONFIG_HOME/edgekit`` or ``~/.config/edgekit``."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "edgekit"


def development_key() -> tuple[Path, Path, bool]:
    """The development key pair (private, public), made on first use; True when it was made now."""
    from edgekit.bundle import generate_keypair

    folder = config_dir()
    key, pub = folder / f"{DEVELOPMENT_KEY_NAME}.key", folder / f"{DEVELOPMENT_KEY_NAME}.pub"
    if key.is_file() and pub.is_file():
        return key, pub, False
    generate_keypair(folder, DEVELOPMENT_KEY_NAME, None)  # unencrypted: it signs development bundles only
    return key, pub, True


def development_key_warning(key: Path, pub: Path, made: bool) -> str:
    from edgekit.bundle import key_id, load_public_key

    how = "made now" if made else "made on an earlier run"
    return (
        f"no --signing-key: signed with the development key {key} ({how}, key id "
        f"{key_id(load_public_key(pub))}); devices accept these bundles only if their agent.toml lists "
        f'trusted_keys = ["{pub}"]; for bundles you ship, make a key with `edgekit keygen` and pass --signing-key'
    )


def usable_memory_bytes() -> int:
    """The memory this process may use: physical RAM, or the cgroup's limit where that is lower
    (a container, a CI job, a systemd unit with MemoryMax)."""
    import os

    try:
        usable = int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):  # no such sysconf name here (not Linux): 0, "unknown"
        usable = 0
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            usable = min(usable, int(text)) if usable else int(text)
        break
    return usable


def default_max_memory_gb() -> float:
    """``--max-memory-gb`` when none is given: ``MEMORY_BOUND_SHARE`` of ``usable_memory_bytes``
    (no bound, ``inf``, where the memory cannot be read)."""
    usable = usable_memory_bytes()
    return round(MEMORY_BOUND_SHARE * usable / 2**30, 1) if usable else float("inf")
