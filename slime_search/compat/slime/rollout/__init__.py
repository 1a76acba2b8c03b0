"""slime.rollout: the generation state and the default generate function."""
