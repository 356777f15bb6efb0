"""examples.demo: the main job, end to end with the cpu target and a real agent."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from examples import demo


def test_demo_packages_digits_and_serves_it_through_a_real_agent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = demo.main(["--targets", "cpu", "--workdir", str(tmp_path / "demo"), "--samples", "4"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert re.search(r"^\s+cpu\s+int8 \(w8a8\).*passed$", out, re.MULTILINE), out
    assert "installed digits v1" in out
    answers = re.findall(r"image \d: predicted (\d), true (\d)", out)
    assert len(answers) == 4
    assert sum(p == t for p, t in answers) >= 3
    assert (tmp_path / "demo" / "bundles" / "digits-cpu-v1.ekb").is_file()
    assert not (tmp_path / "demo" / "agent" / "store" / "daemon.json").exists(), "the agent was not stopped"


def test_demo_refuses_to_wipe_a_folder_it_did_not_make(tmp_path: Path) -> None:
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(demo.DemoError, match="was not made by the demo"):
        demo.scratch_dir(tmp_path)
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_demo_scratch_dir_is_wiped_on_the_next_run(tmp_path: Path) -> None:
    work = demo.scratch_dir(tmp_path / "w")
    (work / "old.ekb").write_text("x")
    demo.scratch_dir(tmp_path / "w")
    assert not (work / "old.ekb").exists()


def test_default_targets_leave_out_targets_without_a_module(monkeypatch: pytest.MonkeyPatch) -> None:
    from edgekit.targets import TARGETS

    monkeypatch.setitem(TARGETS, "nosuch", "edgekit.targets.nosuch_module:NoSuchTarget")
    chosen, skipped = demo.importable_targets()
    assert "nosuch" not in chosen and "cpu" in chosen
    assert any(s.startswith("nosuch: not available") for s in skipped)


def test_demo_default_precisions_are_buildable_by_all_five_targets() -> None:
    # The demo packages every target in one call: its defaults must pass the packager's precision check.
    from edgekit.targets import TARGETS, get_target
    from edgekit.targets.precisions import choose_precisions

    chosen, skipped = demo.importable_targets()
    assert (chosen, skipped) == (list(TARGETS), [])
    precisions = choose_precisions(demo.DEFAULT_PRECISIONS, {t: get_target(t) for t in chosen})
    assert precisions == {"cpu": "int8", "intel": "int8", "coral": "int8", "jetson": "int8", "apple": "palettize4"}
