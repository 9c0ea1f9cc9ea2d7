"""The C loops of the store (``slotroute._native``); everything else is in pyproject.toml.

The C uses GCC/Clang builtins and attributes (``__builtin_prefetch``, unaligned
typedefs, ``target_clones``): it builds with GCC or Clang (Linux, macOS). MSVC cannot
build it, so on Windows no extension is built and slotroute runs its numpy path.
"""

import sys

from setuptools import Extension, setup

setup(
    ext_modules=[]
    if sys.platform == "win32"
    else [Extension("slotroute._native", ["src/slotroute/_native.c"], extra_compile_args=["-O3"])]
)
