"""The ``edgekit`` command: keygen, package, inspect, verify, run, bench, calib make (+ fleet commands).

One exit path: every subcommand returns an exit code or raises an ``EdgekitError``, which
``main`` prints as ``edgekit: error: <message>`` and turns into ``error.exit_code``; an
``OSError`` becomes one line naming the path (exit 1). Subcommands register themselves on the
parser; ``edgekit.fleet.commands.register`` adds ``publish`` and ``fleet``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile
import warnings
from collections import Counter
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from edgekit import __version__
from edgekit import package_defaults as defaults
from edgekit.bundle.command_line import Parser, os_error_message, reader_gone
from edgekit.errors import ConfigError, EdgekitError, EdgekitWarning, InferenceInputError

PROG = "edgekit"
EXIT_CODES = """exit codes:
  0  done (every target passed its validation gate)
  1  other errors (file system, bundle signature or hashes, ...)
  2  bad arguments, config, model or data (nothing was converted)
  3  a target failed its validation gate (its bundle is written only with --allow-failed)
  4  an SDK a target needs is not installed (the message names the pip extra)
  5  the MQTT broker or the object store cannot be reached (publish, fleet)
"""
LOG_LEVELS = ("debug", "info", "warning", "error")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        with warnings_to_stderr():
            return _main(argv)
    except BrokenPipeError:  # `edgekit inspect X | head`: the reader has what it wanted
        return reader_gone()


@contextlib.contextmanager
def warnings_to_stderr() -> Iterator[None]:
    """``EdgekitWarning``s as ``warning: TEXT`` lines on stderr, each time one is raised; other
    warnings as Python shows them."""
    with warnings.catch_warnings():
        warnings.simplefilter("always", EdgekitWarning)
        python_shows = warnings.showwarning

        def show(message: Any, category: type[Warning], *rest: Any, **kw: Any) -> None:
            if issubclass(category, EdgekitWarning):
                print(f"warning: {message}", file=sys.stderr)
            else:
                python_shows(message, category, *rest, **kw)

        warnings.showwarning = show
        yield


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse(argv)
    logging.basicConfig(
        level=getattr(logging, str(getattr(args, "log_level", "warning")).upper()),
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return int(args.func(args))
    except EdgekitError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:
        raise
    except OSError as exc:
        print(f"{PROG}: error: {os_error_message(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


def build_parser() -> Parser:
    parser = Parser(
        prog=PROG,
        description="Package models for edge targets and sign them into bundles.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="warning", help="Python logging level (stderr)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in (
        _register_keygen,
        _register_package,
        _register_inspect,
        _register_verify,
        _register_run,
        _register_bench,
        _register_calib,
    ):
        register(sub)
    from edgekit.fleet import commands as fleet_commands  # lazy: pulls in the MQTT client only for `edgekit`

    fleet_commands.register(sub)
    from edgekit.split import commands as split_commands  # `edgekit split plan`, `edgekit serve-tail`

    split_commands.register(sub)
    from edgekit import doctor  # `edgekit doctor`: this machine's device class, SDKs, buildable targets, runtimes

    doctor.register(sub)
    from edgekit import cascade  # `edgekit cascade plan`: ONNX Runtime is imported only when run

    cascade.register(sub)
    from edgekit.compress import command as compress_command  # `edgekit compress`: torch is imported only when run

    compress_command.register(sub)
    from edgekit import board_commands  # `edgekit board ...`: pyserial is imported only when one runs

    board_commands.register(sub)
    from edgekit import export  # `edgekit export MODULE:FACTORY`: torch is imported only when run

    export.register(sub)
    for command in sub.choices.values():  # also after the subcommand; SUPPRESS keeps one given before it
        command.add_argument("--log-level", choices=LOG_LEVELS, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


# -- keygen ---------------------------------------------------------------------------------


def _register_keygen(sub: Any) -> None:
    p = sub.add_parser(
        "keygen",
        help="make an Ed25519 signing key pair",
        description="Write NAME.key (mode 0600; encrypted when EDGEKIT_KEY_PASSPHRASE is set) and NAME.pub.",
    )
    p.add_argument("--out", type=Path, required=True, metavar="DIR")
    p.add_argument("--name", default="edgekit")
    p.set_defaults(func=_keygen)


def _keygen(args: argparse.Namespace) -> int:
    from edgekit.bundle import generate_keypair, key_id, load_public_key
    from edgekit.bundle.signing import PASSPHRASE_ENV

    passphrase = os.environ.get(PASSPHRASE_ENV)
    key, pub = generate_keypair(args.out, args.name, passphrase.encode() if passphrase else None)
    print(f"wrote {key} (private, {'encrypted' if passphrase else 'unencrypted'}) and {pub}")
    print(f"key id {key_id(load_public_key(pub))}")
    return 0


# -- package --------------------------------------------------------------------------------


def _register_package(sub: Any) -> None:
    p = sub.add_parser(
        "package",
        help="convert, quantize, validate and sign MODEL for one or more targets",
        description="Write OUTDIR/NAME-TARGET-vVERSION.ekb for each target and print the validation table.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        renamed={
            "--force": "use --overwrite to replace existing bundles, --allow-failed to write bundles that "
            "fail validation (marked failed; exit code 3)"
        },
    )
    p.add_argument("model", type=Path, metavar="MODEL.onnx")
    p.add_argument(
        "--target",
        default=",".join(defaults.DEFAULT_TARGETS),
        help=f"comma-separated: cpu, intel, coral, jetson, apple (default {','.join(defaults.DEFAULT_TARGETS)}); "
        "runtime names such as openvino, tensorrt, tflite, edgetpu, coreml stand for their target",
    )
    p.add_argument(
        "--precision",
        default=defaults.DEFAULT_PRECISION,
        metavar="P[,TARGET=P...]",
        help="a default precision, then per-target ones, e.g. int8,apple=int8-weights; targets not named get the "
        f"default ({defaults.DEFAULT_PRECISION} when none is given). Names: fp32, fp16, bf16, int8, "
        "int8-weights, int4-weights, palettize6, palettize4",
    )
    p.add_argument(
        "--calib",
        metavar="DATA",
        help="calibration data: .npz (one array per input, samples on axis 0), .npy (one-input models), or a "
        "folder / glob of images read with --preprocess; not needed when every target builds fp32/fp16/bf16 (with no "
        "data at all, inputs drawn within the model's shapes validate them)",
    )
    p.add_argument(
        "--eval",
        metavar="DATA",
        help="held-out data, same kinds as --calib; an .npz may hold a 'labels' array (default: every 5th calib "
        "sample); 50 or more samples, else a warning (fewer than 10: refused unless --allow-small-eval)",
    )
    p.add_argument("--labels", type=Path, metavar="LABELS.npy", help="class index per evaluation sample")
    p.add_argument(
        "--preprocess",
        metavar="KEY=V,...",
        help="how images become inputs: size=HxW, fit=stretch|letterbox|center-crop, channels=RGB|BGR|GRAY, "
        "layout=NCHW|NHWC, scale=255, mean=M[/M/M], std=S[/S/S], pad=0",
    )
    p.add_argument(
        "--postprocess",
        metavar="KEY=V,...",
        help="what the agent makes of the outputs: boxes=yolo[,score=0.25,iou=0.45,max=300] for a YOLO-style "
        "detector (boxes, scores, classes in the original image's pixels) or topk=K for a classifier (classes, "
        "scores); activation=softmax|sigmoid|none, output=NAME",
    )
    p.add_argument(
        "--task",
        metavar="TASK|OUTPUT=TASK,...",
        help="how the outputs are judged against fp32: classify (top-1 agreement), regress (relative error), "
        "embed, detect, segment (cosine, relative error, worst live channel); one task for every output or "
        "OUTPUT=TASK per output (default: from each output's shape and values; the validation notes say which)",
    )
    p.add_argument(
        "--compress",
        action="append",
        default=[],
        metavar="STEP",
        help="compress the model first, e.g. prune-channels=0.5, low-rank=0.5, distill=width=0.5 (repeatable, in "
        "order; see `edgekit compress -h`); the gate compares with the original model",
    )
    p.add_argument("--train", type=Path, metavar="TRAIN.npz", help="training inputs for --compress fine-tuning")
    p.add_argument("--train-labels", type=Path, metavar="LABELS.npy", help="training labels for --compress")
    p.add_argument(
        "--reference",
        type=Path,
        metavar="ORIGINAL.onnx",
        help="gate against this model instead of MODEL (when MODEL is already compressed from it)",
    )
    p.add_argument(
        "--labels-file",
        type=Path,
        metavar="CLASSES.txt",
        help="class names, one per line, carried in the bundle: the post-processing also answers labels",
    )
    p.add_argument(
        "--signing-key",
        "--key",
        dest="signing_key",
        type=Path,
        metavar="KEY",
        help="private signing key from `edgekit keygen` (--key is the same flag; default: a development key made "
        "once under ~/.config/edgekit/, which devices must trust explicitly)",
    )
    p.add_argument("--name", help="bundle name (default: the model file's stem)")
    p.add_argument(
        "--version",
        type=int,
        metavar="N",
        help="model version, the anti-rollback counter (default: one more than the highest bundle of that name in "
        "OUTDIR, 1 when none)",
    )
    p.add_argument("-o", "--out", type=Path, metavar="OUTDIR", help="where bundles are written (default dist/)")
    p.add_argument(
        "--tolerance",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a validation gate: classifiers min_top1_agreement (0.98), max_top1_drop (0.01); dense "
        "outputs min_cosine (0.96), max_relative_error (0.2), min_channel_cosine (0.9); 'none' turns one off",
    )
    p.add_argument(
        "--max-drop",
        type=float,
        metavar="D",
        help="accuracy budget: with --labels the allowed top-1 drop (0.01 = one point; max_top1_drop); dense "
        "outputs keep their default gate",
    )
    p.add_argument(
        "--cache",
        choices=("exact", "approximate"),
        help="the result cache the manifest declares for the agent; approximate calibrates its distance threshold "
        "on the evaluation data (the agent uses it unless [models.NAME.cache] max_distance is set)",
    )
    p.add_argument(
        "--false-hit-budget",
        type=float,
        default=defaults.DEFAULT_FALSE_HIT_BUDGET,
        metavar="RATE",
        help="--cache approximate: the share of cache hits allowed to differ from a fresh answer, held with a "
        "one-sided 95%% bound on the evaluation data and its perturbed copies "
        f"(default {defaults.DEFAULT_FALSE_HIT_BUDGET:g})",
    )
    p.add_argument(
        "--objective",
        choices=("latency", "size"),
        default=defaults.DEFAULT_OBJECTIVE,
        help=f"what cpu/intel candidates are chosen by within the budget (default {defaults.DEFAULT_OBJECTIVE})",
    )
    p.add_argument(
        "--mixed-precision",
        action="store_true",
        help="let an explicit int8 keep its most sensitive layers in float to meet the budget (auto always may)",
    )
    p.add_argument(
        "--calib-samples",
        type=int,
        default=defaults.DEFAULT_CALIB_SAMPLES,
        metavar="N",
        help=f"calibration subset size, stratified (default {defaults.DEFAULT_CALIB_SAMPLES}; every target)",
    )
    p.add_argument(
        "--max-memory-gb",
        type=float,
        default=None,
        metavar="GB",
        help="memory bound of the run: a candidate estimated to need more to calibrate or measure is skipped, "
        f"its reason in the report (default {defaults.MEMORY_BOUND_SHARE:.0%}% of the memory this machine or "
        f"container allows: {defaults.default_max_memory_gb():g} here)",
    )
    p.add_argument(
        "--runtime-threads",
        type=int,
        default=0,
        metavar="N",
        help="thread count candidates are timed at: the device runtime's (default 0 = the runtime's own)",
    )
    p.add_argument(
        "--keep-candidates",
        type=Path,
        metavar="DIR",
        help="also write every candidate that met the budget to DIR (new or empty), for `edgekit bench --profile "
        "DIR` on the device",
    )
    p.add_argument(
        "--device-profile",
        type=Path,
        metavar="FILE",
        help="choose by the latencies `edgekit bench --profile` measured on the device (its --out file) instead of "
        "the host's or the device class's documented order",
    )
    p.add_argument("--overwrite", action="store_true", help="replace bundles of the same name and version")
    p.add_argument(
        "--require-accelerator",
        action="store_true",
        help="fail (exit 3) rather than write a bundle that runs on the CPU only where the target has an accelerator "
        "(coral without the Edge TPU compiler)",
    )
    p.add_argument(
        "--allow-small-eval",
        action="store_true",
        help="let the validation gate be decided on fewer than 10 held-out samples (fewer than 50 is a warning)",
    )
    p.add_argument(
        "--allow-failed",
        action="store_true",
        help="also write bundles that fail validation (marked failed in the manifest; exit code 3 all the same)",
    )
    p.add_argument("--input-shape", action="append", default=[], metavar="NAME=1x3x224x224")
    p.add_argument(
        "--batch",
        metavar="MIN,OPT,MAX",
        help="jetson: the TensorRT optimization profile of the dynamic batch axis (1,4,8: from 1 to 8, tuned for 4), "
        "recorded in the manifest; the device builds its engine with it (other axes: --profile-shape)",
    )
    p.add_argument(
        "--profile-shape",
        action="append",
        default=[],
        metavar="NAME=MIN:OPT:MAX",
        help="jetson: a TensorRT optimization profile for any dynamic axes of input NAME, as trtexec's "
        "--minShapes/--optShapes/--maxShapes (images=1x3x320x320:4x3x480x480:8x3x640x640); repeat per input",
    )
    p.add_argument(
        "--expires-days",
        type=float,
        default=None,
        metavar="D",
        help=f"the bundle expires D days from now (default {defaults.DEFAULT_EXPIRES_DAYS}; 0 = never: devices accept "
        "it forever)",
    )
    p.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="TARGET.KEY=VALUE",
        help="a target option; `edgekit package --list-options` lists every target's",
    )
    p.add_argument("--list-options", action=_ListOptions, nargs=0, help="list every target's options and exit")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout (progress stays on stderr)")
    p.add_argument("--log-dir", type=Path, metavar="DIR", help="keep each target's converter output as DIR/TARGET.log")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    from edgekit.split.commands import add_package_arguments  # --split and its planning flags

    add_package_arguments(p)
    p.set_defaults(func=_package)


def _note_default_preprocess(model: Path, calib: str) -> None:
    """Images given without --preprocess are read with the default pre-processing: say which."""
    from edgekit.compress.onnx_prep import load_onnx
    from edgekit.compress.signature import served_signature
    from edgekit.validate.preprocess import Preprocess, image_files

    files = image_files(calib)
    if not files:
        return
    try:
        inputs = served_signature(load_onnx(model)).inputs
    except EdgekitError:
        return  # the packager says what is wrong with the model
    if len(inputs) != 1:
        return
    steps = " -> ".join(_step(s) for s in Preprocess().to_steps(inputs[0]))
    print(
        f"note: --calib {calib}: {len(files)} images read as {inputs[0].name!r} with the default pre-processing: "
        f"{steps}; pass --preprocess KEY=V,... if the model was trained otherwise",
        file=sys.stderr,
    )


def _require_accelerator(targets: Sequence[str], options: Sequence[str]) -> None:
    """Before any work: a coral bundle without ``edgetpu_compiler`` would run on LiteRT's CPU only."""
    import shutil

    from edgekit.errors import AcceleratorMissingError
    from edgekit.targets.coral import EDGETPU_COMPILER

    if "coral" not in targets:
        return
    given = [o.split("=", 1)[1] for o in options if o.startswith("coral.edgetpu_compiler=")]
    compiler = given[-1] if given else EDGETPU_COMPILER
    if shutil.which(compiler) is None:
        raise AcceleratorMissingError(
            f"--require-accelerator: {compiler} is not on PATH, so the coral bundle would run on the CPU only "
            "(LiteRT, not compiled for the Edge TPU); install the Edge TPU compiler (package edgetpu-compiler from "
            "Coral's Debian repository, https://coral.ai/docs/edgetpu/compiler/; x86-64 only) or give its path with "
            "--option coral.edgetpu_compiler=PATH"
        )


