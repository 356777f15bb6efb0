"""Open Inference Protocol v2 request/response bodies, JSON and the binary tensor data extension.

Limits: every declared shape's element count is checked (against the request cap and the bytes
given) before any tensor is allocated; NaN and Infinity, which are not JSON, are refused in
requests and written as ``null`` in JSON responses (binary tensors carry them as they are). The
request parameter ``timeout`` (microseconds, as Triton's clients send it) sets the deadline.

Binary extension (as ``tritonclient.http`` sends it by default): the body is a JSON header of
``Inference-Header-Content-Length`` bytes followed by the raw little-endian tensors of every
input whose ``parameters.binary_data_size`` is set, in input order. Outputs come back the same
way when asked with ``parameters.binary_data`` (per output) or ``binary_data_output`` (request).

A client sends the same JSON header with every request of one shape (tritonclient builds it once
per ``InferInput``): ``HeaderCache`` keeps what parsing and checking a binary-only header found
(its tensors' dtypes, shapes and offsets), and the JSON header of a binary-only response, so that
a repeated header is a dict look-up instead of a ``json.loads``, its checks and a ``json.dumps``.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from device_agents.errors import RequestTooLargeError
from device_agents.processing.signature import WireTensor
from edgekit.bundle.errors import InferenceInputError
from edgekit.bundle.manifest import TensorSpec

# v2 datatype <-> numpy (little-endian on the wire). BF16 is not served by edgekit; BYTES only
# where a manifest pre- or post-processes (an encoded image in, labels out: ``WireTensor``).
V2_TO_NUMPY: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
}
# manifest dtype -> v2 datatype
MANIFEST_TO_V2 = {
    "bool": "BOOL",
    "uint8": "UINT8",
    "int8": "INT8",
    "int16": "INT16",
    "int32": "INT32",
    "int64": "INT64",
    "float16": "FP16",
    "float32": "FP32",
}


_MAX_DIMS = 16
_MAX_DIM = 2**31 - 1


@dataclass(slots=True)
class InferRequest:
    """A decoded v2 request (not frozen: one is built per request, and a frozen ``__init__`` costs
    ~1 us more; nothing changes it after ``decode_request``)."""

    id: str | None
    inputs: dict[str, np.ndarray]
    outputs: tuple[tuple[str, bool], ...] | None  # (name, binary) per requested output; None = all
    binary_output: bool  # default for outputs not asked for by name
    timeout_s: float | None = None  # from parameters.timeout (microseconds)
    # inputs that are not model tensors yet: a BYTES tensor (numpy object array of bytes), or the
    # uint8 pixels sent to an image input (see ``device_agents.processing.signature``)
    raw: dict[str, np.ndarray] = field(default_factory=dict)
    # the request's v2 "parameters" as sent (e.g. {"cache": "bypass"}); shared by the requests of one
    # cached header: read, never written
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class _Plan:
    """What a binary-only request header decodes to against one signature, whatever the data."""

    inputs: Sequence[Spec]  # the signature it was checked against (compared by identity)
    outputs: Sequence[Spec]
    max_bytes: int
    max_rows: int | None
    body_length: int  # header + every tensor's bytes
    tensors: tuple[tuple[str, np.dtype[Any], tuple[int, ...], int, int], ...]  # name, wire dtype, shape, offset, count
    request: InferRequest  # its inputs empty


class HeaderCache:
    """Bounded maps: request header bytes -> ``_Plan``; response key -> JSON header bytes.

    At ``max_entries`` the oldest entry goes (clients that send a fresh ``id`` with every request
    only churn it). Thread-safe: a lookup is one ``dict.get``, an insert takes a lock."""

    def __init__(self, max_entries: int = 256) -> None:
        self.max_entries = max_entries
        # read with a plain ``dict.get`` on the hot path (one C call); written through ``keep_*``
        self.plans: dict[bytes, _Plan] = {}
        self.responses: dict[tuple[Any, ...], bytes] = {}
        self._lock = threading.Lock()

    def plan(self, header: bytes) -> _Plan | None:
        return self.plans.get(header)

    def response(self, key: tuple[Any, ...]) -> bytes | None:
        return self.responses.get(key)

    def keep_plan(self, header: bytes, plan: _Plan) -> None:
        self._keep(self.plans, header, plan)

    def keep_response(self, key: tuple[Any, ...], header: bytes) -> None:
        self._keep(self.responses, key, header)

    def _keep(self, table: dict[Any, Any], key: Any, value: Any) -> None:
        with self._lock:
            while len(table) >= self.max_entries:
                del table[next(iter(table))]
            table[key] = value


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON; send non-finite values in a binary tensor")


Spec = TensorSpec | WireTensor


def v2_datatype(spec: Spec) -> str:
    return spec.datatype if isinstance(spec, WireTensor) else MANIFEST_TO_V2[spec.dtype]


def tensor_metadata(spec: Spec) -> dict[str, Any]:
    return {"name": spec.name, "datatype": v2_datatype(spec), "shape": spec.v2_shape}


def decode_request(
    body: bytes | bytearray,
    header_length: int | None,
    inputs: Sequence[Spec],
    outputs: Sequence[Spec],
    *,
    max_bytes: int = 1 << 62,
    cache: HeaderCache | None = None,
    max_rows: int | None = None,
) -> InferRequest:
    """Parse and check a request body against the served signature; raise ``InferenceInputError``.

    ``max_bytes`` bounds every tensor's declared size before it is allocated, ``max_rows`` its
    axis 0 (a 413 past it). ``cache``: a
    binary-only header seen before against the same signature is not parsed again."""
    size = len(body)
    json_end = size if header_length is None else header_length
    if not 0 <= json_end <= size:
        raise InferenceInputError(f"Inference-Header-Content-Length {header_length} is outside the {size}-byte body")
    header: bytes | None = None
    if cache is not None and json_end < size:
        head = body[:json_end]
        header = bytes(head) if isinstance(head, bytearray) else head  # (an inflated body's is not hashable)
        plan = cache.plans.get(header)
        if (
            plan is not None
            and plan.inputs is inputs
            and plan.outputs is outputs
            and plan.max_bytes == max_bytes
            and plan.max_rows == max_rows
            and plan.body_length == size
        ):
            known = {}
            for name, dtype, shape, offset, count in plan.tensors:
                # the checks _decode_input made are the plan's; what is left is the data itself
                arr = np.frombuffer(body, dtype, count, offset)
                if not dtype.isnative:  # a big-endian machine: in native byte order (a copy: aligned)
                    arr = arr.astype(dtype.newbyteorder("="))
                elif not arr.flags.aligned:
                    arr = arr.copy()
                known[name] = arr.reshape(shape)
            r = plan.request
            return InferRequest(r.id, known, r.outputs, r.binary_output, r.timeout_s)
    try:
        doc = json.loads(body[:json_end] if json_end < len(body) else body, parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise InferenceInputError(f"request header is not valid JSON ({exc})") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), list):
        raise InferenceInputError('request must be a JSON object with an "inputs" list')
    specs = {s.name: s for s in inputs}
    offset = json_end
    tensors: dict[str, np.ndarray] = {}
    raw: dict[str, np.ndarray] = {}
    layout: list[tuple[str, np.dtype[Any], tuple[int, ...], int, int]] = []  # the binary ones, for the cache
    binary = 0
    for item in doc["inputs"]:
        name, arr, used = _decode_input(item, specs, body, offset, max_bytes, max_rows)
        if name in tensors or name in raw:
            raise InferenceInputError(f"input {name!r} is given twice")
        if isinstance(specs[name], WireTensor):  # an image: the pre-processing stage makes it a tensor
            raw[name] = arr
            offset += used
            continue
        tensors[name] = arr
        if used:
            binary += 1
            layout.append((name, arr.dtype.newbyteorder("<"), arr.shape, offset, arr.size))  # as on the wire
        offset += used
    if offset != len(body):
        raise InferenceInputError(
            f"binary data is {len(body) - json_end} bytes but the inputs declare {offset - json_end} "
            "(parameters.binary_data_size)"
        )
    params = _parameters(doc, "request")
    req_id = doc.get("id")
    request = InferRequest(
        id=None if req_id is None else str(req_id),
        inputs=tensors,
        outputs=_requested_outputs(doc, {s.name for s in outputs}, params),
        binary_output=bool(params.get("binary_data_output", False)),
        timeout_s=_timeout_s(params),
        raw=raw,
        parameters=params,
    )
    if header is not None and cache is not None and binary == len(tensors) and not raw:
        cache.keep_plan(
            header,
            _Plan(inputs, outputs, max_bytes, max_rows, len(body), tuple(layout), replace(request, inputs={})),
        )
    return request


def _timeout_s(params: Mapping[str, Any]) -> float | None:
    timeout = params.get("timeout")
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout <= 0:
        raise InferenceInputError(f"parameters.timeout must be a positive integer of microseconds, got {timeout!r}")
    return timeout / 1e6


def _requested_outputs(
    doc: dict[str, Any], out_names: set[str], params: dict[str, Any]
) -> tuple[tuple[str, bool], ...] | None:
    if doc.get("outputs") is None:
        return None
    if not isinstance(doc["outputs"], list):
        raise InferenceInputError('"outputs" must be a list')
    requested = []
    for item in doc["outputs"]:
        name = item.get("name") if isinstance(item, dict) else None
        if not isinstance(name, str) or name not in out_names:
            raise InferenceInputError(f"unknown output {name!r}; the model has {', '.join(sorted(out_names))}")
        p = _parameters(item, f"output {name!r}")
        if "classification" in p:
            raise InferenceInputError("the classification extension is not supported; ask for the tensor itself")
        requested.append((name, bool(p.get("binary_data", params.get("binary_data_output", False)))))
    return tuple(requested)


def _decode_input(
    item: Any,
    specs: Mapping[str, Spec],
    body: bytes | bytearray,
    offset: int,
    max_bytes: int,
    max_rows: int | None = None,
) -> tuple[str, np.ndarray, int]:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise InferenceInputError('every input needs a "name"')
    name = item["name"]
    spec = specs.get(name)
    if spec is None:
        raise InferenceInputError(f"unknown input {name!r}; the model takes {', '.join(specs)}")
    datatype, shape = item.get("datatype"), item.get("shape")
    want = v2_datatype(spec)
    if datatype != want and not (want == "BYTES" and datatype == "UINT8"):  # an image input also takes pixels
        more = " (an encoded image needs a bundle packaged with --preprocess)" if datatype == "BYTES" else ""
        raise InferenceInputError(f"input {name!r}: datatype {datatype!r} given, the model takes {want}{more}")
    if (
        not isinstance(shape, list)
        or len(shape) > _MAX_DIMS
        or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= _MAX_DIM for d in shape)
    ):
        raise InferenceInputError(
            f"input {name!r}: shape must be a list of non-negative integers (at most {_MAX_DIMS}, each <= {_MAX_DIM}), "
            f"got {shape!r}"
        )
    if max_rows is not None and shape and shape[0] > max_rows:
        raise RequestTooLargeError(
            f"input {name!r}: {shape[0]} rows, over the {max_rows} one request may give this model "
            "(models.<name>.max_request_rows, else batching.max_batch_size); split the request"
        )
    count = math.prod(shape)
    if count == 0:
        raise InferenceInputError(f"input {name!r}: shape {shape} has no elements")
    if datatype == "BYTES":
        return _decode_bytes(name, item, shape, count, body, offset, max_bytes)
    dtype = V2_TO_NUMPY[datatype]
    if count * dtype.itemsize > max_bytes:
        raise InferenceInputError(
            f"input {name!r}: shape {shape} of {datatype} is {count * dtype.itemsize} bytes, over the request cap "
            f"({max_bytes} bytes)"
        )
    size = _parameters(item, f"input {name!r}").get("binary_data_size")
    if size is not None:
        if not isinstance(size, int) or size != count * dtype.itemsize:
            raise InferenceInputError(
                f"input {name!r}: binary_data_size {size!r} does not match shape {shape} of {datatype} "
                f"({count * dtype.itemsize} bytes)"
            )
        if offset + size > len(body):
            raise InferenceInputError(f"input {name!r}: the body ends before its {size} bytes of binary data")
        return name, _frombuffer(body, dtype, count, offset).reshape(shape), size
    if "data" not in item:
        raise InferenceInputError(f'input {name!r}: give "data" or parameters.binary_data_size')
    if not isinstance(item["data"], list):
        raise InferenceInputError(f'input {name!r}: "data" must be a list of {datatype} values')
    given = _flat_count(item["data"])
    if given != count:  # before numpy builds an array of them
        raise InferenceInputError(f"input {name!r}: {given} values given for shape {shape} ({count} values)")
    try:
        arr = np.asarray(item["data"], dtype=dtype.newbyteorder("="))
    except (ValueError, TypeError, OverflowError) as exc:
        raise InferenceInputError(f"input {name!r}: data is not a list of {datatype} values ({exc})") from exc
    if arr.size != count:
        raise InferenceInputError(f"input {name!r}: {arr.size} values given for shape {shape} ({count} values)")
    return name, arr.reshape(shape), 0


def _decode_bytes(
    name: str, item: dict[str, Any], shape: list[int], count: int, body: bytes | bytearray, offset: int, max_bytes: int
) -> tuple[str, np.ndarray, int]:
    """A BYTES input: in binary, each element is a 4-byte little-endian length and its bytes; in
    JSON, a string (UTF-8), base64 where the input's ``parameters.content_type`` is ``"base64"``,
    or an object ``{"b64": "..."}``."""
    params = _parameters(item, f"input {name!r}")
    size = params.get("binary_data_size")
    elements: list[bytes] = []
    if size is not None:
        if not isinstance(size, int) or size < 4 * count or size > max_bytes:
            raise InferenceInputError(f"input {name!r}: binary_data_size {size!r} cannot hold {count} BYTES elements")
        if offset + size > len(body):
            raise InferenceInputError(f"input {name!r}: the body ends before its {size} bytes of binary data")
        at, end = offset, offset + size
        for _ in range(count):
            if at + 4 > end:
                raise InferenceInputError(f"input {name!r}: binary data ends inside a BYTES element's length")
            n = int.from_bytes(body[at : at + 4], "little")
            if at + 4 + n > end:
                raise InferenceInputError(f"input {name!r}: a BYTES element of {n} bytes runs past its binary data")
            elements.append(bytes(body[at + 4 : at + 4 + n]))
            at += 4 + n
        if at != end:
            raise InferenceInputError(f"input {name!r}: {end - at} bytes after its {count} BYTES elements")
        used = size
    else:
        data = item.get("data")
        if not isinstance(data, list):
            raise InferenceInputError(f'input {name!r}: give "data" (a list of strings) or parameters.binary_data_size')
        flat = _flatten(data)
        if len(flat) != count:
            raise InferenceInputError(f"input {name!r}: {len(flat)} values given for shape {shape} ({count} values)")
        b64 = params.get("content_type") == "base64"
        for value in flat:
            elements.append(_bytes_element(name, value, b64))
        used = 0
    arr = np.empty(count, dtype=object)
    arr[:] = elements
    return name, arr.reshape(shape), used


def _bytes_element(name: str, value: Any, b64: bool) -> bytes:
    if isinstance(value, dict) and isinstance(value.get("b64"), str):
        value, b64 = value["b64"], True
    if not isinstance(value, str):
        raise InferenceInputError(f'input {name!r}: a BYTES element is a string or {{"b64": "..."}}, got {value!r:.40}')
    if not b64:
        return value.encode("utf-8")
    try:
        return base64.b64decode(value, validate=True)
    except binascii.Error as exc:
        raise InferenceInputError(f"input {name!r}: not valid base64 ({exc})") from exc


def _flatten(data: list[Any]) -> list[Any]:
    out: list[Any] = []
    stack = [iter(data)]
    while stack:
        for v in stack[-1]:
            if isinstance(v, list):
                stack.append(iter(v))
                break
            out.append(v)
        else:
            stack.pop()
    return out


def _bytes_wire(arr: np.ndarray) -> bytes:
    """A BYTES tensor in the binary extension: each element's 4-byte little-endian length, then it."""
    return b"".join(len(v).to_bytes(4, "little") + v for v in (_as_bytes(x) for x in arr.ravel()))


