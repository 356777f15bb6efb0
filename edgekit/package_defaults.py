"""What ``edgekit package`` assumes when a first try leaves a flag out.

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
from pathlib import Path

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