def _fill_first_try_defaults(args: argparse.Namespace) -> None:
    """-o, --name, --version and --signing-key left out: what they default to, said where it matters."""
    args.out = defaults.DEFAULT_OUT_DIR if args.out is None else args.out
    args.name = defaults.default_name(args.model) if args.name is None else args.name
    if args.version is None:
        args.version, highest = defaults.next_version(args.out, args.name)
        if highest is not None:
            print(f"note: --version {args.version} (one more than {highest})", file=sys.stderr)
    if args.signing_key is None:
        key, pub, made = defaults.development_key()
        args.signing_key = key
        print(f"warning: {defaults.development_key_warning(key, pub, made)}", file=sys.stderr)


class _ListOptions(argparse.Action):
    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        from edgekit.targets.options import describe_options

        print("\n".join(describe_options()))
        parser.exit(0)


def _package(args: argparse.Namespace) -> int:
    try:
        return _package_or_raise(args)
    except EdgekitError as exc:
        if args.json and not getattr(exc, "result", None):
            print(json.dumps({"passed": False, "exit_code": exc.exit_code, "error": str(exc)}, indent=2))
        raise


def _package_or_raise(args: argparse.Namespace) -> int:
    from edgekit.compress.onnx_prep import parse_input_shape
    from edgekit.packaging.orchestrate import package
    from edgekit.packaging.request import PackageRequest
    from edgekit.packaging.result import PackageResult, PackageValidationError
    from edgekit.progress import PackageProgress
    from edgekit.targets import parse_targets
    from edgekit.targets.options import parse_option_args
    from edgekit.targets.precisions import parse_precision_arg
    from edgekit.validate.metrics import parse_tolerance_args

    targets = parse_targets(args.target, note=lambda text: print(f"note: {text}", file=sys.stderr))
    if args.require_accelerator:
        _require_accelerator(targets, args.option)
    if args.calib and not args.preprocess:
        _note_default_preprocess(args.model, args.calib)
    if args.batch or args.profile_shape:
        from edgekit.targets.shape_profile import batch_option, profile_shapes_option

        batch = [batch_option(args.batch, targets)] if args.batch else []
        ranged = [profile_shapes_option(args.profile_shape, targets)] if args.profile_shape else []
        args.option = [*args.option, *batch, *ranged]
    _fill_first_try_defaults(args)
    if args.split:
        from edgekit.split.commands import check_package_split

        check_package_split(args)
    shapes = dict(parse_input_shape(s) for s in args.input_shape)
    expires = bundle_expiry(args.expires_days)
    progress = None if args.quiet else PackageProgress(targets)
    error: PackageValidationError | None = None
    try:
        request = PackageRequest(
            model=args.model,
            targets=targets,
            precision=parse_precision_arg(args.precision),
            calib=args.calib,
            eval=args.eval,
            labels=args.labels,
            key=args.signing_key,
            name=args.name,
            version=args.version,
            out_dir=args.out,
            tolerance=parse_tolerance_args(args.tolerance) or None,
            overwrite=args.overwrite,
            allow_failed=args.allow_failed,
            input_shapes=shapes or None,
            expires=expires,
            progress=progress,
            options=parse_option_args(args.option, targets),
            preprocess=args.preprocess,
            log_dir=args.log_dir,
            objective=args.objective,
            mixed_precision=args.mixed_precision,
            threads=args.runtime_threads,
            calib_samples=args.calib_samples,
            max_memory_gb=args.max_memory_gb,
            max_drop=args.max_drop,
            keep_candidates=args.keep_candidates,
            device_profile=args.device_profile,
            postprocess=args.postprocess,
            labels_file=args.labels_file,
            task=args.task,
            compress=args.compress,
            reference=args.reference,
            train=args.train,
            train_labels=args.train_labels,
            cache=args.cache,
            false_hit_budget=args.false_hit_budget,
            allow_small_eval=args.allow_small_eval,
        )
        result: PackageResult = package(request)
    except PackageValidationError as exc:
        error, result = exc, exc.result
    finally:
        if progress is not None:
            progress.close()
    code = 0 if result.passed else 3
    if args.json:
        doc = {**result.to_dict(), "exit_code": code}
        if error is not None:
            doc["error"] = str(error)
        print(json.dumps(doc, indent=2))
    else:
        print(result.table())
        for target, path in result.bundles.items():
            print(f"{target}: {path}")
    if error is not None:
        raise error
    if args.split and not code:
        from edgekit.split.commands import split_after_package  # heads, plan and tails added to the bundle

        split_after_package(args, result)
    if code:
        failed = ", ".join(r.target for r in result.rows if not r.passed)
        print(
            f"{PROG}: error: {failed} failed validation; bundles written anyway (--allow-failed), marked failed",
            file=sys.stderr,
        )
    return code


