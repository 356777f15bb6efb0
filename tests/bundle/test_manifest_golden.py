"""The manifest v1 contract: the committed golden manifest, the JSON Schema and the dataclasses
agree, byte for byte, and unknown keys are refused by both with their path named."""

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
GOLDEN = ROOT / "tests" / "golden" / "manifest_v1.json"
SCHEMA = ROOT / "edgekit" / "bundle" / "schema" / "manifest.v1.schema.json"

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
        "manifest.v1.schema.json is out of date: python -m tests.bundle.manifest_schema > " + str(SCHEMA)
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
    data["schema_version"] = 2
    with pytest.raises(ManifestError, match="newer than this agent understands"):
        Manifest.from_dict(data)
    assert list(_validator().iter_errors(data))
