"""Resumable, capped, bounded download against real HTTP(S) servers: the Range-capable one, http.server,
a throttled one and a redirector."""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from device_agents.updates.download import DownloadError, DownloadLimits, download
from edgekit.bundle.fleet_protocol import Notice
from edgekit.bundle.manifest import sha256_file
from examples.fleet_processes import FileServer, Process, free_port
from tests.updates.pki import TestCA
from tests.updates.services import Redirector, SlowFileServer


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


def test_download_refuses_redirects_to_other_schemes(tmp_path: Path, payload: Path, dl: Path) -> None:
    redirector = Redirector(tmp_path / "redirect.log", "ftp://127.0.0.1/bundle.ekb").start()
    try:
        with pytest.raises(DownloadError, match=r"ftp://127.0.0.1/bundle.ekb is not an http:// or https:// URL") as e:
            download(_notice(payload, redirector.url.rsplit("/", 1)[0]), dl, max_bytes=10**7)
        assert e.value.permanent
    finally:
        redirector.kill()


def test_download_refuses_a_redirect_from_https_to_http(
    tmp_path: Path, files: FileServer, payload: Path, dl: Path
) -> None:
    ca = TestCA(tmp_path / "ca")
    redirector = Redirector(tmp_path / "redirect.log", f"{files.base_url}/bundle.ekb",
                            tls=ca.issue("localhost", server=True)).start()  # fmt: skip
    try:
        notice = _notice(payload, redirector.url.rsplit("/", 1)[0])
        with pytest.raises(DownloadError, match=r"redirects to plain http .*a downgrade is refused") as e:
            download(notice, dl, max_bytes=10**7, ca=ca.cert_path)
        assert e.value.permanent and not files.requests()
    finally:
        redirector.kill()


def test_download_of_plain_http_is_refused_where_allow_http_is_off(files: FileServer, payload: Path, dl: Path) -> None:
    with pytest.raises(DownloadError, match=r"updates\.allow_http is false") as e:
        download(_notice(payload, files.base_url), dl, max_bytes=10**7, limits=DownloadLimits(allow_http=False))
    assert e.value.permanent and not files.requests()


@pytest.fixture
def slow(tmp_path: Path, files: FileServer, payload: Path) -> Iterator[FileServer]:
    """The payload's directory behind a 20 kB/s link (1 MB takes 50 s)."""
    server = SlowFileServer(files.dir, tmp_path / "slow.log", bytes_per_s=20_000).start()
    yield server
    server.kill()


def test_download_gives_up_below_the_minimum_rate_and_keeps_the_part(slow: FileServer, payload: Path, dl: Path) -> None:
    notice = _notice(payload, slow.base_url)
    limits = DownloadLimits(deadline_s=60, min_bytes_per_s=100_000, stall_s=1.0)
    with pytest.raises(DownloadError, match=r"too slow: \d+ bytes/s over the last (\d+) s") as e:
        download(notice, dl, max_bytes=10**7, limits=limits)
    # the window is the time since the last mark when a read returned: stall_s or more on a busy machine
    window = re.search(r"over the last (\d+) s", str(e.value))
    assert window is not None and int(window.group(1)) >= limits.stall_s, str(e.value)
    assert not e.value.permanent
    part = dl / f"{notice.sha256}.part"
    assert 0 < part.stat().st_size < payload.stat().st_size  # resumed by the next attempt


def test_download_gives_up_at_its_overall_deadline(slow: FileServer, payload: Path, dl: Path) -> None:
    limits = DownloadLimits(deadline_s=1.5, min_bytes_per_s=0, stall_s=30.0)
    with pytest.raises(DownloadError, match=r"did not finish within download_deadline_s \(1.5 s\)") as e:
        download(_notice(payload, slow.base_url), dl, max_bytes=10**7, limits=limits)
    assert not e.value.permanent
