"""Build dist/txmq-linux-<arch>: one executable that needs no Python (docs/binary.md).

Three steps, run by `make binary` with the virtual environment's Python (PyInstaller installed there):

1. PyInstaller freezes txmq's CLI (with the RocketMQ front end, grpcio and protobuf) into a
   one-directory bundle, build/binary/dist/txmq: a bootloader, libpython, the compiled modules
   (txmq's speed-ups, uvloop, msgpack, grpcio, pydantic-core) and the rest as bytecode.
2. That directory is packed into one gzip stream of records (launcher.c describes the format) with a
   manifest listing every record's type, mode, size and SHA-256, and named
   txmq-<version>-<first 16 hex digits of the SHA-256 of the manifest>.
3. scripts/binary/launcher.c is compiled (zlib linked in statically where libz.a exists) and the
   executable is the launcher, the packed stream, the manifest and a trailer. Its first start unpacks
   the bundle once into the cache directory under that name, checks every file against the manifest's
   SHA-256 and renames it into place; later starts check the tree against the manifest and exec it.

Usage: python scripts/binary/build.py [--out dist/txmq-linux-x86_64] [--keep-work] [--reuse-bundle] [--pyinstaller-onefile]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import os
import platform
import shlex
import shutil
import struct
import subprocess
import sys
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
BUILD = REPO / "build" / "binary"
MAGIC = b"TXMQEXE2"
NAME_SIZE = 96

# Never in the executable: the Spark export's dependencies (an optional extra: the executable says how to
# run spark-export instead), the pytest plugin, and what the build environment happens to hold besides.
EXCLUDE = ["pyspark", "pyarrow", "pandas", "numpy", "py4j", "txmq.pytest_plugin", "pytest", "_pytest", "hypothesis",
           "tkinter", "_tkinter", "setuptools", "pip", "Cython", "grpc_tools", "shiv", "ruff", "importlinter", "grimp", "pyte",
           "build", "wheel", "PyInstaller", "unittest", "pydoc_data", "lib2to3", "ensurepip", "idlelib", "test"]
# The compiled modules the executable must carry (setup.py builds them).
SPEEDUPS = ["txmq.store._speedups", "txmq.broker._speedups", "txmq.broker._fsyncer", "txmq._busypoll"]
# Every compiled module the bundle must hold: the speed-ups, uvloop's loop, msgpack's C extension, gRPC's core.
COMPILED = [*SPEEDUPS, "uvloop.loop", "msgpack._cmsgpack", "grpc._cython.cygrpc", "pydantic_core._pydantic_core"]


def version() -> str:
    ns: dict[str, str] = {}
    exec((REPO / "core" / "__init__.py").read_text(), ns)  # __version__ without importing txmq
    return ns["__version__"]


def stage(dest: Path) -> Path:
    """txmq's packages laid out as installed (pyproject's package-dir: core/ is txmq, store/ is txmq.store, ...), with
    the compiled speed-ups and the generated protobuf modules the install built in the checkout. PyInstaller
    reads the modules from here: an editable install's import hook is not something it follows."""
    conf = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = conf["package-dir"]
    for pkg in conf["packages"]:
        top = max((k for k in roots if pkg == k or pkg.startswith(k + ".")), key=len)
        src = REPO / roots[top] / Path(*pkg[len(top):].split(".")[1:])
        out = dest / Path(*pkg.split("."))
        out.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.is_file() and (f.suffix == ".py" or f.name.endswith(".so")):
                shutil.copy2(f, out / f.name)
    missing = [m for m in SPEEDUPS if not list((dest / Path(*m.split(".")[:-1])).glob(m.split(".")[-1] + ".*.so"))]
    if missing:
        sys.exit(f"the compiled speed-ups {', '.join(missing)} are not built: run `pip install -e '.[rocketmq]'` (a C compiler is needed) first")
    if not list((dest / "txmq" / "broker" / "rocketmq" / "pb").glob("*_pb2.py")):
        sys.exit("the RocketMQ front end's protobuf modules are not generated: run `pip install -e '.[rocketmq]'` first")
    return dest


def freeze(work: Path, onefile: bool = False) -> Path:
    """PyInstaller's one-directory bundle of the CLI (its directory), or with onefile its one-file executable."""
    src = stage(work / "src")
    cmd = [sys.executable, "-m", "PyInstaller", "--paths", str(src), "--noconfirm", "--clean", "--log-level", "WARN",
           "--onefile" if onefile else "--onedir", "--strip", "--name", "txmq",
           "--distpath", str(work / "dist"), "--workpath", str(work / "work"), "--specpath", str(work),
           "--collect-submodules", "txmq", "--collect-submodules", "rich._unicode_data",
           *(a for m in SPEEDUPS for a in ("--hidden-import", m))]  # imported by name (store/codec.py, broker/busypoll.py)
    for mod in EXCLUDE:
        cmd += ["--exclude-module", mod]
    cmd.append(str(HERE / "entry.py"))
    subprocess.run(cmd, check=True, cwd=REPO)
    bundle = work / "dist" / "txmq"
    if onefile:
        return bundle
    missing = [m for m in COMPILED if not list((bundle / "_internal").glob(m.replace(".", "/") + ".*.so"))]
    if missing:
        sys.exit(f"the bundle lacks the compiled modules {', '.join(missing)}: is the {' / '.join(sorted({m.split('.')[0] for m in missing}))} "
                 "package installed in this environment (pip install -e '.[rocketmq]')?")
    return bundle


