"""The import layers (pyproject.toml's import-linter contracts) hold."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_import_layers_contract():
    lint = Path(sys.executable).parent / "lint-imports"
    if not lint.exists():
        lint = shutil.which("lint-imports")
    if not lint:
        pytest.skip("import-linter is not installed")
    r = subprocess.run([str(lint), "--config", str(REPO / "pyproject.toml")], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_packages_import_from_outside_the_repo(tmp_path):
    r = subprocess.run([sys.executable, "-c", "import txmq.store, txmq.broker, txmq.cli, txmq.client; print('ok')"],
                       cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
