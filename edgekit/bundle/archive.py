"""The ``.ekb`` bundle: a gzip'd tar of ``manifest.json``, ``manifest.sig`` and the listed files.

Reading is two-phase and safe by construction:

1. ``read_verified_manifest`` reads only the first two members (capped), checks the signature
   against the trust store, parses the manifest and checks expiry, version and compatibility.
   No artifact byte is touched before this succeeds.
2. ``extract`` streams the remaining members and accepts only regular files that the manifest
   lists, once each, with the declared length; it reads no more than that length, checks the
   SHA-256, and writes into a fresh directory that is removed again on any failure.

Both phases read through ``tar_limits``: before the signature is checked at most
``HEAD_LIMIT_BYTES`` are decompressed (manifest, signature and their headers); after it, the
signed file sizes plus ``tar_limits``' per-member and end slack. Extended headers are capped
before tarfile reads them. Phase 2 re-reads the head and refuses a manifest that differs from
the verified one (the file changed between the phases).
"""

from __future__ import annotations

import io
import os
import shutil
import tarfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from edgekit.bundle.errors import BundleError, ExpiredError, ManifestError, RollbackError
from edgekit.bundle.manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    SIGNATURE_NAME,
    FileEntry,
    Manifest,
    sha256_file,
)
from edgekit.bundle.signing import MAX_SIGNATURE_BYTES, TrustStore, sign
from edgekit.bundle.tar_limits import END_SLACK_BYTES, MEMBER_HEADER_SLACK_BYTES, BoundedReader, open_bounded

BUNDLE_SUFFIX = ".ekb"
DEFAULT_MAX_BUNDLE_BYTES = 2 * 1024**3
_CHUNK = 1 << 20
MAX_MEMBER_NAME_BYTES = 1024
# Everything decompressed before the signature is checked: the two head members and their headers.
HEAD_LIMIT_BYTES = MAX_MANIFEST_BYTES + MAX_SIGNATURE_BYTES + 2 * MEMBER_HEADER_SLACK_BYTES + END_SLACK_BYTES


def file_entries(root: Path, roles: dict[str, str]) -> tuple[FileEntry, ...]:
    """``FileEntry`` for each relative path in ``roles`` (path -> role), measured on disk."""
    entries = []
    for rel, role in roles.items():
        _check_member_name(rel)
        p = root / rel
        if not p.is_file() or p.is_symlink():
            raise BundleError(f"{rel}: not a regular file under {root}")
        entries.append(FileEntry(path=rel, size_bytes=p.stat().st_size, sha256=sha256_file(p), role=role))  # type: ignore[arg-type]  # role is checked by FileEntry's Literal on read
    return tuple(entries)


