"""``edgekit split plan``, ``edgekit split package`` and ``edgekit serve-tail``: registered on the
``edgekit`` parser."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from edgekit.split import compression


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
    pkg.add_argument("--cuts", default="auto", metavar="auto|ID,...", help="cuts to ship (auto: those chosen)")
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
    plan.add_argument("--output-dir", "-o", type=Path, help="where to write (default: MODEL's stem + '-split')")
    plan.add_argument("--save-profile", type=Path, metavar="P.json", help="write this host's times as a profile")
    plan.add_argument("--no-plot", action="store_true", help="skip latency.png")
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
    )


def _package(args: Any) -> int:
    import numpy as np

    from edgekit.split.bundles import write_split_bundles
    from edgekit.split.graph import load_model
    from edgekit.split.planner import sample_feeds

    run = _run_plan(args)
    print(run.table)
    heads = {m.cut.id: m.head_path for m in run.measured.cuts}
    tails = {m.cut.id: m.tail_path for m in run.measured.cuts}
    feeds, _ = sample_feeds(load_model(args.model), args.calib, max(args.samples, 16))
    calib = {name: np.concatenate([f[name] for f in feeds]) for name in feeds[0]}
    cuts = None if args.cuts == "auto" else [c.strip() for c in args.cuts.split(",") if c.strip()]
    result = write_split_bundles(
        args.model,
        run.plan,
        heads,
        tails,
        calib,
        key=args.key,
        name=args.name or args.model.stem,
        out_dir=args.bundle_dir,
        version=args.version,
        cuts=cuts,
    )
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
