"""Engines that serve SGLang's /generate without a model: a replayed script or recorded trajectories (the tests' known
policy and the rollout benchmark's), and an emulated H100 (the overlap benchmark's)."""