def bundle_expiry(days: float | None) -> timedelta | None:
    """``--expires-days``: None = the default (365 days), 0 = never, else that many days."""
    if days is None:
        days = defaults.DEFAULT_EXPIRES_DAYS
    if days < 0:
        raise ConfigError(f"--expires-days must be >= 0 (0 = never expires), got {days:g}")
    return timedelta(days=days) if days else None


# -- inspect --------------------------------------------------------------------------------


def _register_inspect(sub: Any) -> None:
    p = sub.add_parser(
        "inspect",
        help="show a bundle's manifest (signature not checked; use verify)",
        description="Print the manifest of BUNDLE: identity, signature, precision, validation, op placement.",
    )
    p.add_argument("bundle", type=Path)
    p.add_argument("--json", action="store_true", help="print the manifest JSON as stored")
    p.set_defaults(func=_inspect)


def _inspect(args: argparse.Namespace) -> int:
    from edgekit.bundle.archive import read_unverified_manifest

    manifest, kid = read_unverified_manifest(args.bundle)
    if args.json:
        sys.stdout.write(manifest.to_json().decode())
        return 0
    print("\n".join(describe_manifest(manifest, kid)))
    return 0


def _cache_lines(cache: Any) -> list[str]:
    lines = [f"cache: {cache.mode}, ttl {cache.ttl_s} s, up to {cache.max_entries} entries"]
    a = cache.approximate
    if a is not None:
        lines.append(f"  distance threshold {a.max_distance:.4g} ({a.embedding}), {a.samples} look-ups replayed")
        if a.false_hit_rate is not None and a.false_hit_bound is not None:
            budget = f", budget {a.false_hit_budget:g}" if a.false_hit_budget is not None else ""
            hits = f" of {a.hits} hits" if a.hits is not None else ""
            lines.append(
                f"  false-hit rate {a.false_hit_rate:.4f}{hits}, upper bound {a.false_hit_bound:.4f} "
                f"({a.bound_method or '95%'}){budget}"
            )
        else:
            lines.append(f"  agreement {a.agreement:.4f}")
    return lines


