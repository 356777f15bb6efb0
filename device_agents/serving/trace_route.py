"""The loopback-only ``POST /edgekit/v1/trace?seconds=N`` that ``edgekit-agent trace`` asks: records
the requests served in the next N seconds and answers their Chrome trace (``pipeline.trace``);
403 from anywhere but loopback or without ``Content-Type: application/json`` (the install route's
rules), 409 while another trace records."""

from __future__ import annotations

import json
from urllib.parse import parse_qs, urlsplit

from device_agents.serving.install import InstallRoute
from edgekit.bundle.errors import EdgekitError, InferenceInputError


class TraceRoute(InstallRoute):
    """The trace route, on the agent's server."""

    def trace_post(self) -> None:
        """Answer ``POST /edgekit/v1/trace?seconds=N`` with the trace of the next N seconds."""
        reservation = self._reservation()
        try:
            self._check_loopback()
            self._check_json()
            self._read_body(reservation)
            query = parse_qs(urlsplit(self.path).query)
            try:
                seconds = float(query.get("seconds", ["5"])[0])
            except ValueError as exc:
                raise InferenceInputError("trace takes ?seconds=N (a number of seconds)") from exc
            trace = self.server.service.trace(seconds)
            self._send(200, json.dumps(trace, separators=(",", ":"), default=str).encode())
        except EdgekitError as exc:
            self._send_error(exc)
        finally:
            reservation.close()
