"""Ray placement: the Megatron train group (one actor per rank), the RolloutManager's placement, colocation."""
