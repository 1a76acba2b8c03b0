"""Training health: signals of every step, the guard that acts on them, and its remedies."""
