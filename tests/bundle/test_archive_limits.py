"""Bounded reads of untrusted bundles: tar header bombs (a PAX or GNU long-name header declaring
512 MiB) are refused from their 512-byte block, with peak RSS well under 64 MiB above the
process's baseline (measured in a fresh subprocess); many small headers run into the byte
budget before the signature check, and after it into the signed sizes plus slack; a bundle that
changes between the two phases is refused."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
import zlib
from pathlib import Path
from typing import BinaryIO

import pytest

from edgekit.bundle import TrustStore, extract, read_verified_manifest
from edgekit.bundle.tar_limits import (
    END_SLACK_BYTES,
    MAX_EXTENDED_HEADERS_PER_MEMBER,
    MEMBER_HEADER_SLACK_BYTES,
    BoundedReader,
    open_bounded,
)
from edgekit.errors import BundleError
from tests.factories import make_cpu_bundle

BOMB_BYTES = 512 * 1024 * 1024
RSS_LIMIT_KIB = 64 * 1024


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, keypair: tuple[Path, Path]) -> Path:
    return make_cpu_bundle(tmp_path_factory.mktemp("bundle") / "tiny.ekb", tiny_model, keypair[0], version=3)


@pytest.fixture(scope="module")
def trust(keypair: tuple[Path, Path]) -> TrustStore:
    return TrustStore.from_files([keypair[1]])


def _header_bomb(path: Path, kind: bytes) -> Path:
    """A gzip'd tar whose first header declares a BOMB_BYTES extended header (body: zeros),
    streamed so that building it costs no memory. About 0.5 MiB on disk."""
    info = tarfile.TarInfo("././@PaxHeader" if kind == tarfile.XHDTYPE else "././@LongLink")
    info.type, info.size = kind, BOMB_BYTES
    block = info.tobuf(format=tarfile.USTAR_FORMAT if kind == tarfile.XHDTYPE else tarfile.GNU_FORMAT)
    comp = zlib.compressobj(9, zlib.DEFLATED, 31)  # wbits 31: a gzip container
    zeros = bytes(1 << 20)
    with open(path, "wb") as f:
        f.write(comp.compress(block))
        for _ in range(BOMB_BYTES // len(zeros)):
            f.write(comp.compress(zeros))
        f.write(comp.compress(bytes(2 * tarfile.BLOCKSIZE)))
        f.write(comp.flush())
    return path


_MEASURE = """
import json, resource, sys
from pathlib import Path
from edgekit.bundle import TrustStore, read_verified_manifest
from edgekit.errors import BundleError
import time
trust = TrustStore.from_files([Path(sys.argv[2])])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
try:
    read_verified_manifest(Path(sys.argv[1]), trust)
    error = None
except BundleError as exc:
    error = str(exc)
