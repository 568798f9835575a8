# cython: language_level=3
"""Kernel module _packing (being written)."""
