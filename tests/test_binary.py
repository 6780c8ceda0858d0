"""`make binary` builds dist/txmq.pyz, which starts a broker with nothing else on the path."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from brokerproc import free_port

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


@pytest.mark.timeout(1500)  # shiv installs and compiles the package: 5 min was not enough at load 10
def test_zipapp_builds_and_starts_a_broker(tmp_path):
    shiv = Path(sys.executable).parent / "shiv"
    if not shiv.exists():
        pytest.skip("shiv is not installed")
    out = tmp_path / "txmq.pyz"
    r = subprocess.run([str(shiv), "--compressed", "-c", "txmq", "--preamble", str(REPO / "scripts" / "zipapp_preamble.py"),
                        "-o", str(out), str(REPO), "-q"],
                       capture_output=True, text=True, timeout=1200, env={**os.environ, "SHIV_ROOT": str(tmp_path / "shivroot")})
    assert r.returncode == 0, r.stderr[-3000:]
    port = free_port()
    # a clean interpreter: no site-packages, no PYTHONPATH, only the zipapp
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "SHIV_ROOT": str(tmp_path / "shivroot")}
    base_python = getattr(sys, "_base_executable", sys.executable)
    proc = subprocess.Popen([base_python, "-s", str(out), "broker", "start", "--data-dir", str(tmp_path / "d"), "--port", str(port)],
                            stderr=subprocess.PIPE, env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        import socket

        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        else:
            pytest.fail("zipapp broker did not start")
        st = subprocess.run([base_python, "-s", str(out), "broker", "status", "--broker", f"127.0.0.1:{port}", "-o", "json"],
                            capture_output=True, text=True, env=env, timeout=60)
        assert st.returncode == 0 and '"status": "up"' in st.stdout, st.stderr
    finally:
        proc.terminate()
        assert proc.wait(20) == 0
    # under another Python minor version: one line that says which Python it needs, exit 2 (not an ImportError)
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    other = _other_python(here)
    if other is None:
        pytest.skip("no other Python minor version on PATH to run the zipapp with")
    r = subprocess.run([other, "-s", str(out), "--version"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"built for Python {here}" in lines[0], r.stderr[-2000:]


def _other_python(here: str) -> str | None:
    """An interpreter of another minor version that runs (a pyenv shim on PATH may not, so its versions are tried too)."""
    found = [shutil.which(f"python{v}") for v in ("3.13", "3.12", "3.11", "3.10")]
    found += [str(p) for p in sorted(Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")).glob("versions/3.1*/bin/python3"))]
    for exe in filter(None, found):
        r = subprocess.run([exe, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True, text=True)
        if r.returncode == 0 and r.stdout.strip() != here:
            return exe
    return None
