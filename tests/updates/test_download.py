"""Resumable, capped download against real HTTP servers (the Range-capable one and http.server)."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from device_agents.updates.download import DownloadError, download
from device_agents.updates.protocol import Notice
from edgekit.bundle.manifest import sha256_file
from examples.fleet_processes import FileServer, Process, free_port


@pytest.fixture
def payload(files: FileServer) -> Path:
    path = files.dir / "bundle.ekb"
    path.write_bytes(bytes(range(256)) * 4000)  # 1 MB: several download blocks
    return path


@pytest.fixture
def dl(tmp_path: Path) -> Path:
    """The download directory (the test's tmp_path also holds the file server's directory)."""
    (tmp_path / "dl").mkdir()
    return tmp_path / "dl"


def _notice(path: Path, base_url: str, **changes: object) -> Notice:
    n = Notice("n", "2026-03-04T12:00:00Z", "tiny", 2, sha256_file(path), path.stat().st_size,
               f"{base_url}/{path.name}")  # fmt: skip
    return dataclasses.replace(n, **changes)  # type: ignore[arg-type]  # field values as given


def test_download_fetches_verifies_and_names_the_file_by_its_hash(files: FileServer, payload: Path, dl: Path) -> None:
    notice = _notice(payload, files.base_url)
    got = download(notice, dl, max_bytes=10**7)
    assert got == dl / f"{notice.sha256}.ekb"
    assert got.read_bytes() == payload.read_bytes()
    assert list(dl.iterdir()) == [got]
    assert download(notice, dl, max_bytes=10**7) == got  # present already: no second request
    assert len(files.requests()) == 1


def test_download_resumes_a_partial_file_with_a_range_request(files: FileServer, payload: Path, dl: Path) -> None:
    notice = _notice(payload, files.base_url)
    (dl / f"{notice.sha256}.part").write_bytes(payload.read_bytes()[:300_000])
    got = download(notice, dl, max_bytes=10**7)
    assert got.read_bytes() == payload.read_bytes()
    assert files.requests() == ["GET /bundle.ekb range=bytes=300000- -> 206"]


def test_download_starts_over_once_when_a_resumed_file_does_not_verify(
    files: FileServer, payload: Path, dl: Path
) -> None:
    notice = _notice(payload, files.base_url)
    (dl / f"{notice.sha256}.part").write_bytes(b"\0" * 300_000)  # a torn write, say
    assert download(notice, dl, max_bytes=10**7).read_bytes() == payload.read_bytes()
    assert files.requests() == ["GET /bundle.ekb range=bytes=300000- -> 206", "GET /bundle.ekb range=- -> 200"]


@pytest.fixture
def plain_server(files: FileServer, tmp_path: Path) -> Iterator[str]:
    """Python's http.server: ignores Range headers, always answers 200 with the whole file."""
    port = free_port()
    proc = Process(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(files.dir)],
        tmp_path / "http.server.log",
    )
    proc.spawn()
    proc.wait_port(port)
    yield f"http://127.0.0.1:{port}"
    proc.kill()


def test_download_restarts_from_zero_when_the_server_ignores_ranges(plain_server: str, payload: Path, dl: Path) -> None:
    notice = _notice(payload, plain_server)
    (dl / f"{notice.sha256}.part").write_bytes(payload.read_bytes()[:300_000])
    assert download(notice, dl, max_bytes=10**7).read_bytes() == payload.read_bytes()


def test_download_refuses_more_than_the_caps_and_leaves_nothing(files: FileServer, payload: Path, dl: Path) -> None:
    with pytest.raises(DownloadError, match="over the 1000-byte cap") as exc:
        download(_notice(payload, files.base_url), dl, max_bytes=1000)
    assert exc.value.permanent and not files.requests()
    with pytest.raises(DownloadError, match="more than the notice's 5000") as exc:
        download(_notice(payload, files.base_url, size_bytes=5000), dl, max_bytes=10**7)
    assert exc.value.permanent and not list(dl.iterdir())


def test_download_refuses_content_that_does_not_match_the_notice(files: FileServer, payload: Path, dl: Path) -> None:
    with pytest.raises(DownloadError, match="does not match the notice's sha256") as exc:
        download(_notice(payload, files.base_url, sha256="0" * 64), dl, max_bytes=10**7)
    assert exc.value.permanent and not list(dl.iterdir())


def test_download_failures_that_may_pass_are_not_permanent(files: FileServer, payload: Path, dl: Path) -> None:
    with pytest.raises(DownloadError, match="answered 404") as exc:
        download(_notice(payload, files.base_url, url=f"{files.base_url}/missing.ekb"), dl, max_bytes=10**7)
    assert not exc.value.permanent
    closed = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(DownloadError, match="cannot reach") as exc:
        download(_notice(payload, closed), dl, max_bytes=10**7)
    assert not exc.value.permanent
