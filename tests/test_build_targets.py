"""The packaging targets of the Makefile, without building anything: `make image` checks its base image before
it builds the wheels and says in one line what to do when the base can neither be found nor pulled; `make binary`
builds in an environment of its own with only the broker's dependencies and the two build tools.

`make image` runs against a stand-in `docker` on PATH (no daemon needed) with PYTHON=false and a virtual
environment that does not exist, so any step past the base check fails at once with make's own error instead
of building a wheel.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

FAKE_DOCKER = """#!/bin/sh
echo "$*" >> "{log}"
case "$1 $2" in
  "info "*) [ "$TXMQ_FAKE_DAEMON" = up ] || {{ echo "Cannot connect to the Docker daemon at unix:///var/run/docker.sock" >&2; exit 1; }} ;;
  "image inspect") [ "$TXMQ_FAKE_BASE" = here ] || {{ echo "Error: No such image: $3" >&2; exit 1; }} ;;
  "pull "*) echo "Error response from daemon: Get \\"https://registry.invalid/v2/\\": dial tcp: lookup registry.invalid: no such host" >&2; exit 1 ;;
esac
exit 0
"""


def _make_image(tmp_path: Path, daemon: str = "up", base: str = "absent") -> tuple[subprocess.CompletedProcess, list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "docker.log"
    log.touch()
    docker = bin_dir / "docker"
    docker.write_text(FAKE_DOCKER.format(log=log))
    docker.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "TXMQ_FAKE_DAEMON": daemon, "TXMQ_FAKE_BASE": base}
    r = subprocess.run(["make", "--no-print-directory", "image", "BASE=txmq-no-such-base:1", "IMAGE=txmq-never:1",
                        f"VENV={tmp_path / 'venv'}", "PYTHON=false"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    return r, log.read_text().splitlines()


def _own_lines(r: subprocess.CompletedProcess) -> list[str]:
    return [line for line in r.stderr.splitlines() if line.startswith("make image:")]


def test_make_image_without_a_pullable_base_says_in_one_line_to_build_one_before_building_the_wheels(tmp_path):
    r, calls = _make_image(tmp_path)
    assert r.returncode != 0
    own = _own_lines(r)
    assert len(own) == 1, r.stderr
    line = own[0]
    assert "txmq-no-such-base:1" in line and "no such host" in line, line
    assert "`make image-base`" in line and "`make image BASE=txmq-base`" in line, line
    # nothing was built: no venv, no wheel, no docker build
    assert "venv" not in r.stdout + r.stderr.replace(line, ""), r.stdout + r.stderr
    assert not any(c.startswith("build") for c in calls), calls
    assert calls == ["info", "image inspect txmq-no-such-base:1", "pull -q txmq-no-such-base:1"], calls


def test_make_image_without_a_daemon_says_so_in_one_line(tmp_path):
    r, calls = _make_image(tmp_path, daemon="down")
    assert r.returncode != 0
    own = _own_lines(r)
    assert len(own) == 1 and "no Docker daemon" in own[0], r.stderr
    assert calls == ["info"], calls


def test_make_image_with_the_base_at_hand_goes_on_to_the_wheels(tmp_path):
    r, calls = _make_image(tmp_path, base="here")
    assert r.returncode != 0  # PYTHON=false: the wheelhouse's venv cannot be made
    assert not _own_lines(r), r.stderr
    assert f"false -m venv {tmp_path / 'venv'}" in r.stdout, r.stdout + r.stderr
    assert "pull -q txmq-no-such-base:1" not in calls, calls


def _dry_run_binary(tmp_path: Path) -> list[list[str]]:
    venv = tmp_path / "bv"
    r = subprocess.run(["make", "--no-print-directory", "-n", "binary", f"BINARY_VENV={venv}"], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return [shlex.split(line) for line in r.stdout.splitlines() if line.strip()]


def test_make_binary_installs_only_the_broker_and_the_build_tools_in_its_own_environment(tmp_path):
    venv = tmp_path / "bv"
    commands = _dry_run_binary(tmp_path)
    installs = [c for c in commands if c[:2] == [f"{venv}/bin/pip", "install"] and "--upgrade" not in c]
    assert len(installs) == 1, commands
    wanted = [a for a in installs[0][2:] if not a.startswith("-")]
    test_extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    pins = sorted(r for r in test_extra if r.startswith(("pyinstaller", "shiv")))
    assert len(pins) == 2, test_extra
    assert sorted(wanted) == sorted([".[rocketmq]", *pins]), installs[0]  # not the test, spark or report extras
    # the zipapp and the executable are built with that environment's tools, nothing from .venv
    assert [c for c in commands if c and c[0].endswith("/shiv")][0][0] == f"{venv}/bin/shiv", commands
    assert [f"{venv}/bin/python", "scripts/binary/build.py"] in commands, commands
    assert not any(".venv/" in " ".join(c) for c in commands), commands


@pytest.mark.parametrize("target", ["run", "test", "binary"])
def test_the_documented_targets_keep_their_names(target):
    r = subprocess.run(["make", "--no-print-directory", "help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert any(line.split()[:1] == [target] for line in r.stdout.splitlines()), r.stdout
