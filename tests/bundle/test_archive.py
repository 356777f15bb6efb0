"""The .ekb archive and signing contract: a valid bundle verifies and extracts; every way of
breaking it (tampering, keys, expiry, rollback, unsafe or unexpected members, truncation,
oversize) is refused with a ``BundleError`` subclass saying why, and leaves nothing behind."""

from __future__ import annotations

import io
import json
import tarfile
from dataclasses import replace
from pathlib import Path

import pytest

from device_agents.errors import IncompatibleError
from edgekit.bundle import TrustStore, extract, load_private_key, read_verified_manifest, verify_extracted
from edgekit.bundle.archive import read_unverified_manifest
from edgekit.bundle.manifest import FileEntry, Manifest
from edgekit.bundle.signing import sign
from edgekit.errors import BundleError, ExpiredError, ManifestError, RollbackError, SignatureError
from tests.factories import make_cpu_bundle


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, keypair: tuple[Path, Path]) -> Path:
    return make_cpu_bundle(tmp_path_factory.mktemp("bundle") / "tiny.ekb", tiny_model, keypair[0], version=3)


@pytest.fixture(scope="module")
def trust(keypair: tuple[Path, Path]) -> TrustStore:
    return TrustStore.from_files([keypair[1]])


def _members(path: Path) -> list[tuple[tarfile.TarInfo, bytes]]:
    with tarfile.open(path, "r:gz") as tar:
        return [(m, tar.extractfile(m).read() if m.isreg() else b"") for m in tar.getmembers()]  # type: ignore[union-attr]  # regular members have a file


