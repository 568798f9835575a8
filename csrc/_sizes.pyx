# cython: language_level=3
"""Kernel module _sizes (being written)."""
