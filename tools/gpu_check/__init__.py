"""Validate a GPU node before a run: `python -m tools.gpu_check --out DIR` (the kit, `kit.py`) runs each part in a
process of its own and writes one JSON and one markdown report; `--cpu` runs the same parts on the tiny model on CPU."""