def describe_manifest(m: Any, signed_by: str) -> list[str]:
    """Human-readable lines for ``edgekit inspect``."""
    from edgekit.validate.table import cpu_only_reason

    v = m.validation
    lines = [
        f"{m.name} v{m.version}  target {m.target}  "
        f"runtime {m.compatibility.runtime} {m.compatibility.runtime_version}"
        + (f"  ({cpu_only_reason(m)})" if cpu_only_reason(m) else ""),
        f"created {m.created}  expires {m.expires or 'never'}",
        f"signed by key {signed_by} (not verified here; run `edgekit verify`)",
        f"source {m.source.filename} sha256 {m.source.sha256[:16]}... opset {m.source.opset}",
        f"precision {m.precision.label} ({m.precision.weights} weights, {m.precision.activations} activations): "
        f"{m.precision.method}",
        "served inputs:",
        *(f"  {_spec(s)}" for s in m.signature.inputs),
        "served outputs:",
        *(f"  {_spec(s)}" for s in m.signature.outputs),
    ]
    if m.artifact_signature != m.signature or m.mapping:
        lines += [
            "artifact tensors:",
            *(f"  {_spec(s)}" for s in (*m.artifact_signature.inputs, *m.artifact_signature.outputs)),
        ]
        lines += [
            f"  {t.served} -> {t.artifact}" + (f" transpose {list(t.transpose)}" if t.transpose else "")
            for t in m.mapping
        ]
    from edgekit.validate.metrics import MEASURES  # the one list of what validation measured

    measures = [f"{k.replace('_', ' ')} {getattr(v, k):.4g}" for k in MEASURES if getattr(v, k) is not None]
    spread = (
        f", p90 {v.latency_p90_ms:.3f} ms, IQR {v.latency_iqr_ms:.3f} ms"
        if v.latency_p90_ms is not None and v.latency_iqr_ms is not None
        else ""
    )
    latency = (
        f"p50 {v.latency_p50_ms:.3f} ms{spread} (fp32 p50 {v.fp32_latency_p50_ms:.3f} ms)"
        if v.latency_p50_ms is not None and v.fp32_latency_p50_ms is not None
        else "latency not measured here"
    )
    ratio = f" ({v.size_ratio:.2f}x fp32)" if v.size_ratio is not None else ""
    lines += [
        f"validation {'passed' if v.passed else 'FAILED'} ({v.kind}, {v.samples} samples, {v.measured_on}): "
        + ", ".join(measures),
        f"  size {v.size_bytes} bytes{ratio}, {latency}",
        *(f"  failed: {f}" for f in v.failures),
        *(f"  note: {n}" for n in v.notes),
        f"golden vectors: {m.golden.count} in {m.golden.file} (min cosine {m.golden.min_cosine}, atol {m.golden.atol})",
        "files:",
        *(f"  {f.path}  {f.size_bytes} bytes  {f.role}  sha256 {f.sha256[:16]}..." for f in m.files),
    ]
    if m.calibration is not None:
        c = m.calibration
        lines.append(f"calibration: {c.samples} samples from {c.source or 'arrays'}, sha256 {c.sha256[:16]}...")
    if m.estimates is not None and m.estimates.memory_mb is not None:
        e = m.estimates
        peak = f", peak {e.peak_memory_mb:g} MB" if e.peak_memory_mb is not None else ""
        lines.append(f"memory: {e.memory_mb:g} MB resident{peak} (load + first inference, {e.measured_on or 'host'})")
    if m.cache is not None:
        lines += _cache_lines(m.cache)
    if m.preprocess:
        lines.append("pre-processing: " + " -> ".join(_step(s) for s in m.preprocess))
    if m.postprocess:
        lines.append("post-processing: " + " -> ".join(_step(s) for s in m.postprocess))
    if m.op_placement is not None:
        op = m.op_placement
        counts = Counter((e.device, e.op) for e in op.entries)
        lines.append(f"op placement ({op.tool}): {op.accelerated} accelerated, {op.fallback} fallback")
        lines += [f"  {device}: {op_type} x{n}" for (device, op_type), n in sorted(counts.items())]
    if m.target_options:
        lines.append("target options: " + ", ".join(f"{k}={val}" for k, val in sorted(m.target_options.items())))
    if m.provenance:
        lines.append("provenance: " + " -> ".join(f"{p.kind} ({p.tool})" for p in m.provenance))
    if m.candidates is not None:
        from edgekit.optimize.record import summary_lines

        lines += summary_lines(m.candidates)
    return lines


