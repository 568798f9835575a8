# cython: language_level=3
"""Kernel module _shuffle (being written)."""
