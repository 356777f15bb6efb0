"""Errors raised by edgekit (host side).

The classes live in ``edgekit.bundle.errors`` so that the device agent, which may import only
the bundle contract, raises the same ones; this module re-exports them for host code.
"""

from edgekit.bundle.errors import *  # noqa: F403  # re-export: one set of error classes for host and device
from edgekit.bundle.errors import __all__  # noqa: F401  # re-exported names
