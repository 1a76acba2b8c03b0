"""Instruments that measure the product: each module is one benchmark with its command in its docstring."""
