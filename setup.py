"""Optional compiled speed-ups (Cython); everything else is in pyproject.toml.

Two small extension modules, ``txmq.store._speedups`` and
``txmq.broker._speedups``, replace the check pass's per-record hot paths
(README "Compiled speed-ups"). They are optional: without a C compiler,
Cython or zlib's header the install goes on without them and txmq runs its
own Python versions of the same functions, which give the same bytes.
"""

from __future__ import annotations

import os
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext

SPEEDUPS = [("txmq.store._speedups", "store/_speedups.pyx"), ("txmq.broker._speedups", "broker/_speedups.pyx")]


class OptionalBuildExt(build_ext):
    """Build the speed-ups this machine can build; never fail the install because of them.

    Each extension is tried alone and dropped from the list when it fails,
    so the others are still built and (editable installs) copied in place.
    """

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # e.g. no usable compiler at all: the pure-Python paths serve
            print(f"txmq: compiled speed-ups not built ({exc}); using the pure-Python code", file=sys.stderr)

    def build_extensions(self) -> None:
        built = []
        for ext in self.extensions:
            try:
                self.build_extension(ext)
            except Exception as exc:
                print(f"txmq: {ext.name} not built ({exc}); using the pure-Python code", file=sys.stderr)
            else:
                built.append(ext)
        self.extensions = built


def extensions() -> list:
    if os.environ.get("TXMQ_NO_SPEEDUPS"):
        return []
    try:
        from Cython.Build import cythonize
        from setuptools import Extension
    except ImportError:
        print("txmq: Cython not available; compiled speed-ups not built", file=sys.stderr)
        return []
    exts = [Extension(name, [src], libraries=["z"] if "store" in src else [], define_macros=[("_GNU_SOURCE", "1")])
            for name, src in SPEEDUPS]
    try:
        return cythonize(exts, language_level=3, quiet=True)
    except Exception as exc:
        print(f"txmq: cythonize failed ({exc}); compiled speed-ups not built", file=sys.stderr)
        return []


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