def _step(step: Any) -> str:
    from edgekit.validate.preprocess import describe_steps

    return describe_steps((step,))


def _spec(s: Any) -> str:
    layout = f" {s.layout}" if s.layout else ""
    quant = f" q(scale={s.quant.scale:g}, zp={s.quant.zero_point}, {s.quant.dtype})" if s.quant else ""
    return f"{s.name}: {s.dtype} [{', '.join(str(d) for d in s.shape)}]{layout}{quant}"


# -- verify ---------------------------------------------------------------------------------


def _register_verify(sub: Any) -> None:
    p = sub.add_parser(
        "verify",
        help="check a bundle's signature, expiry and every file's length and hash",
        description="Exit 0 when BUNDLE is signed by one of the --pubkey keys and every listed file matches.",
    )
    p.add_argument("bundle", type=Path)
    p.add_argument(
        "--pubkey", type=Path, action="append", required=True, metavar="PUB", help="trusted key (repeatable)"
    )
    p.set_defaults(func=_verify)


def _verify(args: argparse.Namespace) -> int:
    from edgekit.bundle import TrustStore, extract, read_verified_manifest

    verified = read_verified_manifest(args.bundle, TrustStore.from_files(args.pubkey))
    with tempfile.TemporaryDirectory(prefix="edgekit-verify-") as tmp:
        extract(args.bundle, verified, Path(tmp) / "bundle")
    m = verified.manifest
    print(
        f"{args.bundle}: valid: {m.name} v{m.version} for {m.target}, signed by key {verified.key_id}, "
        f"{len(m.files)} files checked"
    )
    if not m.validation.passed:
        print(f"warning: {failed_validation_line(m)}", file=sys.stderr)
    return 0


