"""slime.backends: only what slime's plugins import of it."""
