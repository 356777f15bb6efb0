"""The host and agent CLIs' first hour, part two: the exact command and the exact output it gives."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from device_agents.cli import main as agent_main
from edgekit.cli import main
from tests.cli.test_first_hour import _cli
from tests.factories import confident_inputs, tiny_classifier


def _agent(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    try:
        code = agent_main([str(a) for a in argv])
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("first-hour-two")
    model = tiny_classifier(root / "tiny.onnx")
    np.savez(root / "calib.npz", input=confident_inputs(model, 250))  # 50 held out: a gate worth its numbers
    assert main(["keygen", "--out", str(root / "keys"), "--name", "k"]) == 0
    out = root / "dist"
    argv = ["package", str(model), "--key", str(root / "keys/k.key"), "--name", "m", "--version", "1"]
    assert main([*argv, "-o", str(out), "--calib", str(root / "calib.npz"), "--precision", "fp32", "-q"]) == 0
    return {
        "root": root,
        "model": model,
        "calib": root / "calib.npz",
        "key": root / "keys/k.key",
        "pub": root / "keys/k.pub",
        "bundle": out / "m-cpu-v1.ekb",
    }


def _into_closed_pipe(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run a CLI whose stdout is a pipe nobody reads any more (what `| head` leaves after its lines)."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            [sys.executable, "-m", *argv], stdout=write, stderr=subprocess.PIPE, text=True, timeout=120, cwd=cwd
        )
    finally:
        os.close(write)


def test_cli_inspect_into_a_closed_pipe_ends_quietly(ws) -> None:
    done = _into_closed_pipe("edgekit", "inspect", str(ws["bundle"]), cwd=ws["root"])
    assert (done.returncode, done.stderr) == (141, "")


def test_cli_list_options_into_a_closed_pipe_ends_quietly(ws) -> None:
    done = _into_closed_pipe("edgekit", "package", "--list-options", cwd=ws["root"])  # prints while parsing
    assert (done.returncode, done.stderr) == (141, "")


def test_agent_status_into_a_closed_pipe_ends_quietly(ws) -> None:
    config = ws["root"] / "agent.toml"
    config.write_text(f'store = "store"\ntrusted_keys = ["{ws["pub"]}"]\n')
    done = _into_closed_pipe("device_agents.cli", "status", "--config", str(config), cwd=ws["root"])
    assert (done.returncode, done.stderr) == (141, "")


def _package_signed_with(capsys, ws, key: Path, out: Path, *extra: object) -> tuple[int, str, str]:
    argv = ("--name", "m", "--version", 1, "-o", out, "--calib", ws["calib"], "--precision", "fp32", "-q", *extra)
    return _cli(capsys, "package", ws["model"], "--key", key, *argv)


def test_cli_package_public_key_as_signing_key_is_named(capsys, ws, tmp_path: Path) -> None:
    code, out, err = _package_signed_with(capsys, ws, ws["pub"], tmp_path)
    assert (code, out) == (2, "")
    assert err == f"edgekit: error: signing key {ws['pub']} is a public key; sign with its private key {ws['key']}\n"


def test_cli_public_key_without_its_pair_points_at_keygen(capsys, ws, tmp_path: Path) -> None:
    lone = tmp_path / "lone.pub"
    lone.write_bytes(ws["pub"].read_bytes())
    code, _, err = _package_signed_with(capsys, ws, lone, tmp_path)
    assert code == 2
    assert err == (
        f"edgekit: error: signing key {lone} is a public key; sign with the NAME.key that `edgekit keygen` wrote\n"
    )


def _commands() -> str:
    """The host CLI's commands as argparse lists them (every new command joins the list)."""
    import argparse

    from edgekit.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return ", ".join(repr(c) for c in sub.choices)


def test_cli_misspelt_command_did_you_mean_before_its_flags(capsys, ws) -> None:
    code, out, err = _cli(capsys, "pakage", ws["model"], "--target", "cpu")
    assert (code, out) == (2, "")
    assert err == (
        f"edgekit: error: argument COMMAND: invalid choice: 'pakage' (choose from {_commands()}); did you mean "
        "'package'?\n"
    )


