"""Build the Cython kernels in csrc/ as shardkit._kernels.<name>.

Compiler directives live here and only here. SHARDKIT_CYTHON_DEBUG=1 turns bounds checks,
wraparound and initialisation checks back on.
"""

import os
import platform
from pathlib import Path

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("SHARDKIT_CYTHON_DEBUG", "") == "1"

DIRECTIVES = {
    "language_level": 3,
    "cdivision": True,
    "nonecheck": False,
    "embedsignature": True,
    "binding": True,
    "freethreading_compatible": True,
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "initializedcheck": DEBUG,
}

# xxHash's runtime dispatcher (SSE2 / AVX2 / AVX-512) builds for x86 only, with baseline flags.
X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")
EXTRA_SOURCES = {"_gather": ["csrc/xxhash/xxh_x86dispatch.c"] if X86 else []}
XXH_MACROS = [("SHARDKIT_XXH_DISPATCH", "1")] if X86 else []

extensions = [
    Extension(
        f"shardkit._kernels.{pyx.stem}",
        [str(pyx), *EXTRA_SOURCES.get(pyx.stem, [])],
        include_dirs=[numpy.get_include(), "csrc"],  # numpy's C API; csrc/xxh3.h
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"), *XXH_MACROS],
        extra_compile_args=["-O3"] if not DEBUG else ["-O0", "-g"],
    )
    for pyx in sorted(Path("csrc").glob("*.pyx"))
]

setup(
    ext_modules=cythonize(
        extensions,
        include_path=["csrc"],
        compiler_directives=DIRECTIVES,
        force=DEBUG,
    )
)
