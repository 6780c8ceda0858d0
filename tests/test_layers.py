"""The import layers (pyproject.toml's import-linter contracts) hold."""

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# pyproject's package-dir: import name -> folder (txmq -> core/, txmq.store -> store/, ...)
PACKAGE_DIR = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def _namespace_tree(root: Path) -> Path:
    """import-linter cannot follow pyproject's package-dir mapping, so lay the
    installed `txmq` namespace out as it is in a wheel (with symlinks)."""
    pkg = root / "txmq"
    pkg.mkdir()
    for f in (REPO / PACKAGE_DIR["txmq"]).glob("*.py"):
        (pkg / f.name).symlink_to(f)
    for name, folder in PACKAGE_DIR.items():
        if name.count(".") == 1:  # txmq.cli.commands comes with cli/
            (pkg / name.split(".")[1]).symlink_to(REPO / folder, target_is_directory=True)
    return root


def test_import_layers_contract(tmp_path):
    lint = Path(sys.executable).parent / "lint-imports"
    if not lint.exists():
        found = shutil.which("lint-imports")
        if not found:
            pytest.skip("import-linter is not installed")
        lint = Path(found)
    root = _namespace_tree(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(root)}
    r = subprocess.run([str(lint), "--config", str(REPO / "pyproject.toml"), "--no-cache"], cwd=root, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "KEPT" in r.stdout and "BROKEN" not in r.stdout


def test_packages_import_from_outside_the_repo(tmp_path):
    r = subprocess.run([sys.executable, "-c", "import txmq.store, txmq.broker, txmq.cli, txmq.client; print('ok')"],
                       cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_broker_start_option_defaults_are_the_broker_configs():
    """`txmq broker start` shows and uses BrokerConfig's and CheckSettings' defaults (both read txmq.defaults)."""
    from typer.main import get_command

    from txmq.broker.config import BrokerConfig, CheckSettings
    from txmq.cli.commands.broker import app
    from txmq.cli.common import DEFAULT_BROKER, parse_duration
    from txmq.client.connection import DEFAULT_ADDRESS

    start = get_command(app).commands["start"]
    opt = {p.name: p for p in start.params}
    cfg, check = BrokerConfig(), CheckSettings()
    for name in ("port", "flush", "segment_size", "max_frame", "max_body", "max_properties", "max_preauth_frame",
                 "max_connections_per_ip", "partial_frame_budget"):
        assert opt[name].default == getattr(cfg, name), name
    for name in ("flush_interval", "auth_timeout", "frame_timeout"):
        assert parse_duration(opt[name].default) == getattr(cfg, name + "_s"), name
    assert f"[default: {cfg.host}]" in opt["host"].help
    for name, shown in (("check_interval", "60s"), ("transaction_timeout", "6s"), ("max_checks", "15"), ("retention", "72h")):
        assert f"[default: {shown}]" in opt[name].help, name
        value = check.max_checks if name == "max_checks" else getattr(check, name + "_s")
        assert (int(shown) if name == "max_checks" else parse_duration(shown)) == value, name
    assert DEFAULT_BROKER == DEFAULT_ADDRESS == f"{cfg.host}:{cfg.port}"
