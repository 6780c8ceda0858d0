"""Global options before or after the command, one-line usage errors, help texts, and named contexts."""

import json
import os
import stat

import pytest

from brokerproc import free_port
from clihelpers import UNREACHABLE, USAGE, err, ok, out, start_broker, txmq


def _one_line_error(r, code, *needles):
    assert r.returncode == code, f"exit {r.returncode}: {err(r)}"
    text = err(r)
    assert text.startswith("error: ") and text.count("\n") == 1 and "Traceback" not in text and "╭" not in text, text
    for n in needles:
        assert n in text, text


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    b = start_broker(tmp_path_factory.mktemp("globals"))
    ok(txmq("send", "t-globals", "x", broker=b.address))
    yield b
    b.stop()


@pytest.mark.parametrize("before", [True, False])
def test_broker_and_output_options_work_before_the_command(broker, before):
    args = ["-b", broker.address, "-o", "json", "topics"] if before else ["topics", "-b", broker.address, "-o", "json"]
    r = ok(txmq(*args, broker=f"127.0.0.1:{free_port()}"))  # TXMQ_BROKER points elsewhere: the option wins
    assert [t["topic"] for t in json.loads(out(r))] == ["t-globals"]


def test_long_forms_with_equals_before_the_command(broker):
    r = ok(txmq(f"--broker={broker.address}", "--output=json", "topics"))
    assert [t["topic"] for t in json.loads(out(r))] == ["t-globals"]


@pytest.mark.parametrize("args, env", [
    (["--debug", "topics"], {}),
    (["topics", "--debug"], {}),
    (["topics"], {"TXMQ_DEBUG": "1"}),
])
def test_debug_shows_the_traceback_and_keeps_the_exit_code(args, env):
    r = txmq(*args, broker=f"127.0.0.1:{free_port()}", env=env)
    assert r.returncode == UNREACHABLE, err(r)
    assert "Traceback" in err(r) and err(r).rstrip().splitlines()[-1].startswith("error: broker unreachable")


@pytest.mark.parametrize("args, needle", [
    (["topics", "--nope"], "No such option: --nope"),
    (["inspect", "half", "--limit", "many"], "--limit"),
    (["send", "t", "x", "--tx", "--group", "g", "--state", "bogus"], "--state"),
    (["config", "set", "check-interval", "-1s"], "'-1s' is read as an option"),
    (["config", "set", "max-checks", "-1"], "values have no sign"),
    (["nosuchcommand"], "nosuchcommand"),
])
def test_usage_errors_are_one_line(args, needle):
    _one_line_error(txmq(*args, broker=f"127.0.0.1:{free_port()}"), USAGE, needle, "--help")


def test_help_shows_bracketed_defaults():
    r = ok(txmq("broker", "start", "--help", env={"COLUMNS": "250"}))
    text = out(r)
    assert "Data directory [default: ~/.local/share/txmq]" in text, text
    assert "Check-back interval [default: 60s]" in text


@pytest.fixture
def config_home(tmp_path):
    return {"XDG_CONFIG_HOME": str(tmp_path / "cfg")}


def _topics(*args, env, broker_env=None):
    r = txmq(*args, "topics", "-o", "json", broker=broker_env, env=env)
    return r


def test_context_supplies_broker_and_token(tmp_path, config_home):
    b = start_broker(tmp_path, "--auth-token", "ctx-secret", name="authed")
    try:
        ok(txmq("send", "t-ctx", "x", broker=b.address, env={"TXMQ_AUTH_TOKEN": "ctx-secret"}))
        ok(txmq("context", "add", "prod", "--broker", b.address, "--token", "ctx-secret", env=config_home))
        ok(txmq("context", "add", "nowhere", "--broker", f"127.0.0.1:{free_port()}", env=config_home))
        path = tmp_path / "cfg" / "txmq" / "contexts.json"
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        # the first context added is the current one
        assert [t["topic"] for t in json.loads(out(ok(_topics(env=config_home))))] == ["t-ctx"]
        assert json.loads(out(ok(txmq("topics", "describe", "t-ctx", "-o", "json", env=config_home))))["messages"] == 1
        # --context before or after the command, and TXMQ_CONTEXT
        _one_line_error(_topics("--context", "nowhere", env=config_home), UNREACHABLE)
        _one_line_error(txmq("topics", "--context", "nowhere", env=config_home), UNREACHABLE)
        _one_line_error(_topics(env={**config_home, "TXMQ_CONTEXT": "nowhere"}), UNREACHABLE)
        # the environment wins over the context, the option over both
        _one_line_error(_topics(env=config_home, broker_env=f"127.0.0.1:{free_port()}"), UNREACHABLE)
        ok(_topics("-b", b.address, env={**config_home, "TXMQ_CONTEXT": "nowhere", "TXMQ_AUTH_TOKEN": "ctx-secret"}))
        _one_line_error(_topics(env={**config_home, "TXMQ_AUTH_TOKEN": "wrong"}), 4, "refused the auth token")
        ok(txmq("context", "use", "nowhere", env=config_home))
        _one_line_error(_topics(env=config_home), UNREACHABLE)
        rows = json.loads(out(ok(txmq("context", "list", "-o", "json", env=config_home))))
        assert {r["name"]: (r["current"], r["token"]) for r in rows} == {"prod": (False, "set"), "nowhere": (True, None)}
        assert "ctx-secret" not in out(ok(txmq("context", "list", env=config_home)))
        shown = json.loads(out(ok(txmq("context", "show", "prod", "--token", "-o", "json", env=config_home))))
        assert shown["token"] == "ctx-secret" and shown["broker"] == b.address
        ok(txmq("context", "remove", "nowhere", env=config_home))
        _one_line_error(_topics("--context", "nowhere", env=config_home), USAGE, "no context named 'nowhere'")
    finally:
        b.stop()


def test_context_commands_refuse_bad_input(config_home):
    _one_line_error(txmq("context", "add", "x", "--broker", "nope", env=config_home), USAGE, "HOST:PORT")
    _one_line_error(txmq("context", "add", "bad name", "--broker", "127.0.0.1:1", env=config_home), USAGE, "bad context name")
    ok(txmq("context", "add", "a", "--broker", "127.0.0.1:1", env=config_home))
    _one_line_error(txmq("context", "add", "a", "--broker", "127.0.0.1:2", env=config_home), USAGE, "--force")
    _one_line_error(txmq("context", "use", "zzz", env=config_home), 5)


def test_broker_status_shows_the_check_settings_in_effect_and_one_round_trip(broker):
    st = json.loads(out(ok(txmq("broker", "status", "-o", "json", broker=broker.address))))
    # start_broker passes --check-interval 1s --transaction-timeout 0s: options for this start
    assert (st["check_interval_s"], st["transaction_timeout_s"], st["max_checks"], st["retention_s"]) == (1, 0, 15, 72 * 3600)
    assert 0 < st["rtt_ms"] < 5000  # a round trip, not a connection or an import; no timing bound on a loaded machine
    assert not (broker.data_dir / "config.json").exists()  # the start options were not stored
