"""Ed25519 signing of manifests, with key ids for rotation and a revocation list.

The signature covers the exact manifest bytes stored in the bundle. ``manifest.sig`` is JSON:
``{"alg": "ed25519", "key_id": "...", "signature": "<base64>"}``. A key id is the first 16 hex
digits of the SHA-256 of the raw public key. Private keys are PKCS#8 PEM, optionally encrypted
with a passphrase (``EDGEKIT_KEY_PASSPHRASE``); public keys are SubjectPublicKeyInfo PEM.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from edgekit.bundle.errors import ConfigError, SignatureError

MAX_SIGNATURE_BYTES = 4096
PASSPHRASE_ENV = "EDGEKIT_KEY_PASSPHRASE"


def key_id(public_key: Ed25519PublicKey) -> str:
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def generate_keypair(out_dir: Path, name: str = "edgekit", passphrase: bytes | None = None) -> tuple[Path, Path]:
    """Write ``NAME.key`` (mode 0600) and ``NAME.pub``; refuse to overwrite a key."""
    out_dir.mkdir(parents=True, exist_ok=True)
    key_path, pub_path = out_dir / f"{name}.key", out_dir / f"{name}.pub"
    for p in (key_path, pub_path):
        if p.exists():
            raise ConfigError(f"{p} already exists; choose another --name or remove it first")
    private = Ed25519PrivateKey.generate()
    enc = serialization.BestAvailableEncryption(passphrase) if passphrase else serialization.NoEncryption()
    pem = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, enc)
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    pub_path.write_bytes(
        private.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return key_path, pub_path


def load_private_key(path: Path, passphrase: bytes | None = None) -> Ed25519PrivateKey:
    if passphrase is None and os.environ.get(PASSPHRASE_ENV):
        passphrase = os.environ[PASSPHRASE_ENV].encode()
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=passphrase)
    except FileNotFoundError as exc:
        raise ConfigError(f"signing key {path} does not exist; make one with `edgekit keygen`") from exc
    except TypeError as exc:
        raise ConfigError(f"signing key {path} is encrypted: set {PASSPHRASE_ENV}") from exc
    except ValueError as exc:
        raise ConfigError(f"signing key {path} cannot be read ({exc}); wrong passphrase?") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"signing key {path} is not an Ed25519 key; make one with `edgekit keygen`")
    return key


def load_public_key(path: Path) -> Ed25519PublicKey:
    try:
        key = serialization.load_pem_public_key(Path(path).read_bytes())
    except FileNotFoundError as exc:
        raise ConfigError(f"public key {path} does not exist") from exc
    except ValueError as exc:
        raise ConfigError(f"public key {path} is not a PEM public key ({exc})") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise ConfigError(f"public key {path} is not an Ed25519 key")
    return key


def sign(manifest_bytes: bytes, private_key: Ed25519PrivateKey) -> bytes:
    """The ``manifest.sig`` bytes for ``manifest_bytes``."""
    sig = private_key.sign(manifest_bytes)
    doc = {
        "alg": "ed25519",
        "key_id": key_id(private_key.public_key()),
        "signature": base64.b64encode(sig).decode(),
    }
    return json.dumps(doc).encode() + b"\n"


@dataclass(frozen=True)
class TrustStore:
    """Trusted public keys by key id, minus revoked ids."""

    keys: dict[str, Ed25519PublicKey]
    revoked: frozenset[str] = frozenset()

    @classmethod
    def from_files(cls, paths: Iterable[Path], revoked: Iterable[str] = ()) -> TrustStore:
        keys = {}
        for p in paths:
            k = load_public_key(Path(p))
            keys[key_id(k)] = k
        return cls(keys, frozenset(revoked))

    def verify(self, manifest_bytes: bytes, signature_bytes: bytes) -> str:
        """Return the signer's key id, or raise ``SignatureError`` saying why not."""
        if len(signature_bytes) > MAX_SIGNATURE_BYTES:
            raise SignatureError("manifest.sig is larger than any valid signature")
        try:
            doc = json.loads(signature_bytes)
            alg, kid = doc["alg"], doc["key_id"]
            sig = base64.b64decode(doc["signature"], validate=True)
        except (ValueError, KeyError, TypeError) as exc:
            raise SignatureError(f"manifest.sig is malformed ({exc})") from exc
        if alg != "ed25519":
            raise SignatureError(f"manifest.sig uses {alg!r}; only ed25519 is accepted")
        if kid in self.revoked:
            raise SignatureError(f"bundle is signed by revoked key {kid}; re-sign it with a current key")
        key = self.keys.get(kid)
        if key is None:
            known = ", ".join(sorted(self.keys)) or "none"
            raise SignatureError(
                f"bundle is signed by untrusted key {kid} (trusted: {known}); "
                "add its .pub to trusted_keys or re-sign the bundle"
            )
        try:
            key.verify(sig, manifest_bytes)
        except InvalidSignature as exc:
            raise SignatureError(f"signature by key {kid} does not match the manifest: the bundle was altered") from exc
        return str(kid)
