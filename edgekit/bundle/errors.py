"""Errors both sides raise: the base error, and what a config, a manifest, a bundle or a missing
SDK can be wrong about. Errors only the host raises live in ``edgekit.errors``, those only the
device raises in ``device_agents.errors``.

Every error says what went wrong and what to do about it. The CLI prints ``str(error)`` and
exits with ``error.exit_code``; the agent maps ``http_status`` onto its v2 responses.
"""

from __future__ import annotations

__all__ = [
    "BundleError",
    "ConfigError",
    "EdgekitError",
    "ExpiredError",
    "InferenceInputError",
    "ManifestError",
    "MissingSDKError",
    "RollbackError",
    "SignatureError",
]


class EdgekitError(Exception):
    """Base of every error edgekit raises on purpose."""

    exit_code = 1
    http_status = 500


class ConfigError(EdgekitError):
    """A config file or option is wrong; the message names its path (``updates.broker``)."""

    exit_code = 2


class ManifestError(EdgekitError):
    """A manifest does not match the schema (unknown key, wrong type, missing field)."""


class BundleError(EdgekitError):
    """A bundle archive is unsafe or does not match its manifest (hash, length, extra files)."""


class SignatureError(BundleError):
    """The manifest signature is missing, invalid, or made by an untrusted or revoked key."""


class ExpiredError(BundleError):
    """The manifest's ``expires`` is in the past."""


class RollbackError(BundleError):
    """The bundle's version is lower than the installed one (anti-rollback)."""


class MissingSDKError(EdgekitError):
    """An optional SDK is not installed; the message names the extra to install."""

    exit_code = 4

    def __init__(self, sdk: str, extra: str, what: str = "") -> None:
        purpose = f" for {what}" if what else ""
        super().__init__(f"{sdk} is not installed{purpose}: pip install 'edgekit[{extra}]'")
        self.sdk = sdk
        self.extra = extra


class InferenceInputError(EdgekitError):
    """An inference request does not match the served signature (name, dtype, shape)."""

    http_status = 400
