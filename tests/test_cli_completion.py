"""Completions, help and start-up: no broker needed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from clihelpers import cli_argv, cli_env, out, txmq

REPO = Path(__file__).resolve().parent.parent


# The file in completions/ that holds each shell's script (scripts/gen-completions.sh writes them).
FILES = {"bash": "txmq.bash", "zsh": "_txmq", "fish": "txmq.fish"}


def _script(shell: str) -> str:
    from txmq.cli.commands.completion import script
    from txmq.cli.main import app

    return script(shell, get_command(app))


def test_completion_files_are_up_to_date():
    """completions/ must match what the app generates: run scripts/gen-completions.sh after changing commands."""
    stale = [name for shell, name in FILES.items()
             if not (REPO / "completions" / name).exists()
             or (REPO / "completions" / name).read_text() != _script(shell)]
    assert not stale, f"completions/{', completions/'.join(stale)} out of date: run scripts/gen-completions.sh"


def test_completion_command_prints_the_shipped_script():
    r = txmq("completion", "bash")
    assert r.returncode == 0
    assert out(r) == (REPO / "completions" / "txmq.bash").read_text()
    assert "complete -o default -F _txmq_completion txmq" in out(r)


def test_zsh_and_fish_scripts_name_the_program():
    assert _script("zsh").startswith("#compdef txmq\n")
    assert "complete --command txmq" in _script("fish")
    assert "#   txmq inspect half" in _script("bash")


def _complete_bash(words: str, **env_extra: str) -> list[str]:
    parts = words.split(" ")
    env = cli_env(_TXMQ_COMPLETE="complete_bash", COMP_WORDS=words, COMP_CWORD=str(len(parts) - 1), **env_extra)
    r = subprocess.run(cli_argv(), env=env, capture_output=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout.decode().split()


def test_tab_completion_is_answered_by_the_program():
    assert _complete_bash("txmq insp") == ["inspect"]
    assert set(_complete_bash("txmq inspect ")) >= {"half", "op", "offsets"}
    assert _complete_bash("txmq send orders --state ") == ["commit", "rollback", "unknown"]
    assert "check-interval" in _complete_bash("txmq config set ")


def test_option_values_that_are_a_few_words_are_completed():
    assert _complete_bash("txmq broker start --flush ") == ["sync", "async"]
    assert _complete_bash("txmq broker start --log-format ") == ["kv", "json"]
    assert _complete_bash("txmq bench ") == ["tx", "tx-client", "send", "consume"]
    assert _complete_bash("txmq bench tx-client --end ") == ["pipelined", "wait"]
    assert "outcomes-known-since" not in _complete_bash("txmq config set ")  # read-only: only `config get` takes it
    assert "outcomes-known-since" in _complete_bash("txmq config get ")


def test_completion_skips_global_options_before_the_command_and_completes_context_names(tmp_path):
    home = {"XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    assert txmq("context", "add", "prod", "--broker", "127.0.0.1:1", env=home).returncode == 0
    assert txmq("context", "add", "staging", "--broker", "127.0.0.1:2", env=home).returncode == 0
    assert set(_complete_bash("txmq -b 127.0.0.1:1 inspect ")) == {"half", "op", "tx", "offsets", "scheduled"}
    assert _complete_bash("txmq --context prod --debug inspect h") == ["half"]
    assert _complete_bash("txmq --context ", **home) == ["prod", "staging"]
    assert _complete_bash("txmq inspect half --context s", **home) == ["staging"]
    assert "--context" in _complete_bash("txmq --co") and "--debug" in _complete_bash("txmq inspect half --de")
    env = cli_env(_TXMQ_COMPLETE="complete_zsh", _TYPER_COMPLETE_ARGS="txmq -o json inspect ")
    assert '"offsets"' in subprocess.run(cli_argv(), env=env, capture_output=True, timeout=30).stdout.decode()


def test_startup_imports_nothing_heavy():
    """The completions run the program on every Tab: building the whole app must not load the broker,
    the store, the client, the event loop or pyspark."""
    code = (
        "import sys, txmq.cli.main as m\n"
        "from typer.main import get_command\n"
        "get_command(m.app)\n"
        "heavy = ('pyspark', 'pyarrow', 'pandas', 'txmq.broker', 'txmq.store', 'txmq.client', 'uvloop', 'msgpack')\n"
        "print(' '.join(sorted(n for n in sys.modules if n.split('.')[0] in heavy or n.startswith(heavy))))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "", f"imported at start-up: {r.stdout}"


def test_help_is_quick():
    """Measured in CPU seconds of the process, which a loaded machine does not stretch as it stretches wall time."""
    best = min(_cpu_s(["--help"]) for _ in range(3))
    assert best < 1.5, f"`txmq --help` used {best:.2f} s of CPU"


def _cpu_s(args: list[str]) -> float:
    """User + system CPU seconds of one run of the CLI (wait4's rusage of that child alone)."""
    p = subprocess.Popen(cli_argv(*args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=cli_env())
    _pid, _status, usage = os.wait4(p.pid, 0)
    p.returncode = 0  # reaped here, not by Popen
    return usage.ru_utime + usage.ru_stime


def _leaf_commands():
    from txmq.cli.main import app

    def walk(cmd, path):
        subs = getattr(cmd, "commands", None)
        if not subs:
            yield path
            return
        for name, sub in subs.items():
            yield from walk(sub, [*path, name])

    return list(walk(get_command(app), []))


@pytest.mark.parametrize("path", _leaf_commands(), ids=" ".join)
def test_every_command_help_shows_examples(path):
    from txmq.cli.main import app

    r = CliRunner().invoke(app, [*path, "--help"], prog_name="txmq", env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "Examples:" in r.output and "txmq " + " ".join(path) in r.output


def test_root_help_and_version():
    r = txmq("--help")
    assert r.returncode == 0 and "Examples:" in out(r)
    for name in ("send", "inspect", "resolve", "discard", "config", "checker", "consume", "topics", "stats", "completion"):
        assert name in out(r)
    r = txmq("--version")
    assert r.returncode == 0 and out(r).startswith("txmq ")


def test_unknown_command_is_a_usage_error():
    r = txmq("frobnicate")
    assert r.returncode == 2


def test_shipped_bash_script_completes_in_bash():
    """Source completions/txmq.bash in a real bash and press Tab (call the completion function)."""
    import os
    import shutil

    from clihelpers import TXMQ

    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("bash is not installed")
    path = os.path.dirname(TXMQ) if TXMQ else os.path.dirname(sys.executable)
    script = REPO / "completions" / "txmq.bash"
    cmd = f'source "{script}"; COMP_WORDS=(txmq config set m); COMP_CWORD=3; _txmq_completion txmq; printf "%s\\n" "${{COMPREPLY[@]}}"'
    r = subprocess.run([bash, "--norc", "-c", cmd], capture_output=True, text=True, timeout=30,
                       env=cli_env(PATH=f"{path}{os.pathsep}{os.environ.get('PATH', '')}"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["max-checks"]


def test_version_answers_without_loading_the_cli():
    """`txmq --version` (the console script, the zipapp and the single executable's entry) loads neither Typer nor rich."""
    from txmq import __version__

    code = (
        "import sys\n"
        "sys.argv = ['txmq', '--version']\n"
        "from txmq.cli.launch import main\n"
        "main()\n"
        "print(' '.join(sorted(n for n in sys.modules if n.split('.')[0] in ('typer', 'rich', 'click') or n.startswith('txmq.cli.'))))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"txmq {__version__}", "txmq.cli.launch"], r.stdout
    # any other arguments go to the whole CLI
    r = subprocess.run([sys.executable, "-c", "import sys; sys.argv = ['txmq', '--version', '--help']\n"
                        "from txmq.cli.launch import main; main()"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"txmq {__version__}", (r.stdout, r.stderr)
