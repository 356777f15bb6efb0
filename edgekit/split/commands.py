"""``edgekit split plan``, ``edgekit split package`` and ``edgekit serve-tail``: registered on the
``edgekit`` parser."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from edgekit.split import compression

# samples the full model, the tails and head∘tail are packaged and gated on (every 5th is held out)
SPLIT_SAMPLES = 64


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]  # argparse keeps it generic-less
    split = subparsers.add_parser("split", help="split inference: where to cut a model between device and server")
    split_sub = split.add_subparsers(dest="split_command", required=True, metavar="COMMAND")
    plan = split_sub.add_parser(
        "plan",
        help="the cut that minimises end-to-end latency per bandwidth",
        description=(
            "Enumerate the cut points of MODEL where few tensors cross, extract each head and tail, check that they "
            "compose to MODEL, measure them with ONNX Runtime here (or read --device-profile / --server-profile), "
            "and print, per bandwidth, all-local, all-remote and the best split. Writes the heads, tails, "
            "plan.json, plan.txt and latency.png under --output-dir."
        ),
    )
    _plan_arguments(plan)
    plan.set_defaults(func=_plan)

    pkg = split_sub.add_parser(
        "package",
        help="plan, then write the split device bundle and one tail bundle per useful cut",
        description=(
            "Plan as `edgekit split plan` does, then write the device bundle NAME-cpu-vN.ekb (the full model FP32 as "
            "the local fallback, one head per cut chosen at some planned bandwidth (or --cuts), the plan in the "
            "manifest) and NAME-tail-<cut>-cpu-vN.ekb per cut, all signed with --key. When no cut helps at any "
            "planned bandwidth, only the ordinary bundle is written, and the command says why."
        ),
    )
    _plan_arguments(pkg)
    pkg.add_argument("--key", "--signing-key", dest="key", type=Path, required=True, help="Ed25519 private key")
    pkg.add_argument("--name", help="model name (default: MODEL's stem)")
    pkg.add_argument("--version", type=int, default=1)
    pkg.add_argument(
        "--cuts", default="auto", metavar="auto|all|ID,...", help="cuts to ship (auto: those chosen; all: every one)"
    )
    pkg.add_argument("--bundle-dir", type=Path, default=Path("."), help="where the bundles go (default: .)")
    pkg.set_defaults(func=_package)

    tail = subparsers.add_parser(
        "serve-tail",
        help="serve split tails over v2 REST (KServe/Triton protocol), or export them for Triton / KServe",
        description=(
            "Serve each TAIL (.onnx: packaged into an FP32 cpu bundle signed for this run; .ekb: installed as it is, "
            "its signer trusted with --trust) through the agent's own v2 front-end, service and pipeline, from a "
            "store in a temporary directory. With --triton-repo / --kserve, write the .onnx tails as a Triton model "
            "repository / a KServe layout instead."
        ),
    )
    tail.add_argument("tails", type=Path, nargs="+", metavar="TAIL", help="tail .onnx files or .ekb tail bundles")
    tail.add_argument("--listen", default="127.0.0.1:8600", metavar="HOST:PORT", help="where to serve (port 0: any)")
    tail.add_argument("--trust", type=Path, action="append", default=[], metavar="KEY.pub", help="signer of .ekb tails")
    tail.add_argument(
        "--name-prefix", metavar="P", help="serve TAIL as P-<file stem> (as the plan names tails: MODEL-tail-<cut>)"
    )
    tail.add_argument("--triton-repo", type=Path, metavar="DIR", help="write a Triton model repository and exit")
    tail.add_argument("--kserve", type=Path, metavar="DIR", help="write DIR/<name>/model.onnx for KServe and exit")
    tail.set_defaults(func=_serve_tail)


def _plan_arguments(plan: argparse.ArgumentParser) -> None:
    plan.add_argument("model", type=Path, help="the ONNX model")
    plan.add_argument("--target", default="cpu", help="device target (cpu: measured with ONNX Runtime here)")
    plan.add_argument("--input-shape", action="append", default=[], metavar="NAME=1x3x320x320")
    plan.add_argument("--calib", type=Path, metavar="C.npz", help="sample inputs (one array per input name)")
    plan.add_argument("--samples", type=int, default=8, help="samples checked and compressed per cut")
    plan.add_argument("--device-profile", type=Path, metavar="P.json", help="head/full times recorded on the device")
    plan.add_argument("--server-profile", type=Path, metavar="P.json", help="tail/full times recorded on the server")
    plan.add_argument(
        "--server-speedup",
        type=float,
        default=10.0,
        help="without --server-profile: how many times faster than this host the server runs a tail (default 10)",
    )
    plan.add_argument("--bandwidth-mbps", default="1,10,100,1000", help="Mbit/s, comma-separated")
    plan.add_argument("--rtt-ms", type=float, default=20.0, help="round-trip time to the server (default 20)")
    plan.add_argument(
        "--compress", choices=compression.MODES, default="none", help="send cut tensors as fp16/int8 + zlib"
    )
    plan.add_argument("--max-tensors", type=int, default=1, help="most tensors allowed to cross a cut (default 1)")
    plan.add_argument("--budget-s", type=float, default=20.0, help="time spent timing the segments")
    plan.add_argument(
        "--timing",
        choices=("cpu", "wall"),
        default="cpu",
        help="host times: cpu = CPU time of one-thread sessions (a core to itself, whatever else runs here; "
        "default), wall = wall-clock with ONNX Runtime's default thread pool under this host's load",
    )
    plan.add_argument("--output-dir", "-o", type=Path, help="where to write (default: MODEL's stem + '-split')")
    plan.add_argument("--save-profile", type=Path, metavar="P.json", help="write this host's times as a profile")
    plan.add_argument("--no-plot", action="store_true", help="skip latency.png")
    plan.add_argument(
        "--objective",
        choices=("latency", "energy"),
        default="latency",
        help="what the best option minimises: end-to-end latency, or the device's energy per request",
    )
    plan.add_argument(
        "--device-power-w",
        type=float,
        metavar="W",
        help="--objective energy: watts the device draws computing (default: the device profile's)",
    )
    plan.add_argument(
        "--radio-power-w", type=float, metavar="W", help="--objective energy: watts while sending (assumed 1)"
    )
    plan.add_argument(
        "--idle-power-w", type=float, metavar="W", help="--objective energy: watts waiting for the server (assumed 0.2)"
    )
    plan.add_argument(
        "--all-cuts",
        action="store_true",
        help="measure every cut, also those sending no fewer bytes than an earlier cut (for a server slower "
        "than the device)",
    )


def _plan(args: Any) -> int:
    run = _run_plan(args)
    print(run.table)
    print(f"wrote {run.out_dir}/plan.json, plan.txt" + ("" if args.no_plot else ", latency.png") + ", heads/, tails/")
    return 0


def _run_plan(args: Any) -> Any:
    from edgekit.compress.onnx_prep import parse_input_shape
    from edgekit.split.plan import parse_bandwidths
    from edgekit.split.planner import plan_model

    bandwidths = parse_bandwidths(args.bandwidth_mbps)
    out = args.output_dir or args.model.with_name(args.model.stem + "-split")
    return plan_model(
        args.model,
        out,
        bandwidths,
        target=args.target,
        rtt_ms=args.rtt_ms,
        input_shapes=dict(parse_input_shape(s) for s in args.input_shape),
        calib=args.calib,
        samples=args.samples,
        device_profile=args.device_profile,
        server_profile=args.server_profile,
        server_speedup=args.server_speedup,
        compress=args.compress,
        max_tensors=args.max_tensors,
        budget_s=args.budget_s,
        save_profile=args.save_profile,
        plot=not args.no_plot,
        all_cuts=args.all_cuts,
        objective=args.objective,
        device_power_w=args.device_power_w,
        radio_power_w=args.radio_power_w,
        idle_power_w=args.idle_power_w,
        timing=args.timing,
    )


def _package(args: Any) -> int:
    from edgekit.split.bundles import write_split_bundles

    run = _run_plan(args)
    print(run.table)
    heads = {m.cut.id: m.head_path for m in run.measured.cuts}
    tails = {m.cut.id: m.tail_path for m in run.measured.cuts}
    result = write_split_bundles(
        args.model,
        run.plan,
        heads,
        tails,
        _samples(run.out_dir / "model.onnx", args.calib),
        key=args.key,
        name=args.name or args.model.stem,
        out_dir=args.bundle_dir,
        version=args.version,
        cuts=None if args.cuts == "auto" else _cut_list(args.cuts),
    )
    for line in result.gate:
        print(f"split gate {line}")
    print(f"device bundle: {result.device} ({result.note})")
    for cut_id, path in result.tails.items():
        print(f"tail bundle {cut_id}: {path}")
    return 0


def _serve_tail(args: Any) -> int:
    import signal
    import sys
    import threading

    from edgekit.errors import ConfigError
    from edgekit.split.tail import serve_tail, tail_name

    if args.triton_repo or args.kserve:
        from edgekit.split.export import export_kserve, export_triton

        onnx = [t for t in args.tails if t.suffix == ".onnx"]
        if len(onnx) != len(args.tails):
            raise ConfigError("--triton-repo / --kserve export .onnx tails; give the tails' .onnx files")
        named = [(tail_name(t, args.name_prefix), t) for t in onnx]
        if args.triton_repo:
            for path in export_triton(named, args.triton_repo):
                print(f"wrote {path}")
        if args.kserve:
            for path in export_kserve(named, args.kserve):
                print(f"wrote {path}")
            print(f"serve with: python -m edgekit.split.kserve_tail {args.kserve} --http_port 8080")
        return 0
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())

    def ready(url: str, models: dict[str, int]) -> None:
        print(f"serving {', '.join(models)} at {url}", flush=True)
        sys.stdout.flush()

    return serve_tail(
        args.tails, args.listen, trusted_keys=args.trust, name_prefix=args.name_prefix, on_ready=ready, stop=stop
    )


# -- edgekit package --split -----------------------------------------------------------------


def add_package_arguments(p: argparse.ArgumentParser) -> None:
    """``edgekit package``'s split flags (the package command registers them)."""
    g = p.add_argument_group(
        "split inference",
        "--split: also plan where to cut MODEL between the device and a v2 server (as `edgekit split plan`), add "
        "one head per useful cut and the plan to the cpu bundle (the full model stays as the local fallback), and "
        "write NAME-tail-<cut>-cpu-vN.ekb per cut, all signed; each head and tail composed pass the full model's "
        "gate. When no cut helps at any planned bandwidth the bundle stays ordinary and the plan says why.",
    )
    g.add_argument("--split", action="store_true", help="plan the split and write the device and tail bundles")
    g.add_argument(
        "--cuts",
        default="auto",
        metavar="auto|all|ID,...",
        help="cuts to ship (auto: those the plan chose; all: every cut measured, for `edgekit-agent profile`)",
    )
    g.add_argument("--bandwidth-mbps", default="1,10,100,1000", help="--split: Mbit/s to plan for, comma-separated")
    g.add_argument("--rtt-ms", type=float, default=20.0, help="--split: round-trip time to the tail server")
    g.add_argument(
        "--split-device-profile",
        type=Path,
        metavar="P.json",
        help="--split: head/full times recorded on the device (`edgekit-agent profile BUNDLE -o P.json`)",
    )
    g.add_argument("--server-profile", type=Path, metavar="P.json", help="--split: tail times recorded on the server")
    g.add_argument(
        "--server-speedup",
        type=float,
        default=10.0,
        help="--split, without --server-profile: how many times faster than this host the server runs a tail",
    )
    g.add_argument("--split-budget-s", type=float, default=20.0, help="--split: time spent timing the segments")
    g.add_argument(
        "--split-objective",
        choices=("latency", "energy"),
        default="latency",
        help="--split: the cuts chosen minimise latency, or the device's energy per request (see --device-power-w)",
    )
    g.add_argument("--device-power-w", type=float, metavar="W", help="--split-objective energy: watts computing")
    g.add_argument("--radio-power-w", type=float, metavar="W", help="--split-objective energy: watts sending (1)")
    g.add_argument("--idle-power-w", type=float, metavar="W", help="--split-objective energy: watts waiting (0.2)")
    g.add_argument(
        "--split-dir", type=Path, metavar="DIR", help="--split: where heads, tails and the plan go (OUTDIR/NAME-split)"
    )


