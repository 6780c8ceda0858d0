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


def _fake_jdk(root, libjvm: bytes):
    (root / "bin").mkdir(parents=True, exist_ok=True)
    (root / "lib" / "server").mkdir(parents=True, exist_ok=True)
    (root / "bin" / "java").write_text("#!/bin/sh\n")
    (root / "bin" / "java").chmod(0o755)
    (root / "lib" / "server" / "libjvm.so").write_bytes(libjvm)
    os.utime(root / "bin" / "java", (1_700_000_000, 1_700_000_000))  # the launcher unchanged by the update


def test_archive_path_changes_when_the_jdk_is_updated_in_place(cache, tmp_path, monkeypatch):
    from txmq.spark import session as sess

    if _spark_problem():
        pytest.skip(_spark_problem())
    jdk = tmp_path / "jdk"
    monkeypatch.setenv("JAVA_HOME", str(jdk))
    _fake_jdk(jdk, b"jvm 17.0.14")
    before = sess.class_archive_path()
    _fake_jdk(jdk, b"jvm 17.0.15 build")  # same launcher, another JVM: it would refuse the old archive
    assert sess.class_archive_path() not in (None, before)


def test_archive_path_follows_spark_home(cache, tmp_path, monkeypatch):
    from txmq.spark import session as sess

    if _spark_problem():
        pytest.skip(_spark_problem())
    monkeypatch.delenv("SPARK_HOME", raising=False)
    own = sess.class_archive_path()
    (tmp_path / "spark" / "jars").mkdir(parents=True)
    (tmp_path / "spark" / "jars" / "spark-core.jar").write_bytes(b"PK")
    monkeypatch.setenv("SPARK_HOME", str(tmp_path / "spark"))  # the driver loads that installation's jars
    assert sess.class_archive_path() not in (None, own)


def test_the_users_driver_java_options_keep_the_log_configuration_and_their_sharing_and_jit_choices(cache):
    from txmq.spark import session as sess

    if _spark_problem():
        pytest.skip(_spark_problem())
    defaults = sess.default_conf("local[1]", "/tmp/log4j2.properties")
    log = defaults["spark.driver.extraJavaOptions"]
    settings, _, _ = sess.driver_settings(defaults, {"spark.driver.extraJavaOptions": "-Xmx1g"})
    assert settings["spark.driver.extraJavaOptions"] == f"{log} -Xmx1g"
    settings, recording, final = sess.driver_settings(defaults, {}, archive=True, quick_jit=True)
    assert settings["spark.driver.extraJavaOptions"] == f"-XX:ArchiveClassesAtExit={recording} -XX:TieredStopAtLevel=1 {log}"
    # Spark puts spark.driver.defaultJavaOptions before the extra ones: a choice made there is left alone too
    chosen = {"spark.driver.defaultJavaOptions": "-Xshare:off -XX:-TieredCompilation"}
    settings, recording, final = sess.driver_settings(defaults, chosen, archive=True, quick_jit=True)
    assert settings["spark.driver.extraJavaOptions"] == log and recording is None and final is None


def test_an_archive_removed_during_clean_up_does_not_stop_the_publish(cache):
    from txmq.spark import session as sess

    cache.mkdir(parents=True)
    (cache / "driver-1.0.0-gone.jsa").symlink_to(cache / "removed-meanwhile")  # globbed, then gone when looked at
    final = cache / "driver-9.9.9-0123456789abcdef.jsa"
    recording = cache / f"{final.name}.tmp-1"
    recording.write_bytes(sess.DYNAMIC_ARCHIVE_MAGIC.to_bytes(4, "little") + b"\0" * 60)
    assert sess.publish_archive(recording, final) is True
    assert final.exists() and not recording.exists()


def test_a_cache_folder_this_user_cannot_write_records_no_archive(cache, tmp_path):
    import shutil
    import tempfile

    if _spark_problem():
        pytest.skip(_spark_problem())
    code = "from txmq.spark import session as s; print(s.archive_options({}))"
    base = tempfile.mkdtemp(prefix="txmq-ro-cache-")  # outside pytest's root-only folder: another user can enter it
    try:
        os.chmod(base, 0o755)
        folder = os.path.join(base, "txmq", "spark")
        os.makedirs(folder)
        os.chmod(folder, 0o555)
        env = {**os.environ, "XDG_CACHE_HOME": base}
        env.pop("TXMQ_SPARK_CLASS_ARCHIVE", None)
        cmd = [sys.executable, "-c", code]
        if os.geteuid() == 0:  # root writes anywhere: ask as an ordinary user
            if not shutil.which("setpriv"):
                pytest.skip("running as root without setpriv to ask as another user")
            cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.strip() == "(None, None, None)"  # the JVM could not write one: no run pays for trying
    finally:
        os.chmod(os.path.join(base, "txmq", "spark"), 0o755)
        shutil.rmtree(base, ignore_errors=True)


def test_a_run_with_its_own_driver_class_path_records_no_archive(cache):
    from txmq.spark import session as sess

    if _spark_problem():
        pytest.skip(_spark_problem())
    # the JVM accepts an archive only with the class path it was recorded with, as a prefix
    assert sess.archive_options({"spark.driver.extraClassPath": "/opt/extra.jar"}) == (None, None, None)
    assert sess.archive_options({})[1] is not None


def test_while_one_export_records_the_archive_another_records_none(cache):
    from txmq.spark import session as sess

    if _spark_problem():
        pytest.skip(_spark_problem())
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        final = sess.class_archive_path()
        cache.mkdir(parents=True)
        (cache / f"{final.name}.tmp-{other.pid}").write_bytes(b"")  # that export's claim, its JVM still running
        assert sess.archive_options({}) == (None, None, None)  # neither mapped (none yet) nor recorded twice
    finally:
        other.kill()
        other.wait()
    flag, recording, _ = sess.archive_options({})  # that export gone without publishing: this one records
    assert recording is not None and recording.exists() and flag.endswith(str(recording))


RESTART = textwrap.dedent("""
    from txmq.spark import session as sess
    s = sess.start("local[1]", archive=True)
    assert s.archive_recording is not None and s.spark.range(5).count() == 5
    s.stop(final=True)
    again = sess.start("local[1]", archive=True)  # the JVM has exited: a new one starts, mapping the new archive
    assert again.created and again.archive_recording is None
    assert again.spark.range(7).count() == 7
    args = " ".join(again.spark._jvm.java.lang.management.ManagementFactory.getRuntimeMXBean().getInputArguments())
    print("ARGS", args)
    again.stop(final=True)
    sess.cleanup(s)
    sess.cleanup(again)
""")


def test_after_its_final_stop_a_process_can_start_spark_again(cache):
    from txmq.spark import session as sess

    if _spark_problem():
        pytest.skip(_spark_problem())
    env = {**os.environ, "XDG_CACHE_HOME": str(cache.parent.parent)}
    r = subprocess.run([sys.executable, "-c", RESTART], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"-XX:SharedArchiveFile={sess.class_archive_path()}" in r.stdout
