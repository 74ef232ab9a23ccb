"""Builds the native kernels' shared library when miniapp is installed (everything else about
the package is in pyproject.toml).

The library is plain C++ loaded with ctypes: no Python C API, no torch headers, no network.
It is optional: where it cannot be built (no compiler), the install still succeeds, and the
engine builds it on first use or runs torch's int4 matmul instead (`miniapp doctor` says
which).
"""

import importlib.util
from pathlib import Path

from setuptools import Extension, setup

ROOT = Path(__file__).resolve().parent
# native/build.py holds the flags shared with the build-on-first-use path; it imports only
# the standard library, so it can be loaded before anything is installed.
_spec = importlib.util.spec_from_file_location("_native_build", ROOT / "native" / "build.py")
native_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(native_build)

int4_library = Extension(
    f"miniapp.native.{native_build.LIBRARY_STEM}",
    sources=[str(source.relative_to(ROOT)) for source in native_build.SOURCES],
    depends=[str(header.relative_to(ROOT)) for header in native_build.HEADERS],
    language="c++",
    extra_compile_args=[*native_build.COMPILE_FLAGS, native_build.hash_define()],
    extra_link_args=[flag for flag in native_build.LINK_FLAGS if flag != "-shared"],
    optional=True,  # a failed build warns and installs without it
)

setup(ext_modules=[int4_library])
