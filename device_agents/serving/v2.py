"""The v2 routes (Open Inference Protocol, KServe / Triton REST) over the agent service: decode ->
``AgentService`` -> encode, and nothing else (no policy; errors map to one status each).

``GET /v2``, ``/v2/health/live``, ``/v2/health/ready``, ``/v2/models/{name}[/versions/{v}]``,
``/v2/models/{name}[/versions/{v}]/ready``, ``POST /v2/models/{name}[/versions/{v}]/infer``, the
Triton extensions tools call (``GET /v2/models/{name}/config``, ``GET /v2/models[/{name}]/stats``,
``POST /v2/repository/index``; load and unload are state-changing: ``serving.install``), plus
``GET /metrics`` (Prometheus text) and ``GET /edgekit/v1/stats``. Errors are ``{"error": "..."}``
with 400 (bad input, including one the runtime rejects), 404 (unknown model), 413 (too large),
429 (queue full) / 503 (draining, decode slots busy) with ``Retry-After``, 504 (deadline passed)
or 500 (the runtime failed or hung; the server goes on).

``v2_codec`` is the routes' decode and encode of one infer request, for any front-end that
carries v2 bodies (the HTTP routes here, the serial console, a tail server): it needs the body,
what the front-end read of its framing (the JSON header's length, a content encoding) and the
service's ``infer``; nothing of HTTP.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any

from device_agents import __version__
from device_agents.config import ServerConfig
from device_agents.errors import AnsweredError, ModelNotFoundError, RequestTooLargeError, RuntimeFailure
from device_agents.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from device_agents.pipeline import Request, RequestTiming
from device_agents.runtimes import ServedModel
from device_agents.service import AgentService
from device_agents.serving.bodies import Reservation, inflate
from device_agents.serving.codec import HeaderCache, Spec, decode_request, encode_response, tensor_metadata
from device_agents.serving.transport import BINARY, RequestHandler, Transport
from edgekit.bundle.errors import EdgekitError, InferenceInputError

EXTENSIONS = ("binary_tensor_data", "model_configuration", "statistics", "model_repository")

Decode = Callable[[ServedModel], Request]
# a JSON value parsed: a float object and its list slot; smaller bodies take no reservation
_JSON_VALUE_BYTES = 32
_JSON_FREE_BYTES = 1 << 20
Encode = Callable[[Request], tuple[bytes, int | None]]


def v2_codec(
    name: str,
    version: int | None,
    body: bytes,
    *,
    header_length: int | None,
    max_bytes: int,
    cache: HeaderCache,
    encoding: str | None = None,
    reservation: Reservation | None = None,
    answer: Callable[[EdgekitError], None] | None = None,
    timing: RequestTiming | None = None,
    max_rows: int | None = None,
) -> tuple[Decode, Encode]:
    """The decode and encode of one v2 infer request to ``name`` (JSON, or the binary tensor data
    extension when ``header_length`` is given), for ``AgentService.infer``: encode returns the
    response body and its JSON header's length (None: all JSON). ``encoding``: the body's content
    encoding (gzip, deflate), inflated within ``reservation`` (required with one); ``answer`` and
    ``timing``: the front-end's, as ``Request`` describes them; ``max_rows``: the most rows (axis
    0) an input may have (``ModelConfig.max_request_rows``)."""

    def decode(model: ServedModel) -> Request:
        raw = body
        if encoding is not None:
            if reservation is None:
                raise InferenceInputError(f"Content-Encoding {encoding!r} is not supported by this front-end")
            raw = inflate(body, encoding, max_bytes, reservation)  # type: ignore[assignment]  # bytes-like
        held = 0
        if reservation is not None:  # what the JSON's values take as Python objects, before they are parsed
            held = raw.count(b",", 0, len(raw) if header_length is None else header_length) * _JSON_VALUE_BYTES
            if held > _JSON_FREE_BYTES:
                if held > reservation.inflating.capacity:
                    raise RequestTooLargeError(
                        f"a JSON body of {held // _JSON_VALUE_BYTES} values takes {held} bytes as it is parsed, over "
                        "server.max_buffered_mb; send large tensors as binary data (parameters.binary_data_size)"
                    )
                reservation.add_inflated(held)
            else:
                held = 0
        try:
            wire = decode_request(raw, header_length, model.wire_inputs, model.wire_outputs, max_bytes=max_bytes,
                                  cache=cache, max_rows=max_rows)  # fmt: skip
        finally:
            if held and reservation is not None:
                reservation.give_back_inflated(held)
        asked = None if wire.outputs is None else tuple(output for output, _ in wire.outputs)
        return Request(
            name, wire.inputs, version, wire, wire.timeout_s, answer, timing, parameters=wire.parameters,
            requested_outputs=asked, raw=wire.raw,
        )  # fmt: skip

    def encode(request: Request) -> tuple[bytes, int | None]:
        model = request.model
        outputs = request.outputs
        if model is None or outputs is None:  # the pipeline sets both before it encodes
            raise RuntimeFailure(f"model {name}: no outputs to encode")
        return encode_response(
            name, request.served_version, request.wire, outputs, model.wire_outputs, cache, request.response_parameters
        )

    return decode, encode


class V2Server(Transport):
    """A transport serving the v2 routes of ``service`` (its ``handler`` is built on ``V2Routes``)."""

    def __init__(
        self,
        host: str,
        port: int,
        handler: type[V2Routes],
        service: AgentService,
        limits: ServerConfig | None = None,
    ) -> None:
        self.service = service
        self.header_cache = HeaderCache()  # v2 JSON headers seen before: not parsed again
        self.max_request_rows = service.config.max_request_rows()  # by served name
        rejects = service.metrics.rejects
        super().__init__(
            host,
            port,
            handler,
            limits or service.config.server,
            lambda model, reason: rejects.labels(model, reason).inc(),
        )


def _stats_route(parts: list[str]) -> bool:
    return parts in (["metrics"], ["edgekit", "v1", "stats"], ["v2", "models", "stats"]) or (
        parts[:2] == ["v2", "models"] and parts[-1:] == ["stats"]
    )


class V2Routes(RequestHandler):
    """The v2 routes, on a ``V2Server``."""

    server: V2Server
    _cache_state: str | None = None  # the answered request's response parameter "cache", for X-Edgekit-Cache

    def v2_get(self, parts: list[str]) -> bool:
        """Answer a GET of the v2 routes; False when ``parts`` is none of them."""
        service = self.server.service
        if parts == ["v2", "health", "live"]:
            self._send(200)
        elif parts == ["v2", "health", "ready"]:
            self._send(200 if service.ready else 503)
        elif parts == ["v2"]:
            self._send_json(200, {"name": "edgekit-agent", "version": __version__, "extensions": list(EXTENSIONS)})
        elif not self.loopback and _stats_route(parts) and self.server.limits.metrics_loopback_only:
            self._send_json(403, {"error": "/metrics and stats answer loopback only (server.metrics_loopback_only)"})
        elif parts == ["metrics"]:
            self._send(200, service.metrics_text(), METRICS_CONTENT_TYPE)
        elif parts == ["edgekit", "v1", "stats"]:
            self._send_json(200, service.stats())
        elif parts == ["v2", "models", "stats"]:
            self._send_json(200, {"model_stats": model_statistics(service.statistics())})
        elif parts[:2] == ["v2", "models"] and len(parts) > 2:
            name, version, rest = model_route(parts)
            if rest == []:
                self._model_metadata(name, version)
            elif rest == ["ready"]:
                service.model(name, version)
                self._send(200)
            elif rest == ["config"]:
                self._send_json(200, model_config(name, service.model(name, version)))
            elif rest == ["stats"]:
                stats = service.statistics()
                if name not in stats:
                    raise ModelNotFoundError(f"no model named {name!r} is installed here")
                self._send_json(200, {"model_stats": model_statistics({name: stats[name]})})
            else:
                self._not_found()
        else:
            return False
        return True

    def v2_post(self, parts: list[str]) -> bool:
        """Answer ``POST /v2/repository/index`` (read-only); False when ``parts`` is not it."""
        if parts != ["v2", "repository", "index"]:
            return False
        reservation = Reservation(self.server.budget, self.server.limits.retry_after_s, self.server.inflate_budget)
        try:
            body = self._read_raw_body(reservation)
        finally:
            reservation.close()
        try:
            only_ready = bool(json.loads(body or b"{}").get("ready", False))
        except (ValueError, AttributeError) as exc:
            raise InferenceInputError('the repository index takes {"ready": true|false} or an empty body') from exc
        index = [
            {"name": m["name"], "version": str(m["version"]), "state": "READY" if m["ready"] else "UNAVAILABLE",
             "reason": m["reason"]}
            for m in self.server.service.repository()
            if m["ready"] or not only_ready
        ]  # fmt: skip
        self._send_json(200, index)
        return True

    def _model_metadata(self, name: str, version: int | None) -> None:
        model = self.server.service.model(name, version)
        m = model.manifest
        self._send_json(
            200,
            {
                "name": name,
                "versions": [str(m.version)],
                "platform": m.compatibility.runtime,
                "inputs": [tensor_metadata(s) for s in model.wire_inputs],
                "outputs": [tensor_metadata(s) for s in model.wire_outputs],
            },
        )

    def _infer(self, parts: list[str]) -> None:
        start = self._received
        service = self.server.service
        metrics = service.metrics
        self._label = ""
        self._cache_state = None
        timing = RequestTiming()
        overhead_s = write_cpu_overhead_s = None
        reservation = Reservation(self.server.budget, self.server.limits.retry_after_s, self.server.inflate_budget)
        try:
            try:
                # The body first: a refused request whose body stays unread would be parsed as the
                # next request on this keep-alive connection (tritonclient reuses connections).
                raw = self._read_raw_body(reservation)
                name, version, rest = model_route(parts)
                if rest != ["infer"]:
                    raise ModelNotFoundError(f"no route POST {self.path}")
                decode, encode = self._codec(raw, name, version, reservation, timing)
                try:
                    out, json_len = service.infer(name, version, decode, encode)
                except EdgekitError:
                    self._label = name if service.serves(name) else ""
                    raise
                mark = "" if self._cache_state is None else f"X-Edgekit-Cache: {self._cache_state}\r\n"
                if json_len is None:
                    self._send(200, out, extra=mark)
                else:
                    self._send(200, out, BINARY, extra=f"Inference-Header-Content-Length: {json_len}\r\n{mark}")
                self._label = name  # served: it has an endpoint
                code = 200
                overhead_s = self._written - start - timing.runtime_s
                write_cpu_overhead_s = self._write_start + self._write_cpu_s - start - timing.runtime_s
            except AnsweredError:
                self.close_connection = True  # the watchdog wrote the answer (and counted it)
                return
            except EdgekitError as exc:
                self._send_error(exc)
                code = exc.http_status
            finally:
                reservation.close()
            # Recorded once the answer is written (the pipeline left this request's stage metrics
            # in ``timing``): metrics work is not part of received -> written.
            stages, rows = timing.take()
            seconds = time.perf_counter() - start
            metrics.observe_request(
                self._label, code, seconds, overhead_s, write_cpu_overhead_s, stages, timing.model, rows
            )
        finally:
            if timing.stages is not None or timing.batch_rows:  # no answer of ours recorded them
                stages, rows = timing.take()  # (the watchdog answered, the write failed, ...)
                if stages:
                    metrics.observe_stages(timing.model, stages)
                if rows:
                    metrics.observe_batch(timing.model, rows)

    def _answer_hung(self, name: str, exc: EdgekitError) -> None:
        """Answer this request from the watchdog's thread: this handler's thread is stuck in a
        runtime call (run inline) that hung. It writes nothing when (if ever) it comes back."""
        service = self.server.service
        self._label = name if service.serves(name) else ""
        self._answered = True
        self.close_connection = True
        self._send_error(exc)
        service.metrics.observe_request(self._label, exc.http_status, time.perf_counter() - self._start)
        self._log_access()

    def _codec(
        self, raw: bytes, name: str, version: int | None, reservation: Reservation, timing: RequestTiming
    ) -> tuple[Decode, Encode]:
        """The decode and encode stages of this request (``v2_codec`` with what its headers say)."""
        # a _Headers: lower-case keys, read with dict.get (no .lower() per look-up)
        headers: dict[str, str] = self.headers  # type: ignore[assignment]
        server = self.server
        decode, encode = v2_codec(
            name,
            version,
            raw,
            header_length=header_length(dict.get(headers, "inference-header-content-length")),
            max_bytes=server.max_request_bytes,
            cache=server.header_cache,
            encoding=dict.get(headers, "content-encoding"),
            reservation=reservation,
            answer=lambda exc: self._answer_hung(name, exc),
            timing=timing,
            max_rows=server.max_request_rows.get(name),
        )

        def encode_noting_cache(request: Request) -> tuple[bytes, int | None]:
            state = request.response_parameters.get("cache")
            self._cache_state = None if state is None else str(state)
            return encode(request)

        return decode, encode_noting_cache


def model_config(name: str, model: ServedModel) -> dict[str, Any]:
    """Triton's model configuration (``GET .../config``) of a served model: its served tensors with
    full shapes (``max_batch_size`` 0: a dynamic batch axis shows as -1 in ``dims``)."""
    m = model.manifest

    def tensors(specs: Sequence[Spec]) -> list[dict[str, Any]]:
        return [
            {"name": t["name"], "data_type": "TYPE_" + ("STRING" if t["datatype"] == "BYTES" else t["datatype"]),
             "dims": t["shape"]}
            for t in map(tensor_metadata, specs)
        ]  # fmt: skip

    return {
        "name": name,
        "platform": m.compatibility.runtime,
        "backend": m.compatibility.runtime,
        "version_policy": {"specific": {"versions": [str(m.version)]}},
        "max_batch_size": 0,
        "input": tensors(model.wire_inputs),
        "output": tensors(model.wire_outputs),
        "parameters": {"target": {"string_value": m.target}},
    }


def model_statistics(stats: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Triton's statistics extension entries from ``AgentService.statistics`` (durations in ns)."""

    def duration(count_total: tuple[int, float]) -> dict[str, int]:
        return {"count": count_total[0], "ns": round(count_total[1] * 1e9)}

    out = []
    for name, row in sorted(stats.items()):
        batches, rows = row["batch"]
        out.append(
            {
                "name": name,
                "version": str(row["version"]),
                "last_inference": 0,  # not kept
                "inference_count": int(rows) if batches else row["success"],
                "execution_count": batches or row["success"],
                "inference_stats": {
                    "success": {"count": row["success"], "ns": round(row["request"][1] * 1e9)},
                    "fail": {"count": row["fail"], "ns": 0},
                    "queue": duration(row["queue"]),
                    "compute_input": duration(row["decode"]),
                    "compute_infer": duration(row["infer"]),
                    "compute_output": duration(row["encode"]),
                },
                "batch_stats": [],
            }
        )
    return out


def model_route(parts: list[str]) -> tuple[str, int | None, list[str]]:
    """``["v2", "models", name, ("versions", v), *rest]`` -> (name, version, rest)."""
    name, rest = parts[2], parts[3:]
    if rest[:1] == ["versions"] and len(rest) >= 2:
        v = rest[1]
        # isascii: str.isdigit() is also true of "²" and "٣", which int() refuses or reads as digits
        if not (v.isascii() and v.isdigit()) or len(v) > 18:
            raise ModelNotFoundError(f"model {name!r} has no version {v!r} (versions are integers)")
        return name, int(v), rest[2:]
    return name, None, rest


def header_length(value: str | None) -> int | None:
    """An ``Inference-Header-Content-Length`` value (None: absent), or a 400."""
    if value is None:
        return None
    if not (value.isascii() and value.isdigit()) or len(value) > 18:
        raise InferenceInputError(f"Inference-Header-Content-Length {value!r} is not a number")
    return int(value)
