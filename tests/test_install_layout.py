"""A regular (non-editable) install works with the repository root as the working directory.

`python -m ...`, `python -c ...` and Spark's Python workers put the working
directory first on sys.path, so a top-level folder named like the package
would be imported instead of the installed `txmq` (which maps store/,
broker/, ... under one name). This test builds a wheel from a copy of the
sources, installs it into a fresh virtual environment and, from the
repository root, imports every `txmq.*` package and runs a small
`txmq spark-export`.

It stays offline: the wheel is built with this environment's setuptools and
wheel (no build isolation, no compiled speed-ups), and the fresh environment
reuses this one's installed dependencies through a path file instead of
downloading them.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PACKAGES: list[str] = PYPROJECT["tool"]["setuptools"]["packages"]
IGNORED = (".git", ".venv", ".cache", "venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis",
           ".ruff_cache", "*.so", "*.c", "results", "spark-warehouse", "metastore_db", "data")


def _have_build_tools() -> str | None:
    for mod in ("setuptools", "wheel"):
        try:
            __import__(mod)
        except ImportError:
            return f"{mod} is not installed (it comes with the test extra)"
    return None


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv holding a regular install of txmq; returns its python."""
    problem = _have_build_tools()
    if problem:
        pytest.skip(problem)
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(*IGNORED), symlinks=True)
    env = {**os.environ, "TXMQ_NO_SPEEDUPS": "1", "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp / "wheels"), str(src)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (wheel,) = (tmp / "wheels").glob("txmq-*.whl")

    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    # The dependencies (typer, msgpack, pyspark, ...) come from this environment.
    # A path line does not run that directory's own .pth files, so this
    # environment's editable txmq stays out of the fresh one.
    fresh_site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                     capture_output=True, text=True, check=True).stdout.strip())
    fresh_site.mkdir(parents=True, exist_ok=True)
    (fresh_site / "zz-deps.pth").write_text("".join(f"{p}\n" for p in site.getsitepackages()))
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", str(wheel)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
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
