"""`make binary` builds dist/txmq.pyz, which starts a broker with nothing else on the path."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from brokerproc import free_port

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def test_zipapp_builds_and_starts_a_broker(tmp_path):
    shiv = Path(sys.executable).parent / "shiv"
    if not shiv.exists():
        pytest.skip("shiv is not installed")
    out = tmp_path / "txmq.pyz"
    r = subprocess.run([str(shiv), "--compressed", "-c", "txmq", "-o", str(out), str(REPO), "-q"],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "SHIV_ROOT": str(tmp_path / "shivroot")})
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
