"""edgekit: package models for edge targets and sign them into bundles.

``import edgekit`` loads no ML SDK; ``edgekit.package`` imports what a target needs when called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from edgekit.errors import EdgekitError

__version__ = "0.1.0"

if TYPE_CHECKING:
    from edgekit.packager import PackageResult


def package(*args: Any, **kwargs: Any) -> PackageResult:
    """Package a model; see ``edgekit.packager.package`` for the arguments."""
    from edgekit.packager import package as _package

    return _package(*args, **kwargs)


__all__ = ["EdgekitError", "__version__", "package"]
