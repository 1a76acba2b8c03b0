"""Ray placement groups and actor groups for the Megatron trainer (GPU bundles, or CPU bundles on CPU)."""
