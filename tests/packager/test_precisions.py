"""Per-target precision: parsing ``--precision``, resolving it per target, refusing what a target cannot build."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from edgekit.errors import ConfigError
from edgekit.targets import get_target
from edgekit.targets.precisions import choose_precisions, parse_precision_arg, resolve_precisions
from tests.factories import confident_inputs, tiny_classifier
from tests.factories import package_small_data as package

APPLE_BUILDS = "fp16, int8, int8-weights, palettize6, palettize4, fp32, auto"


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("int8", "int8"),
        (" fp16 ", "fp16"),
        ("int8,apple=int8-weights", {"*": "int8", "apple": "int8-weights"}),
        ("cpu=int8,apple=palettize4", {"cpu": "int8", "apple": "palettize4"}),
        ("apple=palettize4, int8", {"apple": "palettize4", "*": "int8"}),
        (" cpu = fp16 ", {"cpu": "fp16"}),
    ],
)
def test_parse_precision_arg_default_and_per_target(text: str, parsed: object) -> None:
    assert parse_precision_arg(text) == parsed


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "--precision '': expected PRECISION[,TARGET=PRECISION...] such as int8,apple=int8-weights"),
        ("int8,", "--precision 'int8,': expected PRECISION[,TARGET=PRECISION...] such as int8,apple=int8-weights"),
        ("int8,fp16", "--precision 'int8,fp16': more than one default precision"),
        ("apple=fp16,apple=fp32", "--precision 'apple=fp16,apple=fp32': target 'apple' given twice"),
        ("=int8", "--precision '=int8': '=int8' is not TARGET=PRECISION such as apple=int8-weights"),
        ("int8,apple=", "--precision 'int8,apple=': 'apple=' is not TARGET=PRECISION"),
    ],
)
def test_parse_precision_arg_malformed_says_the_form(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_precision_arg(text)


def test_resolve_precisions_default_then_overrides() -> None:
    targets = ["cpu", "jetson", "apple"]
    assert resolve_precisions("fp16", targets) == {"cpu": "fp16", "jetson": "fp16", "apple": "fp16"}
    assert resolve_precisions({"*": "fp16", "apple": "palettize4"}, targets) == {
        "cpu": "fp16",
        "jetson": "fp16",
        "apple": "palettize4",
    }
    # No default given: the targets not named get int8, what --precision defaults to.
    assert resolve_precisions({"apple": "palettize4"}, targets) == {
        "cpu": "int8",
        "jetson": "int8",
        "apple": "palettize4",
    }


@pytest.mark.parametrize(
    ("precision", "message"),
    [
        ({"jetson": "fp16"}, "--precision jetson=fp16: a precision for a target not being packaged (packaging: cpu)"),
        (
            {"aple": "fp16"},
            "--precision aple=fp16: unknown target 'aple' (choose from cpu, intel, coral, jetson, apple); "
            "did you mean 'apple'?",
        ),
        ({"cpu": 8}, "--precision cpu: expected a precision name, got int"),
    ],
)
def test_resolve_precisions_refuses_targets_not_packaged(precision: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve_precisions(precision, ["cpu"])


def _targets(*names: str) -> dict:
    return {n: get_target(n) for n in names}


def test_choose_precisions_default_int8_is_w8a8_for_apple_too() -> None:
    # for apple, int8 means W8A8 once the target builds it (it does: activation quantization
    # on the torch intermediate), so the default precision packages all five targets.
    chosen = choose_precisions("int8", _targets("cpu", "intel", "coral", "jetson", "apple"))
    assert set(chosen.values()) == {"int8"}


def test_choose_precisions_refuses_what_apple_cannot_build_with_the_way_out() -> None:
    # Nothing is mapped onto something else: apple has no int4-weights, and the error says what to write instead.
    with pytest.raises(ConfigError) as err:
        choose_precisions("int4-weights", _targets("cpu", "apple"))
    assert str(err.value) == (
        f"--precision 'int4-weights' is not available for target 'apple' (it builds {APPLE_BUILDS}); "
        "nearest: 'int8-weights'; to keep int4-weights for the other targets, give apple its own: "
        "--precision int4-weights,apple=int8-weights"
    )


def test_choose_precisions_names_the_override_that_is_wrong() -> None:
    with pytest.raises(ConfigError) as err:
        choose_precisions({"*": "fp16", "cpu": "palettize4"}, _targets("cpu", "apple"))
    assert str(err.value) == (
        "--precision 'cpu=palettize4' is not available for target 'cpu' "
        "(it builds fp32, fp16, int8, int8-weights, int4-weights, auto)"
    )
    with pytest.raises(ConfigError, match=re.escape("--precision 'apple=int9' is not one of fp32, ")):
        choose_precisions({"apple": "int9"}, _targets("cpu", "apple"))


def test_choose_precisions_all_five_targets_with_one_override() -> None:
    chosen = choose_precisions(
        parse_precision_arg("int8,apple=int8-weights"), _targets("cpu", "intel", "coral", "jetson", "apple")
    )
    assert chosen == {"cpu": "int8", "intel": "int8", "coral": "int8", "jetson": "int8", "apple": "int8-weights"}


def test_package_mixed_precisions_builds_each_target_at_its_own(keypair, tmp_path: Path) -> None:
    model = tiny_classifier(tmp_path / "m.onnx")
    lines: list[str] = []
    result = package(
        model,
        targets="cpu,jetson",
        precision={"*": "int8", "jetson": "fp16"},
        calib={"input": confident_inputs(model, 40)},
        key=keypair[0],
        name="m",
        out_dir=tmp_path,
        progress=lines.append,
    )
    assert sorted(result.bundles) == ["cpu", "jetson"]
    assert "[cpu] building int8" in lines and "[jetson] building fp16" in lines
    assert result.manifests["cpu"].precision.label == "w8a8"
    assert result.manifests["jetson"].precision.weights == "fp16"
    assert [(r.target, r.precision) for r in result.rows] == [("cpu", "int8"), ("jetson", "fp16")]
