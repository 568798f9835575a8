"""The compiled kernels (csrc/*.pyx). Importing fails loudly when they were not built.

There is no silent pure-Python fallback: a missing build is an error that says how to build.
``SHARDKIT_PUREPYTHON=1`` deliberately swaps in the pure-Python twins in ``shardkit._reference``
(one module per kernel module, same names), for debugging and for running tests on the oracle.
"""

from __future__ import annotations

import os

if os.environ.get("SHARDKIT_PUREPYTHON", "") == "1":
    from .._reference import _gather, _mmap, _packing, _shuffle, _sizes, _sstable, _table, _views

    PURE_PYTHON = True
else:
    try:
        from . import _gather, _mmap, _packing, _shuffle, _sizes, _sstable, _table, _views  # type: ignore[no-redef]
    except ImportError as e:
        raise ImportError(
            f"shardkit's compiled kernels are missing or broken ({e}). shardkit does not run "
            "without them. Build them with `pip install .` (or, in a checkout, "
            "`pip install -e .` / `python setup.py build_ext --inplace`); this needs a C "
            "compiler and Cython>=3.1. If you ran Python from a source checkout that was "
            "never built, the unbuilt package in the current directory shadows the installed one."
        ) from e
    PURE_PYTHON = False

__all__ = ["PURE_PYTHON", "_gather", "_mmap", "_packing", "_shuffle", "_sizes", "_sstable",
           "_table", "_views"]
