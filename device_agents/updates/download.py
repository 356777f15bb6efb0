"""Resumable HTTP(S) download of the bundle a notice points to, under a hard size cap.

The file grows as ``<download_dir>/<sha256>.part`` and becomes ``<sha256>.ekb`` only once its
SHA-256 matches the notice: a crash leaves a ``.part`` that the next attempt resumes with an
HTTP ``Range`` request (a server that ignores ranges answers 200 and the download starts over).
No more than the notice's ``size_bytes`` is ever written, whatever the server sends. A full disk
removes the partial file and raises: nothing is left behind and the old model keeps serving.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import ssl
import urllib.error
import urllib.request
from pathlib import Path

from device_agents.faults import fault_point
from device_agents.store import fsync_dir
from device_agents.updates.protocol import Notice
from edgekit.bundle.errors import EdgekitError
from edgekit.bundle.manifest import sha256_file

_CHUNK = 256 * 1024
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


class DownloadError(EdgekitError):
    """A bundle could not be downloaded. ``permanent`` errors will not go away by retrying."""

    def __init__(self, message: str, *, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


def download(
    notice: Notice, dest_dir: Path, *, max_bytes: int, ca: Path | None = None, timeout_s: float = 30.0
) -> Path:
    """Fetch ``notice.url`` into ``dest_dir`` and return the verified ``<sha256>.ekb`` path."""
    if notice.size_bytes > max_bytes:
        raise DownloadError(
            f"{notice.name} v{notice.version} is {notice.size_bytes} bytes, over the {max_bytes}-byte cap",
            permanent=True,
        )
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    final = dest_dir / f"{notice.sha256}.ekb"
    if final.exists():  # downloaded before a crash or restart: the name is its hash, checked on rename
        return final
    part = dest_dir / f"{notice.sha256}.part"
    resumed = part.exists() and part.stat().st_size > 0
    _fetch(notice, part, ca, timeout_s)
    if sha256_file(part) != notice.sha256:
        part.unlink(missing_ok=True)
        if not resumed:
            raise DownloadError(
                f"{notice.url} does not match the notice's sha256: the bundle was altered on the server or in "
                "transit; publish it again",
                permanent=True,
            )
        # The resumed prefix may be from another file (or a torn write); one fresh attempt decides.
        _fetch(notice, part, ca, timeout_s)
        if sha256_file(part) != notice.sha256:
            part.unlink(missing_ok=True)
            raise DownloadError(f"{notice.url} does not match the notice's sha256; publish it again", permanent=True)
    with open(part, "rb") as f:
        os.fsync(f.fileno())
    os.replace(part, final)
    fsync_dir(dest_dir)
    return final


def _fetch(notice: Notice, part: Path, ca: Path | None, timeout_s: float) -> None:
    """Bring ``part`` to ``notice.size_bytes`` bytes, resuming what is there."""
    offset = part.stat().st_size if part.exists() else 0
    if offset > notice.size_bytes:
        part.unlink()
        offset = 0
    if offset == notice.size_bytes:
        return
    request = urllib.request.Request(notice.url, headers={"User-Agent": "edgekit-agent"})
    if offset:
        request.add_header("Range", f"bytes={offset}-")
    try:
        response = urllib.request.urlopen(request, timeout=timeout_s, context=_ssl_context(notice.url, ca))
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and offset:  # our prefix does not fit the file: start over next time
            part.unlink(missing_ok=True)
            _check_total(notice, exc.headers.get("Content-Range", "").rpartition("/")[2])
        raise DownloadError(f"GET {notice.url} answered {exc.code} {exc.reason}; will retry") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise DownloadError(f"cannot reach {notice.url} ({_reason(exc)}); will retry") from exc
    with response:
        if response.status == 206:
            _check_content_range(notice, response.headers.get("Content-Range", ""), offset)
            mode = "ab"
        else:  # 200: the server sends the whole file (no Range support)
            offset, mode = 0, "wb"
        length = response.headers.get("Content-Length")
        if length is not None and length.isdigit():
            _check_total(notice, str(offset + int(length)))
        _copy(response, part, mode, offset, notice, timeout_s)


def _copy(response: object, part: Path, mode: str, offset: int, notice: Notice, timeout_s: float) -> None:
    written = offset
    try:
        with open(part, mode) as f:
            while True:
                try:
                    block = response.read(_CHUNK)  # type: ignore[attr-defined]  # http.client.HTTPResponse
                except OSError as exc:
                    raise DownloadError(
                        f"download of {notice.url} broke off at {written} bytes ({_reason(exc)}); will resume"
                    ) from exc
                if not block:
                    break
                if written + len(block) > notice.size_bytes:
                    raise DownloadError(
                        f"{notice.url} sent more than the notice's {notice.size_bytes} bytes; refused", permanent=True
                    )
                f.write(block)
                written += len(block)
                if written == offset + len(block):  # first block of this attempt is on disk
                    f.flush()
                    fault_point("download")
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            with contextlib.suppress(OSError):
                part.unlink()
            raise DownloadError(
                f"no space left in {part.parent} for {notice.name} v{notice.version} ({notice.size_bytes} bytes); "
                "free disk space or point updates.download_dir elsewhere; the download was removed"
            ) from exc
        raise DownloadError(f"cannot write {part}: {exc}") from exc
    except DownloadError as exc:
        if exc.permanent:
            part.unlink(missing_ok=True)
        raise
    if written < notice.size_bytes:
        raise DownloadError(f"download of {notice.url} ended at {written} of {notice.size_bytes} bytes; will resume")


def _check_content_range(notice: Notice, header: str, offset: int) -> None:
    m = _CONTENT_RANGE.match(header.strip())
    if m is None or int(m.group(1)) != offset:
        raise DownloadError(f"{notice.url} answered a range request with Content-Range {header!r}; will retry")
    _check_total(notice, m.group(3))


def _check_total(notice: Notice, total: str) -> None:
    """A server that states another size than the notice holds another file: no retry will help."""
    if total.isdigit() and int(total) != notice.size_bytes:
        more = "more than" if int(total) > notice.size_bytes else "not"
        raise DownloadError(
            f"{notice.url} is {total} bytes, {more} the notice's {notice.size_bytes}: the file was replaced "
            "after the notice was published; publish it again",
            permanent=True,
        )


def _ssl_context(url: str, ca: Path | None) -> ssl.SSLContext | None:
    if not url.startswith("https:"):
        return None
    context = ssl.create_default_context()
    if ca is not None:  # a private CA for the bundle server, trusted besides the system's
        context.load_verify_locations(cafile=str(ca))
    return context


def _reason(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None)
    return str(reason if reason is not None else exc)