def write_bundle(manifest: Manifest, root: Path, private_key: object, out_path: Path) -> Path:
    """Sign ``manifest`` and write the bundle to ``out_path`` (atomically: tmp + rename)."""
    raw = manifest.to_json()
    sig = sign(raw, private_key)  # type: ignore[arg-type]  # Ed25519PrivateKey; kept loose so callers need not import cryptography
    for entry in manifest.files:  # the manifest must describe what we ship, byte for byte
        p = root / entry.path
        if p.stat().st_size != entry.size_bytes or sha256_file(p) != entry.sha256:
            raise BundleError(f"{entry.path} changed after the manifest was made")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    with tarfile.open(tmp, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        for name, data in ((MANIFEST_NAME, raw), (SIGNATURE_NAME, sig)):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
        for entry in manifest.files:
            info = tarfile.TarInfo(entry.path)
            info.size, info.mode, info.mtime = entry.size_bytes, 0o644, 0
            with open(root / entry.path, "rb") as f:
                tar.addfile(info, f)
    os.replace(tmp, out_path)
    return out_path


@dataclass(frozen=True)
class VerifiedManifest:
    manifest: Manifest
    raw: bytes
    key_id: str
    signature: bytes = b""  # the manifest.sig bytes (kept beside extracted files: verify_extracted)


def read_verified_manifest(
    path: Path,
    trust: TrustStore,
    *,
    max_bundle_bytes: int = DEFAULT_MAX_BUNDLE_BYTES,
    installed_version: int | None = None,
    compatible: Callable[[Manifest], None] | None = None,
) -> VerifiedManifest:
    """Phase 1: verify signature, then schema, expiry, anti-rollback and compatibility."""
    raw, sig = _read_head(Path(path), max_bundle_bytes)
    kid = trust.verify(raw, sig)
    manifest = Manifest.from_json(raw)
    trust.check_name(kid, manifest.name)
    if manifest.signer_key_id and manifest.signer_key_id != kid:
        raise ManifestError(f"manifest names signer {manifest.signer_key_id} but was signed by {kid}")
    if manifest.expired():
        raise ExpiredError(
            f"bundle {manifest.name} v{manifest.version} expired at {manifest.expires}; ask for a fresh one"
        )
    if installed_version is not None and manifest.version < installed_version:
        raise RollbackError(
            f"bundle {manifest.name} v{manifest.version} is older than installed v{installed_version}; "
            "publish a higher --version"
        )
    if compatible is not None:
        compatible(manifest)
    return VerifiedManifest(manifest, raw, kid, sig)


def read_unverified_manifest(path: Path, *, max_bundle_bytes: int = DEFAULT_MAX_BUNDLE_BYTES) -> tuple[Manifest, str]:
    """For display only (``edgekit inspect``): the manifest and the key id ``manifest.sig`` names,
    with the signature NOT checked. Never use this to decide what to install or run."""
    import json

    raw, sig = _read_head(Path(path), max_bundle_bytes)
    try:
        kid = str(json.loads(sig)["key_id"])
    except (ValueError, KeyError, TypeError) as exc:
        raise BundleError(f"{SIGNATURE_NAME} is malformed ({exc})") from exc
    return Manifest.from_json(raw), kid


def _read_head(path: Path, max_bundle_bytes: int) -> tuple[bytes, bytes]:
    """The manifest and signature bytes (the first two members), after the size cap."""
    try:
        size = path.stat().st_size
    except FileNotFoundError as exc:
        raise BundleError(f"{path} does not exist") from exc
    if size > max_bundle_bytes:
        raise BundleError(f"{path} is {size} bytes, over the {max_bundle_bytes}-byte cap")
    with _open_stream(path, "before its signature is checked") as (tar, _):
        raw = _read_member(tar, MANIFEST_NAME, MAX_MANIFEST_BYTES)
        sig = _read_member(tar, SIGNATURE_NAME, MAX_SIGNATURE_BYTES)
    return raw, sig


def _body_limit_bytes(manifest: Manifest) -> int:
    """Bytes the signed manifest lets the archive hold after its head."""
    blocks = sum(-(-e.size_bytes // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE for e in manifest.files)
    return blocks + len(manifest.files) * MEMBER_HEADER_SLACK_BYTES + END_SLACK_BYTES


def extract(path: Path, verified: VerifiedManifest, dest: Path) -> Path:
    """Phase 2: extract the listed files into ``dest`` (must not exist); remove it on failure."""
    dest = Path(dest)
    if dest.exists():
        raise BundleError(f"{dest} already exists")
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _extract_into(Path(path), verified, tmp)
        (tmp / MANIFEST_NAME).write_bytes(verified.raw)
        if verified.signature:
            (tmp / SIGNATURE_NAME).write_bytes(verified.signature)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def verify_extracted(model_dir: Path, trust: TrustStore, *, signature: bytes | None = None) -> VerifiedManifest:
    """Check an extracted bundle at rest: ``manifest.sig`` (or ``signature``) over its
    ``manifest.json`` by a key ``trust`` still accepts (not revoked, still allowed the model's
    name), and every listed file's length and SHA-256. Expiry is not checked: it bounds how
    long a bundle may be *installed*.

    Raises ``SignatureError`` (bad or revoked signature), ``BundleError`` (a file changed,
    or went missing: the ``__cause__`` is then the ``OSError``)."""
    model_dir = Path(model_dir)
    raw = _read_capped(model_dir / MANIFEST_NAME, MAX_MANIFEST_BYTES)
    sig = signature if signature is not None else _read_capped(model_dir / SIGNATURE_NAME, MAX_SIGNATURE_BYTES)
    kid = trust.verify(raw, sig)
    manifest = Manifest.from_json(raw)
    trust.check_name(kid, manifest.name)  # a key's names may have narrowed since the install
    for entry in manifest.files:
        _check_member_name(entry.path)
        p = model_dir / entry.path
        try:
            if p.is_symlink():
                raise BundleError(f"{p} is a symlink now; the files of an installed bundle are regular files")
            size = p.stat().st_size
            digest = sha256_file(p) if size == entry.size_bytes else ""
        except OSError as exc:
            raise BundleError(f"{p} cannot be read ({exc})") from exc
        if size != entry.size_bytes:
            raise BundleError(f"{p} is {size} bytes, its signed manifest says {entry.size_bytes}: changed at rest")
        if digest != entry.sha256:
            raise BundleError(f"{p}: sha256 does not match its signed manifest: changed at rest")
    return VerifiedManifest(manifest, raw, kid, sig)


def read_head(path: Path, *, max_bundle_bytes: int = DEFAULT_MAX_BUNDLE_BYTES) -> tuple[bytes, bytes]:
    """The raw ``manifest.json`` and ``manifest.sig`` of a bundle, unverified (bounded reads)."""
    return _read_head(Path(path), max_bundle_bytes)


def _read_capped(path: Path, cap: int) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(cap + 1)
    except OSError as exc:
        raise BundleError(f"{path} cannot be read ({exc})") from exc
    if len(data) > cap:
        raise BundleError(f"{path} is over the {cap}-byte cap")
    return data


def _extract_into(path: Path, verified: VerifiedManifest, out: Path) -> None:
    expected = {e.path: e for e in verified.manifest.files}
    seen: set[str] = set()
    with _open_stream(path, "before its signature is checked") as (tar, reader):
        if _read_member(tar, MANIFEST_NAME, MAX_MANIFEST_BYTES) != verified.raw:
            raise BundleError(f"{path} changed after its manifest was verified; download it again")
        _read_member(tar, SIGNATURE_NAME, MAX_SIGNATURE_BYTES)
        reader.limit = reader.consumed + _body_limit_bytes(verified.manifest)
        reader.phase = "beyond the file sizes its signed manifest lists"
        while True:
            try:
                info = tar.next()
            except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
                raise BundleError(f"bundle is truncated or corrupt ({exc}); download it again") from exc
            if info is None:
                break
            name = info.name
            _check_member_name(name)
            if not _is_plain_file(info):
                raise BundleError(f"bundle member {name!r} is not a regular file (link or device); refused")
            if name in seen:
                raise BundleError(f"bundle lists {name!r} twice; refused")
            entry = expected.get(name)
            if entry is None:
                raise BundleError(f"bundle member {name!r} is not listed in the manifest; refused")
            if info.size != entry.size_bytes:
                raise BundleError(f"{name}: {info.size} bytes in the archive, manifest says {entry.size_bytes}")
            seen.add(name)
            target = out / name
            target.parent.mkdir(parents=True, exist_ok=True)
            src = tar.extractfile(info)
            if src is None:
                raise BundleError(f"{name}: cannot be read")
            _copy_exact(src, target, entry)
    missing = sorted(set(expected) - seen)
    if missing:
        raise BundleError(f"bundle is missing {missing[0]} (listed in the manifest); download it again")


def _copy_exact(src: io.BufferedIOBase | object, target: Path, entry: FileEntry) -> None:
    import hashlib

    h = hashlib.sha256()
    left = entry.size_bytes
    try:
        with open(target, "xb") as f:
            while left > 0:
                block = src.read(min(_CHUNK, left))  # type: ignore[union-attr]  # tarfile's ExFileObject
                if not block:
                    raise BundleError(f"{entry.path}: archive ends early; download it again")
                h.update(block)
                f.write(block)
                left -= len(block)
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        if isinstance(exc, OSError) and exc.errno == 28:
            raise BundleError(f"no space left while extracting {entry.path}; free disk space") from exc
        raise BundleError(f"{entry.path}: archive is truncated or corrupt ({exc}); download it again") from exc
    if h.hexdigest() != entry.sha256:
        raise BundleError(f"{entry.path}: sha256 does not match the manifest; the bundle was altered")


def _is_plain_file(info: tarfile.TarInfo) -> bool:
    """A regular file, not sparse (``isreg`` also admits GNU sparse and contiguous files)."""
    return info.type in (tarfile.REGTYPE, tarfile.AREGTYPE) and getattr(info, "sparse", None) is None


def _check_member_name(name: str) -> None:
    if len(name.encode("utf-8", "surrogateescape")) > MAX_MEMBER_NAME_BYTES:
        raise BundleError(f"bundle member name {name[:64]!r}... is over {MAX_MEMBER_NAME_BYTES} bytes; refused")
    p = PurePosixPath(name)
    if not name or name.startswith("/") or "\\" in name or p.is_absolute() or ".." in p.parts or name != p.as_posix():
        raise BundleError(f"bundle member name {name!r} is unsafe (absolute, '..' or odd); refused")
    if name in (MANIFEST_NAME, SIGNATURE_NAME):
        raise BundleError(f"bundle member {name!r} appears again; refused")


class _open_stream:
    """Bounded streaming tar reader (``tar_limits``) that turns archive errors into ``BundleError``."""

    def __init__(self, path: Path, phase: str) -> None:
        self.path = path
        self.phase = phase

    def __enter__(self) -> tuple[tarfile.TarFile, BoundedReader]:
        self._raw = open(self.path, "rb")
        try:
            self._tar, reader = open_bounded(self._raw, HEAD_LIMIT_BYTES, self.phase)
        except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
            self._raw.close()
            raise BundleError(f"{self.path} is not an edgekit bundle ({exc})") from exc
        except BaseException:
            self._raw.close()
            raise
        return self._tar, reader

    def __exit__(self, *exc: object) -> None:
        try:
            self._tar.close()
        except (tarfile.TarError, OSError, EOFError, zlib.error):
            pass
        finally:
            self._raw.close()


def _read_member(tar: tarfile.TarFile, name: str, cap: int) -> bytes:
    try:
        info = tar.next()
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        raise BundleError(f"bundle is truncated or corrupt ({exc})") from exc
    if info is None or info.name != name or not _is_plain_file(info):
        got = None if info is None else info.name
        raise BundleError(
            f"bundle must start with {MANIFEST_NAME} and {SIGNATURE_NAME}; found {got!r} where {name} belongs"
        )
    if info.size > cap:
        raise BundleError(f"{name} is {info.size} bytes, over the {cap}-byte cap")
    f = tar.extractfile(info)
    try:
        data = f.read(cap) if f else b""
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        raise BundleError(f"bundle is truncated or corrupt ({exc})") from exc
    if len(data) != info.size:
        raise BundleError(f"{name} is truncated")
    return data
