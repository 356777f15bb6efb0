"""Resumable HTTP(S) download of the bundle a notice points to, under a hard size cap.

The file grows as ``<download_dir>/<sha256>.part`` and becomes ``<sha256>.ekb`` only once its
SHA-256 matches the notice: a crash leaves a ``.part`` that the next attempt resumes with an
HTTP ``Range`` request (a server that ignores ranges answers 200 and the download starts over).
No more than the notice's ``size_bytes`` is ever written, whatever the server sends. A full disk
removes the partial file and raises: nothing is left behind and the old model keeps serving.

A download cannot stall its model's updates (``DownloadLimits``): it gives up after an overall
deadline, and when fewer than ``min_bytes_per_s`` arrived over any ``stall_s`` (a server that
sends one byte every few seconds as much as one that sends nothing); the partial file is kept
for the next attempt. Only ``https://`` and, where ``allow_http``, ``http://`` are fetched, on
the first request and on every redirect; a redirect from https to http is refused.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import ssl
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from device_agents.faults import fault_point
from device_agents.store import fsync_dir
from edgekit.bundle.errors import EdgekitError
from edgekit.bundle.fleet_protocol import Notice
from edgekit.bundle.manifest import sha256_file

_CHUNK = 256 * 1024
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


class DownloadError(EdgekitError):
    """A bundle could not be downloaded. ``permanent`` errors will not go away by retrying."""

    def __init__(self, message: str, *, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


@dataclass(frozen=True)
class DownloadLimits:
    """Bounds of one download (the ``download_*`` and ``allow_http`` fields of ``[updates]``)."""

    deadline_s: float = 1800.0
    min_bytes_per_s: int = 1024
    stall_s: float = 30.0  # the window of the rate check; a read waits at most twice this
    allow_http: bool = True


class _Clock:
    """The deadline of one ``download`` call and the rate watch of the current attempt."""

    def __init__(self, url: str, limits: DownloadLimits) -> None:
        self.url, self.limits = url, limits
        self.deadline = time.monotonic() + limits.deadline_s
        self.mark_t, self.mark_bytes = time.monotonic(), 0

    def read_timeout(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise self._over_deadline()
        # twice the rate window: a trickle is judged by the rate check, a read that returns nothing for
        # this long has stalled outright (a timeout: "broke off", resumed later)
        return min(2 * self.limits.stall_s, left)

    def start_attempt(self, written: int) -> None:
        self.mark_t, self.mark_bytes = time.monotonic(), written

    def check(self, written: int) -> None:
        now = time.monotonic()
        if now >= self.deadline:
            raise self._over_deadline()
        span = now - self.mark_t
        if span >= self.limits.stall_s:
            rate = (written - self.mark_bytes) / span
            if rate < self.limits.min_bytes_per_s:
                raise DownloadError(
                    f"download of {self.url} is too slow: {rate:.0f} bytes/s over the last {span:.0f} s, under "
                    f"download_min_bytes_per_s ({self.limits.min_bytes_per_s}); will resume later"
                )
            self.mark_t, self.mark_bytes = now, written

    def _over_deadline(self) -> DownloadError:
        return DownloadError(
            f"download of {self.url} did not finish within download_deadline_s ({self.limits.deadline_s:g} s); "
            "will resume later"
        )


def check_url_scheme(url: str, allow_http: bool, *, previous: str | None = None) -> None:
    """``DownloadError`` (permanent) unless ``url`` may be fetched; ``previous``: the URL redirecting here."""
    scheme = urlsplit(url).scheme.lower()
    if scheme not in ("http", "https"):
        raise DownloadError(
            f"{url} is not an http:// or https:// URL"
            + (f" (a redirect from {previous})" if previous else "")
            + "; refused",
            permanent=True,
        )
    if previous is not None and scheme == "http" and urlsplit(previous).scheme.lower() == "https":
        raise DownloadError(f"{previous} redirects to plain http ({url}); a downgrade is refused", permanent=True)
    if scheme == "http" and not allow_http:
        raise DownloadError(
            f"{url} is plain http, and updates.allow_http is false; publish the bundle at an https:// URL",
            permanent=True,
        )


class _SchemeGuard(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to a URL that ``check_url_scheme`` lets through."""

    def __init__(self, allow_http: bool) -> None:
        super().__init__()
        self.allow_http = allow_http

    def redirect_request(
        self, req: urllib.request.Request, fp: Any, code: int, msg: str, headers: Any, newurl: str
    ) -> urllib.request.Request | None:
        check_url_scheme(newurl, self.allow_http, previous=req.full_url)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def download(
    notice: Notice,
    dest_dir: Path,
    *,
    max_bytes: int,
    ca: Path | None = None,
    limits: DownloadLimits | None = None,
) -> Path:
    """Fetch ``notice.url`` into ``dest_dir`` and return the verified ``<sha256>.ekb`` path."""
    limits = limits or DownloadLimits()
    check_url_scheme(notice.url, limits.allow_http)
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
    clock = _Clock(notice.url, limits)
    _fetch(notice, part, ca, clock)
    if sha256_file(part) != notice.sha256:
        part.unlink(missing_ok=True)
        if not resumed:
            raise DownloadError(
                f"{notice.url} does not match the notice's sha256: the bundle was altered on the server or in "
                "transit; publish it again",
                permanent=True,
            )
        # The resumed prefix may be from another file (or a torn write); one fresh attempt decides.
        _fetch(notice, part, ca, clock)
        if sha256_file(part) != notice.sha256:
            part.unlink(missing_ok=True)
            raise DownloadError(f"{notice.url} does not match the notice's sha256; publish it again", permanent=True)
    with open(part, "rb") as f:
        os.fsync(f.fileno())
    os.replace(part, final)
    fsync_dir(dest_dir)
    return final


def _fetch(notice: Notice, part: Path, ca: Path | None, clock: _Clock) -> None:
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
    opener = urllib.request.build_opener(
        urllib.request.HTTPSHandler(context=_ssl_context(ca)), _SchemeGuard(clock.limits.allow_http)
    )
    try:
        response = opener.open(request, timeout=clock.read_timeout())
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
        _copy(response, part, mode, offset, notice, clock)


def _copy(response: Any, part: Path, mode: str, offset: int, notice: Notice, clock: _Clock) -> None:
    written = offset
    clock.start_attempt(written)
    try:
        with open(part, mode) as f:
            while True:
                try:
                    # read1: returns what has arrived (read() would wait for a whole block from a slow server)
                    block = response.read1(_CHUNK)
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
                clock.check(written)
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


def _ssl_context(ca: Path | None) -> ssl.SSLContext:
    context = ssl.create_default_context()
    if ca is not None:  # a private CA for the bundle server, trusted besides the system's
        context.load_verify_locations(cafile=str(ca))
    return context


def _reason(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None)
    return str(reason if reason is not None else exc)