def records(root: Path):
    """The bundle as (type, mode, relative path, data) in a fixed order: directories before what they hold."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        base = Path(dirpath)
        for name in sorted(dirnames + filenames):
            p = base / name
            rel = p.relative_to(root).as_posix()
            if p.is_symlink():
                yield b"L", 0o777, rel, os.readlink(p).encode()
            elif p.is_dir():
                yield b"D", 0o755, rel, b""
            else:
                mode = 0o755 if os.access(p, os.X_OK) else 0o644
                yield b"F", mode, rel, p.read_bytes()


def pack(root: Path, out_payload: Path, compresslevel: int = 9) -> bytes:
    """Write the gzip stream of records; return the manifest: one line per record, in the same order,
    `<type> <mode, octal> <data length> <SHA-256 of the data, or - for a directory> <path>`."""
    manifest = []
    with open(out_payload, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=compresslevel, mtime=0, filename="") as gz:
        for kind, mode, rel, data in records(root):
            path = rel.encode()
            if b"\n" in path or b"\0" in path:
                sys.exit(f"cannot pack {rel!r}: a path with a newline or NUL")
            gz.write(kind + struct.pack("<IIQ", mode, len(path), len(data)) + path)
            gz.write(data)
            digest = "-" if kind == b"D" else hashlib.sha256(data).hexdigest()
            manifest.append(b"%s %o %d %s %s\n" % (kind, mode, len(data), digest.encode(), path))
        gz.write(b"E" + struct.pack("<IIQ", 0, 0, 0))
    return b"".join(manifest)


def compile_launcher(out: Path) -> None:
    cc = os.environ.get("CC", "cc")
    src = str(HERE / "launcher.c")
    flags = ["-O2", "-Wall", "-Wno-format-truncation", *shlex.split(os.environ.get("CFLAGS", "")), "-o", str(out), src]
    # zlib linked in, so the executable needs only glibc; a shared libz.so.1 where there is no libz.a
    static = subprocess.run([cc, *flags, "-Wl,-Bstatic", "-lz", "-Wl,-Bdynamic"], capture_output=True, text=True)
    if static.returncode != 0:
        r = subprocess.run([cc, *flags, "-lz"], capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"cannot compile {src} (needs a C compiler and zlib's headers, e.g. apt install gcc zlib1g-dev):\n{r.stderr}")
    subprocess.run(["strip", str(out)], check=False)


def assemble(bundle: Path, out: Path, work: Path, compresslevel: int = 9) -> str:
    """Write the executable for the bundle directory to out: launcher, payload, manifest, trailer. Returns its
    cache directory's name."""
    payload = work / "payload.gz"
    manifest = pack(bundle, payload, compresslevel)
    launcher = work / "launcher"
    compile_launcher(launcher)
    return write_executable(launcher, payload, manifest, out)


def write_executable(launcher: Path, payload: Path, manifest: bytes, out: Path) -> str:
    """launcher + payload + manifest + trailer, written to out atomically; returns the cache directory's name."""
    digest = hashlib.sha256(manifest)
    name = f"txmq-{version()}-{digest.hexdigest()[:16]}"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(launcher.read_bytes())
        offset = f.tell()
        with open(payload, "rb") as p:
            shutil.copyfileobj(p, f, 1 << 20)
        length = f.tell() - offset
        f.write(manifest)
        f.write(MAGIC + struct.pack("<QQQ", offset, length, len(manifest)) + digest.digest() + name.encode().ljust(NAME_SIZE, b"\0"))
    tmp.chmod(0o755)
    tmp.replace(out)
    return name


def machine() -> str:
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine().lower())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "dist" / f"txmq-linux-{machine()}")
    ap.add_argument("--keep-work", action="store_true", help="keep build/binary (PyInstaller's work and the bundle)")
    ap.add_argument("--reuse-bundle", action="store_true",
                    help="reuse the bundle an earlier build left in build/binary/dist/txmq (to rebuild after a change to launcher.c only)")
    ap.add_argument("--pyinstaller-onefile", action="store_true",
                    help="instead, write PyInstaller's own one-file executable to --out (unpacks on every start; for comparison, docs/binary.md)")
    args = ap.parse_args()
    t0 = time.monotonic()
    if args.reuse_bundle:
        if not (BUILD / "dist" / "txmq" / "txmq").is_file():
            sys.exit(f"no bundle in {BUILD / 'dist' / 'txmq'} to reuse: build once without --reuse-bundle")
    elif BUILD.exists():
        shutil.rmtree(BUILD)
    BUILD.mkdir(parents=True, exist_ok=True)
    if args.pyinstaller_onefile:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(freeze(BUILD, onefile=True), args.out)
        print(f"built {args.out}: {args.out.stat().st_size / 1e6:.1f} MB (PyInstaller --onefile), in {time.monotonic() - t0:.0f} s")
        return
    bundle = BUILD / "dist" / "txmq" if args.reuse_bundle else freeze(BUILD)
    t_freeze = time.monotonic() - t0
    name = assemble(bundle, args.out, BUILD)
    unpacked = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file() and not p.is_symlink())
    if not args.keep_work:
        shutil.rmtree(BUILD / "work", ignore_errors=True)
    print(f"built {args.out.relative_to(REPO) if args.out.is_relative_to(REPO) else args.out}: {args.out.stat().st_size / 1e6:.1f} MB "
          f"(unpacks once to {unpacked / 1e6:.0f} MB in ~/.cache/txmq/{name}), in {time.monotonic() - t0:.0f} s "
          f"(PyInstaller {t_freeze:.0f} s)")


if __name__ == "__main__":
    main()
