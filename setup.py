"""Build steps beyond pyproject.toml: optional compiled speed-ups (Cython) and the RocketMQ protobuf modules.

Two small extension modules, ``txmq.store._speedups`` and
``txmq.broker._speedups``, replace the check pass's per-record hot paths
(README "Compiled speed-ups"). They are optional: without a C compiler,
Cython or zlib's header the install goes on without them and txmq runs its
own Python versions of the same functions, which give the same bytes.

The RocketMQ 5 gRPC front end's message and service modules
(``txmq.broker.rocketmq.pb``) are generated from the ``.proto`` files in
broker/rocketmq/pb/ with grpcio-tools (a build requirement) by every
build_py, which editable installs, wheels and ``make binary`` all run; the
generated files are not kept in git.
"""

from __future__ import annotations

import os
import sys

from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

SPEEDUPS = [("txmq.store._speedups", "store/_speedups.pyx"), ("txmq.broker._speedups", "broker/_speedups.pyx"),
            ("txmq.broker._fsyncer", "broker/_fsyncer.pyx"), ("txmq._busypoll", "core/_busypoll.pyx"),
            ("txmq.spark._columns", "spark/_columns.pyx")]


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
    exts = [Extension(name, [src], libraries=["z"] if "store" in src or "spark" in src else [], define_macros=[("_GNU_SOURCE", "1")])
            for name, src in SPEEDUPS]
    try:
        return cythonize(exts, language_level=3, quiet=True)
    except Exception as exc:
        print(f"txmq: cythonize failed ({exc}); compiled speed-ups not built", file=sys.stderr)
        return []


PROTO_DIR = Path(__file__).resolve().parent / "broker" / "rocketmq" / "pb"
PROTO_PACKAGE = "txmq/broker/rocketmq/pb"  # the import path the generated modules name each other by
PROTOS = ("definition.proto", "service.proto")


def generate_protos() -> None:
    """broker/rocketmq/pb/*.proto -> *_pb2.py (and service_pb2_grpc.py) beside them, with grpc_tools.protoc.

    Regenerated when a .proto is newer than its module. The .proto files
    are mapped to the virtual path txmq/broker/rocketmq/pb/, so the modules
    import each other as txmq.broker.rocketmq.pb.* (never a top-level
    package). Without grpcio-tools (a build requirement, so only when
    building without isolation) the front end is left out and says so.
    """
    outputs = {p: PROTO_DIR / p.replace(".proto", "_pb2.py") for p in PROTOS}
    if all(out.exists() and out.stat().st_mtime >= (PROTO_DIR / p).stat().st_mtime for p, out in outputs.items()):
        return
    try:
        import grpc_tools
        from grpc_tools import protoc
    except ImportError:
        print("txmq: grpcio-tools not available; the RocketMQ gRPC front end's protobuf modules not generated", file=sys.stderr)
        return
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        args = ["grpc_tools.protoc", f"-I{PROTO_PACKAGE}={PROTO_DIR}", f"-I{Path(grpc_tools.__file__).parent / '_proto'}",
                f"--python_out={tmp}", f"--grpc_python_out={tmp}"] + [str(PROTO_DIR / p) for p in PROTOS]
        if protoc.main(args) != 0:
            raise RuntimeError("grpc_tools.protoc failed on broker/rocketmq/pb/*.proto")
        for name in ("definition_pb2.py", "service_pb2.py", "service_pb2_grpc.py"):
            shutil.copyfile(Path(tmp) / PROTO_PACKAGE / name, PROTO_DIR / name)


class BuildPyWithProtos(build_py):
    """build_py that first generates the protobuf modules into the source tree (editable installs see them there)."""

    def run(self) -> None:
        generate_protos()
        super().run()


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt, "build_py": BuildPyWithProtos})
