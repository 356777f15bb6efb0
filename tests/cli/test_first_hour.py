"""The host CLI's first hour: every problem a new user hit, as the exact command and the
exact one-line output it gives now (hatch style). Packaging runs fp32 on a tiny model where the
precision does not matter, so that each test converts as little as possible."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from device_agents.cli import main as agent_main
from edgekit.cli import main
from tests.factories import confident_inputs, sample_inputs, tiny_classifier, tiny_dense


def _cli(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse's own errors (usage) exit from the parser
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def _agent(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    code = agent_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("first-hour")
    model = tiny_classifier(root / "tiny.onnx")
    np.savez(root / "calib.npz", input=confident_inputs(model, 250))  # 50 held out: no small-gate warning
    assert main(["keygen", "--out", str(root / "keys"), "--name", "k"]) == 0
    return {
        "root": root,
        "model": model,
        "calib": root / "calib.npz",
        "key": root / "keys/k.key",
        "pub": root / "keys/k.pub",
    }


def _package(capsys, ws: dict[str, Path], out: Path, *extra: object, model: object = None) -> tuple[int, str, str]:
    return _cli(
        capsys,
        "package",
        model or ws["model"],
        "--key",
        ws["key"],
        "--name",
        "m",
        "--version",
        1,
        "-o",
        out,
        *extra,
    )


def _error(err: str) -> str:
    """The one error line (progress lines, when not -q, come before it)."""
    lines = err.splitlines()
    assert lines and lines[-1].startswith(("edgekit: error: ", "edgekit package: error: ")), err
    return lines[-1]


# -- 1. --force did two jobs ----------------------------------------------------------------


def test_cli_package_force_is_gone_and_names_its_two_replacements(capsys, ws, tmp_path: Path) -> None:
    code, out, err = _package(capsys, ws, tmp_path, "--calib", ws["calib"], "--force")
    assert (code, out) == (2, "")
    assert err == (
        "edgekit package: error: --force is gone: use --overwrite to replace existing bundles, --allow-failed to "
        "write bundles that fail validation (marked failed; exit code 3)\n"
    )


def test_cli_package_existing_bundle_points_at_overwrite(capsys, ws, tmp_path: Path) -> None:
    args = ("--calib", ws["calib"], "--precision", "fp32", "-q")
    assert _package(capsys, ws, tmp_path, *args)[0] == 0
    code, _, err = _package(capsys, ws, tmp_path, *args)
    assert code == 2
    assert err == (
        f"edgekit: error: {tmp_path}/m-cpu-v1.ekb already exists; publish a higher --version, remove it, or pass "
        "--overwrite\n"
    )
    assert _package(capsys, ws, tmp_path, *args, "--overwrite")[0] == 0


def test_cli_allow_failed_bundle_exits_3_verify_warns_agent_refuses_unless_allowed(capsys, ws, tmp_path: Path) -> None:
    gate = "min_top1_agreement=1.5"
    code, out, err = _package(
        capsys, ws, tmp_path, "--calib", ws["calib"], "--precision", "fp32", "--tolerance", gate, "--allow-failed", "-q"
    )
    bundle = tmp_path / "m-cpu-v1.ekb"
    assert code == 3 and bundle.exists()
    assert out.splitlines()[2].endswith("FAILED")
    assert err == "edgekit: error: cpu failed validation; bundles written anyway (--allow-failed), marked failed\n"

    code, out, err = _cli(capsys, "verify", bundle, "--pubkey", ws["pub"])
    assert code == 0 and out.startswith(f"{bundle}: valid: m v1 for cpu")
    assert err.startswith("warning: m v1 for cpu failed validation when it was packaged (top-1 agreement with fp32 1")
    assert err.endswith("); edgekit-agent refuses it unless its agent.toml sets allow_failed_validation = true\n")

    agent_dir = tmp_path / "agent"
    agent_dir.mkdir()
    config = agent_dir / "agent.toml"
    config.write_text(f'store = "store"\ntrusted_keys = ["{ws["pub"]}"]\n')
    code, out, err = _agent(capsys, "install", bundle, "--config", config)
    assert (code, out) == (1, "")
    assert err.startswith("edgekit-agent: error: bundle m v1 failed validation when it was packaged")
    assert err.endswith(
        "; package it again so that it passes, or set allow_failed_validation = true at the top of agent.toml to "
        "take it anyway\n"
    )
    assert not list((agent_dir / "store").glob("models/*"))  # refused before anything was extracted
    config.write_text(f'allow_failed_validation = true\nstore = "store"\ntrusted_keys = ["{ws["pub"]}"]\n')
    code, out, _ = _agent(capsys, "install", bundle, "--config", config)
    assert code == 0 and out.startswith("installed m v1; self-test passed")


# -- 2. OS errors were tracebacks -----------------------------------------------------------


def test_cli_package_unwritable_out_dir_one_line_before_any_conversion(capsys, ws) -> None:
    code, out, err = _package(capsys, ws, Path("/proc/nope"), "--calib", ws["calib"])
    assert (code, out) == (2, "")
    assert err == (
        "edgekit: error: -o /proc/nope: cannot create or write this folder (no such file or directory); "
        "check the path\n"
    )  # no progress line: nothing was prepared or converted


def test_cli_package_out_dir_that_is_a_file(capsys, ws) -> None:
    code, out, err = _package(capsys, ws, ws["calib"], "--calib", ws["calib"])
    assert (code, out, err) == (
        2,
        "",
        f"edgekit: error: -o {ws['calib']}: is a file, not a folder; give a folder for the output\n",
    )


def test_cli_keygen_unwritable_folder_one_line(capsys) -> None:
    code, out, err = _cli(capsys, "keygen", "--out", "/proc/x")
    assert (code, out, err) == (1, "", "edgekit: error: /proc/x: no such file or directory; check the path\n")


def _busy_port() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s


def test_agent_run_on_a_port_in_use_one_line(capsys, ws, tmp_path: Path) -> None:
    with _busy_port() as busy:
        port = busy.getsockname()[1]
        config = tmp_path / "agent.toml"
        config.write_text(f'store = "store"\nlisten = "127.0.0.1:{port}"\ntrusted_keys = ["{ws["pub"]}"]\n')
        done = subprocess.run(
            [sys.executable, "-m", "device_agents.cli", "run", "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == (
        f"edgekit-agent: error: listen = '127.0.0.1:{port}' ({config}): cannot listen there (address already in "
        "use); the address is in use; stop what listens there or choose another port"
    )


def test_cli_fleet_serve_on_a_port_in_use_one_line(capsys, tmp_path: Path) -> None:
    with _busy_port() as busy:
        port = busy.getsockname()[1]
        code, out, err = _cli(capsys, "fleet", "serve", tmp_path, "--port", port)
    assert (code, out) == (2, "")
    assert err == (
        f"edgekit: error: --bind 127.0.0.1 --port {port}: cannot listen there (address already in use); the address "
        "is in use; stop what listens there or choose another port\n"
    )


# -- 3. misleading messages -----------------------------------------------------------------


def test_cli_package_a_folder_lists_the_onnx_files_in_it(capsys, ws, tmp_path: Path) -> None:
    code, out, err = _package(capsys, ws, tmp_path, "--calib", ws["calib"], model=ws["root"])
    assert (code, out) == (2, "")
    assert err == f"edgekit: error: model {ws['root']} is a folder, not an ONNX file; it holds {ws['model']}\n"


def test_cli_package_git_lfs_pointer_says_git_lfs_pull(capsys, ws, tmp_path: Path) -> None:
    pointer = tmp_path / "model.onnx"
    pointer.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:4d7a\nsize 2729763\n")
    code, _, err = _package(capsys, ws, tmp_path / "out", "--calib", ws["calib"], "-q", model=pointer)
    assert code == 2
    assert err == (
        f"edgekit: error: {pointer} is a git-LFS pointer, not the model itself; fetch it with `git lfs pull` (or "
        "download the file)\n"
    )


def test_cli_package_truncated_onnx_says_truncated(capsys, ws, tmp_path: Path) -> None:
    cut = tmp_path / "cut.onnx"
    data = ws["model"].read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    code, _, err = _package(capsys, ws, tmp_path / "out", "--calib", ws["calib"], "-q", model=cut)
    assert code == 2
    assert err == (
        f"edgekit: error: {cut} ({len(data) // 2} bytes) starts like an ONNX model but cannot be read to the end: "
        "truncated or corrupt; copy or export it again\n"
    )


def test_cli_package_input_shape_mismatch_blames_the_flag(capsys, ws, tmp_path: Path) -> None:
    model = tiny_classifier(tmp_path / "dyn.onnx", dynamic_size=True)
    code, _, err = _package(
        capsys, ws, tmp_path, "--calib", ws["calib"], "--input-shape", "input=1x3x224x224", "-q", model=model
    )
    assert code == 2
    assert err == (
        "edgekit: error: calibration data: input 'input' has shape [250, 3, 16, 16], expected [N, 3, 224, 224] "
        "(axis 2 is 16, --input-shape input=1x3x224x224 sets it to 224)\n"
    )


def test_cli_package_input_shape_against_a_fixed_dim_names_the_model(capsys, ws, tmp_path: Path) -> None:
    code, _, err = _package(capsys, ws, tmp_path, "--calib", ws["calib"], "--input-shape", "input=1x3x224x224", "-q")
    assert code == 2
    assert err == (
        "edgekit: error: --input-shape input=1x3x224x224: axis 2 is 224, but the model fixes it to 16 "
        "([batch, 3, 16, 16])\n"
    )


def test_cli_package_tolerance_for_the_other_output_kind_is_an_error(capsys, ws, tmp_path: Path) -> None:
    code, _, err = _package(capsys, ws, tmp_path, "--calib", ws["calib"], "--tolerance", "min_cosine=0.9999", "-q")
    assert code == 2
    assert err == (
        "edgekit: error: tolerance.min_cosine: gates dense outputs, but the model's first output 'probs' "
        "['batch', 10] is a classifier (one score vector per sample); use max_top1_drop or min_top1_agreement\n"
    )
    dense = tiny_dense(tmp_path / "dense.onnx")
    np.savez(tmp_path / "d.npz", image=sample_inputs(10))
    code, _, err = _package(
        capsys, ws, tmp_path, "--calib", tmp_path / "d.npz", "--tolerance", "min_top1_agreement=0.9", "-q", model=dense
    )
    assert code == 2 and err.startswith("edgekit: error: tolerance.min_top1_agreement: gates classifier outputs")


# -- 5. calibration from real data ----------------------------------------------------------


def test_cli_package_fp16_needs_no_calibration_data(capsys, ws, tmp_path: Path) -> None:
    np.savez(tmp_path / "eval.npz", input=confident_inputs(ws["model"], 50))
    code, out, err = _package(capsys, ws, tmp_path, "--precision", "fp16", "--eval", tmp_path / "eval.npz", "-q")
    assert (code, err) == (0, "")
    # fp16 of a tiny model may run slower than fp32 here: shipped all the same, and said so
    assert out.splitlines()[2].startswith("cpu ") and out.splitlines()[2].endswith(
        ("passed", "passed, slower than fp32")
    )
    code, _, err = _package(capsys, ws, tmp_path / "b", "--precision", "int8", "-q")
    assert (code, err) == (
        2,
        "edgekit: error: package: int8 needs calibration data (--calib CALIB.npz, an .npy or a folder of images)\n",
    )


def test_cli_package_npy_calibration_for_a_one_input_model(capsys, ws, tmp_path: Path) -> None:
    np.save(tmp_path / "calib.npy", confident_inputs(ws["model"], 250))
    code, out, err = _package(capsys, ws, tmp_path, "--precision", "fp32", "--calib", tmp_path / "calib.npy", "-q")
    assert (code, err) == (0, "")
    assert out.splitlines()[-1] == f"cpu: {tmp_path}/m-cpu-v1.ekb"


def test_cli_package_uses_labels_inside_the_eval_npz(capsys, ws, tmp_path: Path) -> None:
    x = confident_inputs(ws["model"], 50)
    labels = np.arange(50) % 10
    np.savez(tmp_path / "eval.npz", input=x, labels=labels)
    code, out, err = _package(
        capsys, ws, tmp_path, "--precision", "fp32", "--calib", ws["calib"], "--eval", tmp_path / "eval.npz", "-q"
    )
    assert (code, err) == (0, "")
    assert "acc " in out.splitlines()[2]  # accuracy against the labels, not only agreement
    code, _, err = _package(
        capsys,
        ws,
        tmp_path / "b",
        "--precision",
        "fp32",
        "--calib",
        ws["calib"],
        "--eval",
        tmp_path / "eval.npz",
        "--labels",
        tmp_path / "l.npy",
        "-q",
    )
    assert (code, err) == (
        2,
        "edgekit: error: evaluation data holds a 'labels' array and --labels was given too; keep one of them\n",
    )


SMALL_GATE = (  # a gate on n < 50 held-out samples split off the calibration data (--allow-small-eval below 10)
    "warning: the validation gate is decided on {n} held-out samples (fewer than 50), too few to trust its numbers; "
    "give --eval data with 50 or more samples, or --calib data with 250 or more (every 5th sample is held out)\n"
)


def _image_folder(root: Path, model: Path, n: int = 12) -> Path:
    from PIL import Image

    rng = np.random.default_rng(3)
    for i in range(n):
        cls = root / f"class{i % 2}"
        cls.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(cls / f"img{i:02d}.png")
    return root


def test_cli_calib_make_writes_a_reproducible_npz_with_its_hash(capsys, ws, tmp_path: Path) -> None:
    images = _image_folder(tmp_path / "images", ws["model"])
    pre = "size=16x16,fit=letterbox,mean=0.5/0.5/0.5,std=0.25/0.25/0.25"
    args = ("calib", "make", images, "--model", ws["model"], "--preprocess", pre, "--labels-from-folders")
    code, out, err = _cli(capsys, *args, "-o", tmp_path / "a.npz")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == (
        f"wrote {tmp_path}/a.npz: 12 images as 'input' float32 [12, 3, 16, 16] (size=16x16,fit=letterbox,layout=NCHW,"
        "scale=255,mean=0.5/0.5/0.5,std=0.25/0.25/0.25,pad=0), labels for 2 classes"
    )
    code, out2, _ = _cli(capsys, *args, "-o", tmp_path / "b.npz")
    assert code == 0 and out2.splitlines()[1] == lines[1]  # same images, same sha256
    assert (tmp_path / "a.npz").read_bytes() == (tmp_path / "b.npz").read_bytes()
    import hashlib

    assert lines[1] == f"sha256 {hashlib.sha256((tmp_path / 'a.npz').read_bytes()).hexdigest()}"
    with np.load(tmp_path / "a.npz") as data:
        assert data["labels"].tolist() == [0] * 6 + [1] * 6  # sorted by path: class0/..., then class1/...
        assert data["input"].shape == (12, 3, 16, 16)


def test_cli_package_takes_the_npz_calib_make_wrote_with_labels_from_folders(capsys, ws, tmp_path: Path) -> None:
    # calib make --labels-from-folders writes a 'labels' array; package --calib reads it back as
    # the classes of the samples it holds out (no --eval), and leaves it aside with --eval
    images = _image_folder(tmp_path / "images", ws["model"], n=20)
    pre = "size=16x16,mean=0.5/0.5/0.5,std=0.25/0.25/0.25"
    code, _, err = _cli(capsys, "calib", "make", images, "--model", ws["model"], "--preprocess", pre,
                        "--labels-from-folders", "-o", tmp_path / "data.npz")  # fmt: skip
    assert (code, err) == (0, "")
    code, _, err = _package(capsys, ws, tmp_path / "a", "--calib", tmp_path / "data.npz", "--precision", "fp32", "-q",
                            "--allow-small-eval")  # fmt: skip
    assert (code, err) == (0, SMALL_GATE.format(n=4))
    from edgekit.bundle.archive import read_unverified_manifest

    m, _ = read_unverified_manifest(tmp_path / "a" / "m-cpu-v1.ekb")
    assert m.validation.samples == 4 and m.validation.fp32_top1_accuracy is not None  # 4 of 20 held out, labelled
    code, _, err = _package(capsys, ws, tmp_path / "b", "--calib", tmp_path / "data.npz", "--eval", tmp_path /
                            "data.npz", "--precision", "fp32")  # fmt: skip
    assert code == 0
    assert "calibration data: its 'labels' array is not used (the evaluation data, --eval, is what is gated)" in err
    np.save(tmp_path / "l.npy", np.zeros(20, np.int64))
    code, _, err = _package(capsys, ws, tmp_path / "c", "--calib", tmp_path / "data.npz", "--labels",
                            tmp_path / "l.npy", "--precision", "fp32", "-q")  # fmt: skip
    assert (code, err) == (
        2,
        "edgekit: error: calibration data holds a 'labels' array and --labels was given too; keep one of them\n",
    )


def test_cli_package_from_an_image_folder_with_preprocess(capsys, ws, tmp_path: Path) -> None:
    images = _image_folder(tmp_path / "images", ws["model"])
    code, out, err = _package(
        capsys,
        ws,
        tmp_path,
        "--precision",
        "fp32",
        "--calib",
        images,
        "--preprocess",
        "fit=center-crop,channels=BGR",
        "-q",
        "--allow-small-eval",
    )
    assert (code, err) == (0, SMALL_GATE.format(n=2))
    assert out.splitlines()[-1] == f"cpu: {tmp_path}/m-cpu-v1.ekb"
    from edgekit.bundle.archive import read_unverified_manifest

    m, _ = read_unverified_manifest(tmp_path / "m-cpu-v1.ekb")
    assert [s.op for s in m.preprocess] == ["channel_order", "center_crop", "scale", "layout", "cast"]
    assert m.preprocess[1].size == (16, 16) and m.preprocess[2].value == pytest.approx(1 / 255)
    assert m.calibration is not None and (m.calibration.samples, m.calibration.source) == (
        10,
        str(images),
    )  # 2 of 12 held out
    code, out, _ = _cli(capsys, "inspect", tmp_path / "m-cpu-v1.ekb")
    assert (
        "pre-processing: channel_order order=BGR -> center_crop size=16x16 interpolation=bilinear -> "
        "scale value=0.00392157 -> layout layout=NCHW -> cast dtype=float32" in out.splitlines()
    )
    code, _, err = _package(capsys, ws, tmp_path / "b", "--calib", images, "--preprocess", "fit=letterbx", "-q")
    assert (code, err) == (
        2,
        "edgekit: error: --preprocess fit=letterbx: choose from stretch, letterbox, center-crop; did you mean "
        "'letterbox'?\n",
    )


# -- 6. names ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["--precision", "INT8"],
            "edgekit: error: --precision 'INT8' is not one of fp32, fp16, bf16, int8, int8-weights, int4-weights, "
            "palettize6, palettize4, auto; did you mean 'int8'?",
        ),
        (
            ["--precision", "w8a8"],
            "edgekit: error: --precision 'w8a8' is not one of fp32, fp16, bf16, int8, int8-weights, int4-weights, "
            "palettize6, palettize4, auto; did you mean 'int8'?",
        ),
        (["--targt", "cpu"], "edgekit package: error: unrecognized argument --targt; did you mean --target?"),
        (["--nme", "x"], "edgekit package: error: unrecognized argument --nme; did you mean --name?"),
        (
            ["--target", "tensorrtx"],
            "edgekit: error: --target: unknown target 'tensorrtx' (choose from cpu, intel, coral, jetson, apple); "
            "did you mean 'tensorrt'?",
        ),
        (
            ["--target", "apple", "--precision", "int4-weights"],
            "edgekit: error: --precision 'int4-weights' is not available for target 'apple' (it builds fp16, int8, "
            "int8-weights, palettize6, palettize4, fp32, auto); nearest: 'int8-weights'",
        ),
    ],
)
def test_cli_package_names_get_a_suggestion(capsys, ws, tmp_path: Path, argv: list[str], line: str) -> None:
    code, out, err = _package(capsys, ws, tmp_path, "--calib", ws["calib"], "-q", *argv)
    assert (code, out, err) == (2, "", line + "\n")


def test_cli_package_runtime_names_stand_for_their_target_with_a_note(capsys, ws, tmp_path: Path) -> None:
    code, _, err = _package(
        capsys, ws, tmp_path, "--calib", ws["calib"], "-q", "--target", "onnxruntime", "--precision", "fp32"
    )
    assert (code, err) == (0, "note: --target onnxruntime is the cpu target\n")
    from edgekit.targets import parse_targets

    notes: list[str] = []
    assert parse_targets("openvino,tensorrt,tflite,edgetpu,coreml", notes.append) == [
        "intel",
        "jetson",
        "coral",
        "apple",
    ]
    assert notes[0] == "--target openvino is the intel target" and len(notes) == 5


def test_cli_command_typo_gets_a_suggestion(capsys) -> None:
    code, out, err = _cli(capsys, "pakage")
    assert (code, out) == (2, "")
    assert err.startswith("edgekit: error: argument COMMAND: invalid choice: 'pakage' (choose from 'keygen', ")
    assert err.endswith("); did you mean 'package'?\n") and len(err.splitlines()) == 1


def test_cli_package_signing_key_flag_and_key_alias(capsys, ws, tmp_path: Path) -> None:
    code, _, err = _cli(
        capsys,
        "package",
        ws["model"],
        "--signing-key",
        ws["key"],
        "--calib",
        ws["calib"],
        "--precision",
        "fp32",
        "--name",
        "m",
        "--version",
        1,
        "-o",
        tmp_path,
        "-q",
    )
    assert (code, err) == (0, "")  # and _package above uses --key


def test_cli_publish_key_is_tls_key_now(capsys, ws) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["publish", str(ws["model"]), "--broker", "mqtt://127.0.0.1:1", "--fleet", "f", "--key", "k.key"])
    assert exc.value.code == 2
    assert capsys.readouterr().err == (
        "edgekit publish: error: --key is gone: it is --tls-key now (the private key of the --cert client "
        "certificate); bundles are signed by `edgekit package --signing-key`\n"
    )


def test_agent_verbose_after_the_subcommand_and_version(capsys, tmp_path: Path) -> None:
    code, out, err = _agent(capsys, "status", "--config", tmp_path / "none.toml", "-v")
    assert (code, out) == (2, "")
    assert err == f"edgekit-agent: error: config file {tmp_path}/none.toml does not exist; pass --config PATH\n"
    with pytest.raises(SystemExit) as exc:
        agent_main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out == "edgekit-agent 0.1.0\n"


def test_cli_package_list_options_shows_every_target_option(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["package", "--list-options"])
    assert exc.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert "cpu.activations: 'auto' | 'uint8' | 'int8' = 'auto'" in lines
    assert "jetson.workspace_mb: int = 1024" in lines
    assert {line.split(".")[0] for line in lines} == {"cpu", "intel", "coral", "jetson", "apple"}


def test_cli_fleet_serve_help_is_plain_text(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["fleet", "serve", "--help"])
    out = capsys.readouterr().out
    assert "``" not in out and "edgekit fleet serve DIR: a static HTTP file server" in out


# -- 7. output for CI and people --------------------------------------------------------------


def test_cli_package_json_alone_on_stdout(capsys, ws, tmp_path: Path) -> None:
    code, out, err = _package(capsys, ws, tmp_path, "--calib", ws["calib"], "--precision", "fp32", "--json")
    assert code == 0
    doc = json.loads(out)  # nothing but the JSON on stdout
    assert doc["exit_code"] == 0 and doc["passed"] is True
    assert doc["bundles"] == {"cpu": f"{tmp_path}/m-cpu-v1.ekb"}
    row = doc["rows"][0]
    assert (row["target"], row["precision"], row["label"], row["passed"]) == ("cpu", "fp32", "w32a32", True)
    v = row["validation"]
    assert v["top1_agreement"] == 1.0 and v["latency_p90_ms"] >= v["latency_p50_ms"] > 0 and v["latency_iqr_ms"] >= 0
    assert set(doc["timings_s"]) == {"prepare", "cpu"}
    assert "preparing tiny.onnx" in err  # progress went to stderr

    code, out, err = _package(capsys, ws, tmp_path, "--calib", ws["calib"], "--json", "-q")
    assert code == 2 and json.loads(out) == {
        "passed": False,
        "exit_code": 2,
        "error": f"{tmp_path}/m-cpu-v1.ekb already exists; publish a higher --version, remove it, or pass --overwrite",
    }


def test_cli_help_documents_exit_codes(capsys) -> None:
    for argv in (["--help"], ["package", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        out = capsys.readouterr().out
        assert "exit codes:\n  0  done" in out
        assert "  3  a target failed its validation gate" in out and "  5  the MQTT broker" in out


def test_cli_package_log_dir_keeps_the_converter_output(capsys, ws, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    code, _, _ = _package(capsys, ws, tmp_path, "--calib", ws["calib"], "--precision", "int8", "--log-dir", logs, "-q")
    assert code == 0
    assert [p.name for p in logs.iterdir()] == ["cpu.log"]


def test_progress_on_a_terminal_shows_target_k_of_n_and_elapsed() -> None:
    import io

    from edgekit.progress import PackageProgress

    stream = io.StringIO()
    progress = PackageProgress(["cpu", "intel"], stream=stream, fancy=False)
    progress("preparing m.onnx")
    progress("[intel] building int8")
    progress("[intel] wrote out/m-intel-v1.ekb")
    lines = stream.getvalue().splitlines()
    assert [re.sub(r"^ *\d+\.\ds ", "", x) for x in lines] == [
        "preparing m.onnx",
        "[2/2 intel] building int8",
        "[2/2 intel] wrote out/m-intel-v1.ekb",
    ]
    fancy = io.StringIO()
    bar = PackageProgress(["cpu", "intel"], stream=fancy, fancy=True)
    bar("[intel] building int8")
    bar.close()
    assert "[2/2 intel] building int8" in fancy.getvalue()


def test_package_api_is_typed_mypy_catches_a_misspelt_keyword(tmp_path: Path) -> None:
    import edgekit

    assert (Path(edgekit.__file__).parent / "py.typed").exists()
    snippet = tmp_path / "use.py"
    snippet.write_text('import edgekit\n\nedgekit.package("m.onnx", targetz=["cpu"])\n')
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--follow-imports=silent", str(snippet)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1
    assert f'{snippet}:3: error: Unexpected keyword argument "targetz" for "package"' in done.stdout


def test_package_api_takes_the_request_fields_keyword_only_after_the_model() -> None:
    import dataclasses
    import inspect

    import edgekit
    from edgekit.packaging.request import PackageRequest

    params = list(inspect.signature(edgekit.package).parameters.values())
    fields = [f for f in dataclasses.fields(PackageRequest)]
    assert [(p.name, p.default) for p in params] == [
        (f.name, f.default if f.name != "model" else p.empty) for f, p in zip(fields, params, strict=True)
    ]
    assert [p.kind for p in params] == [inspect.Parameter.POSITIONAL_OR_KEYWORD] + [inspect.Parameter.KEYWORD_ONLY] * (
        len(params) - 1
    )
    call = edgekit.package
    with pytest.raises(TypeError):
        call("m.onnx", ["cpu"])  # type: ignore[misc]  # the point: positional settings are refused


# -- edgekit bench ----------------------------------------------------------------------------


def test_cli_bench_times_a_bundle_at_each_batch_size(capsys, ws, tmp_path: Path) -> None:
    assert _package(capsys, ws, tmp_path, "--calib", ws["calib"], "--precision", "fp32", "-q")[0] == 0
    bundle = tmp_path / "m-cpu-v1.ekb"
    args = ("bench", bundle, "--batch", "1,4", "--warmup", "1", "--repeats", "10", "--budget-s", "0.5")
    code, out, err = _cli(capsys, *args, "--pubkey", ws["pub"])
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].startswith("m v1 (cpu, onnxruntime ") and lines[0].endswith(", 1 warm-up")
    assert lines[1].split() == ["batch", "calls", "p50", "p90", "p99", "throughput"]
    for line, batch in zip(lines[2:], (1, 4), strict=True):
        assert re.fullmatch(rf" *{batch} +10 +(\d+\.\d{{3}} ms +){{3}}\d+\.\d/s", line)
    code, out, _ = _cli(capsys, *args, "--json")
    doc = json.loads(out)
    assert [t["batch"] for t in doc["timings"]] == [1, 4]
    assert all(t["p99_ms"] >= t["p90_ms"] >= t["p50_ms"] > 0 and t["samples_per_s"] > 0 for t in doc["timings"])
    code, _, err = _cli(capsys, "bench", bundle, "--batch", "1,x")
    assert (code, err) == (2, "edgekit: error: --batch '1,x': expected sizes such as 1,8,32\n")


def test_table_marks_an_artifact_slower_than_fp32() -> None:
    # The engine sets validation.slower_than_fp32; the table must not show such a result as a plain "passed".
    from edgekit.bundle.manifest import Tolerance, Validation
    from edgekit.packaging.result import Row
    from edgekit.validate.table import format_table

    v = Validation(
        passed=True,
        kind="classifier",
        samples=8,
        tolerance=Tolerance(),
        top1_agreement=1.0,
        size_bytes=1024,
        latency_p50_ms=2.0,
        fp32_latency_p50_ms=1.0,
        latency_p90_ms=2.5,
        latency_iqr_ms=0.2,
        slower_than_fp32=True,
    )
    row = format_table([Row("cpu", "int8", "w8a8", "m", v, bundle=Path("b.ekb"))]).splitlines()[2]
    assert row.endswith("2.000 / 2.500 ms (0.200)  0.50x          passed, slower than fp32")


def test_cli_log_level_before_or_after_the_subcommand() -> None:
    from edgekit.cli import build_parser

    base = ["package", "m.onnx", "--key", "k", "--name", "n", "--version", "1", "-o", "o"]
    parser = build_parser()
    assert parser.parse(["--log-level", "debug", *base]).log_level == "debug"
    assert parser.parse([*base, "--log-level", "info"]).log_level == "info"
    assert parser.parse(base).log_level == "warning"


def test_agent_verbose_anywhere_turns_on_debug_logging() -> None:
    from device_agents.cli import build_parser

    parser = build_parser()
    assert parser.parse(["-v", "status", "--config", "a.toml"]).verbose is True
    assert parser.parse(["status", "--config", "a.toml", "-v"]).verbose is True
    assert parser.parse(["run", "--config", "a.toml"]).verbose is False


def test_agent_os_error_is_one_line(capsys, tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text('store = "/proc/nope/store"\ntrusted_keys = ["k.pub"]\n')
    code, out, err = _agent(capsys, "status", "--config", config)
    assert (code, out, err) == (1, "", "edgekit-agent: error: /proc/nope: no such file or directory; check the path\n")


def test_cli_package_json_on_a_failed_gate_exit_3(capsys, ws, tmp_path: Path) -> None:
    code, out, err = _package(
        capsys, ws, tmp_path, "--calib", ws["calib"], "--precision", "fp32", "--tolerance",
        "min_top1_agreement=1.5", "--json", "-q",
    )  # fmt: skip
    assert code == 3
    doc = json.loads(out)
    assert (doc["exit_code"], doc["passed"], doc["bundles"]) == (3, False, {})
    assert doc["rows"][0]["failures"] == doc["rows"][0]["validation"]["failures"] != []
    assert doc["error"].startswith("cpu fp32 failed validation on 50 held-out samples: top-1 agreement with fp32 1")
    assert err.startswith("edgekit: error: cpu fp32 failed validation")
