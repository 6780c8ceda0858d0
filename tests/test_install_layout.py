"""The built distributions hold what an install needs, and a regular (non-editable) install works.

`python -m ...`, `python -c ...` and Spark's Python workers put the working
directory first on sys.path, so a top-level folder named like the package
would be imported instead of the installed `txmq` (which maps store/,
broker/, ... under one name). This module builds an sdist and a wheel from a
copy of the sources (as `make dist` does), installs the wheel with the
`rocketmq` extra into a fresh virtual environment and, from the repository
root, imports every `txmq.*` package and runs a small `txmq spark-export`;
from a directory outside the repository it runs `txmq`, a broker with the
RocketMQ front end and a user's test session with the `txmq_broker` fixture.

It stays offline: the distributions are built with this environment's
setuptools, wheel and build (no build isolation, no compiled speed-ups), and
the fresh environment reuses this one's installed dependencies through a path
file, so pip finds the extra's dependencies installed instead of downloading
them (`--no-index`).
"""

from __future__ import annotations

import json
import os
import shutil
import site
import socket
import subprocess
import sys
import tarfile
import time
import tomllib
import zipfile
from pathlib import Path

import pytest

from brokerproc import free_port

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PACKAGES: list[str] = PYPROJECT["tool"]["setuptools"]["packages"]
IGNORED = (".git", ".venv", ".cache", "venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis",
           ".ruff_cache", "*.so", "*.c", "results", "spark-warehouse", "metastore_db", "data")


def _have_build_tools() -> str | None:
    for mod in ("setuptools", "wheel", "build"):
        try:
            __import__(mod)
        except ImportError:
            return f"{mod} is not installed (it comes with the test extra)"
    return None


