"""Performance instruments: each module measures one part of the product (time, throughput, bytes, memory) and prints
its figures; `docs/benchmarks/` records them with the machine named, and `benchmarks/harness/baselines.json` keeps the
figures that are the same on every machine."""
