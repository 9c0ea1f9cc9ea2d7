"""The C loops of the store (``slotroute._native``); everything else is in pyproject.toml."""

import sys

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "slotroute._native",
            ["src/slotroute/_native.c"],
            extra_compile_args=[] if sys.platform == "win32" else ["-O3"],
        )
    ]
)
