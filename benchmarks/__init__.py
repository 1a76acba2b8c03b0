"""Instruments that measure the product, none imported by it: `perf/` (performance), `studies/` (the studies behind
the defaults) and `harness/` (what they share, and the only module one instrument may import from another). Each
module's docstring opens with its command; the GPU node check is `tools/gpu_check/`."""
