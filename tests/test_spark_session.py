"""The Spark driver's class-data archive: recorded once, mapped afterwards, never published half written."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.spark


def _spark_problem() -> str | None:
    from txmq.spark.session import missing_dependency, missing_java

    return missing_dependency() or missing_java()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("TXMQ_SPARK_CLASS_ARCHIVE", raising=False)
    return tmp_path / "cache" / "txmq" / "spark"


def test_archive_path_names_the_pyspark_version_and_changes_with_the_java(cache, tmp_path, monkeypatch):
    import pyspark

    from txmq.spark import session as sess

    if _spark_problem():
        pytest.skip(_spark_problem())
    path = sess.class_archive_path()
    assert path is not None and path.parent == cache and path.name.startswith(f"driver-{pyspark.__version__}-")
    fake = tmp_path / "jdk" / "bin"
    fake.mkdir(parents=True)
    (fake / "java").write_text("#!/bin/sh\n")
    (fake / "java").chmod(0o755)
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "jdk"))
    assert sess.class_archive_path() not in (None, path)


def test_without_an_archive_one_is_recorded_and_with_one_it_is_mapped(cache):
    from txmq.spark import session as sess

    if _spark_problem():
        pytest.skip(_spark_problem())
    flag, recording, final = sess.archive_options({})
    assert flag == f"-XX:ArchiveClassesAtExit={recording}" and recording.parent == final.parent == cache
    assert recording.name == f"{final.name}.tmp-{os.getpid()}"
    final.write_bytes(sess.DYNAMIC_ARCHIVE_MAGIC.to_bytes(4, "little") + b"rest")
    assert sess.archive_options({}) == (f"-XX:SharedArchiveFile={final}", None, final)
    # the user's own sharing settings, or TXMQ_SPARK_CLASS_ARCHIVE=0, leave the JVM alone
    assert sess.archive_options({"spark.driver.extraJavaOptions": "-Xshare:off"}) == (None, None, None)
    os.environ["TXMQ_SPARK_CLASS_ARCHIVE"] = "0"
    try:
        assert sess.archive_options({}) == (None, None, None)
    finally:
        del os.environ["TXMQ_SPARK_CLASS_ARCHIVE"]


def test_a_recording_that_is_not_a_whole_archive_is_never_published(cache):
    from txmq.spark import session as sess

    cache.mkdir(parents=True)
    final = cache / "driver-9.9.9-0123456789abcdef.jsa"
    recording = cache / f"{final.name}.tmp-1"
    recording.write_bytes(b"\0" * 64)  # cut before its header was written
    assert sess.publish_archive(recording, final) is False
    assert not final.exists() and not recording.exists()
    recording.write_bytes(sess.DYNAMIC_ARCHIVE_MAGIC.to_bytes(4, "little") + b"\0" * 60)
    assert sess.publish_archive(recording, final) is True
    assert final.exists() and not recording.exists()


def test_abandoned_recordings_and_long_unused_archives_are_removed(cache):
    from txmq.spark import session as sess

    if _spark_problem():
        pytest.skip(_spark_problem())
    cache.mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    abandoned = cache / f"driver-9.9.9-aaaa.jsa.tmp-{dead.pid}"
    mine = cache / f"driver-9.9.9-bbbb.jsa.tmp-{os.getpid()}"
    abandoned.write_bytes(b"x")
    mine.write_bytes(b"x")
    old, recent = cache / "driver-1.0.0-old.jsa", cache / "driver-1.0.0-recent.jsa"
    for p in (old, recent):
        p.write_bytes(b"x")
    week_ago = time.time() - sess.UNUSED_ARCHIVE_S - 60
    os.utime(old, (week_ago, week_ago))
    sess.archive_options({})
    assert not abandoned.exists() and mine.exists()
    final = sess.class_archive_path()
    rec = final.with_name(final.name + ".tmp-x")
    rec.write_bytes(sess.DYNAMIC_ARCHIVE_MAGIC.to_bytes(4, "little"))
    assert sess.publish_archive(rec, final)
    assert not old.exists() and recent.exists() and final.exists()


START = textwrap.dedent("""
    import sys
    from txmq.spark import session as sess
    s = sess.start("local[1]", archive=True, quick_jit=True)
    jvm = s.spark._jvm
    mx = jvm.java.lang.management.ManagementFactory.getRuntimeMXBean()
    args = " ".join(mx.getInputArguments())
    assert s.spark.range(5).count() == 5
    print("ARGS", args)
    s.stop(final=True)
    sess.cleanup(s)
""")


def test_a_session_records_the_archive_on_its_final_stop_and_the_next_one_maps_it(cache):
    from txmq.spark import session as sess

    if _spark_problem():
        pytest.skip(_spark_problem())
    java = sess._java_executable()
    if subprocess.run([java, "-Xshare:on", "-version"], capture_output=True).returncode != 0:
        pytest.skip("this Java has no base class-data archive (classes.jsa) to build an application archive on")
    env = {**os.environ, "XDG_CACHE_HOME": str(cache.parent.parent)}
    first = subprocess.run([sys.executable, "-c", START], capture_output=True, text=True, timeout=240, env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "-XX:ArchiveClassesAtExit=" in first.stdout and "-XX:TieredStopAtLevel=1" in first.stdout
    final = sess.class_archive_path()
    assert final is not None and final.exists(), sorted(os.listdir(cache))
    assert [p.name for p in cache.iterdir()] == [final.name]  # no recording left beside it
    second = subprocess.run([sys.executable, "-c", START], capture_output=True, text=True, timeout=240, env=env)
    assert second.returncode == 0, second.stderr[-2000:]
    assert f"-XX:SharedArchiveFile={final}" in second.stdout