def check_package_split(args: Any) -> None:
    """Before any work: ``--split`` makes the cpu bundle a split one (heads run with ONNX Runtime)."""
    from edgekit.errors import ConfigError
    from edgekit.split.plan import parse_bandwidths

    targets = [t.strip() for t in str(args.target).split(",") if t.strip()]
    if targets != ["cpu"]:
        raise ConfigError(
            f"--split with --target {args.target}: split bundles are made for the cpu target (its heads run with "
            "ONNX Runtime on the device); package with --target cpu --split, and other targets without --split"
        )
    if args.postprocess:
        raise ConfigError(
            "--split with --postprocess: a split answer comes from the tail and skips the agent's post-processing; "
            "package the split model without --postprocess"
        )
    if args.compress or args.reference:
        raise ConfigError(
            "--split with --compress/--reference: the heads are cut from MODEL as given; compress first "
            "(`edgekit compress`), then package the compressed model with --split"
        )
    parse_bandwidths(args.bandwidth_mbps)
    if args.split_objective == "energy" and args.device_power_w is None and not _profile_power(args):
        raise ConfigError(
            "--split-objective energy needs the device's power while computing: give --device-power-w W, or a "
            "--split-device-profile with device_power_w (`edgekit-agent profile` on a device with an energy meter)"
        )
    if args.cuts != "auto" and not _cut_list(args.cuts):
        raise ConfigError(f"--cuts {args.cuts!r}: give auto or cut ids such as cut3,cut5 (from `edgekit split plan`)")


