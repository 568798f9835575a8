# cython: language_level=3
"""Kernel module _gather (being written)."""
