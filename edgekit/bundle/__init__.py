"""The bundle contract shared by host and device: manifest, signing, archive.

``device_agents`` may import this package and nothing else of ``edgekit``.
"""

from edgekit.bundle.archive import (
    BUNDLE_SUFFIX,
    VerifiedManifest,
    extract,
    file_entries,
    read_verified_manifest,
    verify_extracted,
    write_bundle,
)
from edgekit.bundle.manifest import SCHEMA_VERSION, Manifest
from edgekit.bundle.signing import TrustStore, generate_keypair, key_id, load_private_key, load_public_key

__all__ = [
    "BUNDLE_SUFFIX",
    "SCHEMA_VERSION",
    "Manifest",
    "TrustStore",
    "VerifiedManifest",
    "extract",
    "file_entries",
    "generate_keypair",
    "key_id",
    "load_private_key",
    "load_public_key",
    "read_verified_manifest",
    "verify_extracted",
    "write_bundle",
]
