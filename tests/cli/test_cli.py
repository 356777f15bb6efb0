"""The ``edgekit`` command: exact output and exit codes of keygen, package, inspect, verify, run,
and the one error path (``edgekit: error: <message>``, exit code from the error class)."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from edgekit import __version__
from edgekit.bundle import key_id, load_private_key, load_public_key
from edgekit.bundle.manifest import Manifest
from edgekit.cli import main
from tests.factories import confident_inputs, make_cpu_bundle, sample_inputs, tiny_classifier


def _cli(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _package(
    capsys, ws: dict[str, Path], out_dir: Path, *extra: object, model: Path | None = None, calib: Path | None = None
) -> tuple[int, str, str]:
    """``edgekit package`` of the workspace model as m v1, quietly, with ``extra`` arguments."""
    calib = calib or ws["root"] / "calib.npz"
    return _cli(
        capsys,
        "package",
        model or ws["model"],
        "--calib",
        calib,
        "--key",
        ws["key"],
        "--name",
        "m",
        "--version",
        1,
        "-o",
        out_dir,
        "-q",
        *extra,
    )


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cli")
    model = tiny_classifier(root / "tiny.onnx")
    np.savez(root / "calib.npz", input=confident_inputs(model, 250))  # 50 held out: no small-gate warning
    np.savez(root / "x.npz", input=sample_inputs(3, seed=5))
    assert main(["keygen", "--out", str(root / "keys"), "--name", "k"]) == 0
    assert main(["keygen", "--out", str(root / "other"), "--name", "o"]) == 0
    code = main(
        [
            "package",
            str(model),
            "--target",
            "cpu",
            "--precision",
            "int8",
            "--calib",
            str(root / "calib.npz"),
            "--key",
            str(root / "keys/k.key"),
            "--name",
            "tiny",
            "--version",
            "2",
            "-o",
            str(root / "out"),
            "-q",
        ]
    )
    assert code == 0
    return {
        "root": root,
        "model": model,
        "bundle": root / "out" / "tiny-cpu-v2.ekb",
        "key": root / "keys/k.key",
        "pub": root / "keys/k.pub",
        "other_pub": root / "other/o.pub",
    }


def _kid(pub: Path) -> str:
    return key_id(load_public_key(pub))


# -- keygen ---------------------------------------------------------------------------------


def test_cli_keygen_writes_private_key_0600_and_prints_key_id(capsys, tmp_path: Path) -> None:
    code, out, err = _cli(capsys, "keygen", "--out", tmp_path, "--name", "site")
    assert code == 0 and err == ""
    pub = tmp_path / "site.pub"
    assert out == f"wrote {tmp_path}/site.key (private, unencrypted) and {pub}\nkey id {_kid(pub)}\n"
    assert (tmp_path / "site.key").stat().st_mode & 0o777 == 0o600


def test_cli_keygen_encrypts_with_passphrase_from_environment(capsys, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("EDGEKIT_KEY_PASSPHRASE", "s3cret")
    code, out, _ = _cli(capsys, "keygen", "--out", tmp_path)
    assert code == 0 and "(private, encrypted)" in out
    assert b"ENCRYPTED" in (tmp_path / "edgekit.key").read_bytes()
    load_private_key(tmp_path / "edgekit.key")  # the same variable unlocks it
    monkeypatch.setenv("EDGEKIT_KEY_PASSPHRASE", "wrong")
    code, _, err = _cli(
        capsys,
        "package",
        tmp_path / "m.onnx",
        "--calib",
        tmp_path / "c.npz",
        "--key",
        tmp_path / "edgekit.key",
        "--name",
        "m",
        "--version",
        "1",
        "-o",
        tmp_path,
    )
    assert code == 2 and err.startswith(f"edgekit: error: signing key {tmp_path}/edgekit.key cannot be read")


def test_cli_keygen_refuses_to_overwrite(capsys, workspace) -> None:
    code, out, err = _cli(capsys, "keygen", "--out", workspace["root"] / "keys", "--name", "k")
    assert (code, out) == (2, "")
    assert err == f"edgekit: error: {workspace['key']} already exists; choose another --name or remove it first\n"


# -- package --------------------------------------------------------------------------------


def test_cli_package_prints_progress_table_and_bundle_path(capsys, workspace, tmp_path: Path) -> None:
    code, out, err = _cli(
        capsys,
        "package",
        workspace["model"],
        "--target",
        "cpu",
        "--precision",
        "fp32",
        "--calib",
        workspace["root"] / "calib.npz",
        "--key",
        workspace["key"],
        "--name",
        "tiny",
        "--version",
        "5",
        "-o",
        tmp_path,
        "--expires-days",
        "3",
        "--tolerance",
        "min_top1_agreement=0.99",
    )
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == (
        "target precision size size vs fp32 accuracy vs fp32 p50 / p90 (IQR) speed vs fp32 result".split()
    )
    assert re.search(r" \d+\.\d{3} / \d+\.\d{3} ms \(\d+\.\d{3}\) ", lines[2])  # latency with its spread
    assert set(lines[1]) == {"-", " "}
    assert lines[2].startswith("cpu ") and "fp32 (w32a32)" in lines[2] and lines[2].endswith("passed")
    from edgekit.host_cpu import describe_host_cpu

    assert lines[3:] == [f"timed on this host: {describe_host_cpu()}", f"cpu: {tmp_path}/tiny-cpu-v5.ekb"]
    progress = [re.sub(r"^ *\d+\.\ds ", "", line) for line in err.splitlines()]
    assert all(re.match(r"^ *\d+\.\ds ", line) for line in err.splitlines())  # elapsed time first
    assert progress[0] == "preparing tiny.onnx"
    assert f"[1/1 cpu] wrote {tmp_path}/tiny-cpu-v5.ekb" in progress
    assert "[1/1 cpu] building fp32" in progress


@pytest.mark.parametrize(
    ("extra", "code", "message"),
    [
        (["--option", "cpu.max_candidates=many"], 2, "targets.cpu.max_candidates: expected an integer, got 'many'"),
        (
            ["--option", "jetson.workspace_mb=64"],
            2,
            "targets.jetson: --option for a target not being packaged (packaging: cpu)",
        ),
        (["--option", "cpu"], 2, "--option 'cpu': expected TARGET.KEY=VALUE such as cpu.activations=uint8"),
        (["--tolerance", "min_cosine"], 2, "--tolerance 'min_cosine': expected KEY=VALUE such as min_cosine=0.95"),
        (["--tolerance", "min_cosine=high"], 2, "tolerance.min_cosine: expected a number >= 0 or 'none', got 'high'"),
        (
            ["--input-shape", "input=1x3xbig"],
            2,
            "--input-shape 'input=1x3xbig': expected NAME=DIMxDIMx... such as input=1x3x224x224",
        ),
        (
            ["--precision", "palettize4"],
            2,
            "--precision 'palettize4' is not available for target 'cpu' (it builds fp32, fp16, int8, int8-weights, "
            "int4-weights, auto)",
        ),
        (["--target", "gpux"], 2, "--target: unknown target 'gpux' (choose from cpu, intel, coral, jetson, apple)"),
        (
            ["--target", "cpu,apple", "--precision", "int4-weights"],
            2,
            "--precision 'int4-weights' is not available for target 'apple' (it builds fp16, int8, int8-weights, "
            "palettize6, palettize4, fp32, auto); nearest: 'int8-weights'; to keep int4-weights for the other targets, "
            "give apple its own: --precision int4-weights,apple=int8-weights",
        ),
        (
            ["--precision", "int8,jetson=fp16"],
            2,
            "--precision jetson=fp16: a precision for a target not being packaged (packaging: cpu)",
        ),
        (
            ["--precision", "int8,fp16"],
            2,
            "--precision 'int8,fp16': more than one default precision; give one "
            "default and at most one TARGET=PRECISION each",
        ),
        (["--expires-days", "-1"], 2, "--expires-days must be >= 0 (0 = never expires), got -1"),
        (
            ["--device-profile", "/nonexistent-edgekit/p.json"],
            2,
            "--device-profile /nonexistent-edgekit/p.json: cannot read it (No such file or directory)",
        ),
    ],
)
def test_cli_package_bad_arguments_one_error_line(
    capsys, workspace, tmp_path: Path, extra, code: int, message: str
) -> None:
    got, out, err = _package(capsys, workspace, tmp_path, *extra)
    assert (got, out, err) == (code, "", f"edgekit: error: {message}\n")


def test_cli_package_non_onnx_model_exit_2(capsys, workspace, tmp_path: Path) -> None:
    model = tmp_path / "model.onnx"
    model.write_bytes(b"")
    code, out, err = _package(capsys, workspace, tmp_path, model=model)
    assert (code, out) == (2, "")
    assert err == (
        f"edgekit: error: {model} is not an ONNX model (no graph nodes or outputs were read); export it to ONNX first\n"
    )


def test_cli_package_wrong_calibration_names_input_exit_2(capsys, workspace, tmp_path: Path) -> None:
    calib = tmp_path / "c.npz"
    np.savez(calib, image=sample_inputs(4))
    code, _, err = _package(capsys, workspace, tmp_path, calib=calib)
    assert code == 2
    assert err == "edgekit: error: calibration data: array 'image' is not a model input (inputs: input)\n"


def test_cli_package_failing_validation_prints_table_then_error_exit_3(capsys, workspace, tmp_path: Path) -> None:
    code, out, err = _package(
        capsys, workspace, tmp_path, "--precision", "fp16", "--tolerance", "min_top1_agreement=1.5"
    )
    assert code == 3
    assert out.splitlines()[2].endswith("FAILED, no bundle")
    assert err.startswith(
        "edgekit: error: cpu fp16 failed validation on 50 held-out samples: top-1 agreement with "
        "fp32 1, needs >= 1.5 (off by 0.5); fallback chain: ort fp16, the target's float candidate, failed the "
        "final gate\nno bundle was written"
    )
    assert not list(tmp_path.glob("*.ekb"))


def test_cli_package_default_precision_with_a_per_target_override(capsys, workspace, tmp_path: Path) -> None:
    # The command from the issue, on two targets: apple builds no int8, so it gets its own precision.
    code, out, err = _package(
        capsys,
        workspace,
        tmp_path,
        "--target",
        "cpu,apple",
        "--precision",
        "int8,apple=int8-weights",
        "--option",
        "apple.weight_threshold=0",  # the tiny model's weights are below coremltools' default threshold
    )
    assert (code, err) == (0, "")
    rows = out.splitlines()[2:4]
    # a tiny model may run slower in int8 than in fp32 here: still shipped, and said so
    assert rows[0].startswith("cpu ") and "int8 (w8a8)" in rows[0]
    assert rows[0].endswith(("passed", "passed, slower than fp32"))
    assert rows[1].startswith("apple ") and "int8-weights (w8a16)" in rows[1] and rows[1].endswith("passed")
    assert out.splitlines()[4].startswith("timed on ")
    # apple freezes the dynamic batch axis, and says so before the bundles
    assert out.splitlines()[5:] == [
        "apple static shapes: input 'input' axis 0 (batch) frozen to 1",
        f"cpu: {tmp_path}/m-cpu-v1.ekb",
        f"apple: {tmp_path}/m-apple-v1.ekb",
    ]


# -- inspect / verify / run -----------------------------------------------------------------


def test_cli_inspect_shows_identity_precision_validation_and_op_placement(capsys, workspace) -> None:
    code, out, err = _cli(capsys, "inspect", workspace["bundle"])
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == f"tiny v2  target cpu  runtime onnxruntime {ort.__version__}"
    assert lines[2] == f"signed by key {_kid(workspace['pub'])} (not verified here; run `edgekit verify`)"
    assert lines[4].startswith("precision w8a8 (int8 weights, ")
    assert "  input: float32 [batch, 3, 16, 16] NCHW" in lines
    assert any(x.startswith("validation passed (classifier, 50 samples, host onnxruntime") for x in lines)
    placement = [x for x in lines if x.startswith("op placement (onnxruntime ")]
    assert len(placement) == 1 and placement[0].endswith(" accelerated, 0 fallback")
    assert any(x.startswith("  CPUExecutionProvider: QLinearConv x") for x in lines)


def test_cli_inspect_validation_line_lists_every_measure_the_manifest_holds(capsys, workspace) -> None:
    # one list (validate.metrics.MEASURES): mean abs error was recorded but never printed
    from edgekit.bundle.archive import read_unverified_manifest
    from edgekit.validate.metrics import MEASURES

    v = read_unverified_manifest(workspace["bundle"])[0].validation
    assert v.mean_abs_error is not None
    code, out, _ = _cli(capsys, "inspect", workspace["bundle"])
    line = next(x for x in out.splitlines() if x.startswith("validation passed ("))
    want = ", ".join(f"{k.replace('_', ' ')} {getattr(v, k):.4g}" for k in MEASURES if getattr(v, k) is not None)
    assert code == 0 and line.endswith("): " + want) and "mean abs error" in want


def test_cli_inspect_prints_every_candidate_the_choice_why_and_the_choice_as_provenance(capsys, workspace) -> None:
    from edgekit.bundle.archive import read_unverified_manifest

    manifest, _ = read_unverified_manifest(workspace["bundle"])
    report = manifest.candidates
    assert report is not None
    code, out, _ = _cli(capsys, "inspect", workspace["bundle"])
    lines = out.splitlines()
    assert code == 0 and "provenance: prepare (edgekit) -> prepare (edgekit) -> select (edgekit optimize)" in lines
    first = lines.index(next(x for x in lines if x.startswith("candidates (objective latency, ")))
    rows = lines[first + 1 : first + 1 + len(report.candidates)]
    for row, c in zip(rows, report.candidates, strict=True):
        assert row.split()[0] == c.status and f" {c.id}: " in row
        if c.status == "skipped":
            assert row.endswith(c.reason)
        else:
            assert f"top-1 agree {c.top1_agreement:.1%}, p50 {c.latency_p50_ms:.3f} ms ({c.speedup_vs_fp32:.2f}x" in row
    chosen = next(c for c in report.candidates if c.status == "chosen")
    assert lines[first + 1 + len(report.candidates)] == (
        f"chosen: {chosen.id}, {chosen.speedup_vs_fp32:.2f}x ORT fp32: {chosen.reason}"
    )
    assert chosen.reason.startswith("fastest within the budget")
    # the p50 the summary and the validation print are the one the choice used
    assert manifest.validation.latency_p50_ms == chosen.latency_p50_ms
    step = manifest.provenance[-1]
    assert (step.kind, step.tool, step.settings["candidate"]) == ("select", "edgekit optimize", chosen.id)
    assert step.notes.startswith(f"{chosen.reason} (on ")
    assert f"{report.selection_samples} calibration samples" in step.notes


def test_cli_inspect_json_prints_the_stored_manifest(capsys, workspace) -> None:
    code, out, _ = _cli(capsys, "inspect", workspace["bundle"], "--json")
    assert code == 0
    with tarfile.open(workspace["bundle"], "r:gz") as tar:
        stored = tar.extractfile("manifest.json").read()  # type: ignore[union-attr]  # a regular member
    assert out.encode() == stored
    assert Manifest.from_json(stored).name == "tiny"


def test_cli_verify_valid_bundle_exit_0(capsys, workspace) -> None:
    code, out, err = _cli(capsys, "verify", workspace["bundle"], "--pubkey", workspace["pub"])
    assert (code, err) == (0, "")
    assert (
        out
        == f"{workspace['bundle']}: valid: tiny v2 for cpu, signed by key {_kid(workspace['pub'])}, 2 files checked\n"
    )


def test_cli_verify_untrusted_key_exit_1(capsys, workspace) -> None:
    code, out, err = _cli(capsys, "verify", workspace["bundle"], "--pubkey", workspace["other_pub"])
    assert (code, out) == (1, "")
    assert err == (
        f"edgekit: error: bundle is signed by untrusted key {_kid(workspace['pub'])} "
        f"(trusted: {_kid(workspace['other_pub'])}); add its .pub to trusted_keys or re-sign the bundle\n"
    )


def test_cli_verify_tampered_file_exit_1(capsys, workspace, tmp_path: Path) -> None:
    tampered = tmp_path / "t.ekb"
    with tarfile.open(workspace["bundle"], "r:gz") as src, tarfile.open(tampered, "w:gz") as dst:
        for info in src.getmembers():
            data = src.extractfile(info).read()  # type: ignore[union-attr]  # all members are regular files
            if info.name == "model.onnx":
                data = data[:-1] + bytes([data[-1] ^ 0xFF])
            dst.addfile(info, io.BytesIO(data))
    code, out, err = _cli(capsys, "verify", tampered, "--pubkey", workspace["pub"])
    assert (code, out) == (1, "")
    assert err == "edgekit: error: model.onnx: sha256 does not match the manifest; the bundle was altered\n"


def test_cli_verify_expired_exit_1(capsys, workspace, tmp_path: Path) -> None:
    old = make_cpu_bundle(tmp_path / "old.ekb", workspace["model"], workspace["key"], expires="2021-05-01T00:00:00Z")
    code, _, err = _cli(capsys, "verify", old, "--pubkey", workspace["pub"])
    assert code == 1
    assert err == "edgekit: error: bundle tiny v1 expired at 2021-05-01T00:00:00Z; ask for a fresh one\n"


def test_cli_verify_truncated_exit_1(capsys, workspace, tmp_path: Path) -> None:
    cut = tmp_path / "cut.ekb"
    cut.write_bytes(workspace["bundle"].read_bytes()[:-200])
    code, _, err = _cli(capsys, "verify", cut, "--pubkey", workspace["pub"])
    assert code == 1 and err.startswith("edgekit: error: ") and ("truncated" in err or "ends early" in err)


def test_cli_run_through_device_runtime_saves_outputs(capsys, workspace, tmp_path: Path) -> None:
    y = tmp_path / "y.npz"
    code, out, err = _cli(
        capsys,
        "run",
        workspace["bundle"],
        "--input",
        workspace["root"] / "x.npz",
        "--output",
        y,
        "--pubkey",
        workspace["pub"],
    )
    assert (code, err) == (0, "")
    with np.load(y) as saved:
        probs = saved["probs"]
    assert probs.shape == (3, 10)
    assert out == f"wrote {y}\nprobs: float32 [3, 10] top-1 {probs.argmax(1).tolist()}\n"


def test_cli_run_without_pubkey_says_the_signature_was_not_checked(capsys, workspace) -> None:
    code, out, err = _cli(capsys, "run", workspace["bundle"], "--input", workspace["root"] / "x.npz")
    assert code == 0 and out.startswith("probs: float32 [3, 10] top-1 ")
    assert err == f"note: signature not checked (no --pubkey); signed by key {_kid(workspace['pub'])} per the bundle\n"


def test_cli_run_missing_input_exit_1(capsys, workspace, tmp_path: Path) -> None:
    x = tmp_path / "x.npz"
    np.savez(x, image=sample_inputs(1))
    code, out, err = _cli(capsys, "run", workspace["bundle"], "--input", x, "--pubkey", workspace["pub"])
    assert (code, out) == (1, "")
    assert err == f"edgekit: error: --input {x} has no array 'input' (or in_input); it has image\n"


def test_cli_run_bad_input_or_output_paths_one_error_line(capsys, workspace, tmp_path: Path) -> None:
    npy = tmp_path / "x.npy"
    np.save(npy, sample_inputs(1))
    code, out, err = _cli(capsys, "run", workspace["bundle"], "--input", npy, "--pubkey", workspace["pub"])
    assert (code, out) == (2, "") and err.startswith(f"edgekit: error: --input {npy} holds a single array")
    missing = tmp_path / "no-such-folder" / "y.npz"
    x = workspace["root"] / "x.npz"
    code, out, err = _cli(capsys, "run", workspace["bundle"], "--input", x, "--output", missing)
    assert (code, out) == (2, "")
    assert err.endswith(
        f"edgekit: error: --output {missing}: folder {missing.parent} does not exist; create it first\n"
    )


def test_cli_run_accepts_golden_style_keys(capsys, workspace, tmp_path: Path) -> None:
    x = tmp_path / "g.npz"
    np.savez(x, in_input=sample_inputs(2))
    code, out, _ = _cli(capsys, "run", workspace["bundle"], "--input", x, "--pubkey", workspace["pub"])
    assert code == 0 and out.startswith("probs: float32 [2, 10]")


# -- the command itself ---------------------------------------------------------------------


def test_cli_help_lists_every_subcommand_including_fleet(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for command in ("keygen", "package", "inspect", "verify", "run", "publish", "fleet"):
        assert f"    {command} " in out


def test_cli_console_script_runs(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("edgekit")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "edgekit.cli"]
    done = subprocess.run([*cmd, "--version"], capture_output=True, text=True, env={**os.environ}, check=False)
    assert (done.returncode, done.stdout) == (0, f"edgekit {__version__}\n")


def test_cli_runs_as_python_dash_m_edgekit() -> None:
    """``python -m edgekit`` is the command too (a venv whose bin/ is not on PATH)."""
    done = subprocess.run(
        [sys.executable, "-m", "edgekit", "--version"], capture_output=True, text=True, env={**os.environ}, check=False
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, f"edgekit {__version__}\n", "")


def test_cli_package_keep_candidates_refuses_a_folder_with_files(capsys, workspace, tmp_path: Path) -> None:
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "old.txt").write_text("x")
    got, out, err = _package(capsys, workspace, tmp_path, "--keep-candidates", str(tmp_path / "kept"))
    assert (got, out, err) == (
        2,
        "",
        f"edgekit: error: --keep-candidates {tmp_path}/kept: give a new or empty folder\n",
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "bench: give a BUNDLE or --profile DIR (one of them)"),
        (["--profile", "{dir}"],
         "bench --profile: give --out profile.json (what `edgekit package --device-profile` reads)"),
        (["--profile", "{dir}", "--out", "p.json"], "--profile {dir}: no candidates.json there; write the folder with "
         "`edgekit package ... --keep-candidates DIR`"),
        (["x.ekb", "--out", "p.json"], "bench: --out is for --profile; a bundle's timing prints (--json for JSON)"),
    ],
)  # fmt: skip
def test_cli_bench_profile_arguments_one_error_line(capsys, tmp_path: Path, argv, message: str) -> None:
    assert main(["bench", *(a.format(dir=tmp_path) for a in argv)]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"edgekit: error: {message.format(dir=tmp_path)}\n")
