"""Build the Cython kernels in csrc/ as shardkit._kernels.<name>.

Compiler directives and flags live here and only here. SHARDKIT_CYTHON_DEBUG=1 turns bounds
checks, wraparound and initialisation checks back on and compiles with -O0 -g.

A release build compiles without debug information (-g0: Python's own CFLAGS carry -g, which
more than doubles the compile time of the generated C and the size of the wheel), cythonizes
and compiles the extensions in parallel, one job per CPU (`build_ext -j N` overrides), and
keeps -O3 for the kernels with hot loops.
"""

import os
import platform
import sys
import time
from pathlib import Path

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

DEBUG = os.environ.get("SHARDKIT_CYTHON_DEBUG", "") == "1"
JOBS = os.cpu_count() or 1

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

# Kernels whose loops run per byte or per tensor on the hot path get -O3; the others (size
# arithmetic, building views, mapping files) spend their time in Python API calls, where -O2
# is as fast.
HOT = {"_gather", "_packing", "_shuffle", "_sstable", "_table"}

# xxHash's runtime dispatcher (SSE2 / AVX2 / AVX-512) builds for x86 only, with baseline flags.
# Only _gather hashes (through csrc/xxh3.h), so only _gather compiles and links it, once.
X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")
EXTRA_SOURCES = {"_gather": ["csrc/xxhash/xxh_x86dispatch.c"] if X86 else []}
EXTRA_MACROS = {"_gather": [("SHARDKIT_XXH_DISPATCH", "1")] if X86 else []}


def _flags(name: str) -> list[str]:
    if DEBUG:
        return ["-O0", "-g"]
    return ["-g0", "-O3" if name in HOT else "-O2"]


extensions = [
    Extension(
        f"shardkit._kernels.{pyx.stem}",
        [str(pyx), *EXTRA_SOURCES.get(pyx.stem, [])],
        include_dirs=[numpy.get_include(), "csrc"],  # numpy's C API; csrc/xxh3.h
        define_macros=[
            ("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"),
            *EXTRA_MACROS.get(pyx.stem, []),
        ],
        extra_compile_args=_flags(pyx.stem),
    )
    for pyx in sorted(Path("csrc").glob("*.pyx"))
]


class BuildExt(build_ext):
    """build_ext that compiles the extensions in parallel and says what it is doing."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if not self.parallel:  # neither -j nor [build_ext] parallel given
            self.parallel = JOBS

    def build_extensions(self) -> None:
        jobs = self.parallel if isinstance(self.parallel, int) and self.parallel > 1 else 1
        mode = "debug (-O0 -g, checks on)" if DEBUG else "release"
        _say(f"compiling {len(self.extensions)} kernels, {mode}, {jobs} parallel job(s)")
        start = time.perf_counter()
        super().build_extensions()
        _say(f"kernels compiled in {time.perf_counter() - start:.1f} s")


def _say(message: str) -> None:
    # pip shows a build's output with `pip install -v`; setuptools' own lines come on stdout.
    print(f"shardkit: {message}", file=sys.stderr, flush=True)


setup(
    cmdclass={"build_ext": BuildExt},
    ext_modules=cythonize(
        extensions,
        include_path=["csrc"],
        compiler_directives=DIRECTIVES,
        force=DEBUG,
        nthreads=JOBS if JOBS > 1 else 0,
    ),
)
