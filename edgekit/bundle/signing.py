"""Ed25519 signing of manifests and fleet documents, with key ids, roles and revocation.

The signature covers the exact manifest bytes stored in the bundle. ``manifest.sig`` is JSON:
``{"alg": "ed25519", "key_id": "...", "signature": "<base64>"}``. A key id is the first 16 hex
digits of the SHA-256 of the raw public key. Private keys are PKCS#8 PEM, optionally encrypted
with a passphrase (``EDGEKIT_KEY_PASSPHRASE``); public keys are SubjectPublicKeyInfo PEM.

Key roles (TUF-style): a *bundle* key signs manifests (``TrustStore``; optionally limited to model
name patterns), a *notice* key signs a fleet's desired state, a *root* key signs the keys document
that adds and revokes bundle and notice keys (``RoleKeys``, with a threshold). A key is trusted
only for the role it is listed under: a bundle key cannot sign a desired state and vice versa.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
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
        data = Path(path).read_bytes()
    except FileNotFoundError as exc:
        raise ConfigError(f"signing key {path} does not exist; make one with `edgekit keygen`") from exc
    if b"-----BEGIN PUBLIC KEY-----" in data:  # the .pub of a pair: no passphrase makes it a private key
        private = Path(path).with_suffix(".key")
        which = f"its private key {private}" if private.is_file() else "the NAME.key that `edgekit keygen` wrote"
        raise ConfigError(f"signing key {path} is a public key; sign with {which}")
    try:
        key = serialization.load_pem_private_key(data, password=passphrase)
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


def public_key_text(public_key: Ed25519PublicKey) -> str:
    """The raw public key in base64: how fleet documents carry keys."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def public_key_from_text(text: str) -> Ed25519PublicKey:
    try:
        raw = base64.b64decode(text, validate=True)
        return Ed25519PublicKey.from_public_bytes(raw)
    except ValueError as exc:
        raise SignatureError(f"{text[:20]!r}... is not a base64 Ed25519 public key ({exc})") from exc


def sign_detached(payload: bytes, private_key: Ed25519PrivateKey) -> dict[str, str]:
    """``{"key_id": ..., "signature": <base64>}`` over ``payload`` (one entry of a signed document)."""
    return {
        "key_id": key_id(private_key.public_key()),
        "signature": base64.b64encode(private_key.sign(payload)).decode(),
    }


@dataclass(frozen=True)
class RoleKeys:
    """The public keys of one role (``notice``, ``root``) and how many of them must sign.

    ``other_roles`` maps key ids trusted for *other* roles to that role's name, only to say so
    when such a key signs here (``key 1a2b... is a bundle key, not a notice key``).
    """

    role: str
    keys: Mapping[str, Ed25519PublicKey]
    threshold: int = 1
    revoked: frozenset[str] = frozenset()
    other_roles: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.threshold < 1:
            raise ConfigError(f"{self.role} threshold must be >= 1, got {self.threshold}")

    @classmethod
    def from_files(cls, role: str, paths: Iterable[Path], **kwargs: object) -> RoleKeys:
        keys = {}
        for p in paths:
            k = load_public_key(Path(p))
            keys[key_id(k)] = k
        return cls(role, keys, **kwargs)  # type: ignore[arg-type]  # the remaining fields, by name

    def verify(self, payload: bytes, signatures: Sequence[Mapping[str, str]], what: str) -> tuple[str, ...]:
        """The key ids of this role that signed ``payload`` validly; ``SignatureError`` below the threshold."""
        good: list[str] = []
        problems: list[str] = []
        for entry in signatures:
            kid, text = str(entry.get("key_id", "")), str(entry.get("signature", ""))
            if kid in self.revoked:
                problems.append(f"key {kid} is revoked")
            elif kid not in self.keys:
                other = self.other_roles.get(kid)
                problems.append(
                    f"key {kid} is a {other} key, not a {self.role} key"
                    if other
                    else f"key {kid} is not a {self.role} key"
                )
            else:
                try:
                    self.keys[kid].verify(base64.b64decode(text, validate=True), payload)
                except (InvalidSignature, ValueError):
                    problems.append(f"the signature by key {kid} does not match: the document was altered")
                    continue
                if kid not in good:
                    good.append(kid)
        if len(good) >= self.threshold:
            return tuple(good)
        known = ", ".join(sorted(k for k in self.keys if k not in self.revoked)) or "none"
        why = "; ".join(problems) or "it carries no signature"
        raise SignatureError(
            f"{what} needs {self.threshold} valid {self.role} signature(s), has {len(good)} ({why}); "
            f"{self.role} keys trusted here: {known}"
        )


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
    """Trusted bundle-signing public keys by key id, minus revoked ids.

    ``names`` limits a key to model name patterns (``fnmatch``: ``det-*``); a key without an
    entry may sign any model name.
    """

    keys: dict[str, Ed25519PublicKey]
    revoked: frozenset[str] = frozenset()
    names: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @classmethod
    def from_files(
        cls,
        paths: Iterable[Path],
        revoked: Iterable[str] = (),
        limited: Iterable[tuple[Path, Sequence[str]]] = (),
    ) -> TrustStore:
        """``paths`` may sign any name; each ``(path, patterns)`` of ``limited`` only matching names."""
        keys, names = {}, {}
        for p in paths:
            k = load_public_key(Path(p))
            keys[key_id(k)] = k
        for p, patterns in limited:
            k = load_public_key(Path(p))
            kid = key_id(k)
            if kid not in keys:  # listed without limits as well: the wider grant stands
                keys[kid] = k
                names[kid] = tuple(patterns)
        return cls(keys, frozenset(revoked), names)

    def check_name(self, kid: str, name: str) -> None:
        """``SignatureError`` when key ``kid`` may not sign a bundle named ``name``."""
        patterns = self.names.get(kid)
        if patterns is not None and not any(fnmatch.fnmatchcase(name, p) for p in patterns):
            raise SignatureError(
                f"bundle {name!r} is signed by key {kid}, which may sign only {', '.join(patterns)}; "
                "sign it with a key trusted for that name or widen the key's names in [[trusted]]"
            )

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