def test_cli_misspelt_subcommand_after_a_flag_with_a_value(capsys) -> None:
    code, _, err = _cli(capsys, "--log-level", "info", "fleet", "sevre", "dir", "--port", "1")
    assert code == 2
    assert err == (
        "edgekit fleet: error: argument COMMAND: invalid choice: 'sevre' (choose from 'status', 'serve', 'refresh', "
        "'keys', 'acl'); did you mean 'serve'?\n"
    )


def test_agent_misspelt_command_did_you_mean_the_transposed_one(capsys) -> None:
    code, out, err = _agent(capsys, "stauts", "--config", "agent.toml")
    assert (code, out) == (2, "")
    from device_agents.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    listed = ", ".join(repr(c) for c in sub.choices)  # every new command joins the list
    assert err.endswith(f"invalid choice: 'stauts' (choose from {listed}); did you mean 'status'?\n")


# -- fewer flags before a first try ---------------------------------------------------------


def test_cli_package_first_try_needs_no_key_name_version_or_out(capsys, ws, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    key, pub = tmp_path / "config/edgekit/development.key", tmp_path / "config/edgekit/development.pub"
    code, _, err = _cli(capsys, "package", ws["model"], "--calib", ws["calib"], "--precision", "fp32", "-q")
    from edgekit.bundle import key_id, load_public_key

    kid = key_id(load_public_key(pub))
    trust = f'devices accept these bundles only if their agent.toml lists trusted_keys = ["{pub}"]'
    ship = "for bundles you ship, make a key with `edgekit keygen` and pass --signing-key"
    assert (code, err) == (
        0,
        f"warning: no --signing-key: signed with the development key {key} (made now, key id {kid}); {trust}; {ship}\n",
    )
    assert (tmp_path / "dist/tiny-cpu-v1.ekb").is_file()
    code, _, err = _cli(capsys, "package", ws["model"], "--calib", ws["calib"], "--precision", "fp32", "-q")
    assert (code, err.splitlines()) == (
        0,
        [
            "note: --version 2 (one more than dist/tiny-cpu-v1.ekb)",
            f"warning: no --signing-key: signed with the development key {key} (made on an earlier run, key id "
            f"{kid}); {trust}; {ship}",
        ],
    )
    code, out, _ = _cli(capsys, "verify", "dist/tiny-cpu-v2.ekb", "--pubkey", pub)
    assert code == 0 and out.startswith("dist/tiny-cpu-v2.ekb: valid: tiny v2 for cpu")


def test_cli_package_device_names_stand_for_their_target_with_a_note(capsys, ws, tmp_path: Path) -> None:
    code, _, err = _package_signed_with(capsys, ws, ws["key"], tmp_path, "--target", "raspberrypi")
    assert (code, err) == (0, "note: --target raspberrypi is the cpu target (ONNX Runtime on its CPU)\n")
    from edgekit.targets import parse_targets

    notes: list[str] = []
    assert parse_targets("rpi,arm64,jetson-orin,coral-usb,mac", notes.append) == ["cpu", "jetson", "coral", "apple"]
    assert notes == [
        "--target rpi is the cpu target (ONNX Runtime on its CPU)",
        "--target arm64 is the cpu target (ONNX Runtime on its CPU)",
        "--target jetson-orin is the jetson target (TensorRT on its GPU)",
        "--target coral-usb is the coral target (LiteRT with the Edge TPU delegate)",
        "--target mac is the apple target (Core ML on the Neural Engine, GPU or CPU)",
    ]


def test_agent_config_found_from_env_then_cwd(capsys, ws, tmp_path: Path, monkeypatch) -> None:
    from device_agents.cli import SYSTEM_CONFIG

    here, there = tmp_path / "here", tmp_path / "there"
    for folder in (here, there):
        folder.mkdir()
        (folder / "agent.toml").write_text(f'store = "store"\ntrusted_keys = ["{ws["pub"]}"]\n')
    monkeypatch.chdir(here)
    monkeypatch.delenv("EDGEKIT_AGENT_CONFIG", raising=False)
    code, out, _ = _agent(capsys, "status")
    assert (code, out.splitlines()[0]) == (0, f"agent: not running; store {here / 'store'}")
    monkeypatch.setenv("EDGEKIT_AGENT_CONFIG", str(there / "agent.toml"))
    code, out, _ = _agent(capsys, "status")
    assert (code, out.splitlines()[0]) == (0, f"agent: not running; store {there / 'store'}")
    monkeypatch.delenv("EDGEKIT_AGENT_CONFIG")
    monkeypatch.chdir(tmp_path)
    if SYSTEM_CONFIG.exists():
        pytest.skip(f"{SYSTEM_CONFIG} exists on this machine")
    assert _agent(capsys, "status") == (
        2,
        "",
        "edgekit-agent: error: no agent config: give --config FILE, set EDGEKIT_AGENT_CONFIG, or put agent.toml in "
        "this folder or at /etc/edgekit/agent.toml\n",
    )


# -- what was shipped, and on what it was timed ---------------------------------------------


def test_cli_package_names_the_shipped_candidate_and_where_it_was_timed(capsys, ws, tmp_path: Path) -> None:
    from edgekit.bundle.archive import read_unverified_manifest
    from edgekit.host_cpu import describe_host_cpu

    code, out, _ = _cli(
        capsys, "package", ws["model"], "--key", ws["key"], "-o", tmp_path, "--calib", ws["calib"], "-q"
    )
    manifest, _ = read_unverified_manifest(tmp_path / "tiny-cpu-v1.ekb")
    assert manifest.candidates is not None
    shipped = f"{manifest.candidates.chosen} on onnxruntime"
    table = out.splitlines()
    assert code == 0 and table[2].startswith(f"cpu     int8 (w8a8) \u2192 {shipped}  ")
    assert table[3] == f"timed on this host: {describe_host_cpu()}"
    assert manifest.validation.measured_on.endswith(f" on {describe_host_cpu()}")
    code, out, _ = _cli(
        capsys, "package", ws["model"], "--key", ws["key"], "-o", tmp_path, "--calib", ws["calib"], "-q", "--json"
    )
    (row,) = json.loads(out)["rows"]
    second, _ = read_unverified_manifest(tmp_path / "tiny-cpu-v2.ekb")  # timed again: maybe another candidate
    assert second.candidates is not None and row["shipped"] == f"{second.candidates.chosen} on onnxruntime"
    assert row["timed_on"] == f"this host: {describe_host_cpu()}" and row["result"].startswith("passed")


def test_host_cpu_names_the_features_that_decide_int8_speed(tmp_path: Path) -> None:
    from edgekit.host_cpu import cpu_flags, describe_host_cpu

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni amx_tile\n")
    assert describe_host_cpu(cpu_flags(info), "x86_64") == "x86_64 AVX-512 VNNI AMX"
    info.write_text("processor\t: 0\nFeatures\t: fp asimd asimdhp asimddp\n")
    assert describe_host_cpu(cpu_flags(info), "aarch64") == "aarch64 NEON dot-product FP16"
    assert describe_host_cpu(set(), "x86_64") == "x86_64"


@pytest.mark.skipif(shutil.which("edgetpu_compiler") is not None, reason="the Edge TPU compiler is installed here")
def test_cli_coral_without_the_edge_tpu_compiler_says_cpu_only_everywhere(capsys, ws, tmp_path: Path) -> None:
    argv = ("package", ws["model"], "--key", ws["key"], "-o", tmp_path, "--calib", ws["calib"], "--target", "coral")
    code, out, err = _cli(capsys, *argv, "--input-shape", "input=1x3x16x16", "--require-accelerator")
    assert (code, out) == (3, "")
    assert err == (
        "edgekit: error: --require-accelerator: edgetpu_compiler is not on PATH, so the coral bundle would run on the "
        "CPU only (LiteRT, not compiled for the Edge TPU); install the Edge TPU compiler (package edgetpu-compiler "
        "from Coral's Debian repository, https://coral.ai/docs/edgetpu/compiler/; x86-64 only) or give its path "
        "with --option coral.edgetpu_compiler=PATH\n"
    )
    assert not list(tmp_path.iterdir())  # refused before any conversion
    code, out, _ = _cli(capsys, *argv, "--input-shape", "input=1x3x16x16", "-q", "--json")
    (row,) = json.loads(out)["rows"]
    assert code == 0 and row["result"].startswith("passed (LiteRT CPU only: not compiled for the Edge TPU)")
    assert row["shapes"] == "static shapes: input 'input' axis 0 (batch) frozen to 1"  # the table's line, too
    code, out, _ = _cli(capsys, "inspect", tmp_path / "tiny-coral-v1.ekb")
    assert out.splitlines()[0].endswith("  (LiteRT CPU only: not compiled for the Edge TPU)")


def test_cli_package_from_images_without_preprocess_says_which_it_used(capsys, ws, tmp_path: Path) -> None:
    from tests.cli.test_first_hour import _image_folder

    images = _image_folder(tmp_path / "images", ws["model"])
    code, _, err = _package_signed_with(
        capsys, ws, ws["key"], tmp_path / "out", "--calib", images, "--allow-small-eval"
    )
    assert code == 0
    assert err.splitlines() == [
        f"note: --calib {images}: 12 images read as 'input' with the default pre-processing: resize size=16x16 "
        "interpolation=bilinear -> scale value=0.00392157 -> layout layout=NCHW -> cast dtype=float32; "
        "pass --preprocess KEY=V,... if the model was trained otherwise",
        "warning: the validation gate is decided on 2 held-out samples (fewer than 50), too few to trust its "
        "numbers; give --eval data with 50 or more samples, or --calib data with 250 or more (every 5th sample is "
        "held out)",
    ]
    # recorded: in the manifest (the agent applies the same steps to an image request) and in the report
    from edgekit.bundle.archive import read_unverified_manifest
    from edgekit.validate.preprocess import describe_steps

    used = "resize size=16x16 interpolation=bilinear -> scale value=0.00392157 -> layout layout=NCHW -> cast "
    used += "dtype=float32"
    manifest, _ = read_unverified_manifest(tmp_path / "out/m-cpu-v1.ekb")
    assert describe_steps(manifest.preprocess) == used
    assert f"Images read with: {used}." in (tmp_path / "out/m-cpu-v1.report.md").read_text().splitlines()
    assert json.loads((tmp_path / "out/m-cpu-v1.report.json").read_text())["preprocess"] == used


# -- a gate on few held-out samples -----------------------------------------------------------


def test_cli_package_gate_on_fewer_than_10_held_out_samples_is_refused(capsys, ws, tmp_path: Path) -> None:
    np.savez(tmp_path / "few.npz", input=confident_inputs(ws["model"], 20))
    argv = ("package", ws["model"], "--key", ws["key"], "-o", tmp_path / "out", "--calib", tmp_path / "few.npz", "-q")
    code, out, err = _cli(capsys, *argv)
    assert (code, out) == (2, "")
    assert err == (
        "edgekit: error: the validation gate would be decided on 4 held-out samples (fewer than 10); give --eval "
        "data with 50 or more samples, or --calib data with 250 or more (every 5th sample is held out), or pass "
        "--allow-small-eval\n"
    )
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())  # refused before converting
    code, _, err = _cli(capsys, *argv, "--allow-small-eval")
    assert (code, err) == (
        0,
        "warning: the validation gate is decided on 4 held-out samples (fewer than 50), too few to trust its "
        "numbers; give --eval data with 50 or more samples, or --calib data with 250 or more (every 5th sample is "
        "held out)\n",
    )


