"""A nearly full disk: `txmq send -` stores every line that fits, on the file systems a data directory lives on.

Sixty 80 KB lines piped through `send -` reach the broker together and go
out as one write, far more than a 3 MB disk holds; the preallocation ahead
of the data fails first. Lines are refused only once the disk is really
full: on tmpfs (a failed fallocate gives its pages back) and on ext4 (it
keeps the blocks it found, the store gives them back). Needs root and
mount(2); skipped otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from brokerproc import BrokerProcess
from clihelpers import PARTIAL, txmq

pytestmark = [pytest.mark.fault]

LINE = 80_000


def _mount(args: list[str], mnt) -> None:
    r = subprocess.run(["mount", *args, str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount here: {r.stderr.decode().strip()}")


@pytest.fixture(params=["tmpfs", "ext4"])
def small_disk(request, tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if request.param == "tmpfs":
        _mount(["-t", "tmpfs", "-o", "size=3m", "tmpfs"], mnt)
    else:
        if shutil.which("mkfs.ext4") is None:
            pytest.skip("no mkfs.ext4")
        image = tmp_path / "disk.img"
        with open(image, "wb") as f:
            f.truncate(4 << 20)
        subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True)
        _mount(["-o", "loop", str(image)], mnt)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_piped_lines_are_stored_until_the_disk_is_really_full(small_disk, tmp_path):
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    b = BrokerProcess(small_disk / "data")
    b.log = tmp_path / "broker.log"  # not on the small disk
    lines = "".join(f"{i:02d}" + "x" * (LINE - 2) + "\n" for i in range(60))
    with b:
        r = txmq("send", "big", "-", "-o", "jsonl", broker=b.address, input=lines, timeout=120)
        assert r.returncode == PARTIAL, r.stderr.decode()[-2000:]
        sent = sorted(json.loads(line)["line"] for line in r.stdout.decode().splitlines())
        # the space the directory's other files take (the index and timer databases, the queues) is under 400 KB
        assert len(sent) >= (free - (400 << 10)) // LINE, (len(sent), free, r.stderr.decode()[-1500:])
        assert sent == list(range(1, len(sent) + 1))  # in order: no line stored after one refused
        assert "store full" in r.stderr.decode()
    assert "event=preallocation_failed" in b.log.read_text()
