"""The ``edgekit`` command: keygen, package, inspect, verify, run (+ fleet commands).

One exit path: every subcommand returns an exit code or raises an ``EdgekitError``, which
``main`` prints as ``edgekit: error: <message>`` and turns into ``error.exit_code``. Subcommands
register themselves on the parser; ``edgekit.fleet.commands.register`` adds ``publish`` and
``fleet status``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from edgekit import __version__
from edgekit.errors import ConfigError, EdgekitError, InferenceInputError

PROG = "edgekit"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except EdgekitError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Package models for edge targets and sign them into bundles."
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in (_register_keygen, _register_package, _register_inspect, _register_verify, _register_run):
        register(sub)
    from edgekit.fleet import commands as fleet_commands  # lazy: pulls in the MQTT client only for `edgekit`

    fleet_commands.register(sub)
    from edgekit import doctor  # `edgekit doctor`: this machine's device class, SDKs, buildable targets, runtimes

    doctor.register(sub)
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
    )
    p.add_argument("model", type=Path, metavar="MODEL.onnx")
    p.add_argument("--target", default="cpu", help="comma-separated: cpu, intel, coral, jetson, apple (default cpu)")
    p.add_argument(
        "--precision",
        default="int8",
        metavar="P[,TARGET=P...]",
        help="a default precision, then per-target ones, e.g. int8,apple=int8-weights; targets not named get the "
        "default (int8 when none is given). Names: fp32, fp16, int8, int8-weights, int4-weights, palettize6, "
        "palettize4",
    )
    p.add_argument(
        "--calib", type=Path, required=True, metavar="CALIB.npz", help="one array per input, samples on axis 0"
    )
    p.add_argument("--eval", type=Path, metavar="EVAL.npz", help="held-out data (default: every 5th calib sample)")
    p.add_argument("--labels", type=Path, metavar="LABELS.npy", help="class index per evaluation sample")
    p.add_argument("--key", type=Path, required=True, metavar="KEY", help="private signing key from `edgekit keygen`")
    p.add_argument("--name", required=True)
    p.add_argument("--version", type=int, required=True, metavar="N", help="model version (anti-rollback counter)")
    p.add_argument("-o", "--out", type=Path, required=True, metavar="OUTDIR")
    p.add_argument(
        "--tolerance",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a validation gate, e.g. min_top1_agreement=0.97 or max_relative_error=none",
    )
    p.add_argument("--force", action="store_true", help="write the bundle even when validation fails")
    p.add_argument("--input-shape", action="append", default=[], metavar="NAME=1x3x224x224")
    p.add_argument(
        "--expires-days",
        type=float,
        default=None,
        metavar="D",
        help="the bundle expires D days from now (default 365; 0 = never: devices accept it forever)",
    )
    p.add_argument("--option", action="append", default=[], metavar="TARGET.KEY=VALUE", help="a target option")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=_package)


def _package(args: argparse.Namespace) -> int:
    from edgekit.compress.onnx_prep import parse_input_shape
    from edgekit.packager import PackageValidationError, package
    from edgekit.targets import parse_targets
    from edgekit.targets.options import parse_option_args
    from edgekit.targets.precisions import parse_precision_arg
    from edgekit.validate.metrics import parse_tolerance_args

    targets = parse_targets(args.target)
    shapes = dict(parse_input_shape(s) for s in args.input_shape)
    expires = bundle_expiry(args.expires_days)
    try:
        result = package(
            args.model,
            targets=targets,
            precision=parse_precision_arg(args.precision),
            calib=args.calib,
            eval=args.eval,
            labels=args.labels,
            key=args.key,
            name=args.name,
            version=args.version,
            out_dir=args.out,
            tolerance=parse_tolerance_args(args.tolerance) or None,
            force=args.force,
            input_shapes=shapes or None,
            expires=expires,
            progress=None if args.quiet else _progress,
            options=parse_option_args(args.option, targets),
        )
    except PackageValidationError as exc:
        print(exc.result.table())
        raise
    print(result.table())
    for target, path in result.bundles.items():
        print(f"{target}: {path}")
    return 0


def bundle_expiry(days: float | None) -> timedelta | None:
    """``--expires-days``: None = the default (365 days), 0 = never, else that many days."""
    from edgekit.packager import DEFAULT_EXPIRES_DAYS

    if days is None:
        days = DEFAULT_EXPIRES_DAYS
    if days < 0:
        raise ConfigError(f"--expires-days must be >= 0 (0 = never expires), got {days:g}")
    return timedelta(days=days) if days else None


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


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


def describe_manifest(m: Any, signed_by: str) -> list[str]:
    """Human-readable lines for ``edgekit inspect``."""
    v = m.validation
    lines = [
        f"{m.name} v{m.version}  target {m.target}  "
        f"runtime {m.compatibility.runtime} {m.compatibility.runtime_version}",
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
    measures = [
        f"{k.replace('_', ' ')} {getattr(v, k):.4g}"
        for k in ("top1_agreement", "top1_accuracy", "fp32_top1_accuracy", "cosine", "relative_error", "max_abs_error")
        if getattr(v, k) is not None
    ]
    latency = (
        f"p50 {v.latency_p50_ms:.3f} ms (fp32 {v.fp32_latency_p50_ms:.3f} ms)"
        if v.latency_p50_ms is not None and v.fp32_latency_p50_ms is not None
        else "latency not measured here"
    )
    ratio = f" ({v.size_ratio:.2f}x fp32)" if v.size_ratio is not None else ""
    lines += [
        f"validation {'passed' if v.passed else 'FAILED'} ({v.kind}, {v.samples} samples, {v.measured_on}): "
        + ", ".join(measures),
        f"  size {v.size_bytes} bytes{ratio}, {latency}",
        *(f"  note: {n}" for n in v.notes),
        f"golden vectors: {m.golden.count} in {m.golden.file} (min cosine {m.golden.min_cosine}, atol {m.golden.atol})",
        "files:",
        *(f"  {f.path}  {f.size_bytes} bytes  {f.role}  sha256 {f.sha256[:16]}..." for f in m.files),
    ]
    if m.op_placement is not None:
        op = m.op_placement
        counts = Counter((e.device, e.op) for e in op.entries)
        lines.append(f"op placement ({op.tool}): {op.accelerated} accelerated, {op.fallback} fallback")
        lines += [f"  {device}: {op_type} x{n}" for (device, op_type), n in sorted(counts.items())]
    if m.target_options:
        lines.append("target options: " + ", ".join(f"{k}={val}" for k, val in sorted(m.target_options.items())))
    return lines


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
    return 0


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


if __name__ == "__main__":
    sys.exit(main())
