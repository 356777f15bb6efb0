"""What converter SDKs print goes to a log while a target builds; the packager's progress stays visible."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from edgekit.targets.sdk_output import sdk_output_to
from tests.factories import confident_inputs, tiny_classifier
from tests.factories import package_small_data as package


def test_sdk_output_to_captures_fd_sys_and_logging_output_but_not_progress(
    capfd: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    logger = logging.getLogger("edgekit-test-sdk")
    handler = logging.StreamHandler(sys.stderr)  # like NNCF's and absl's console handlers
    logger.addHandler(handler)
    try:
        with sdk_output_to(tmp_path / "sdk.log", print) as say:
            print("python stdout")
            print("python stderr", file=sys.stderr)
            os.write(1, b"c++ stdout\n")
            os.write(2, b"c++ stderr\n")
            subprocess.run([sys.executable, "-c", "print('child process')"], check=True)
            logger.warning("sdk warning")
            say("[t] progress line")
    finally:
        logger.removeHandler(handler)
    out, err = capfd.readouterr()
    assert (out, err) == ("[t] progress line\n", "")
    log = (tmp_path / "sdk.log").read_text()
    for line in ("python stdout", "python stderr", "c++ stdout", "c++ stderr", "child process", "sdk warning"):
        assert line in log
    assert "progress line" not in log


def test_sdk_output_to_restores_the_console(capfd: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    before = (sys.stdout, sys.stderr)
    logger = logging.getLogger("edgekit-test-sdk-late")
    with sdk_output_to(tmp_path / "sdk.log", print):
        late = logging.StreamHandler()  # an SDK imported meanwhile binds its handler to the captured stderr
        logger.addHandler(late)
    try:
        assert (sys.stdout, sys.stderr) == before
        assert late.stream is sys.stderr  # not the closed log
        logger.warning("after the build")
        os.write(1, b"fd 1 after\n")
        print("print after")
    finally:
        logger.removeHandler(late)
    out, err = capfd.readouterr()
    assert out == "fd 1 after\nprint after\n"
    assert err == "after the build\n"


def test_sdk_output_to_prints_the_log_tail_when_the_build_fails(
    capfd: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with pytest.raises(RuntimeError, match="converter gave up"), sdk_output_to(tmp_path / "sdk.log", print):
        for i in range(30):
            print(f"sdk line {i}")
        raise RuntimeError("converter gave up")
    out, err = capfd.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert lines[0] == "last 20 of 30 lines the SDK printed before the error:"
    assert lines[1:] == [f"  | sdk line {i}" for i in range(10, 30)]


def test_package_intel_leaves_no_sdk_lines_on_stdout(
    capfd: pytest.CaptureFixture[str], keypair: tuple[Path, Path], tmp_path: Path
) -> None:
    # NNCF draws its "Statistics collection" progress bars on stdout; OpenVINO may log on stderr.
    model = tiny_classifier(tmp_path / "m.onnx")
    calib = {"input": confident_inputs(model, 40)}
    capfd.readouterr()
    result = package(
        model,
        targets="intel",
        precision="int8",
        calib=calib,
        key=keypair[0],
        name="m",
        out_dir=tmp_path,
        progress=print,
    )
    out, err = capfd.readouterr()
    assert "intel" in result.bundles
    lines = out.splitlines()
    assert "[intel] building int8" in lines
    assert any(re.fullmatch(r"\[intel\] candidate \d+: nncf int8 .*", line) for line in lines)
    assert lines[-1] == f"[intel] wrote {result.bundles['intel']}"
    assert all(line.startswith(("preparing ", "fp32 reference", "no evaluation data", "[intel] ")) for line in lines)
    assert err == ""
