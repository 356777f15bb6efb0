"""The loopback-only ``POST /edgekit/v1/install`` that ``edgekit-agent install`` hands bundles to:
``{"bundle": "/absolute/path.ekb", "origin": "cli"}`` -> the install result (200), or the
refusal with its error type and exit code (400); 403 from anywhere but loopback, without
``Content-Type: application/json``, or with a ``Host`` (or an ``Origin``) that is not the
listen address, localhost, a loopback address or one of ``server.allowed_hosts`` (a page whose
name was rebound to 127.0.0.1 is same-origin with the agent, but names itself in both).
``POST /edgekit/v1/models/{name}/uninstall`` and ``.../rollback`` (``{"origin": "cli"}``) follow
the same rules and answer the model's new state, as do Triton's ``POST /v2/repository/models/{name}/load|unload``."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from urllib.parse import urlsplit

from device_agents.serving.transport import JSON, RequestHandler, is_loopback
from device_agents.serving.v2 import V2Server
from edgekit.bundle.codec import to_data
from edgekit.bundle.errors import BundleError, EdgekitError, InferenceInputError

_GZIP_MAGIC = b"\x1f\x8b"  # an .ekb is a gzip'd tar


class _Forbidden(EdgekitError):
    http_status = 403


class InstallRoute(RequestHandler):
    """The install route, on the agent's server (its ``service``)."""

    server: V2Server

    def install_post(self) -> None:
        """Answer ``POST /edgekit/v1/install`` (the body read within the buffer budget)."""
        reservation = self._reservation()
        try:
            self._check_loopback()
            self._check_host()
            self._check_json()
            self._install(self._read_body(reservation))
        except EdgekitError as exc:
            self._send_error(exc)
        finally:
            reservation.close()

    def manage_post(self, name: str, action: str) -> None:
        """Answer ``POST /edgekit/v1/models/{name}/uninstall|rollback``, under the install route's rules."""
        reservation = self._reservation()
        try:
            self._check_loopback()
            self._check_host()
            self._check_json()
            body = self._read_body(reservation)
            try:
                origin = printable(str(json.loads(body or b"{}").get("origin", "cli")))
            except (ValueError, AttributeError) as exc:
                raise InferenceInputError(f'{action} takes {{"origin": "cli"}} or an empty body') from exc
            act = self.server.service.uninstall if action == "uninstall" else self.server.service.rollback
            try:
                state = act(name, origin=origin)
            except EdgekitError as exc:
                status = exc.http_status if exc.http_status == 404 else 400
                self._send_json(
                    status, {"error": str(exc), "error_type": type(exc).__name__, "exit_code": exc.exit_code}
                )
                return
            self._send_json(200, {"name": name, **to_data(state)})
        except EdgekitError as exc:
            self._send_error(exc)
        finally:
            reservation.close()

    def repository_post(self, name: str, action: str) -> None:
        """Answer Triton's ``POST /v2/repository/models/{name}/load|unload`` under the install route's
        rules (loopback, ``Content-Type: application/json``); 200 with an empty JSON object."""
        reservation = self._reservation()
        try:
            self._check_loopback()
            self._check_host()
            self._check_json()
            self._read_body(reservation)  # parameters (a config to load with, unload_dependents) are not taken
            if action == "load":
                self.server.service.load_model(name)
            else:
                self.server.service.unload_model(name)
            self._send_json(200, {})
        except EdgekitError as exc:
            self._send_error(exc)
        finally:
            reservation.close()

    def _check_loopback(self) -> None:
        if not is_loopback(self.client_address[0]):
            self.close_connection = True  # the body stays unread
            raise _Forbidden("this route answers only on loopback; run `edgekit-agent` on the device itself")

    def _check_host(self) -> None:
        """Refuse (403) a ``Host`` or ``Origin`` naming another site (DNS rebinding)."""
        host = self.headers.get("Host")
        origin = self.headers.get("Origin")
        if host is None or not self._names_this_agent(host):
            self.close_connection = True  # the body stays unread
            raise _Forbidden(
                f"POST {self.path} takes a Host that names this agent (its listen address, localhost, "
                "or one of server.allowed_hosts)"
            )
        if origin is not None:
            parts = urlsplit(origin)
            if parts.scheme not in ("http", "https") or not self._names_this_agent(parts.netloc):
                self.close_connection = True
                raise _Forbidden(f"POST {self.path} is not taken from a page of another origin")

    def _names_this_agent(self, authority: str) -> bool:
        """Whether ``host[:port]`` names this agent: its port (when given) and a known name."""
        name, port = authority.lower(), ""
        if name.startswith("["):  # [v6]:port
            name, _, rest = name[1:].partition("]")
            port = rest.removeprefix(":")
        elif name.count(":") == 1:
            name, port = name.split(":")
        if port and port != str(self.server.server_address[1]):
            return False
        listen = str(self.server.server_address[0]).lower()
        return (
            name in ("localhost", listen)
            or is_loopback(name)
            or any(name == allowed.lower() for allowed in self.server.limits.allowed_hosts)
        )

    def _check_json(self) -> None:
        """A web page open on the device can POST to loopback, but only as a "simple" request
        (form or text/plain): requiring application/json forces a CORS preflight, never answered."""
        if self.headers.get_content_type() != JSON:
            self.close_connection = True  # the body stays unread
            raise _Forbidden(
                f"POST {self.path} takes Content-Type: application/json (tritonclient: "
                "headers={'Content-Type': 'application/json'})"
            )

    def _install(self, body: bytes | bytearray) -> None:
        try:
            doc = json.loads(body)
            bundle = Path(doc["bundle"])
            origin = printable(str(doc.get("origin", "cli")))
        except (ValueError, KeyError, TypeError) as exc:
            raise InferenceInputError('install takes {"bundle": "/absolute/path.ekb"}') from exc
        try:
            self._check_bundle_file(bundle)
            result = self.server.service.install(bundle, origin=origin)
        except EdgekitError as exc:
            self._send_json(400, {"error": str(exc), "error_type": type(exc).__name__, "exit_code": exc.exit_code})
            return
        self._send_json(200, to_data(result))

    def _check_bundle_file(self, bundle: Path) -> None:
        """Refuse, before the install takes the store's lock, a path that is not a regular file
        starting like a bundle, or not under ``server.install_dirs`` (when set): a named pipe
        would block the install, lock held, and no error quotes what another file holds.
        Opened non-blocking, so a FIFO is refused at once."""
        shown = printable(str(bundle))
        if not bundle.is_absolute():
            raise BundleError(f"bundle path {shown} is not absolute; give the full path of the .ekb")
        dirs = self.server.limits.install_dirs
        if dirs:
            real = Path(os.path.realpath(bundle))
            if not any(real.is_relative_to(os.path.realpath(d)) for d in dirs):
                raise BundleError(f"bundle {shown} is not under server.install_dirs; copy it into one of them")
        try:
            fd = os.open(bundle, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise BundleError(f"cannot open bundle {shown}: {exc.strerror}") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise BundleError(f"bundle {shown} is not a regular file; give the path of an .ekb file")
            if os.pread(fd, len(_GZIP_MAGIC), 0) != _GZIP_MAGIC:
                raise BundleError(f"{shown} is not an edgekit bundle (.ekb, from `edgekit package`)")
        finally:
            os.close(fd)


def printable(text: str, max_chars: int = 200) -> str:
    """``text`` (a client-supplied string bound for logs and state) with control characters
    escaped (a newline cannot forge a log line) and cut at ``max_chars``."""
    if text.isprintable() and len(text) <= max_chars:
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:max_chars])
