"""Build the Cython kernels in csrc/ as shardkit._kernels.<name>.

Compiler directives live here and only here. SHARDKIT_CYTHON_DEBUG=1 turns bounds checks,
wraparound and initialisation checks back on.
"""

import os
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

extensions = [
    Extension(
        f"shardkit._kernels.{pyx.stem}",
        [str(pyx)],
        include_dirs=[numpy.get_include()],  # _views uses numpy's C API
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
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
