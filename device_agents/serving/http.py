"""The agent's HTTP front-end: the v2 routes (``serving.v2``), ``/metrics`` and stats, and the
loopback-only install route (``serving.install``), over the HTTP/1.1 transport
(``serving.transport``: connections, parsing, limits).

Decode and encode only: every request goes to ``AgentService``; errors map to one status each.
"""

from __future__ import annotations

from device_agents.config import ServerConfig
from device_agents.service import AgentService
from device_agents.serving.install import InstallRoute
from device_agents.serving.trace_route import TraceRoute
from device_agents.serving.transport import is_loopback, route
from device_agents.serving.v2 import EXTENSIONS, V2Routes, V2Server
from edgekit.bundle.errors import EdgekitError

__all__ = ["EXTENSIONS", "AgentServer", "is_loopback"]


class _Handler(V2Routes, TraceRoute, InstallRoute):
    def do_GET(self) -> None:  # stdlib naming
        try:
            if not self.v2_get(route(self.path)):
                self._not_found()
        except EdgekitError as exc:
            self._send_error(exc)

    def do_POST(self) -> None:  # stdlib naming
        parts = route(self.path)
        if parts[:2] == ["v2", "models"] and len(parts) > 3 and parts[-1] == "infer":
            self._infer(parts)
        elif parts == ["edgekit", "v1", "install"]:
            self.install_post()
        elif parts == ["edgekit", "v1", "trace"]:
            self.trace_post()
        elif parts[:3] == ["v2", "repository", "models"] and len(parts) == 5 and parts[4] in ("load", "unload"):
            self.repository_post(parts[3], parts[4])
        elif parts[:3] == ["edgekit", "v1", "models"] and len(parts) == 5 and parts[4] in ("uninstall", "rollback"):
            self.manage_post(parts[3], parts[4])
        else:
            try:
                if not self.v2_post(parts):
                    self._discard()
            except EdgekitError as exc:
                self._send_error(exc)


class AgentServer(V2Server):
    """One server per agent; ``serve_forever`` in a thread, ``shutdown`` from another."""

    def __init__(self, host: str, port: int, service: AgentService, limits: ServerConfig | None = None) -> None:
        super().__init__(host, port, _Handler, service, limits)
