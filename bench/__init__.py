"""Benchmarks: each script writes JSON (and PNG) to bench/results/."""
