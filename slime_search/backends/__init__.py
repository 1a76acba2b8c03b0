"""Training backends."""
