"""``edgekit fleet serve DIR``: a static HTTP file server with ``Range`` support, for one box or tests.

Devices resume interrupted downloads with ``Range: bytes=N-``; Python's ``http.server`` ignores
that header (it always sends the whole file), which costs a full re-download after every broken
transfer. This server answers a single byte range with 206 and anything else like
``http.server``. Production fleets serve the directory with nginx, a CDN or object storage, which
all support ranges. Every request is logged to stderr as ``GET PATH range=... -> STATUS``.
``--throttle-bytes-per-s`` sends file bodies no faster than that (a slow link, for demos and tests).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import time
from functools import partial
from http import HTTPStatus
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import BinaryIO

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


class RangeRequestHandler(SimpleHTTPRequestHandler):
    """``SimpleHTTPRequestHandler`` plus single-range ``GET``/``HEAD`` (206 / 416)."""

    _range: tuple[int, int] | None = None
    throttle_bytes_per_s: int = 0  # 0 = as fast as the network allows

    def send_head(self) -> BinaryIO | None:
        self._range = None
        header = self.headers.get("Range")
        path = Path(self.translate_path(self.path))
        if header is None or not path.is_file():
            return super().send_head()
        size = path.stat().st_size
        span = _parse_range(header, size)
        if span is None:  # multi-range or malformed: ignore the header, as RFC 9110 allows
            return super().send_head()
        start, end = span
        if start >= size or start > end:
            self.send_response(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE)
            self.send_header("Content-Range", f"bytes */{size}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        f = open(path, "rb")  # closed by the base class's send/copy code
        f.seek(start)
        self._range = (start, end)
        self.send_response(HTTPStatus.PARTIAL_CONTENT)
        self.send_header("Content-Type", self.guess_type(str(path)))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Last-Modified", self.date_time_string(int(path.stat().st_mtime)))
        self.end_headers()
        return f

    def copyfile(self, source: BinaryIO, outputfile: BinaryIO) -> None:  # type: ignore[override]  # narrower file types
        try:
            if self._range is None and not self.throttle_bytes_per_s:
                shutil.copyfileobj(source, outputfile)
                return
            left = self._range[1] - self._range[0] + 1 if self._range is not None else None
            step = min(256 * 1024, self.throttle_bytes_per_s or 256 * 1024)
            while left is None or left > 0:
                block = source.read(step if left is None else min(step, left))
                if not block:
                    break
                outputfile.write(block)
                outputfile.flush()
                if left is not None:
                    left -= len(block)
                if self.throttle_bytes_per_s:
                    time.sleep(len(block) / self.throttle_bytes_per_s)
        except (BrokenPipeError, ConnectionResetError):  # the client went away (it resumes with a Range later)
            sys.stderr.write(f"{self.command} {self.path}: client disconnected mid-transfer\n")
            self.close_connection = True

    def end_headers(self) -> None:
        if self._range is None and self.command in ("GET", "HEAD"):
            self.send_header("Accept-Ranges", "bytes")
        super().end_headers()

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        status = code.value if isinstance(code, HTTPStatus) else code
        sys.stderr.write(f"{self.command} {self.path} range={self.headers.get('Range', '-')} -> {status}\n")
        sys.stderr.flush()


def _parse_range(header: str, size: int) -> tuple[int, int] | None:
    m = _RANGE.match(header.strip())
    if m is None or (not m.group(1) and not m.group(2)):
        return None
    if not m.group(1):  # suffix range: the last N bytes
        n = int(m.group(2))
        return (max(0, size - n), size - 1) if n else None
    start = int(m.group(1))
    end = int(m.group(2)) if m.group(2) else size - 1
    return start, min(end, size - 1)


def serve(
    directory: Path, host: str = "127.0.0.1", port: int = 0, *, throttle_bytes_per_s: int = 0
) -> ThreadingHTTPServer:
    """A server for ``directory`` bound to ``host:port`` (0 = a free port); call ``serve_forever``."""
    cls = type("ThrottledHandler", (RangeRequestHandler,), {"throttle_bytes_per_s": throttle_bytes_per_s})
    handler = partial(cls, directory=os.fspath(directory))
    return ThreadingHTTPServer((host, port), handler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="edgekit fleet serve", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", type=Path, help="directory to serve (what `edgekit publish --copy-to` fills)")
    parser.add_argument("--bind", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="port (0 = any free port; default 8080)")
    parser.add_argument(
        "--throttle-bytes-per-s", type=int, default=0, metavar="N", help="send bodies at most this fast (0 = no limit)"
    )


def run(args: argparse.Namespace) -> int:
    from edgekit.bundle.command_line import os_error_parts
    from edgekit.errors import ConfigError

    if not Path(args.directory).is_dir():
        raise ConfigError(f"{args.directory}: not a folder; give the folder to serve (`edgekit publish --copy-to`)")
    try:
        server = serve(args.directory, args.bind, args.port, throttle_bytes_per_s=args.throttle_bytes_per_s)
    except OSError as exc:
        reason, advice = os_error_parts(exc)
        raise ConfigError(f"--bind {args.bind} --port {args.port}: cannot listen there ({reason}); {advice}") from exc
    print(f"serving {args.directory} at http://{args.bind}:{server.server_port}/", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
