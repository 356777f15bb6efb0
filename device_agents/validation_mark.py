"""The failed-validation mark: a bundle written by ``edgekit package --allow-failed`` carries
``validation.passed = false`` in its signed manifest. The agent refuses such a bundle before
anything of it is extracted, unless its config says ``allow_failed_validation = true``.
"""

from __future__ import annotations

from edgekit.bundle.errors import BundleError
from edgekit.bundle.manifest import Manifest


class FailedValidationError(BundleError):
    """The bundle failed its host validation gate and this agent does not take such bundles."""


def check_validation_mark(manifest: Manifest, allow_failed_validation: bool) -> None:
    """Raise ``FailedValidationError`` for a bundle marked failed, unless allowed."""
    v = manifest.validation
    if v.passed or allow_failed_validation:
        return
    failures = v.failures
    why = f" ({'; '.join(failures)})" if failures else ""
    raise FailedValidationError(
        f"bundle {manifest.name} v{manifest.version} failed validation when it was packaged{why}; package it "
        "again so that it passes, or set allow_failed_validation = true at the top of agent.toml to take it anyway"
    )
