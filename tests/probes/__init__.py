"""Probes: runnable checks of behaviour that also print the table a page of docs/benchmarks/ records
(`python -m tests.probes.bad_inputs`, `python -m tests.probes.engine_fuzz`); each has a test beside it or in the
suite that runs it."""
