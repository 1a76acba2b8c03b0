"""Megatron-core training backend: model build, CPU compatibility, log-probs and loss wiring."""