def _as_bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode("utf-8")


# Each wire dtype in native byte order (a ``newbyteorder`` call per tensor costs ~0.5 us).
_NATIVE = {dt: dt.newbyteorder("=") for dt in V2_TO_NUMPY.values()}
_LITTLE_ENDIAN = sys.byteorder == "little"


def _frombuffer(body: bytes | bytearray, dtype: np.dtype[Any], count: int, offset: int) -> np.ndarray:
    """``count`` values of little-endian ``dtype`` at ``offset``, aligned and in native byte order."""
    arr = np.frombuffer(body, dtype=dtype, count=count, offset=offset)
    if not arr.flags.aligned:
        arr = arr.copy()
    native = _NATIVE.get(dtype)
    return arr.astype(dtype.newbyteorder("=") if native is None else native, copy=False)


def _little_endian_bytes(arr: np.ndarray) -> bytes:
    """The array's values as little-endian bytes (the binary tensor extension's byte order)."""
    order = arr.dtype.byteorder
    if order in ("<", "|") or (order == "=" and _LITTLE_ENDIAN):
        return arr.tobytes()
    return arr.astype(arr.dtype.newbyteorder("<")).tobytes()


def _flat_count(data: list[Any]) -> int:
    """How many scalars the (possibly nested, already parsed) list holds."""
    count, stack = 0, [data]
    while stack:
        for v in stack.pop():
            if isinstance(v, list):
                stack.append(v)
            else:
                count += 1
    return count


