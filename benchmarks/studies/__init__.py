"""Studies that chose a default: each runs the miniature or a simulation over seeds, modes or shapes and prints the
table of `docs/benchmarks/` its docstring names; they share `benchmarks/harness/miniature_runs.py`."""