BUILD_ENV = {"TXMQ_NO_SPEEDUPS": "1", "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """An sdist and a wheel built from a copy of the sources: {"sdist": ..., "wheel": ...}."""
    problem = _have_build_tools()
    if problem:
        pytest.skip(problem)
    tmp = tmp_path_factory.mktemp("build")
    src = tmp / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(*IGNORED), symlinks=True)
    env = {**os.environ, **BUILD_ENV}
    # Both from the source folder: a wheel built from the sdist needs grpcio-tools (a build
    # requirement, not installed here) to generate the protobuf modules the sdist leaves out.
    r = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--skip-dependency-check", "--sdist", "--wheel",
                        "--outdir", str(tmp / "dist"), str(src)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (sdist,) = (tmp / "dist").glob("txmq-*.tar.gz")
    (wheel,) = (tmp / "dist").glob("txmq-*.whl")
    return {"sdist": sdist, "wheel": wheel}


@pytest.fixture(scope="module")
def installed(built, tmp_path_factory) -> Path:
    """A fresh venv holding a regular install of the wheel with the rocketmq extra; returns its python."""
    try:
        import grpc  # noqa: F401
        import google.protobuf  # noqa: F401
    except ImportError:
        pytest.skip("the rocketmq extra (grpcio, protobuf) is not installed here, so pip cannot find it offline")
    venv = tmp_path_factory.mktemp("install") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    # The dependencies (typer, msgpack, grpcio, pyspark, ...) come from this environment.
    # A path line does not run that directory's own .pth files, so this
    # environment's editable txmq stays out of the fresh one.
    fresh_site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                     capture_output=True, text=True, check=True).stdout.strip())
    fresh_site.mkdir(parents=True, exist_ok=True)
    (fresh_site / "zz-deps.pth").write_text("".join(f"{p}\n" for p in site.getsitepackages()))
    # With the extra and without --no-deps: pip checks that the extra exists and that its
    # requirements are met, taking them from the environment above (--no-index: no download).
    env = {**os.environ, **BUILD_ENV}
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-index", f"{built['wheel']}[rocketmq]"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "does not provide the extra" not in r.stdout + r.stderr
    return py


def _clean_env(venv_bin: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv_bin}{os.pathsep}{env.get('PATH', '')}"
    return env


def test_no_top_level_folder_is_named_txmq():
    """The folder mapped to the `txmq` package itself must not be called txmq (README "Layout")."""
    assert PYPROJECT["tool"]["setuptools"]["package-dir"]["txmq"] != "txmq"
    assert not (REPO / "txmq" / "__init__.py").exists()


def test_every_package_imports_from_the_repository_root(installed):
    code = (
        "import importlib, sys\n"
        f"for name in {PACKAGES!r}:\n"
        "    m = importlib.import_module(name)\n"
        "    assert sys.prefix in m.__file__, (name, m.__file__)\n"
        "print('ok')\n"
    )
    env = _clean_env(installed.parent)
    r = subprocess.run([str(installed), "-c", code], cwd=REPO, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
    r = subprocess.run([str(installed), "-m", "txmq", "--version"], cwd=REPO, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]


def _folder(package: str) -> str:
    """The source folder of an import name, through pyproject's package-dir (txmq.broker.native -> broker/native)."""
    mapping = PYPROJECT["tool"]["setuptools"]["package-dir"]
    base = max((name for name in mapping if package == name or package.startswith(name + ".")), key=len)
    rest = package[len(base):].lstrip(".").replace(".", "/")
    return f"{mapping[base]}/{rest}".rstrip("/")


def test_sdist_holds_the_sources_and_leaves_out_what_builds_generate(built):
    with tarfile.open(built["sdist"]) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    version = PYPROJECT["project"]["version"]
    assert built["sdist"].name == f"txmq-{version}.tar.gz"
    needed = {"LICENSE", "README.md", "pyproject.toml", "setup.py", "MANIFEST.in",
              "store/_speedups.pyx", "broker/_speedups.pyx", "broker/_fsyncer.pyx", "core/_busypoll.pyx",
              "spark/_columns.pyx", "broker/rocketmq/pb/definition.proto", "broker/rocketmq/pb/service.proto", "core/pytest_plugin.py"}
    needed |= {f"{_folder(p)}/__init__.py" for p in PACKAGES}
    assert needed <= names, sorted(needed - names)
    generated = [n for n in names if n.endswith(("_pb2.py", "_pb2_grpc.py", ".c", ".so"))]
    assert generated == []


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def test_installed_wheel_serves_rocketmq_from_outside_the_repository(installed, tmp_path):
    """`pip install 'dist/txmq-...whl[rocketmq]'` is all a machine needs: the command, the extra's front end, a broker."""
    env = _clean_env(installed.parent)
    txmq = installed.parent / "txmq"
    version = PYPROJECT["project"]["version"]
    r = subprocess.run([str(txmq), "--version"], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == f"txmq {version}", r.stdout + r.stderr[-3000:]
    code = "import txmq, txmq.broker.rocketmq.server, txmq.broker.rocketmq.pb.service_pb2_grpc; print(txmq.__file__)"
    r = subprocess.run([str(installed), "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().startswith(str(installed.parent.parent)), r.stdout

    port, rocketmq_port = free_port(), free_port()  # never the same port twice (tests/brokerproc.py)
    log = tmp_path / "broker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(txmq), "broker", "start", "--data-dir", str(tmp_path / "data"), "--port", str(port),
                                 "--rocketmq-port", str(rocketmq_port)], cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 60
        while not (_accepts(port) and _accepts(rocketmq_port)):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
    finally:
        proc.terminate()
        rc = proc.wait(60)
    text = log.read_text()
    assert rc == 0, text[-3000:]
    assert f"event=rocketmq_listening host=127.0.0.1 port={rocketmq_port}" in text, text[-3000:]


USER_TEST = """\
import pytest

import txmq
from txmq.client import Message


def test_a_sent_message_is_consumed(request, txmq_broker):
    # the installed wheel, not a checkout
    assert txmq.__file__.startswith({prefix!r}), txmq.__file__
    assert request.config.pluginmanager.get_plugin("txmq").__file__.startswith({prefix!r})
    txmq_broker.client.send("orders", b"one")
    with txmq_broker.consumer("audit", "orders") as consumer:
        assert [m.body for m in consumer.poll(timeout=10)] == [b"one"]


@pytest.mark.txmq(rocketmq=True)
def test_the_rocketmq_port_is_served(txmq_broker):
    host, port = txmq_broker.rocketmq_address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
"""


def test_installed_wheel_gives_pytest_the_txmq_broker_fixture(built, installed, tmp_path):
    """The wheel's pytest11 entry point loads the plugin in a user's own test session, with no conftest."""
    with zipfile.ZipFile(built["wheel"]) as whl:
        (entry_points,) = [n for n in whl.namelist() if n.endswith(".dist-info/entry_points.txt")]
        text = whl.read(entry_points).decode()
    assert "[pytest11]\ntxmq = txmq.pytest_plugin" in text, text
    (tmp_path / "test_app.py").write_text(USER_TEST.format(prefix=str(installed.parent.parent)))
    env = _clean_env(installed.parent)
    env.pop("PYTEST_ADDOPTS", None)
    env.pop("PYTEST_DISABLE_PLUGIN_AUTOLOAD", None)
    r = subprocess.run([str(installed), "-m", "pytest", "-p", "no:cacheprovider", "-q", "test_app.py"],
                       cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "2 passed" in r.stdout, r.stdout[-3000:]


@pytest.mark.spark
@pytest.mark.slow  # a Spark session: ~10-20 s
def test_spark_export_from_the_repository_root(installed, tmp_path):
    from txmq.spark.session import missing_dependency, missing_java

    problem = missing_dependency() or missing_java()
    if problem:
        pytest.skip(problem)
    from txmq.store import Message, Store, TxType

    data = tmp_path / "data"
    s = Store(data)
    s.open()
    try:
        s.append([Message("orders", 0, TxType.NORMAL, 1000, {"KEYS": f"k{i}"}, b"body %d" % i, -1) for i in range(3)])
    finally:
        s.close()
    out = tmp_path / "out"
    env = _clean_env(installed.parent)
    r = subprocess.run([str(installed.parent / "txmq"), "spark-export", "--data-dir", str(data), "--out", str(out),
                        "--table", "messages", "--format", "json", "-o", "json"],
                       cwd=REPO, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for f in sorted((out / "messages").rglob("*.json")) for line in f.read_text().splitlines() if line]
    assert sorted(row["keys"] for row in rows) == ["k0", "k1", "k2"]
