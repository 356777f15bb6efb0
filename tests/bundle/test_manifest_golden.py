"""The manifest contract: the committed golden v2 manifest, the JSON Schema and the dataclasses
agree, byte for byte, and unknown keys are refused by both with their path named; v1 manifests
(as released, with their own frozen schema) migrate to a committed v2 result."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from edgekit.bundle.manifest import Manifest
from edgekit.errors import ManifestError
from tests.bundle.manifest_schema import render

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden" / "manifest_v2.json"
SCHEMA = ROOT / "edgekit" / "bundle" / "schema" / "manifest.v2.schema.json"
GOLDEN_V1 = ROOT / "tests" / "golden" / "manifest_v1.json"
GOLDEN_V1_MIGRATED = ROOT / "tests" / "golden" / "manifest_v1_migrated.json"
SCHEMA_V1 = ROOT / "edgekit" / "bundle" / "schema" / "manifest.v1.schema.json"

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is in the dev extra")


def _validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text()))


def _golden() -> dict:
    return json.loads(GOLDEN.read_bytes())


def test_golden_manifest_round_trips_byte_identically() -> None:
    raw = GOLDEN.read_bytes()
    assert Manifest.from_json(raw).to_json() == raw


def test_golden_manifest_validates_against_the_schema() -> None:
    errors = sorted(_validator().iter_errors(_golden()), key=str)
    assert not errors, errors[0].message if errors else ""


def test_committed_schema_matches_the_dataclasses() -> None:
    assert SCHEMA.read_text() == render(), (
        "manifest.v2.schema.json is out of date: python -m tests.bundle.manifest_schema > " + str(SCHEMA)
    )


def test_schema_is_a_valid_draft_2020_12_schema() -> None:
    jsonschema.Draft202012Validator.check_schema(json.loads(SCHEMA.read_text()))


@pytest.mark.parametrize(
    ("where", "path"),
    [
        ((), "manifest"),
        (("validation", "tolerance"), "manifest.validation.tolerance"),
        (("files", 1), "manifest.files[1]"),
    ],
)
def test_manifest_unknown_key_rejected_with_its_path(where: tuple, path: str) -> None:
    data = _golden()
    node = data
    for part in where:
        node = node[part]
    node["surprise"] = 1
    with pytest.raises(ManifestError, match="^" + re.escape(f"{path}: unknown key 'surprise'")):
        Manifest.from_dict(data)
    errors = list(_validator().iter_errors(data))
    assert len(errors) == 1
    assert tuple(errors[0].absolute_path) == where
    assert "surprise" in errors[0].message


def test_manifest_missing_required_key_rejected_by_both() -> None:
    data = _golden()
    del data["precision"]["weights"]
    with pytest.raises(ManifestError, match=r"manifest.precision: missing required key 'weights'"):
        Manifest.from_dict(data)
    assert [tuple(e.absolute_path) for e in _validator().iter_errors(data)] == [("precision",)]


def test_manifest_wrong_dtype_rejected_by_both() -> None:
    data = _golden()
    data["signature"]["inputs"][0]["dtype"] = "float64"
    with pytest.raises(ManifestError, match=r"manifest.signature.inputs\[0\]: dtype 'float64'"):
        Manifest.from_dict(data)
    assert list(_validator().iter_errors(data))


def test_manifest_newer_schema_version_refused() -> None:
    data = copy.deepcopy(_golden())
    data["schema_version"] = 3
    with pytest.raises(ManifestError, match="newer than this agent understands"):
        Manifest.from_dict(data)
    assert list(_validator().iter_errors(data))


def test_v1_manifest_migrates_to_the_committed_v2_result() -> None:
    migrated = Manifest.from_json(GOLDEN_V1.read_bytes())
    assert migrated.schema_version == 2
    assert migrated.to_json() == GOLDEN_V1_MIGRATED.read_bytes()


def test_v1_manifest_migration_maps_processing_split_and_cache() -> None:
    m = Manifest.from_json(GOLDEN_V1.read_bytes())
    v1 = json.loads(GOLDEN_V1.read_bytes())
    assert m.preprocess[0].op == "scale" and m.preprocess[0].value == v1["preprocess"][0]["params"]["value"]
    assert m.preprocess[1].mean == tuple(v1["preprocess"][1]["params"]["mean"])
    assert m.postprocess[0].axis == 1
    assert m.split is not None and [c.tensors for c in m.split.cuts] == [tuple(v1["split"]["cut"])]
    assert m.split.cuts[0].head_file == v1["split"]["head_file"]
    assert m.cache is not None and (m.cache.mode, m.cache.ttl_s) == ("exact", v1["cache"]["ttl_s"])
    disabled = copy.deepcopy(v1)
    disabled["cache"]["enabled"] = False
    assert Manifest.from_dict(disabled).cache is None


def test_v1_golden_still_validates_against_the_released_v1_schema() -> None:
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA_V1.read_text()))
    assert not list(validator.iter_errors(json.loads(GOLDEN_V1.read_bytes())))


def test_v2_golden_fills_every_planned_field() -> None:
    data = _golden()
    for key in ("preprocess", "postprocess", "split", "cache", "estimates", "calibration", "provenance", "candidates"):
        assert data.get(key), key
    assert data["precision"]["excluded_nodes"] and data["cache"]["approximate"]
    statuses = {c["status"] for c in data["candidates"]["candidates"]}
    assert statuses == {"chosen", "passed", "error", "skipped"}


@pytest.mark.parametrize(
    ("step", "message"),
    [
        ({"op": "resize"}, "op 'resize' needs size"),
        ({"op": "normalize", "mean": [0.5], "std": [0.2, 0.3]}, "normalize: mean has 1 values, std 2"),
        ({"op": "blur"}, "'blur' is not one of"),
    ],
)
def test_manifest_processing_step_refused_with_what_it_needs(step: dict, message: str) -> None:
    data = _golden()
    data["preprocess"] = [step]
    with pytest.raises(ManifestError, match=re.escape(message)):
        Manifest.from_dict(data)


def test_manifest_failed_mark_consistent() -> None:
    data = _golden()
    data["validation"]["failures"] = ["top-1 agreement 0.95 < 0.98"]
    with pytest.raises(ManifestError, match=r"validation\.passed is true but validation\.failures"):
        Manifest.from_dict(data)
    data["validation"]["passed"] = False
    assert Manifest.from_dict(data).validation.failures == ("top-1 agreement 0.95 < 0.98",)