def failed_validation_line(m: Any) -> str:
    """What ``verify`` (and the agent) say about a bundle written by ``package --allow-failed``."""
    failures = m.validation.failures
    why = f" ({'; '.join(failures)})" if failures else ""
    return (
        f"{m.name} v{m.version} for {m.target} failed validation when it was packaged{why}; edgekit-agent refuses "
        "it unless its agent.toml sets allow_failed_validation = true"
    )


# -- run ------------------------------------------------------------------------------------


def _register_run(sub: Any) -> None:
    p = sub.add_parser(
        "run",
        help="run a bundle on this host through the device runtime",
        description="Feed X.npz (one array per input name, or in_<name>) to BUNDLE and print or save the outputs.",
    )
    p.add_argument("bundle", type=Path)
    p.add_argument("--input", type=Path, required=True, metavar="X.npz")
    p.add_argument("--output", type=Path, metavar="Y.npz", help="save the outputs here (keys: output names)")
    p.add_argument(
        "--pubkey",
        type=Path,
        action="append",
        default=[],
        metavar="PUB",
        help="verify the signature with this key (without it only lengths and hashes are checked)",
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import numpy as np

    from device_agents.runtimes import load_model
    from edgekit.bundle import TrustStore, VerifiedManifest, extract, read_verified_manifest
    from edgekit.bundle.archive import read_unverified_manifest
    from edgekit.validate.calib import load_arrays

    if args.pubkey:
        verified = read_verified_manifest(args.bundle, TrustStore.from_files(args.pubkey))
    else:
        manifest, kid = read_unverified_manifest(args.bundle)
        print(f"note: signature not checked (no --pubkey); signed by key {kid} per the bundle", file=sys.stderr)
        verified = VerifiedManifest(manifest, manifest.to_json(), kid)
    if args.output is not None and not args.output.parent.is_dir():
        raise ConfigError(f"--output {args.output}: folder {args.output.parent} does not exist; create it first")
    inputs = load_arrays(args.input, "--input")
    names = [s.name for s in verified.manifest.signature.inputs]
    missing = [n for n in names if n not in inputs and f"in_{n}" not in inputs]
    if missing:
        raise InferenceInputError(
            f"--input {args.input} has no array {missing[0]!r} (or in_{missing[0]}); it has {', '.join(sorted(inputs))}"
        )
    feed = {n: inputs[n] if n in inputs else inputs[f"in_{n}"] for n in names}
    with tempfile.TemporaryDirectory(prefix="edgekit-run-") as tmp:
        model_dir = extract(args.bundle, verified, Path(tmp) / "bundle")
        served = load_model(model_dir, verified.manifest)
        try:
            outputs = served.infer(feed)
        finally:
            served.close()
    if args.output is not None:
        try:
            np.savez(args.output, **outputs)  # type: ignore[arg-type]  # numpy's savez kwargs stub is too narrow
        except OSError as exc:
            raise ConfigError(f"--output {args.output}: cannot write it ({exc}); choose a writable path") from exc
        print(f"wrote {args.output}")
    for name, value in outputs.items():
        line = f"{name}: {value.dtype} {list(value.shape)}"
        if value.ndim == 2 and value.shape[1] > 1:
            line += f" top-1 {value.argmax(axis=1).tolist()}"
        print(line)
    return 0


# -- bench ----------------------------------------------------------------------------------


def _register_bench(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="time a bundle on this machine through the device runtime (p50/p90/p99, throughput)",
        description="Open BUNDLE with the runtime the agent uses and time its golden inputs at each batch size: "
        "warm-up calls, then p50/p90/p99 per call and samples per second.",
    )
    p.add_argument("bundle", type=Path, nargs="?", help="the bundle to time (or --profile DIR)")
    p.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="time every candidate `edgekit package --keep-candidates DIR` wrote (batch 1, or the artifact's static "
        "batch) and write the device profile to --out, for `edgekit package --device-profile`",
    )
    p.add_argument("--out", type=Path, metavar="FILE", help="with --profile: where to write the profile JSON")
    p.add_argument("--batch", default="1,8,32", metavar="N[,N...]", help="batch sizes (default 1,8,32)")
    p.add_argument("--warmup", type=int, default=5, metavar="N", help="untimed calls per batch size (default 5)")
    p.add_argument("--repeats", type=int, default=200, metavar="N", help="timed calls per batch size at most")
    p.add_argument("--budget-s", type=float, default=3.0, metavar="S", help="seconds per batch size at most")
    p.add_argument("--threads", type=int, metavar="N", help="runtime threads (default: the runtime's)")
    p.add_argument("--pubkey", type=Path, action="append", default=[], metavar="PUB", help="verify with this key")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_bench)


