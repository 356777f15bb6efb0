"""Benchmarks: ``python -m bench`` runs every entry of ``bench.registry.BENCHMARKS``.

Each benchmark measures A and B side by side in one run (interleaved, medians over repeats) and
returns ``Measurement`` rows; the runner prints them with the machine they ran on and writes
``bench/results/latest.json`` (and ``latest.png`` where matplotlib is installed). Numbers that
need hardware this machine lacks are reported as "not measured here". A benchmark is not a test:
nothing asserts on these numbers.
"""