def _profile_power(args: Any) -> bool:
    """Whether --split-device-profile gives the device's power."""
    from edgekit.split.profile import read

    return args.split_device_profile is not None and read(args.split_device_profile).device_power_w is not None


def split_after_package(args: Any, result: Any) -> Any:
    """``edgekit package --split``, once the ordinary cpu bundle is written: plan, gate each cut,
    write the tails, add the heads and the plan to the bundle. Prints what it wrote (to stderr
    with --json) and returns the ``SplitBundles``."""
    import sys

    from edgekit.compress.onnx_prep import parse_input_shape
    from edgekit.split.bundles import add_split
    from edgekit.split.plan import parse_bandwidths
    from edgekit.split.planner import plan_model

    out = sys.stderr if args.json else sys.stdout
    bundle = result.bundles["cpu"]
    work = args.split_dir or Path(args.out) / f"{args.name}-split"
    calib_npz = _calib_npz(args, work)
    run = plan_model(
        args.model,
        work,
        parse_bandwidths(args.bandwidth_mbps),
        rtt_ms=args.rtt_ms,
        input_shapes=dict(parse_input_shape(s) for s in args.input_shape),
        calib=calib_npz,
        device_profile=args.split_device_profile,
        server_profile=args.server_profile,
        server_speedup=args.server_speedup,
        budget_s=args.split_budget_s,
        objective=args.split_objective,
        device_power_w=args.device_power_w,
        radio_power_w=args.radio_power_w,
        idle_power_w=args.idle_power_w,
    )
    print(run.table, file=out)
    split = add_split(
        bundle,
        run.out_dir / "model.onnx",
        run.plan,
        {m.cut.id: m.head_path for m in run.measured.cuts},
        {m.cut.id: m.tail_path for m in run.measured.cuts},
        _samples(run.out_dir / "model.onnx", calib_npz),
        key=args.signing_key,
        name=args.name,
        out_dir=Path(args.out),
        version=args.version,
        cuts=None if args.cuts == "auto" else _cut_list(args.cuts),
    )
    for line in split.gate:
        print(f"split gate {line}", file=out)
    print(f"split device bundle: {split.device} ({split.note}); plan in {run.out_dir}", file=out)
    for cut_id, path in split.tails.items():
        print(f"tail bundle {cut_id}: {path}", file=out)
    return split