def _bench(args: argparse.Namespace) -> int:
    from edgekit.benchmark import bench_bundle, bench_profile, profile_table

    if (args.bundle is None) == (args.profile is None):
        raise ConfigError("bench: give a BUNDLE or --profile DIR (one of them)")
    if args.profile is not None:
        if args.out is None:
            raise ConfigError(
                "bench --profile: give --out profile.json (what `edgekit package --device-profile` reads)"
            )
        profile = bench_profile(
            args.profile, warmup=args.warmup, repeats=args.repeats, budget_s=args.budget_s, threads=args.threads
        )
        try:
            args.out.write_text(json.dumps(profile, indent=1) + "\n")
        except OSError as exc:
            raise ConfigError(f"--out {args.out}: cannot write it ({exc.strerror or exc})") from exc
        print(json.dumps(profile, indent=2) if args.json else profile_table(profile))
        print(f"wrote {args.out}")
        return 0
    if args.out is not None:
        raise ConfigError("bench: --out is for --profile; a bundle's timing prints (--json for JSON)")

    try:
        sizes = [int(b) for b in args.batch.split(",") if b.strip()]
    except ValueError:
        raise ConfigError(f"--batch {args.batch!r}: expected sizes such as 1,8,32") from None
    result = bench_bundle(
        args.bundle,
        pubkeys=args.pubkey,
        batch_sizes=sizes,
        warmup=args.warmup,
        repeats=args.repeats,
        budget_s=args.budget_s,
        threads=args.threads,
    )
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.table())
    return 0