def _parameters(item: Mapping[str, Any], what: str) -> dict[str, Any]:
    params = item.get("parameters", {})
    if not isinstance(params, dict):
        raise InferenceInputError(f"{what}: parameters must be an object")
    return params


def encode_response(
    model_name: str,
    version: int,
    request: InferRequest,
    results: Mapping[str, np.ndarray],
    outputs: Sequence[Spec],
    cache: HeaderCache | None = None,
    parameters: Mapping[str, Any] | None = None,
) -> tuple[bytes, int | None]:
    """The response body and, when it carries binary tensors, its JSON header length.

    ``cache``: the JSON header of a binary-only response without an ``id`` is built once per
    model, version, outputs asked for, their shapes and dtypes and the response ``parameters``
    (the v2 response's own, e.g. ``{"cache": "hit"}``; values must be hashable)."""
    extra = tuple(parameters.items()) if parameters else ()
    wanted = request.outputs if request.outputs is not None else tuple((s.name, request.binary_output) for s in outputs)
    key: tuple[Any, ...] | None = None
    if cache is not None and request.id is None:
        if len(wanted) == 1:  # one output (the usual case): no generator or list of one
            out_name, binary = wanted[0]
            a = results[out_name]
            if binary and a.dtype != object:  # (a BYTES tensor's header depends on its values' lengths)
                key = (model_name, version, wanted, extra, (a.shape, a.dtype))
                cached = cache.responses.get(key)
                if cached is not None:
                    return cached + _little_endian_bytes(a), len(cached)
        elif all(binary for _, binary in wanted) and all(results[name].dtype != object for name, _ in wanted):
            arrays = [results[name] for name, _ in wanted]
            key = (model_name, version, wanted, extra, *((a.shape, a.dtype) for a in arrays))
            cached = cache.responses.get(key)
            if cached is not None:
                tensors = [_little_endian_bytes(a) for a in arrays]
                return cached + b"".join(tensors), len(cached)
    datatypes = {s.name: v2_datatype(s) for s in outputs}  # ServedModel returns the served dtypes
    blobs: list[bytes] = []
    items = []
    for name, binary in wanted:
        arr = results[name]
        item: dict[str, Any] = {"name": name, "datatype": datatypes[name], "shape": list(arr.shape)}
        if binary:
            raw = _bytes_wire(arr) if arr.dtype == object else _little_endian_bytes(arr)
            item["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        elif arr.dtype == object:  # BYTES: strings (labels are UTF-8 text)
            item["data"] = [_as_bytes(v).decode("utf-8", "replace") for v in arr.ravel()]
        else:
            flat = arr.ravel()
            values = flat.tolist()
            if flat.dtype.kind == "f" and not np.isfinite(flat).all():
                values = [v if math.isfinite(v) else None for v in values]  # NaN/Infinity are not JSON
            item["data"] = values
        items.append(item)
    doc: dict[str, Any] = {"model_name": model_name, "model_version": str(version)}
    if parameters:
        doc["parameters"] = dict(parameters)
    if request.id is not None:
        doc["id"] = request.id
    doc["outputs"] = items
    header = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    if not blobs:
        return header, None
    if key is not None and cache is not None:
        cache.keep_response(key, header)
    return header + b"".join(blobs), len(header)
