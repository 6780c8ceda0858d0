"""spark-export without its dependencies: a clear message and exit code 9, through the real entry point.

These run the CLI in a subprocess with pyspark hidden (``sys.modules['pyspark']
= None``) or with no Java reachable (PATH without java, JAVA_HOME unset).
They start no Spark, so they run even where pyspark or Java is missing.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.spark

MISSING_DEPENDENCY = 9


def run_cli(args: list[str], prelude: str = "", env: dict | None = None) -> subprocess.CompletedProcess:
    code = (
        "import sys\n"
        f"{prelude}\n"
        f"sys.argv = ['txmq', *{args!r}]\n"
        "from txmq.cli.main import main\n"
        "main()\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)  # an upper bound: Spark starts in seconds, a loaded machine took over 60


def data_dir(tmp_path):
    (tmp_path / "data" / "commitlog").mkdir(parents=True)
    return str(tmp_path / "data")


def test_without_pyspark_it_says_what_to_install(tmp_path):
    r = run_cli(["spark-export", "--data-dir", data_dir(tmp_path), "--out", str(tmp_path / "out")],
                prelude="sys.modules['pyspark'] = None")
    assert r.returncode == MISSING_DEPENDENCY, r.stderr
    assert "pyspark" in r.stderr and "'.[spark]'" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()


def test_without_pyarrow_it_says_what_to_install(tmp_path):
    r = run_cli(["spark-export", "--data-dir", data_dir(tmp_path), "--out", str(tmp_path / "out")],
                prelude="sys.modules['pyarrow'] = None")
    assert r.returncode == MISSING_DEPENDENCY, r.stderr
    assert "pyarrow" in r.stderr and "'.[spark]'" in r.stderr


def test_without_java_it_says_so(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    env["PATH"] = os.path.dirname(sys.executable)  # the venv's bin: python, no java
    r = run_cli(["spark-export", "--data-dir", data_dir(tmp_path), "--out", str(tmp_path / "out")], env=env)
    assert r.returncode == MISSING_DEPENDENCY, r.stderr
    if "pyspark" in r.stderr and "not installed" in r.stderr:
        pytest.skip("pyspark is missing here, so that is reported first")
    assert "Java" in r.stderr and "JAVA_HOME" in r.stderr and "PATH" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_java_home_without_java_is_named(tmp_path):
    env = {**os.environ, "JAVA_HOME": str(tmp_path / "nojava")}
    r = run_cli(["spark-export", "--data-dir", data_dir(tmp_path), "--out", str(tmp_path / "out")], env=env)
    assert r.returncode == MISSING_DEPENDENCY, r.stderr
    if "not installed" not in r.stderr:
        assert str(tmp_path / "nojava") in r.stderr


def test_help_does_not_import_pyspark():
    code = (
        "import sys\n"
        "sys.argv = ['txmq', 'spark-export', '--help']\n"
        "from txmq.cli.main import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print('PYSPARK_LOADED' if 'pyspark' in sys.modules else 'PYSPARK_NOT_LOADED')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    for opt in ("--data-dir", "--out", "--format", "--table", "--master", "--since", "--until", "--topic",
                "--partition-by", "--mode", "--conf", "--output"):
        assert opt in r.stdout
    assert r.stdout.rstrip().endswith("PYSPARK_NOT_LOADED")


def test_a_directory_without_a_commit_log_is_not_found(tmp_path):
    pytest.importorskip("pyspark")
    from txmq.spark.session import missing_java

    if missing_java():
        pytest.skip("no Java")
    r = run_cli(["spark-export", "--data-dir", str(tmp_path), "--out", str(tmp_path / "out")])
    assert r.returncode == 5 and "not a txmq data directory" in r.stderr, r.stderr


# ---- a real (small) export: complete or absent, never partial ------------------------
def _spark_ready() -> str | None:
    from txmq.spark.session import missing_dependency, missing_java

    return missing_dependency() or missing_java()


def small_data_dir(tmp_path, n: int = 200) -> str:
    from txmq.store import Message, Store, StoreConfig, TxType

    d = tmp_path / "data"
    s = Store(d, StoreConfig(segment_size=64 << 10))
    s.open()
    try:
        msgs = [Message("orders", i % 2, TxType.NORMAL, 1_700_000_000_000 + i, {"KEYS": f"k{i}"}, b"body-%d" % i, -1)
                for i in range(n)]
        for i in range(0, n, 1000):
            s.append(msgs[i:i + 1000])
        s.sync()
    finally:
        s.close()
    return str(d)


def test_an_export_is_renamed_into_place_once_complete(tmp_path):
    problem = _spark_ready()
    if problem:
        pytest.skip(problem)
    out = tmp_path / "out"
    r = run_cli(["spark-export", "--data-dir", small_data_dir(tmp_path), "--out", str(out), "--master", "local[1]", "-o", "json"])
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["messages", "transactions"]
    assert any(p.suffix == ".parquet" for p in (out / "messages").iterdir())
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


@pytest.mark.parametrize("scheme", ["file:", "file://"])
def test_a_file_uri_out_is_the_local_folder_it_names_checked_and_staged_as_one(tmp_path, scheme):
    import json

    problem = _spark_ready()
    if problem:
        pytest.skip(problem)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    out = tmp_path / "out"
    code = ("import sys\nsys.argv = ['txmq', *sys.argv[1:]]\nfrom txmq.cli.main import main\nmain()\n")
    args = ["spark-export", "--data-dir", small_data_dir(tmp_path), "--out", f"{scheme}{out}", "--master", "local[1]", "-o", "json"]
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=240, cwd=cwd)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["out"] == str(out)
    assert sorted(p.name for p in out.iterdir()) == ["messages", "transactions"]
    assert list(cwd.iterdir()) == []  # not a folder named "file:" under the working folder
    again = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=240, cwd=cwd)
    assert again.returncode == 2 and "--mode overwrite" in again.stderr  # refused before Spark starts


def test_a_damaged_record_fails_the_export_with_a_hint_and_skip_damaged_lists_it(tmp_path):
    import json

    from txmq.store import StoreReader

    problem = _spark_ready()
    if problem:
        pytest.skip(problem)
    data = small_data_dir(tmp_path)
    with StoreReader(data) as r:
        victim = list(r.scan())[100]
    seg = max(p for p in os.listdir(os.path.join(data, "commitlog")) if int(p) <= victim.commit_log_offset)
    with open(os.path.join(data, "commitlog", seg), "r+b") as f:  # a body byte: a CRC mismatch
        f.seek(victim.commit_log_offset - int(seg) + victim.size - 1)
        f.write(b"\xff")
    args = ["spark-export", "--data-dir", data, "--master", "local[1]", "-o", "json"]
    r = run_cli([*args, "--out", str(tmp_path / "a")])
    assert r.returncode != 0 and f"crc mismatch at {victim.commit_log_offset}" in r.stderr and "--skip-damaged" in r.stderr
    assert not (tmp_path / "a").exists()
    r = run_cli([*args, "--out", str(tmp_path / "b"), "--skip-damaged"])
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["damaged_records"] == 1 and s["damaged"][0]["offset"] == victim.commit_log_offset
    assert s["tables"]["messages"]["rows"] == 199


def test_ctrl_c_during_an_export_exits_130_and_leaves_no_output(tmp_path):
    import signal
    import time

    problem = _spark_ready()
    if problem:
        pytest.skip(problem)
    data = small_data_dir(tmp_path, n=20000)
    out = tmp_path / "out"
    code = (
        "import sys\n"
        f"sys.argv = ['txmq', 'spark-export', '--data-dir', {data!r}, '--out', {str(out)!r}, '--master', 'local[1]',"
        " '--partition-bytes', '64KiB']\n"
        "from txmq.cli.main import main\n"
        "main()\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        staging = tmp_path / f"out.tmp-{p.pid}"
        deadline = time.monotonic() + 120
        while not staging.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if p.poll() is not None:
            pytest.fail(f"the export ended before its temporary output appeared: {p.stderr.read()}")
        p.send_signal(signal.SIGINT)
        rc = p.wait(120)
        stderr = p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
    assert rc == 130, stderr
    assert "Traceback" not in stderr and "py4j" not in stderr, stderr
    assert [ln for ln in stderr.splitlines() if ln.strip()] == [f"interrupted: nothing written to {out}"], stderr
    assert not out.exists() and not staging.exists()


def test_only_the_broker_option_turns_an_export_into_a_read_through_a_broker(tmp_path):
    """TXMQ_BROKER (or a context) names the broker of the other commands: spark-export stays on its data directory."""
    env = {**os.environ, "TXMQ_BROKER": "127.0.0.1:1"}
    r = run_cli(["spark-export", "--data-dir", data_dir(tmp_path), "--out", str(tmp_path / "out"), "--follow",
                 "--checkpoint", str(tmp_path / "ckpt")], env=env)
    if r.returncode == MISSING_DEPENDENCY:
        pytest.skip("pyspark or Java is missing here")
    assert r.returncode == 2 and "--follow reads through a broker: give --broker" in r.stderr, r.stderr
    r = run_cli(["spark-export", "--broker", "127.0.0.1:1", "--out", str(tmp_path / "out"), "--follow"])
    assert r.returncode == 2 and "--follow needs --checkpoint" in r.stderr, r.stderr


def test_the_quick_jit_is_chosen_only_when_the_messages_table_skips_sparks_writer(tmp_path):
    from dataclasses import replace

    from txmq.cli.commands.spark import _quick_jit
    from txmq.spark.export import ExportOptions

    opts = ExportOptions(str(tmp_path), str(tmp_path / "out"))
    assert _quick_jit(opts, "local[2]", {})
    assert _quick_jit(opts, "local[2]", {"spark.sql.parquet.compression.codec": "zstd"})
    assert not _quick_jit(opts, "spark://h:7077", {})
    # the messages table through Spark's writer: the JVM moves every row, the full JIT pays for itself
    assert not _quick_jit(opts, "local[2]", {"spark.sql.parquet.compression.codec": "lz4"})
    for other in ({"parquet_writer": "spark"}, {"fmt": "json"}, {"partition_by": ("date",)}, {"out": "hdfs:///t"}):
        assert not _quick_jit(replace(opts, **other), "local[2]", {})
    assert _quick_jit(ExportOptions(str(tmp_path), str(tmp_path / "out"), fmt="json", tables=("transactions",)), "local[2]", {})


# Ctrl-C while the driver JVM writes its class-data archive (after the export): the first wait for the JVM is cut short
CTRL_C_WHILE_ARCHIVING = """
import subprocess
_wait = subprocess.Popen.wait
def wait(self, timeout=None):
    from pyspark import SparkContext
    gw = SparkContext._gateway
    if gw is not None and getattr(gw, "proc", None) is self and timeout is not None:
        print(f"JVM {self.pid}", file=sys.stderr, flush=True)
        raise KeyboardInterrupt
    return _wait(self, timeout)
