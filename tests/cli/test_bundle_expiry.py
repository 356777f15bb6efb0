"""``edgekit package --expires-days``: bundles expire by default; 0 says never, explicitly."""

from __future__ import annotations

import inspect
from datetime import timedelta

import pytest

from edgekit import package
from edgekit.cli import bundle_expiry
from edgekit.errors import ConfigError
from edgekit.package_defaults import DEFAULT_EXPIRES


def test_bundle_expiry_defaults_to_a_year_and_zero_means_never() -> None:
    assert bundle_expiry(None) == timedelta(days=365) == DEFAULT_EXPIRES
    assert bundle_expiry(30) == timedelta(days=30)
    assert bundle_expiry(0) is None
    with pytest.raises(ConfigError, match="must be >= 0"):
        bundle_expiry(-1)
    assert inspect.signature(package).parameters["expires"].default == DEFAULT_EXPIRES  # the API too