def _write(path: Path, members: list[tuple[tarfile.TarInfo, bytes]]) -> Path:
    with tarfile.open(path, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            info = copy_info(info)
            if info.isreg():
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    return path


def copy_info(info: tarfile.TarInfo) -> tarfile.TarInfo:
    new = tarfile.TarInfo(info.name)
    new.type, new.linkname, new.mode, new.size = info.type, info.linkname, info.mode, info.size
    return new


def _member(
    name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, link: str = ""
) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size = kind, link, len(data)
    return info, data


def _resigned(bundle: Path, key_path: Path, change, extra: list[tuple[tarfile.TarInfo, bytes]]) -> list:
    """Members of ``bundle`` with the manifest changed by ``change`` and signed again by a trusted key."""
    members = _members(bundle)
    manifest = change(Manifest.from_json(members[0][1]))
    raw = manifest.to_json()
    key = load_private_key(key_path)
    return [_member("manifest.json", raw), _member("manifest.sig", sign(raw, key)), *members[2:], *extra]


def _refused(path: Path, trust: TrustStore, dest: Path, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        extract(path, read_verified_manifest(path, trust), dest)
    assert not dest.exists()
    assert not dest.with_name(dest.name + ".partial").exists()


def test_bundle_valid_verifies_and_extracts_every_listed_file(bundle: Path, trust: TrustStore, tmp_path: Path) -> None:
    verified = read_verified_manifest(bundle, trust)
    out = extract(bundle, verified, tmp_path / "x")
    assert sorted(p.name for p in out.iterdir()) == ["golden.npz", "manifest.json", "manifest.sig", "model.onnx"]
    assert (out / "manifest.json").read_bytes() == verified.raw
    assert (out / "manifest.sig").read_bytes() == verified.signature


def test_bundle_tampered_file_rejected(bundle: Path, trust: TrustStore, tmp_path: Path) -> None:
    members = _members(bundle)
    name = "model.onnx"
    members = [(i, (bytes([d[0] ^ 1]) + d[1:]) if i.name == name else d) for i, d in members]
    _refused(
        _write(tmp_path / "t.ekb", members), trust, tmp_path / "x", BundleError, "model.onnx: sha256 does not match"
    )


def test_bundle_tampered_manifest_rejected_by_signature(bundle: Path, trust: TrustStore, tmp_path: Path) -> None:
    members = _members(bundle)
    doc = json.loads(members[0][1])
    doc["version"] = 99
    members[0] = (members[0][0], json.dumps(doc, indent=1).encode() + b"\n")
    with pytest.raises(SignatureError, match="does not match the manifest: the bundle was altered"):
        read_verified_manifest(_write(tmp_path / "t.ekb", members), trust)


def test_bundle_untrusted_key_rejected(bundle: Path, other_keypair: tuple[Path, Path]) -> None:
    with pytest.raises(SignatureError, match="signed by untrusted key"):
        read_verified_manifest(bundle, TrustStore.from_files([other_keypair[1]]))


def test_bundle_revoked_key_rejected(bundle: Path, keypair: tuple[Path, Path]) -> None:
    trust = TrustStore.from_files([keypair[1]])
    revoked = TrustStore(trust.keys, frozenset(trust.keys))
    with pytest.raises(SignatureError, match="revoked key"):
        read_verified_manifest(bundle, revoked)


def test_bundle_malformed_signature_rejected(bundle: Path, trust: TrustStore, tmp_path: Path) -> None:
    members = _members(bundle)
    members[1] = (members[1][0], b'{"alg": "ed25519"}')
    with pytest.raises(SignatureError, match="malformed"):
        read_verified_manifest(_write(tmp_path / "t.ekb", members), trust)


def test_bundle_expired_rejected(
    tiny_model: Path, keypair: tuple[Path, Path], trust: TrustStore, tmp_path: Path
) -> None:
    path = make_cpu_bundle(tmp_path / "e.ekb", tiny_model, keypair[0], expires="2020-01-01T00:00:00Z")
    with pytest.raises(ExpiredError, match="expired at 2020-01-01T00:00:00Z"):
        read_verified_manifest(path, trust)


def test_bundle_older_version_rejected(bundle: Path, trust: TrustStore) -> None:
    with pytest.raises(RollbackError, match="v3 is older than installed v4"):
        read_verified_manifest(bundle, trust, installed_version=4)
    assert read_verified_manifest(bundle, trust, installed_version=3).manifest.version == 3


def test_bundle_incompatible_rejected_by_check(bundle: Path, trust: TrustStore) -> None:
    def only_tensorrt(m: Manifest) -> None:
        if m.compatibility.runtime != "tensorrt":
            raise IncompatibleError(f"needs {m.compatibility.runtime}")

    with pytest.raises(IncompatibleError, match="needs onnxruntime"):
        read_verified_manifest(bundle, trust, compatible=only_tensorrt)


def test_bundle_signer_mismatch_rejected(
    bundle: Path, keypair: tuple[Path, Path], trust: TrustStore, tmp_path: Path
) -> None:
    members = _resigned(bundle, keypair[0], lambda m: replace(m, signer_key_id="ffffffffffffffff"), [])
    with pytest.raises(ManifestError, match="names signer ffffffffffffffff"):
        read_verified_manifest(_write(tmp_path / "t.ekb", members), trust)


@pytest.mark.parametrize("name", ["../evil.onnx", "/etc/evil", "a/../../evil", "a\\evil", "./model.onnx"])
def test_bundle_path_traversal_member_rejected(
    bundle: Path, keypair: tuple[Path, Path], trust: TrustStore, tmp_path: Path, name: str
) -> None:
    # Even a manifest signed by a trusted key may not place files outside the bundle dir.
    entry = FileEntry(name, 4, "0" * 64, "report")
    members = _resigned(bundle, keypair[0], lambda m: replace(m, files=(*m.files, entry)), [_member(name, b"evil")])
    _refused(_write(tmp_path / "t.ekb", members), trust, tmp_path / "x", BundleError, "is unsafe")
    assert not (tmp_path / "evil.onnx").exists()


@pytest.mark.parametrize(
    ("kind", "link"),
    [(tarfile.SYMTYPE, "/etc/passwd"), (tarfile.LNKTYPE, "model.onnx"), (tarfile.CHRTYPE, ""), (tarfile.FIFOTYPE, "")],
)
def test_bundle_link_or_device_member_rejected(
    bundle: Path, keypair: tuple[Path, Path], trust: TrustStore, tmp_path: Path, kind: bytes, link: str
) -> None:
    entry = FileEntry("extra.bin", 0, "0" * 64, "report")
    members = _resigned(
        bundle, keypair[0], lambda m: replace(m, files=(*m.files, entry)), [_member("extra.bin", kind=kind, link=link)]
    )
    _refused(_write(tmp_path / "t.ekb", members), trust, tmp_path / "x", BundleError, "not a regular file")


def test_bundle_duplicate_member_rejected(bundle: Path, trust: TrustStore, tmp_path: Path) -> None:
    members = _members(bundle)
    _refused(_write(tmp_path / "t.ekb", [*members, members[2]]), trust, tmp_path / "x", BundleError, "twice")


def test_bundle_second_manifest_member_rejected(bundle: Path, trust: TrustStore, tmp_path: Path) -> None:
    members = _members(bundle)
    _refused(_write(tmp_path / "t.ekb", [*members, members[0]]), trust, tmp_path / "x", BundleError, "appears again")


def test_bundle_unlisted_member_rejected(bundle: Path, trust: TrustStore, tmp_path: Path) -> None:
    members = [*_members(bundle), _member("payload.sh", b"#!/bin/sh\n")]
    _refused(_write(tmp_path / "t.ekb", members), trust, tmp_path / "x", BundleError, "'payload.sh' is not listed")


def test_bundle_missing_listed_file_rejected(bundle: Path, trust: TrustStore, tmp_path: Path) -> None:
    members = [m for m in _members(bundle) if m[0].name != "golden.npz"]
    _refused(_write(tmp_path / "t.ekb", members), trust, tmp_path / "x", BundleError, "missing golden.npz")


def test_bundle_length_mismatch_rejected(bundle: Path, trust: TrustStore, tmp_path: Path) -> None:
    members = [(i, d + b"\0" if i.name == "model.onnx" else d) for i, d in _members(bundle)]
    _refused(_write(tmp_path / "t.ekb", members), trust, tmp_path / "x", BundleError, "manifest says")


def test_bundle_members_out_of_order_rejected(bundle: Path, trust: TrustStore, tmp_path: Path) -> None:
    members = _members(bundle)
    with pytest.raises(BundleError, match=r"must start with manifest.json"):
        read_verified_manifest(_write(tmp_path / "t.ekb", [members[2], *members]), trust)


@pytest.mark.parametrize("keep", [0.3, 0.9])
def test_bundle_truncated_rejected(bundle: Path, trust: TrustStore, tmp_path: Path, keep: float) -> None:
    data = bundle.read_bytes()
    cut = tmp_path / "cut.ekb"
    cut.write_bytes(data[: int(len(data) * keep)])
    dest = tmp_path / "x"
    with pytest.raises(BundleError, match=r"truncated|corrupt|ends early|not an edgekit bundle"):
        extract(cut, read_verified_manifest(cut, trust), dest)
    assert not dest.exists()


def test_bundle_not_an_archive_rejected(trust: TrustStore, tmp_path: Path) -> None:
    junk = tmp_path / "junk.ekb"
    junk.write_bytes(b"this is not a gzip'd tar" * 10)
    with pytest.raises(BundleError, match="not an edgekit bundle"):
        read_verified_manifest(junk, trust)


def test_bundle_oversize_rejected_before_reading(bundle: Path, trust: TrustStore) -> None:
    with pytest.raises(BundleError, match="over the 100-byte cap"):
        read_verified_manifest(bundle, trust, max_bundle_bytes=100)


def test_bundle_oversize_manifest_member_rejected(bundle: Path, trust: TrustStore, tmp_path: Path) -> None:
    members = _members(bundle)
    members[0] = (members[0][0], b" " * (4 * 1024 * 1024 + 1))
    with pytest.raises(BundleError, match=r"manifest.json is .* over the"):
        read_verified_manifest(_write(tmp_path / "t.ekb", members), trust)


def test_bundle_unverified_read_names_the_signer_without_trusting_it(bundle: Path, trust: TrustStore) -> None:
    manifest, kid = read_unverified_manifest(bundle)
    assert kid == next(iter(trust.keys))
    assert manifest == read_verified_manifest(bundle, trust).manifest


def test_bundle_extracted_verifies_at_rest_until_a_bit_flips(bundle: Path, trust: TrustStore, tmp_path: Path) -> None:
    out = extract(bundle, read_verified_manifest(bundle, trust), tmp_path / "x")
    assert verify_extracted(out, trust).manifest.version == 3
    data = bytearray((out / "model.onnx").read_bytes())
    data[len(data) // 2] ^= 0x01
    (out / "model.onnx").write_bytes(bytes(data))
    with pytest.raises(BundleError, match=r"model\.onnx: sha256 does not match its signed manifest: changed at rest"):
        verify_extracted(out, trust)


def test_bundle_extracted_refused_at_rest_once_its_key_is_revoked(
    bundle: Path, trust: TrustStore, tmp_path: Path
) -> None:
    out = extract(bundle, read_verified_manifest(bundle, trust), tmp_path / "x")
    with pytest.raises(SignatureError, match="revoked key"):
        verify_extracted(out, TrustStore(trust.keys, frozenset(trust.keys)))


def test_bundle_extracted_missing_file_or_edited_manifest_refused_at_rest(
    bundle: Path, trust: TrustStore, tmp_path: Path
) -> None:
    out = extract(bundle, read_verified_manifest(bundle, trust), tmp_path / "x")
    (out / "golden.npz").unlink()
    with pytest.raises(BundleError, match=r"golden\.npz cannot be read") as missing:
        verify_extracted(out, trust)
    assert isinstance(missing.value.__cause__, OSError)  # the caller may treat it as transient
    (out / "manifest.json").write_bytes((out / "manifest.json").read_bytes().replace(b'"version": 3', b'"version": 9'))
    with pytest.raises(SignatureError, match="does not match the manifest"):
        verify_extracted(out, trust)
