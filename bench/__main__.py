"""``python -m bench``: run every benchmark (or ``--only quant.cpu,agent``) and report ratios.

Prints the machine, then one table of A vs B measured side by side in this run, and writes
``bench/results/latest.json`` (+ ``latest.png`` with matplotlib). ``--quick`` lowers the repeats
for a fast look; numbers from a quick run are noisier. ``--markdown docs/benchmarks.md`` also
writes the run as the benchmark page, stamped with its date, machine, CPU flags and command; with
``--plot-only`` the page (and plot) are written again from ``latest.json`` without measuring.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

if __package__ in (None, ""):  # `python bench/__main__.py`: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import machine, report
from bench.registry import BENCHMARKS, MODELS_ENV, NOT_HERE, BenchContext, Measurement, model_entries, select
from edgekit.errors import EdgekitError

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated benchmark names or prefixes (e.g. quant.cpu,agent)")
    parser.add_argument("--quick", action="store_true", help="fewer repeats (noisier numbers)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for latest.json and latest.png")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    parser.add_argument(
        "--models",
        metavar="MODEL.onnx:CALIB.npz:EVAL.npz,...",
        default=os.environ.get(MODELS_ENV, ""),
        help=f"also run the engine benchmark on these models (engine.<file stem>; default ${MODELS_ENV}); "
        "an EVAL.npz may hold a 'labels' array",
    )
    parser.add_argument(
        "--plot-only",
        action="store_true",
        help="measure nothing: redraw OUT/latest.png (and the --markdown page) from OUT/latest.json",
    )
    parser.add_argument(
        "--markdown",
        type=Path,
        metavar="PAGE.md",
        help="also write the results as a Markdown page (e.g. docs/benchmarks.md), stamped with date, machine, "
        "CPU flags and command",
    )
    args = parser.parse_args(argv)
    if args.plot_only:
        return _replot(args.out, args.markdown)
    try:
        extra = model_entries(args.models)
        entries = select(args.only, extra)
    except ValueError as exc:
        parser.error(str(exc))
    if args.list:
        for e in (*BENCHMARKS, *extra):
            print(f"{e.name:18s} {e.description}")
        return 0
    info = machine.describe()
    print(f"machine: {machine.one_line(info)}", flush=True)
    started = datetime.now(timezone.utc).replace(microsecond=0).isoformat()
    t0 = time.perf_counter()
    rows: list[Measurement] = []
    with tempfile.TemporaryDirectory(prefix="edgekit-bench-") as tmp:
        from edgekit.bundle import generate_keypair

        key, pub = generate_keypair(Path(tmp) / "keys", "bench")
        ctx = BenchContext(
            workdir=Path(tmp),
            key=key,
            pub=pub,
            repeats=15 if args.quick else 60,
            budget_s=3.0 if args.quick else 20.0,
            progress=lambda msg: print(f"  {msg}", flush=True),
        )
        for entry in entries:
            print(f"[{entry.name}] {entry.description}", flush=True)
            try:
                got = entry.run(ctx)
            except EdgekitError as exc:  # one benchmark failing must not hide the others' numbers
                print(f"  {entry.name} failed: {exc}", flush=True)
                got = [Measurement(entry.name, "-", "-", "", "", "", note=f"failed: {exc}".splitlines()[0])]
            rows += got
            if len(entries) > 1:  # each benchmark's rows as soon as they are measured (a long run may be cut)
                print(report.format_table(got), flush=True)
    duration = time.perf_counter() - t0
    print()
    print(report.format_table(rows))
    command = shlex.join(["python", "-m", "bench", *(sys.argv[1:] if argv is None else argv)])
    doc = report.to_json(info, rows, started, duration, command)
    json_path = report.write_json(args.out / "latest.json", doc)
    title = f"python -m bench, {started}\n{machine.short_line(info)}"
    png = report.write_plot(args.out / "latest.png", rows, title)
    print(f"\n{len(rows)} rows ({sum(m.note.startswith(NOT_HERE) for m in rows)} {NOT_HERE}) in {duration:.0f} s")
    print(f"wrote {json_path}" + (f" and {png}" if png else " (no plot: matplotlib is not installed)"))
    if args.markdown is not None:
        print(f"wrote {report.write_markdown(args.markdown, doc, png)}")
    return 1 if any(m.note.startswith("failed") for m in rows) else 0


def _replot(out: Path, markdown: Path | None) -> int:
    import json

    doc = json.loads((out / "latest.json").read_text())
    rows = report.load_doc_rows(doc)
    title = f"python -m bench, {doc['started']}\n{machine.short_line(doc['machine'])}"
    png = report.write_plot(out / "latest.png", rows, title)
    print(f"wrote {png}" if png else "no plot: matplotlib is not installed")
    if markdown is not None:
        print(f"wrote {report.write_markdown(markdown, doc, png)}")
    return 0 if png else 1


if __name__ == "__main__":
    sys.exit(main())