def _cut_list(text: str) -> list[str]:
    return [c.strip() for c in text.split(",") if c.strip()]


def _calib_npz(args: Any, work: Path) -> Path | None:
    """The samples the split is planned and gated on: --calib as an .npz (images and .npy are read
    as the packager reads them, with --preprocess, and saved once under ``work``)."""
    import numpy as np

    if not args.calib:
        return None
    if str(args.calib).lower().endswith(".npz"):
        return Path(args.calib)
    from edgekit.compress.onnx_prep import load_onnx
    from edgekit.compress.signature import served_signature
    from edgekit.validate.calib import load_data
    from edgekit.validate.preprocess import Preprocess

    pre = Preprocess.parse(args.preprocess) if args.preprocess else None
    arrays = load_data(args.calib, served_signature(load_onnx(args.model)), preprocess=pre)
    work.mkdir(parents=True, exist_ok=True)
    np.savez(work / "calib.npz", **arrays)  # type: ignore[arg-type]  # numpy's savez stubs take **kwds: ArrayLike
    return work / "calib.npz"


def _samples(model: Path, calib: Path | None, count: int = SPLIT_SAMPLES) -> dict[str, Any]:
    """``count`` samples, batched on axis 0: the rows of ``calib``, topped up with the planner's
    seeded inputs where it has fewer (the tails are packaged and gated on them)."""
    import numpy as np

    from edgekit.split.graph import load_model
    from edgekit.split.planner import sample_feeds

    loaded = load_model(model)
    feeds, _ = sample_feeds(loaded, calib, count) if calib is not None else ([], "")
    if len(feeds) < count:
        feeds += sample_feeds(loaded, None, count - len(feeds))[0]
    return {name: np.concatenate([f[name] for f in feeds]) for name in feeds[0]}
