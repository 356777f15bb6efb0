"""v2 bodies: JSON and binary tensors in, JSON and binary tensors out (as tritonclient reads them)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tritonclient.http import InferResult

from device_agents.serving.codec import decode_request, encode_response
from edgekit.bundle.errors import InferenceInputError
from edgekit.bundle.manifest import TensorSpec

INPUTS = (TensorSpec("a", "float16", ("n", 3)), TensorSpec("b", "int8", (2,)), TensorSpec("c", "bool", (2,)))
OUTPUTS = (TensorSpec("y", "float32", ("n", 2)), TensorSpec("z", "int64", (1,)))


def _binary_body(header: dict, *blobs: bytes) -> tuple[bytes, int]:
    raw = json.dumps(header).encode()
    return raw + b"".join(blobs), len(raw)


def test_decode_binary_inputs_at_unaligned_offsets() -> None:
    a = np.arange(6, dtype=np.float16).reshape(2, 3)
    b = np.array([-3, 7], np.int8)
    header = {
        "id": "r1",
        "inputs": [
            {"name": "b", "shape": [2], "datatype": "INT8", "parameters": {"binary_data_size": 2}},
            {"name": "a", "shape": [2, 3], "datatype": "FP16", "parameters": {"binary_data_size": 12}},
            {"name": "c", "shape": [2], "datatype": "BOOL", "data": [True, False]},
        ],
    }
    body, hlen = _binary_body(header, b.tobytes(), a.tobytes())
    req = decode_request(body, hlen, INPUTS, OUTPUTS)
    np.testing.assert_array_equal(req.inputs["a"], a)
    np.testing.assert_array_equal(req.inputs["b"], b)
    np.testing.assert_array_equal(req.inputs["c"], [True, False])
    assert req.id == "r1" and req.outputs is None and not req.binary_output


def test_decode_nested_json_data() -> None:
    body = json.dumps(
        {
            "inputs": [
                {"name": "a", "shape": [1, 3], "datatype": "FP16", "data": [[1, 2, 3]]},
                {"name": "b", "shape": [2], "datatype": "INT8", "data": [1, 2]},
                {"name": "c", "shape": [2], "datatype": "BOOL", "data": [False, True]},
            ],
            "outputs": [{"name": "z", "parameters": {"binary_data": True}}, {"name": "y"}],
        }
    ).encode()
    req = decode_request(body, None, INPUTS, OUTPUTS)
    assert req.inputs["a"].dtype == np.float16 and req.inputs["a"].tolist() == [[1, 2, 3]]
    assert req.outputs == (("z", True), ("y", False))


@pytest.mark.parametrize(
    ("inputs", "extra", "message"),
    [
        (
            [{"name": "b", "shape": [2], "datatype": "INT16", "data": [1, 2]}],
            {},
            "datatype 'INT16' given, the model takes INT8",
        ),
        ([{"name": "b", "shape": [2], "datatype": "INT8", "data": [1, 2, 3]}], {}, "3 values given for shape [2]"),
        ([{"name": "b", "shape": [-2], "datatype": "INT8", "data": []}], {}, "shape must be a list of non-negative"),
        ([{"name": "b", "shape": [2], "datatype": "INT8", "data": ["x", 2]}], {}, "data is not a list of INT8 values"),
        ([{"name": "b", "shape": [2], "datatype": "INT8"}], {}, 'give "data" or parameters.binary_data_size'),
        (
            [{"name": "q", "shape": [2], "datatype": "INT8", "data": [1, 2]}],
            {},
            "unknown input 'q'; the model takes a, b, c",
        ),
        (
            [{"name": "b", "shape": [2], "datatype": "INT8", "data": [1, 2]}] * 2,
            {},
            "input 'b' is given twice",
        ),
        (
            [{"name": "b", "shape": [2], "datatype": "INT8", "parameters": {"binary_data_size": 3}}],
            {},
            "binary_data_size 3 does not match shape [2] of INT8 (2 bytes)",
        ),
        (
            [{"name": "b", "shape": [2], "datatype": "INT8", "data": [1, 2]}],
            {"outputs": [{"name": "y", "parameters": {"classification": 3}}]},
            "classification extension is not supported",
        ),
        (
            [{"name": "b", "shape": [2], "datatype": "INT8", "data": [1, 2]}],
            {"outputs": [{"name": "w"}]},
            "unknown output 'w'; the model has y, z",
        ),
    ],
)
def test_decode_refuses_bad_requests_with_the_reason(inputs: list, extra: dict, message: str) -> None:
    body = json.dumps({"inputs": inputs, **extra}).encode()
    with pytest.raises(InferenceInputError) as err:
        decode_request(body, None, INPUTS, OUTPUTS)
    assert message in str(err.value)


def test_decode_refuses_binary_bytes_no_input_claims() -> None:
    header = {"inputs": [{"name": "b", "shape": [2], "datatype": "INT8", "parameters": {"binary_data_size": 2}}]}
    body, hlen = _binary_body(header, b"\x01\x02", b"extra")
    with pytest.raises(InferenceInputError, match="binary data is 7 bytes but the inputs declare 2"):
        decode_request(body, hlen, INPUTS, OUTPUTS)


@pytest.mark.parametrize("binary", [True, False])
def test_encode_is_read_back_by_tritonclient(binary: bool) -> None:
    results = {"y": np.array([[0.25, -1.5]], np.float32), "z": np.array([7], np.int64)}
    req = decode_request(
        json.dumps(
            {
                "id": "q",
                "inputs": [],
                "parameters": {"binary_data_output": binary},
                "outputs": [{"name": "y"}, {"name": "z"}],
            }
        ).encode(),
        None,
        (),
        OUTPUTS,
    )
    body, hlen = encode_response("m", 3, req, results, OUTPUTS)
    assert (hlen is not None) is binary
    parsed = InferResult.from_response_body(body, header_length=hlen)
    assert parsed.get_response()["id"] == "q" and parsed.get_response()["model_version"] == "3"
    np.testing.assert_array_equal(parsed.as_numpy("y"), results["y"])
    np.testing.assert_array_equal(parsed.as_numpy("z"), results["z"])
    assert parsed.get_output("z")["datatype"] == "INT64"


# -- the header cache: a repeated binary-only header is not parsed again -----------------------------


def _binary_request(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> tuple[bytes, int]:
    header = {
        "inputs": [
            {"name": "a", "shape": list(a.shape), "datatype": "FP16", "parameters": {"binary_data_size": a.nbytes}},
            {"name": "b", "shape": [2], "datatype": "INT8", "parameters": {"binary_data_size": 2}},
            {"name": "c", "shape": [2], "datatype": "BOOL", "parameters": {"binary_data_size": 2}},
        ],
        "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
    }
    return _binary_body(header, a.tobytes(), b.tobytes(), c.tobytes())


def test_decode_a_repeated_binary_header_is_not_parsed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    from device_agents.serving import codec

    cache = codec.HeaderCache()
    b, c = np.array([1, 2], np.int8), np.array([True, False])
    first = np.arange(6, dtype=np.float16).reshape(2, 3)
    body, hlen = _binary_request(first, b, c)
    assert decode_request(body, hlen, INPUTS, OUTPUTS, cache=cache).inputs["a"].tolist() == first.tolist()

    def no_parsing(*args: object, **kwargs: object) -> object:
        raise AssertionError("the header was parsed again")

    monkeypatch.setattr(codec.json, "loads", no_parsing)
    second = first + 10
    body, hlen = _binary_request(second, b, c)
    req = decode_request(body, hlen, INPUTS, OUTPUTS, cache=cache)
    np.testing.assert_array_equal(req.inputs["a"], second)
    np.testing.assert_array_equal(req.inputs["b"], b)
    np.testing.assert_array_equal(req.inputs["c"], c)
    assert req.outputs == (("y", True),) and req.id is None


def test_decode_checks_a_cached_header_again_against_another_signature_or_body_length() -> None:
    from device_agents.serving.codec import HeaderCache

    cache = HeaderCache()
    a, b, c = np.zeros((2, 3), np.float16), np.array([1, 2], np.int8), np.array([True, False])
    body, hlen = _binary_request(a, b, c)
    decode_request(body, hlen, INPUTS, OUTPUTS, cache=cache)
    other = (TensorSpec("a", "float32", ("n", 3)), *INPUTS[1:])  # same names, another dtype
    with pytest.raises(InferenceInputError, match="datatype 'FP16' given, the model takes FP32"):
        decode_request(body, hlen, other, OUTPUTS, cache=cache)
    with pytest.raises(InferenceInputError, match="binary data is"):
        decode_request(body + b"\0", hlen, INPUTS, OUTPUTS, cache=cache)


def test_encode_a_repeated_binary_response_header_is_built_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from device_agents.serving import codec

    cache = codec.HeaderCache()
    req = codec.InferRequest(None, {}, (("y", True),), True)
    y = np.arange(4, dtype=np.float32).reshape(2, 2)
    first, first_len = encode_response("m", 3, req, {"y": y, "z": np.zeros(1, np.int64)}, OUTPUTS, cache)

    def no_dumping(*args: object, **kwargs: object) -> object:
        raise AssertionError("the header was built again")

    monkeypatch.setattr(codec.json, "dumps", no_dumping)
    again, again_len = encode_response("m", 3, req, {"y": y + 1, "z": np.zeros(1, np.int64)}, OUTPUTS, cache)
    assert again_len == first_len and again[:first_len] == first[:first_len]
    assert first_len is not None
    result = InferResult.from_response_body(again, header_length=first_len)
    np.testing.assert_array_equal(result.as_numpy("y"), y + 1)


def test_header_cache_keeps_at_most_max_entries() -> None:
    from device_agents.serving.codec import HeaderCache

    cache = HeaderCache(max_entries=2)
    for i in range(3):
        cache.keep_response(("k", i), b"h")
    assert cache.response(("k", 0)) is None and cache.response(("k", 2)) == b"h"


def test_encode_writes_big_endian_results_as_little_endian_binary() -> None:
    results = {"y": np.array([[0.25, -1.5]], ">f4"), "z": np.array([7], ">i8")}
    doc = {"inputs": [], "parameters": {"binary_data_output": True}}
    req = decode_request(json.dumps(doc).encode(), None, (), OUTPUTS)
    body, hlen = encode_response("m", 1, req, results, OUTPUTS)
    assert hlen is not None
    assert body[hlen:] == np.array([[0.25, -1.5]], "<f4").tobytes() + np.array([7], "<i8").tobytes()


def test_decode_keeps_the_request_parameters_and_encode_writes_the_response_s() -> None:
    from device_agents.serving.codec import HeaderCache

    body = json.dumps({"inputs": [], "parameters": {"cache": "bypass", "priority": 2}}).encode()
    req = decode_request(body, None, (), OUTPUTS)
    assert req.parameters == {"cache": "bypass", "priority": 2}
    results = {"y": np.array([[0.25, -1.5]], np.float32), "z": np.array([7], np.int64)}
    binary = decode_request(
        json.dumps({"inputs": [], "parameters": {"binary_data_output": True}}).encode(), None, (), OUTPUTS
    )
    cache = HeaderCache()
    for state in ("miss", "hit", "miss"):  # a cached binary header per response parameters, not one for all
        out, hlen = encode_response("m", 1, binary, results, OUTPUTS, cache, parameters={"cache": state})
        parsed = InferResult.from_response_body(out, header_length=hlen)
        assert parsed.get_response()["parameters"] == {"cache": state}
        np.testing.assert_array_equal(parsed.as_numpy("y"), results["y"])
    plain, _ = encode_response("m", 1, req, results, OUTPUTS)
    assert "parameters" not in json.loads(plain)