def test_cli_package_gate_on_fewer_than_50_eval_samples_warns_with_the_number(capsys, ws, tmp_path: Path) -> None:
    np.savez(tmp_path / "eval.npz", input=confident_inputs(ws["model"], 12, seed=3))
    code, _, err = _package_signed_with(capsys, ws, ws["key"], tmp_path, "--eval", tmp_path / "eval.npz")
    assert (code, err) == (
        0,
        "warning: the validation gate is decided on 12 held-out samples (fewer than 50), too few to trust its "
        "numbers; give --eval data with 50 or more samples\n",
    )


def test_package_api_small_gate_raises_or_warns(ws, tmp_path: Path) -> None:
    from edgekit import package
    from edgekit.errors import CalibrationDataError, EdgekitWarning

    few = {"input": confident_inputs(ws["model"], 20)}
    kw = {"key": ws["key"], "out_dir": tmp_path, "precision": "fp32"}
    with pytest.raises(CalibrationDataError, match="decided on 4 held-out samples"):
        package(ws["model"], calib=few, **kw)
    with pytest.warns(EdgekitWarning, match="decided on 4 held-out samples"):
        result = package(ws["model"], calib=few, allow_small_eval=True, **kw)
    assert result.passed and result.manifests["cpu"].validation.samples == 4