elapsed = time.perf_counter() - t0
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"error": error, "rss_delta_kib": after - before, "elapsed_s": elapsed}))
"""


@pytest.mark.parametrize(("kind", "what"), [(tarfile.XHDTYPE, "pax"), (tarfile.GNUTYPE_LONGNAME, "gnu-longname")])
def test_bundle_header_bomb_refused_under_the_memory_limit(
    tmp_path: Path, keypair: tuple[Path, Path], kind: bytes, what: str
) -> None:
    bomb = _header_bomb(tmp_path / f"{what}.ekb", kind)
    assert bomb.stat().st_size < 4 * 1024 * 1024
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(bomb), str(keypair[1])],
        capture_output=True,
        text=True,
        timeout=120,  # a generous guard only; the refusal takes milliseconds
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["error"] is not None and f"{BOMB_BYTES}-byte extended tar header" in result["error"], result
    assert result["rss_delta_kib"] < RSS_LIMIT_KIB, result


def _pax_header(comment_bytes: int) -> bytes:
    """One PAX extended header (block + body) holding a ``comment`` record, padded to blocks."""
    body = b" comment=" + b"x" * comment_bytes + b"\n"
    n = len(body) + 4  # a 4-digit length field counts itself
    record = str(n).encode() + body
    head = tarfile.TarInfo("././@PaxHeader")
    head.type, head.size = tarfile.XHDTYPE, len(record)
    return head.tobuf(format=tarfile.USTAR_FORMAT) + record + bytes(-len(record) % tarfile.BLOCKSIZE)


def _with_pax_headers(members: list[tuple[tarfile.TarInfo, bytes]], before: str, count: int) -> bytes:
    """The tar bytes of ``members`` with ``count`` chained PAX headers (each under the
    per-header cap) placed before the member named ``before``."""
    buf = io.BytesIO()
    for info, data in members:
        if info.name == before:
            buf.write(_pax_header(3000) * count)
        new = tarfile.TarInfo(info.name)
        new.size, new.mode = len(data), 0o644
        buf.write(new.tobuf(format=tarfile.USTAR_FORMAT))
        buf.write(data + bytes(-len(data) % tarfile.BLOCKSIZE))
    buf.write(bytes(2 * tarfile.BLOCKSIZE))
    return buf.getvalue()


def _members(path: Path) -> list[tuple[tarfile.TarInfo, bytes]]:
    with tarfile.open(path, "r:gz") as tar:
        return [(m, tar.extractfile(m).read()) for m in tar.getmembers()]  # type: ignore[union-attr]  # all members are regular


def _gz(data: bytes) -> bytes:
    comp = zlib.compressobj(6, zlib.DEFLATED, 31)
    return comp.compress(data) + comp.flush()


@pytest.mark.parametrize("before", ["manifest.json", "model.onnx"])
def test_bundle_chained_extended_headers_refused(bundle: Path, trust: TrustStore, tmp_path: Path, before: str) -> None:
    # Chained headers cost tarfile a recursion level each; a chain of them is no bundle's.
    path = tmp_path / "c.ekb"
    path.write_bytes(_gz(_with_pax_headers(_members(bundle), before, MAX_EXTENDED_HEADERS_PER_MEMBER + 1)))
    with pytest.raises(BundleError, match="extended tar headers before one member"):
        extract(path, read_verified_manifest(path, trust), tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_bundle_pax_headers_within_the_caps_still_extract(bundle: Path, trust: TrustStore, tmp_path: Path) -> None:
    members = _members(bundle)
    for before in ("manifest.json", "model.onnx"):
        path = tmp_path / f"{before}.ekb"
        path.write_bytes(_gz(_with_pax_headers(members, before, MAX_EXTENDED_HEADERS_PER_MEMBER)))
        out = extract(path, read_verified_manifest(path, trust), tmp_path / before)
        assert (out / "model.onnx").read_bytes() == dict((i.name, d) for i, d in members)["model.onnx"]


def test_bounded_reader_refuses_to_hand_out_more_than_its_limit() -> None:
    reader = BoundedReader(io.BytesIO(_gz(bytes(1 << 20))), 100_000, "in this test")
    assert len(reader.read(60_000)) == 60_000
    reader.read(40_000)
    assert reader.consumed == 100_000
    with pytest.raises(BundleError, match="decompresses past 100000 bytes in this test"):
        reader.read(1)
    unbounded = BoundedReader(io.BytesIO(_gz(bytes(1 << 20))), 100_000, "in this test")
    with pytest.raises(BundleError, match="decompresses past"):
        unbounded.read()  # read() with no size is bounded too


def test_bundle_extract_reads_no_more_than_the_signed_sizes_plus_slack(
    bundle: Path, trust: TrustStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from edgekit.bundle import archive

    opened: list[BoundedReader] = []
    real_open = open_bounded

    def recording_open(raw: BinaryIO, limit: int, phase: str) -> tuple[tarfile.TarFile, BoundedReader]:
        tar, reader = real_open(raw, limit, phase)
        opened.append(reader)
        return tar, reader

    verified = read_verified_manifest(bundle, trust)
    monkeypatch.setattr(archive, "open_bounded", recording_open)
    extract(bundle, verified, tmp_path / "x")
    (reader,) = opened
    files = verified.manifest.files
    head = len(verified.raw) + 4096 + 2 * MEMBER_HEADER_SLACK_BYTES + tarfile.RECORDSIZE  # sig, headers, read-ahead
    body = sum(-(-e.size_bytes // 512) * 512 for e in files) + len(files) * MEMBER_HEADER_SLACK_BYTES + END_SLACK_BYTES
    assert reader.consumed <= reader.limit <= head + body
    assert reader.phase == "beyond the file sizes its signed manifest lists"


def test_bundle_changed_between_verify_and_extract_refused(
    bundle: Path, tiny_model: Path, keypair: tuple[Path, Path], trust: TrustStore, tmp_path: Path
) -> None:
    verified = read_verified_manifest(bundle, trust)
    other = make_cpu_bundle(tmp_path / "v4.ekb", tiny_model, keypair[0], version=4)
    with pytest.raises(BundleError, match="changed after its manifest was verified"):
        extract(other, verified, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_bundle_sparse_member_refused(bundle: Path, trust: TrustStore, tmp_path: Path) -> None:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for info, data in _members(bundle):
            new = tarfile.TarInfo(info.name)
            new.size = len(data)
            if info.name == "model.onnx":
                new.type = tarfile.GNUTYPE_SPARSE
            tar.addfile(new, io.BytesIO(data))
    path = tmp_path / "s.ekb"
    path.write_bytes(_gz(raw.getvalue()))
    with pytest.raises(BundleError, match="GNU sparse file"):
        extract(path, read_verified_manifest(path, trust), tmp_path / "x")
