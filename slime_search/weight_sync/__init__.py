"""Stage 3 of a step: the actor's weights to the engines, by one transport (disk, broadcast or tensor handles)."""