# -- fp32/fp16 without data -------------------------------------------------------------------


def test_cli_package_fp32_without_data_draws_inputs_and_says_so(capsys, ws, tmp_path: Path) -> None:
    from edgekit.bundle.archive import read_unverified_manifest

    argv = ("package", ws["model"], "--key", ws["key"], "-o", tmp_path, "--precision", "fp32", "-q")
    code, _, err = _cli(capsys, *argv)
    drawn = "50 inputs drawn within the declared shapes (seed 0): 'input' float32 [N, 3, 16, 16] standard normal"
    assert (code, err) == (
        0,
        f"warning: no --calib or --eval data: validated and golden vectors on {drawn}; the gate shows the artifact "
        "computes what the source model does on these, not its accuracy on your data\n",
    )
    manifest, _ = read_unverified_manifest(tmp_path / "tiny-cpu-v1.ekb")
    assert manifest.validation.passed and manifest.validation.samples == 50
    assert f"validated and golden vectors on {drawn}" in manifest.validation.notes
    assert manifest.golden.count == 4


def _token_model(path: Path, rows: int) -> Path:
    """ids int64 [batch, seq] -> Gather from a (rows, 4) table -> ReduceMean over seq -> [batch, 4]."""
    from onnx import TensorProto, helper, numpy_helper

    from tests.factories import _save

    table = numpy_helper.from_array(np.random.default_rng(0).standard_normal((rows, 4)).astype(np.float32), "table")
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["table", "ids"], ["emb"]),
            helper.make_node("ReduceMean", ["emb"], ["out"], axes=[1], keepdims=0),
        ],
        "tokens",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", 4])],
        [table],
    )
    return _save(graph, path, 13)