subprocess.Popen.wait = wait
"""


def test_ctrl_c_while_the_class_archive_is_written_keeps_the_finished_export_and_skips_the_archive(tmp_path):
    import json
    import re
    import time

    from txmq.spark.session import missing_dependency, missing_java
    from txmq.store import Message, Store, TxType

    if missing_dependency() or missing_java():
        pytest.skip(missing_dependency() or missing_java())
    data = tmp_path / "data"
    with Store(data) as s:
        s.append([Message("t", 0, TxType.NORMAL, 1, {}, b"x" * 10) for _ in range(20)])
    cache = tmp_path / "cache"
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    env.pop("TXMQ_SPARK_CLASS_ARCHIVE", None)
    code = ("import sys\n" f"{CTRL_C_WHILE_ARCHIVING}\n"
            f"sys.argv = ['txmq', 'spark-export', '--data-dir', {str(data)!r}, '--out', {str(tmp_path / 'out')!r}, "
            "'--master', 'local[1]', '-o', 'json']\n"
            "from txmq.cli.main import main\nmain()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout)["tables"]["messages"]["rows"] == 20
    assert (tmp_path / "out" / "messages" / "_SUCCESS").exists() and "interrupted" not in r.stderr
    jvm = int(re.search(r"JVM (\d+)", r.stderr).group(1))
    def ended() -> bool:
        try:
            return " Z " in open(f"/proc/{jvm}/stat").read()
        except FileNotFoundError:
            return True

    deadline = time.monotonic() + 30  # an upper bound: a JVM told to end may take a moment on a loaded machine
    while not ended() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ended()  # ended, not left writing
    assert list((cache / "txmq" / "spark").glob("*.jsa*")) == []  # no archive, no recording left


def test_the_format_option_offers_the_export_formats_table():
    """--format's choices, default and help are the export's formats (txmq.spark.formats), in their order."""
    from typer.testing import CliRunner

    from txmq.cli.main import app
    from txmq.spark.formats import DEFAULT_FORMAT, EXPORT_FORMATS, FORMATS, export_format, format_help

    assert FORMATS == ("parquet", "json", "csv") and DEFAULT_FORMAT == "parquet"
    assert format_help() == "parquet, json or csv (csv: properties as a JSON string, body as base64)."
    r = CliRunner().invoke(app, ["spark-export", "--help"], prog_name="txmq", env={"COLUMNS": "250"})
    assert r.exit_code == 0 and "<parquet|json|csv>" in r.output and format_help() in r.output, r.output
    r = CliRunner().invoke(app, ["spark-export", "--out", "o", "--format", "xml"], prog_name="txmq")
    assert r.exit_code == 2 and "xml" in r.output, r.output
    with pytest.raises(ValueError, match="--format must be one of parquet, json, csv"):
        export_format("xml")
    # the Arrow writer writes Parquet only; only CSV holds the map and binary columns as text
    assert [f.name for f in EXPORT_FORMATS if f.arrow_writer] == ["parquet"]
    assert [f.name for f in EXPORT_FORMATS if f.text_columns] == ["csv"]
