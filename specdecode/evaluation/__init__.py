"""Benchmarks and evaluation: every result is JSON + a markdown table (+ plots) under docs/results/."""