def test_package_fp16_without_data_draws_int_inputs_within_the_table_they_index(ws, tmp_path: Path) -> None:
    from edgekit import package
    from edgekit.errors import CalibrationDataError, EdgekitWarning

    model = _token_model(tmp_path / "tokens.onnx", rows=7)
    kw = {"key": ws["key"], "out_dir": tmp_path, "precision": "fp16"}
    with pytest.raises(CalibrationDataError) as refused:
        package(model, **kw)
    assert str(refused.value) == (
        "no data to draw inputs from: input 'ids' ['batch', 'seq'] has the dynamic axis 1 ('seq'); give its size "
        "with --input-shape ids=1x128, or give --eval data"
    )
    with pytest.warns(EdgekitWarning) as said:
        result = package(model, input_shapes={"ids": (1, 6)}, **kw)
    (warning,) = [str(w.message) for w in said if issubclass(w.category, EdgekitWarning)]
    assert "'ids' int64 [N, 6] integers in [0, 7) (the rows of the table it indexes)" in warning
    assert result.passed and result.manifests["cpu"].validation.samples == 50


# -- PyTorch in -------------------------------------------------------------------------------


def test_package_api_takes_a_torch_module_with_example_inputs(ws, tmp_path: Path) -> None:
    import torch

    from edgekit import package
    from edgekit.bundle import TrustStore, extract, read_verified_manifest
    from edgekit.errors import ConfigError, EdgekitWarning

    class TinyNet(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
            self.head = torch.nn.Linear(4, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.relu(self.conv(x)).mean(dim=(2, 3)))

    torch.manual_seed(0)
    net = TinyNet()
    with pytest.raises(ConfigError, match="model is a TinyNet, not an ONNX file: give example_inputs"):
        package(model=net, key=ws["key"], out_dir=tmp_path, precision="fp32")
    with pytest.warns(EdgekitWarning, match="50 inputs drawn within the declared shapes"):
        result = package(
            model=net, example_inputs=torch.zeros(1, 3, 8, 8), key=ws["key"], out_dir=tmp_path, precision="fp32"
        )
    manifest = result.manifests["cpu"]
    assert result.bundles["cpu"] == tmp_path / "tinynet-cpu-v1.ekb"
    assert manifest.source.filename == "tinynet.onnx" and (tmp_path / "tinynet.onnx").is_file()
    assert [(s.name, s.shape) for s in manifest.signature.inputs] == [("input", ("batch", 3, 8, 8))]
    verified = read_verified_manifest(result.bundles["cpu"], TrustStore.from_files([ws["pub"]]))
    files = extract(result.bundles["cpu"], verified, tmp_path / "x")
    golden = np.load(files / manifest.golden.file)
    with torch.no_grad():  # the bundle's expected outputs are the module's own
        expected = net(torch.from_numpy(golden["in_input"])).numpy()
    assert np.allclose(golden[f"out_{manifest.signature.outputs[0].name}"], expected, atol=1e-4)


# -- shapes: a TensorRT profile, frozen axes, the batching refusal ----------------------------


def test_cli_package_jetson_batch_records_a_tensorrt_profile_the_runtime_builds_with(capsys, ws, tmp_path) -> None:
    from device_agents.config import BatchingConfig, ModelConfig
    from device_agents.runtimes.tensorrt import engine_profile, ort_trt_profile_options, split_over_profile
    from edgekit.bundle.archive import read_unverified_manifest

    argv = ("package", ws["model"], "--key", ws["key"], "-o", tmp_path, "--calib", ws["calib"], "--target", "jetson")
    code, out, err = _cli(capsys, *argv, "--precision", "fp32", "-q", "--batch", "1,4,8")
    assert (code, err) == (0, "")
    assert out.splitlines()[3] == (
        "jetson TensorRT optimization profile (min / opt / max): 'input' 1x3x16x16 / 4x3x16x16 / 8x3x16x16"
    )
    manifest, _ = read_unverified_manifest(tmp_path / "tiny-jetson-v1.ekb")
    assert manifest.target_options["optimization_profile"] == {
        "input": {"min": [1, 3, 16, 16], "opt": [4, 3, 16, 16], "max": [8, 3, 16, 16]}
    }
    assert manifest.signature.inputs[0].shape == manifest.artifact_signature.inputs[0].shape == ("batch", 3, 16, 16)
    # what the device's TensorRT runtime hands IOptimizationProfile.set_shape (and ONNX Runtime's TensorRT EP)
    profile = engine_profile(manifest)
    assert profile == {"input": ((1, 3, 16, 16), (4, 3, 16, 16), (8, 3, 16, 16))}
    assert ort_trt_profile_options(profile)["trt_profile_max_shapes"] == "input:8x3x16x16"
    parts = split_over_profile({"input": np.zeros((20, 3, 16, 16), np.float32)}, profile)
    assert [p["input"].shape[0] for p in parts] == [8, 8, 4]  # a batch above the profile's maximum runs in parts
    ModelConfig(batching=BatchingConfig(max_batch_size=8)).check("tiny", manifest)  # the agent batches it


def test_cli_package_static_targets_say_which_axis_they_froze_and_the_agent_says_why(capsys, ws, tmp_path) -> None:
    from device_agents.config import BatchingConfig, ModelConfig
    from device_agents.runtimes.tensorrt import engine_profile
    from edgekit.bundle.archive import read_unverified_manifest
    from edgekit.errors import ConfigError

    argv = ("package", ws["model"], "--key", ws["key"], "-o", tmp_path, "--calib", ws["calib"], "--target", "jetson")
    code, out, _ = _cli(capsys, *argv, "--precision", "fp32", "-q")
    assert code == 0 and out.splitlines()[3] == (
        "jetson static shapes: input 'input' axis 0 (batch) frozen to 1 (--batch MIN,OPT,MAX gives a TensorRT "
        "profile instead)"
    )
    manifest, _ = read_unverified_manifest(tmp_path / "tiny-jetson-v1.ekb")
    assert "input 'input' axis 0 (batch) frozen to 1" in manifest.validation.notes
    assert engine_profile(manifest) == {"input": ((1, 3, 16, 16),) * 3}  # pinned: min = opt = max
    with pytest.raises(ConfigError) as refused:
        ModelConfig(batching=BatchingConfig(max_batch_size=8)).check("tiny", manifest)
    assert str(refused.value) == (
        "agent.models.tiny.batching: model tiny v1 has a static batch (input 'input' shape [1, 3, 16, 16]); dynamic "
        "batching needs axis 0 dynamic (-1). This jetson bundle pins its TensorRT engine to one shape (no "
        "optimization profile): package it again with --batch MIN,OPT,MAX (e.g. 1,4,8) to record a profile the "
        "engine is built with; or remove [models.tiny.batching]"
    )
    code, _, err = _cli(capsys, *argv[:-2], "--batch", "1,4,8")
    assert (code, err) == (
        2,
        "edgekit: error: --batch 1,4,8: ranges the jetson target's TensorRT optimization profile, and jetson is not "
        "being packaged (packaging: cpu); cpu and intel keep the model's dynamic batch axis, coral and apple take "
        "one static shape (--input-shape NAME=8x3x224x224)\n",
    )


# -- the agent says what it runs with, and on what --------------------------------------------


def test_agent_logs_what_each_model_runs_on_at_install_and_start_and_its_settings_with_v(
    capsys, caplog, ws, tmp_path: Path
) -> None:
    import logging

    import onnxruntime as ort

    from tests.agent.conftest import start_agent

    config = tmp_path / "agent.toml"
    config.write_text(f'store = "store"\ntrusted_keys = ["{ws["pub"]}"]\n[server]\nmax_connections = 64\n')
    runs_on = f"m: v1 runs on onnxruntime {ort.__version__} on CPUExecutionProvider"
    with caplog.at_level(logging.INFO, logger="edgekit.agent"):
        code, _, _ = _agent(capsys, "install", ws["bundle"], "--config", config)
    assert code == 0 and runs_on in caplog.messages  # at install
    agent = start_agent(config, args=("-v",))
    try:
        assert agent.stop() == 0
        log = agent.log.read_text()
    finally:
        if agent.proc.poll() is None:
            agent.proc.kill()
    assert f"edgekit.agent: {runs_on}\n" in log  # at start
    assert f"edgekit.agent: setting store = {tmp_path / 'store'}\n" in log
    assert "edgekit.agent: setting server.max_connections = 64\n" in log  # set in the file
    assert "edgekit.agent: setting listen = '127.0.0.1:8500' (default)\n" in log
    quiet = start_agent(config)  # without -v: no settings (the log file is appended to)
    assert quiet.stop() == 0 and "setting store" not in quiet.log.read_text()[len(log) :]


def test_runs_on_names_the_delegate_provider_or_device_of_each_runtime() -> None:
    from device_agents.runtimes.runs_on import runs_on

    assert runs_on({"runtime": "litert", "version": "2.3", "delegate": "xnnpack (cpu)"}) == (
        "litert 2.3 with the xnnpack (cpu) delegate"
    )
    assert runs_on({"runtime": "openvino", "version": "2026.4", "device": "AUTO", "execution_devices": ["CPU"]}) == (
        "openvino 2026.4 on AUTO (execution devices: CPU)"
    )
    trt = {"runtime": "tensorrt", "version": "10.3", "device": "Orin", "compute_capability": "8.7"}
    assert runs_on({**trt, "builder_flags": ["int8", "fp16"]}) == (
        "tensorrt 10.3 on Orin (compute capability 8.7), builder flags int8, fp16"
    )
    fallback = {"runtime": "tensorrt", "version": "onnxruntime 1.32", "fallback": "ort-trt"}
    assert runs_on({**fallback, "providers": ["TensorrtExecutionProvider", "CUDAExecutionProvider"]}) == (
        "tensorrt onnxruntime 1.32 (fallback ort-trt) on TensorrtExecutionProvider (then CUDAExecutionProvider)"
    )


def test_shape_profile_ranges_dynamic_axes_and_refuses_what_the_model_or_data_rule_out() -> None:
    from edgekit.bundle.manifest import Signature, TensorSpec
    from edgekit.errors import ConfigError
    from edgekit.targets.shape_profile import ShapeRange, optimization_profile, parse_batch

    served = Signature(
        inputs=(TensorSpec("images", "float32", ("batch", 3, "height", "width")),),
        outputs=(TensorSpec("out", "float32", ("batch", 10)),),
    )
    static = {"images": (1, 3, 320, 320)}
    assert optimization_profile(served, static) is None  # nothing asked: the shape stays pinned
    assert optimization_profile(served, static, parse_batch("1,4,8")) == {
        "images": ShapeRange((1, 3, 320, 320), (4, 3, 320, 320), (8, 3, 320, 320))
    }
    hw = ("images=1x3x256x256:4x3x480x480:8x3x640x640",)
    assert optimization_profile(served, static, (), hw)["images"].text() == "1x3x256x256 / 4x3x480x480 / 8x3x640x640"
    assert parse_batch("8") == (1, 8, 8)
    refusals = {
        "--batch 4,2,8: expected MIN,OPT,MAX with 1 <= MIN <= OPT <= MAX, such as 1,4,8": lambda: parse_batch("4,2,8"),
        "targets.jetson.profile_shapes images=1x3x256x256:4x3x480x480:8x4x640x640: axis 1 is fixed to 3 by the "
        "model; give 3 in min, opt and max": lambda: optimization_profile(
            served, static, (), ("images=1x3x256x256:4x3x480x480:8x4x640x640",)
        ),
        "targets.jetson: input 'images' is validated at 1x3x320x320 (--input-shape or the calibration data), outside "
        "its profile 2x3x320x320 / 4x3x320x320 / 8x3x320x320; widen the range to include it": lambda: (
            optimization_profile(served, static, (2, 4, 8))
        ),
    }
    for message, call in refusals.items():
        with pytest.raises(ConfigError) as refused:
            call()
        assert str(refused.value) == message


def test_cli_package_jetson_profile_ranges_height_and_width_where_the_model_has_them(capsys, ws, tmp_path) -> None:
    from device_agents.runtimes.tensorrt import engine_profile
    from edgekit.bundle.archive import read_unverified_manifest

    model = tiny_classifier(tmp_path / "dyn.onnx", dynamic_size=True)
    code, out, err = _cli(
        capsys, "package", model, "--key", ws["key"], "-o", tmp_path, "--calib", ws["calib"], "--target", "jetson",
        "--precision", "fp32", "-q", "--profile-shape", "input=1x3x16x16:2x3x24x24:4x3x32x32",
    )  # fmt: skip
    assert (code, err) == (0, "")
    assert out.splitlines()[3] == (
        "jetson TensorRT optimization profile (min / opt / max): 'input' 1x3x16x16 / 2x3x24x24 / 4x3x32x32"
    )
    manifest, _ = read_unverified_manifest(tmp_path / "dyn-jetson-v1.ekb")
    source = tuple(manifest.signature.inputs[0].shape)
    assert source[1] == 3 and all(isinstance(d, str) for d in (source[0], source[2], source[3]))  # all three ranged
    assert engine_profile(manifest)["input"] == ((1, 3, 16, 16), (2, 3, 24, 24), (4, 3, 32, 32))
    code, _, err = _cli(capsys, "package", model, "--target", "jetson", "--profile-shape", "input=1x3x16x16")
    assert (code, err) == (
        2,
        "edgekit: error: --profile-shape input=1x3x16x16: expected NAME=MIN:OPT:MAX such as "
        "images=1x3x320x320:4x3x480x480:8x3x640x640\n",
    )


def test_tensorrt_runtime_refuses_a_shape_outside_its_profile_and_splits_a_batch_above_it() -> None:
    from device_agents.runtimes.tensorrt import check_in_profile, split_over_profile
    from edgekit.errors import InferenceInputError

    ranged = ((1, 3, 16, 16), (4, 3, 16, 16), (8, 3, 16, 16))
    check_in_profile("input", (20, 3, 16, 16), ranged)  # above the maximum batch: run in parts of 8
    with pytest.raises(InferenceInputError) as refused:
        check_in_profile("input", (2, 3, 32, 32), ranged)
    assert str(refused.value) == (
        "input 'input': shape [2, 3, 32, 32]; this TensorRT engine takes [1, 3, 16, 16] to [8, 3, 16, 16] (its "
        "optimization profile)"
    )
    pinned = ((1, 3, 16, 16),) * 3
    with pytest.raises(InferenceInputError, match=r"takes \[1, 3, 16, 16\]$"):
        check_in_profile("input", (4, 3, 16, 16), pinned, ranged=False)  # no profile: the one shape only
    two_to_eight = ((2, 3, 16, 16), (4, 3, 16, 16), (8, 3, 16, 16))
    with pytest.raises(InferenceInputError):
        check_in_profile("input", (9, 3, 16, 16), two_to_eight)  # 8 + 1: the last part is below the minimum 2
    parts = split_over_profile({"input": np.zeros((10, 3, 16, 16), np.float32)}, {"input": two_to_eight})
    assert [p["input"].shape[0] for p in parts] == [8, 2]