# -- calib ----------------------------------------------------------------------------------


def _register_calib(sub: Any) -> None:
    p = sub.add_parser("calib", help="make calibration / evaluation data from real inputs")
    calib_sub = p.add_subparsers(dest="calib_command", required=True, metavar="COMMAND")
    make = calib_sub.add_parser(
        "make",
        help="write a reproducible .npz from a folder or glob of images",
        description="Read the images of SOURCE (a folder, recursively, or a glob; sorted by path) as MODEL's input "
        "with --preprocess and write OUT.npz (the same images give the same bytes); prints its sha256.",
    )
    make.add_argument("source", metavar="SOURCE", help="a folder of images or a glob such as 'imgs/*.jpg'")
    make.add_argument("--model", type=Path, required=True, metavar="MODEL.onnx", help="the model the data feeds")
    make.add_argument("--preprocess", metavar="KEY=V,...", default="", help="as for `edgekit package`")
    make.add_argument(
        "--labels-from-folders",
        action="store_true",
        help="add a 'labels' array: each image's class is its folder under SOURCE (sorted names = class indices)",
    )
    make.add_argument("--limit", type=int, metavar="N", help="the first N images only")
    make.add_argument("-o", "--out", type=Path, required=True, metavar="OUT.npz")
    make.set_defaults(func=_calib_make)


def _calib_make(args: argparse.Namespace) -> int:
    from edgekit.compress.onnx_prep import load_onnx
    from edgekit.compress.signature import served_signature
    from edgekit.errors import CalibrationDataError
    from edgekit.package_checks import check_model_path, check_out_dir
    from edgekit.validate.calib import LABELS_KEY, folder_labels, write_npz
    from edgekit.validate.preprocess import Preprocess, image_files

    preprocess = Preprocess.parse(args.preprocess)
    files = image_files(args.source)
    if files is None:
        raise CalibrationDataError(f"calib make: {args.source} is neither a folder nor a glob of images")
    if not files:
        raise CalibrationDataError(f"calib make: no image files in {args.source}")
    if args.limit is not None:
        if args.limit < 1:
            raise ConfigError(f"--limit must be >= 1, got {args.limit}")
        files = files[: args.limit]
    check_model_path(args.model)
    check_out_dir(args.out.parent if str(args.out.parent) else Path("."), "-o")
    served = served_signature(load_onnx(args.model))
    if len(served.inputs) != 1:
        raise CalibrationDataError(
            f"calib make: {args.model} has {len(served.inputs)} inputs; images feed one-input models"
        )
    spec = served.inputs[0]
    arrays = {spec.name: preprocess.apply(files, spec)}
    classes: list[str] = []
    if args.labels_from_folders:
        if any(c in args.source for c in "*?["):
            raise ConfigError("--labels-from-folders needs SOURCE to be a folder (ROOT/CLASS/IMAGE), not a glob")
        arrays[LABELS_KEY], classes = folder_labels(files, Path(args.source))
    digest = write_npz(args.out, arrays)
    arr = arrays[spec.name]
    print(
        f"wrote {args.out}: {arr.shape[0]} images as {spec.name!r} {arr.dtype} {list(arr.shape)} "
        f"({preprocess.describe()})" + (f", labels for {len(classes)} classes" if classes else "")
    )
    print(f"sha256 {digest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
