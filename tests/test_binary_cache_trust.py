"""The single executable's launcher (scripts/binary/launcher.c, docs/binary.md) runs only a tree it unpacked.

These tests build a small executable with the launcher and scripts/binary/build.py's packing, around a
tiny bundle instead of PyInstaller's: its `txmq` is a shell script that sources `_internal/lib.sh`, the
way the real bootloader loads its files from `_internal`. Every planted copy is the genuine tree with
`txmq` and `lib.sh` swapped for scripts of the same sizes that create a marker file: the marker shows a
planted file ran. Trees planted by another user are chowned to `nobody` (needs root; skipped otherwise).
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the single executable is for Linux")

GENUINE = '#!/bin/sh\n. "$(dirname "$0")/_internal/lib.sh"\necho "genuine $*"\n'
LIB = "lib_ok=1\n"
# SHA-256 pads to 64-byte blocks: sizes on either side of its boundaries, and files of many blocks
SIZES = [0, 1, 55, 56, 63, 64, 65, 119, 120, 4096, 1 << 20, 3 * (1 << 20) + 7]


def _build_module():
    spec = importlib.util.spec_from_file_location("txmq_binary_build", REPO / "scripts" / "binary" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _same_size(script: str, size: int) -> str:
    """script padded with a comment to size bytes: a planted file a size check cannot tell apart."""
    assert len(script) + 2 <= size, (script, size)
    return script + "#" + "x" * (size - len(script) - 2) + "\n"


def _genuine_tree(root: Path) -> None:
    (root / "_internal" / "data").mkdir(parents=True)
    (root / "txmq").write_text(GENUINE + "#" * 400 + "\n")  # room for a planted script of the same size
    (root / "txmq").chmod(0o755)
    (root / "_internal" / "lib.sh").write_text(LIB + "#" * 400 + "\n")
    for n in SIZES:
        (root / "_internal" / "data" / f"f{n}").write_bytes(os.urandom(n))
    (root / "_internal" / "big-link").symlink_to(f"data/f{SIZES[-1]}")


def _plant_scripts(tree: Path, marker: Path) -> None:
    """Swap txmq and lib.sh for scripts of the same sizes and modes that create marker (and say so)."""
    for rel, script in (("txmq", f'#!/bin/sh\ntouch {marker}\necho "planted $*"\n'), ("_internal/lib.sh", f"touch {marker}\n")):
        f = tree / rel
        st = f.stat()
        f.unlink()
        f.write_text(_same_size(script, st.st_size))
        f.chmod(st.st_mode & 0o777)


class Mini:
    def __init__(self, work: Path) -> None:
        self.build = _build_module()
        self.work = work
        self.bundle = work / "bundle"
        _genuine_tree(self.bundle)
        self.exe = work / "txmq-mini"
        self.name = self.build.assemble(self.bundle, self.exe, work, compresslevel=1)
        # the space the launcher says the tree needs: files in 4 KiB blocks, a block per directory
        entries = list(self.bundle.rglob("*"))
        self.need = sum(-(-p.stat().st_size // 4096) * 4096 for p in entries if p.is_file() and not p.is_symlink())
        self.need += 4096 * sum(1 for p in entries if p.is_dir() and not p.is_symlink())

    def run(self, env: dict[str, str], *args: str, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(self.exe), *(args or ("--version",))], capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin", **env}, **kw
        )

    def planted_copy(self, dest: Path, marker: Path) -> Path:
        """The genuine tree as dest/<name>, with the planted scripts."""
        tree = dest / self.name
        shutil.copytree(self.bundle, tree, symlinks=True)
        (tree / ".txmq-manifest").write_text("".join(f"{p.stat().st_size} {p.relative_to(tree)}\n" for p in tree.rglob("*") if p.is_file()))
        _plant_scripts(tree, marker)
        return tree


@pytest.fixture(scope="module")
def mini(tmp_path_factory) -> Mini:
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler to build the launcher")
    try:
        return Mini(tmp_path_factory.mktemp("mini"))
    except SystemExit as e:  # build.py's one line: no zlib headers, say
        pytest.skip(str(e))


def _nobody() -> int:
    if os.geteuid() != 0:
        pytest.skip("planting files owned by another user needs root")
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        return 65534


def _chown_tree(path: Path, uid: int) -> None:
    os.lchown(path, uid, uid)
    for p in path.rglob("*"):
        os.lchown(p, uid, uid)


def _one_line(r: subprocess.CompletedProcess) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


def _private(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True)
    return path


def test_the_launcher_unpacks_verifies_and_runs_its_own_tree(mini, tmp_path):
    cache = tmp_path / "cache"
    r = mini.run({"TXMQ_CACHE_DIR": str(cache)}, "a", "b c")
    assert (r.returncode, r.stdout, r.stderr) == (0, "genuine a b c\n", "")
    tree = cache / mini.name
    assert sorted(p.name for p in cache.iterdir()) == [mini.name]  # complete, under its final name, nothing else
    assert oct(tree.stat().st_mode & 0o777) == oct(0o700)
    for n in SIZES:  # the launcher's SHA-256 agreed with Python's for every size
        assert (tree / "_internal" / "data" / f"f{n}").read_bytes() == (mini.bundle / "_internal" / "data" / f"f{n}").read_bytes()
    stamp = {p: p.stat().st_mtime_ns for p in tree.rglob("*")}
    r = mini.run({"TXMQ_CACHE_DIR": str(cache)}, "warm")
    assert (r.returncode, r.stdout, r.stderr) == (0, "genuine warm\n", "")
    assert {p: p.stat().st_mtime_ns for p in tree.rglob("*")} == stamp, "a warm start wrote into the cache"


def test_concurrent_first_starts_leave_one_verified_tree(mini, tmp_path):
    cache = tmp_path / "cache"
    env = {"PATH": "/usr/bin:/bin", "TXMQ_CACHE_DIR": str(cache)}
    procs = [subprocess.Popen([str(mini.exe), str(i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for i in range(8)]
    for i, p in enumerate(procs):
        out, err = p.communicate(timeout=60)
        assert (p.returncode, out, err) == (0, f"genuine {i}\n", ""), (i, p.returncode, out, err)
    assert sorted(p.name for p in cache.iterdir()) == [mini.name]  # the racers' private copies removed


def test_the_portable_sha256_agrees_with_pythons(mini, tmp_path, monkeypatch):
    """The launcher hashes with the CPU's SHA instructions where it has them; the portable code, compiled alone
    here, must verify the same files (sizes around the 64-byte block boundaries, files of many blocks)."""
    monkeypatch.setenv("CFLAGS", "-DTXMQ_PORTABLE_SHA256")
    exe = tmp_path / "txmq-portable"
    assert mini.build.assemble(mini.bundle, exe, tmp_path, compresslevel=1) == mini.name
    r = subprocess.run(
        [str(exe), "x"], capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "TXMQ_CACHE_DIR": str(tmp_path / "c")}
    )
    assert (r.returncode, r.stdout, r.stderr) == (0, "genuine x\n", "")


def test_a_cache_directory_writable_by_others_is_refused_and_a_tree_planted_there_never_runs(mini, tmp_path):
    nobody = _nobody()
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # like /tmp: anyone may create files in it
    marker = tmp_path / "planted-code-ran"
    _chown_tree(mini.planted_copy(shared, marker), nobody)
    r = mini.run({"TXMQ_CACHE_DIR": str(shared)})
    assert r.returncode == 1 and r.stdout == "", (r.returncode, r.stdout, r.stderr)
    line = _one_line(r)
    assert f"TXMQ_CACHE_DIR={shared}" in line and f"{shared} is writable by others (mode 1777)" in line, line
    assert not marker.exists(), "the launcher ran a tree another user planted"


def test_a_cache_directory_owned_by_another_user_is_refused(mini, tmp_path):
    nobody = _nobody()
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    marker = tmp_path / "planted-code-ran"
    mini.planted_copy(theirs, marker)
    _chown_tree(theirs, nobody)
    r = mini.run({"TXMQ_CACHE_DIR": str(theirs)})
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert f"{theirs} is owned by uid {nobody}" in _one_line(r)
    assert not marker.exists()


def test_a_default_cache_that_links_to_another_users_directory_is_not_followed(mini, tmp_path):
    """~/.cache/txmq a symbolic link to a directory of nobody's, open to all: the start unpacks its own copy into
    $TMPDIR/txmq-<uid> instead, says so in one line, and never runs what is behind the link."""
    nobody = _nobody()
    home = _private(tmp_path / "home")
    evil = tmp_path / "evil"
    evil.mkdir()
    marker = tmp_path / "planted-code-ran"
    mini.planted_copy(evil, marker)
    _chown_tree(evil, nobody)
    evil.chmod(0o777)
    (home / ".cache").mkdir()
    (home / ".cache" / "txmq").symlink_to(evil)
    tmpdir = _private(tmp_path / "tmp")
    r = mini.run({"HOME": str(home), "TMPDIR": str(tmpdir)}, "x")
    assert (r.returncode, r.stdout) == (0, "genuine x\n"), (r.returncode, r.stdout, r.stderr)
    line = _one_line(r)
    assert f"not using the cache directory {home}/.cache/txmq: {evil} is owned by uid {nobody}" in line, line
    assert not marker.exists()
    assert (tmpdir / f"txmq-{os.geteuid()}" / mini.name / "txmq").is_file()


def test_a_symbolic_link_planted_by_another_user_in_a_sticky_directory_is_not_followed(mini, tmp_path):
    """A shared sticky directory (/tmp) is fine on the way, but a link in it another user made is not."""
    nobody = _nobody()
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    mine = _private(tmp_path / "mine")  # a private directory: the link's target is not what is wrong
    marker = tmp_path / "planted-code-ran"
    mini.planted_copy(mine, marker)
    link = sticky / "cache"
    link.symlink_to(mine)
    os.lchown(link, nobody, nobody)
    r = mini.run({"TXMQ_CACHE_DIR": str(link)})
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert f"{link} is a symbolic link owned by uid {nobody}" in _one_line(r)
    assert not marker.exists()
    # the same directory through a link of this user's is used
    shutil.rmtree(mine / mini.name)
    link.unlink()
    link.symlink_to(mine)
    r = mini.run({"TXMQ_CACHE_DIR": str(link)})
    assert (r.returncode, r.stdout, r.stderr) == (0, "genuine --version\n", ""), r.stderr


@pytest.mark.parametrize("mode", [0o777, 0o775])
def test_a_directory_on_the_way_writable_by_others_is_refused(mini, tmp_path, mode):
    opened = tmp_path / "opened"
    opened.mkdir()
    opened.chmod(mode)  # no sticky bit: anyone (or the group) could rename the cache below and put another there
    r = mini.run({"TXMQ_CACHE_DIR": str(opened / "cache")})
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    who = "others" if mode & 0o002 else "its group"
    assert f"{opened} is writable by {who} (mode {mode:04o}) without the sticky bit" in _one_line(r)
    assert not (opened / "cache").exists()


@pytest.mark.parametrize(
    "how", ["owned by nobody", "a file writable by others", "a directory writable by others", "a link out of the tree", "a link in place of the tree"]
)
def test_a_tree_under_the_final_name_that_fails_the_rules_is_replaced_and_never_run(mini, tmp_path, how):
    cache = _private(tmp_path / "cache")
    marker = tmp_path / "planted-code-ran"
    tree = mini.planted_copy(cache, marker)
    if how == "owned by nobody":
        _chown_tree(tree, _nobody())
    elif how == "a file writable by others":
        (tree / "txmq").chmod(0o777)
        (tree / "_internal" / "lib.sh").chmod(0o666)
    elif how == "a directory writable by others":
        (tree / "_internal").chmod(0o777)
    elif how == "a link in place of the tree":  # the tree's name a link to a planted copy elsewhere
        elsewhere = _private(tmp_path / "elsewhere")
        shutil.move(tree, elsewhere / mini.name)
        tree.symlink_to(elsewhere / mini.name)
    else:  # _internal itself a link to a copy elsewhere whose lib.sh is planted; the top txmq genuine
        outside = tmp_path / "outside"
        shutil.copytree(mini.bundle, outside, symlinks=True)
        _plant_scripts(outside, marker)  # only its lib.sh matters here
        shutil.rmtree(tree / "_internal")
        (tree / "_internal").symlink_to(outside / "_internal")
        (tree / "txmq").unlink()
        shutil.copy2(mini.bundle / "txmq", tree / "txmq")
    r = mini.run({"TXMQ_CACHE_DIR": str(cache)})
    assert (r.returncode, r.stdout, r.stderr) == (0, "genuine --version\n", ""), (r.returncode, r.stdout, r.stderr)
    assert not marker.exists(), f"the launcher ran a tree {how}"
    assert sorted(p.name for p in cache.iterdir()) == [mini.name]  # replaced in place; the planted copy removed
    st = tree.stat()
    assert (st.st_uid, st.st_mode & 0o777) == (os.geteuid(), 0o700)
    assert not (tree / "_internal").is_symlink()


def test_an_unpacked_file_that_does_not_match_the_manifests_hash_is_never_run(mini, tmp_path):
    """The cold path reads every unpacked file back against the manifest's SHA-256 before it renames the copy
    into place: an executable whose packed files differ from its manifest (same sizes) runs nothing."""
    other = tmp_path / "other"
    shutil.copytree(mini.bundle, other, symlinks=True)
    marker = tmp_path / "planted-code-ran"
    _plant_scripts(other, marker)
    manifest = mini.build.pack(mini.bundle, tmp_path / "genuine.gz", 1)
    mini.build.pack(other, tmp_path / "other.gz", 1)  # the same records, sizes and modes; other contents
    exe = tmp_path / "txmq-mismatched"
    name = mini.build.write_executable(mini.work / "launcher", tmp_path / "other.gz", manifest, exe)
    assert name == mini.name
    cache = tmp_path / "cache"
    r = subprocess.run(
        [str(exe), "--version"], capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "TXMQ_CACHE_DIR": str(cache)}
    )
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    line = _one_line(r)
    assert f"the unpacked file {cache}/.tmp-{name}-" in line and "/txmq does not match the SHA-256" in line, line
    assert not marker.exists()
    assert list(cache.iterdir()) == []  # neither published nor left half-done


def test_a_damaged_manifest_is_refused(mini, tmp_path):
    data = bytearray(mini.exe.read_bytes())
    at = data.rfind(b"\nF 755 ") + 3  # a file's mode in the manifest (755 -> 555): the trailer's hash no longer matches
    data[at] = ord("5")
    exe = tmp_path / "txmq-damaged"
    exe.write_bytes(bytes(data))
    exe.chmod(0o755)
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60, env={"TXMQ_CACHE_DIR": str(tmp_path / "cache")})
    assert r.returncode == 1 and "manifest does not match its hash" in _one_line(r), r.stderr
    assert not (tmp_path / "cache").exists()


def _no_unpack_left(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


def test_a_file_size_limit_during_the_unpack_removes_the_partial_copy(mini, tmp_path):
    cache = _private(tmp_path / "cache")
    limit = 1 << 20  # below the bundle's largest file

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    r = mini.run({"TXMQ_CACHE_DIR": str(cache)}, preexec_fn=small_files)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)  # not killed by SIGXFSZ: it cleaned up and said why
    line = _one_line(r)
    assert f"cannot unpack into {cache}: File too large" in line and "its largest file is 4 MB" in line and "ulimit -f" in line, line
    assert _no_unpack_left(cache) == []
    r = mini.run({"TXMQ_CACHE_DIR": str(cache)})  # without the limit: unpacks and runs
    assert (r.returncode, r.stdout) == (0, "genuine --version\n"), r.stderr


def test_a_full_disk_during_the_unpack_removes_the_partial_copy_and_says_how_much_space_it_needs(mini, tmp_path):
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("mounting a small tmpfs in a private mount namespace needs root and unshare")
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    need_mb = -(-mini.need // 1_000_000)
    script = (
        'mount -t tmpfs -o size=2m,mode=0700 tmpfs "$1" || exit 77; '
        'TXMQ_CACHE_DIR="$1" "$2" --version; echo "exit=$?"; TXMQ_CACHE_DIR="$1" "$2" --version; echo "exit=$?"; ls -A "$1"'
    )
    r = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", str(cache), str(mini.exe)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin:/usr/sbin:/sbin"},
    )
    if r.returncode == 77 or "unshare failed" in r.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()[-300:]}")
    assert r.stdout.splitlines() == ["exit=1", "exit=1"], (r.stdout, r.stderr)  # the second try fails the same way: nothing left over
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0] == lines[1], r.stderr
    assert f"cannot unpack into {cache}: No space left on device: it needs {need_mb} MB there, 2 MB are free" in lines[0], lines[0]
    assert "TXMQ_CACHE_DIR" in lines[0]


def test_a_cache_this_user_cannot_write_falls_back_to_the_private_temporary_directory(mini, tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root can write anywhere")
    home = _private(tmp_path / "home")
    (home / ".cache").mkdir(mode=0o500)
    tmpdir = _private(tmp_path / "tmp")
    r = mini.run({"HOME": str(home), "TMPDIR": str(tmpdir)})
    assert (r.returncode, r.stdout, r.stderr) == (0, "genuine --version\n", "")
    assert (tmpdir / f"txmq-{os.geteuid()}" / mini.name).is_dir()
