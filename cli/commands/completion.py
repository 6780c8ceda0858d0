"""txmq completion bash|zsh|fish: print a shell completion script.

The scripts call `txmq` with _TXMQ_COMPLETE set on each Tab (Typer's
completion protocol), so they always match the installed commands; each
also records the command tree it was generated from. The copies in
completions/ are regenerated with `scripts/gen-completions.sh` (or
`python -m txmq.cli.commands.completion completions/`), and
tests/test_cli_completion.py fails when they are out of date.
"""

import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

COMPLETE_VAR = "_TXMQ_COMPLETE"
FILES = {"bash": "txmq.bash", "zsh": "_txmq", "fish": "txmq.fish"}

EPILOG = """Examples:

  txmq completion bash > ~/.local/share/bash-completion/completions/txmq

  txmq completion zsh > "${fpath[1]}/_txmq"          # or any directory in $fpath

  txmq completion fish > ~/.config/fish/completions/txmq.fish

  eval "$(txmq completion bash)"                    # just this shell"""

_BASH = """\
_txmq_completion() {
    local IFS=$'\\n'
    COMPREPLY=( $( env COMP_WORDS="${COMP_WORDS[*]}" \\
                   COMP_CWORD=$COMP_CWORD \\
                   _TXMQ_COMPLETE=complete_bash "$1" ) )
    return 0
}

complete -o default -F _txmq_completion txmq
"""

_ZSH = """\
_txmq_completion() {
  eval $(env _TYPER_COMPLETE_ARGS="${words[1,$CURRENT]}" _TXMQ_COMPLETE=complete_zsh txmq)
}

if [[ "${funcstack[1]}" == "_txmq" ]]; then
  _txmq_completion "$@"            # autoloaded from $fpath
else
  compdef _txmq_completion txmq    # sourced
fi
"""

_FISH = """\
complete --command txmq --no-files \\
  --arguments "(env _TXMQ_COMPLETE=complete_fish _TYPER_COMPLETE_FISH_ACTION=get-args _TYPER_COMPLETE_ARGS=(commandline -cp) txmq)" \\
  --condition "env _TXMQ_COMPLETE=complete_fish _TYPER_COMPLETE_FISH_ACTION=is-args _TYPER_COMPLETE_ARGS=(commandline -cp) txmq"
"""

_INSTALL = {
    "bash": "txmq completion bash > ~/.local/share/bash-completion/completions/txmq",
    "zsh": 'txmq completion zsh > "${fpath[1]}/_txmq"   (then: autoload -U compinit && compinit)',
    "fish": "txmq completion fish > ~/.config/fish/completions/txmq.fish",
}


class Shell(str, Enum):
    bash = "bash"
    zsh = "zsh"
    fish = "fish"


def register(app: typer.Typer) -> None:
    app.command("completion", epilog=EPILOG)(completion)


def completion(shell: Annotated[Shell, typer.Argument(metavar="SHELL", help="bash, zsh or fish.", show_default=False)]) -> None:
    """Print the shell completion script for txmq."""
    sys.stdout.write(script(shell.value))
    sys.stdout.flush()


def command_tree(command: Any = None, prefix: str = "txmq") -> list[str]:
    """One line per command of the app, e.g. 'txmq inspect half'."""
    if command is None:
        from typer.main import get_command

        from ..main import app

        command = get_command(app)
    subs = getattr(command, "commands", None)
    if not subs:
        return [prefix]
    lines: list[str] = []
    for name in sorted(subs):
        if not subs[name].hidden:
            lines.extend(command_tree(subs[name], f"{prefix} {name}"))
    return lines


def script(shell: str) -> str:
    body = {"bash": _BASH, "zsh": _ZSH, "fish": _FISH}[shell]
    head = [
        f"# txmq completion for {shell}: generated from the app by `txmq completion {shell}`; do not edit.",
        f"# Install: {_INSTALL[shell]}",
        "# On each Tab the shell asks `txmq` itself (with _TXMQ_COMPLETE set). Commands when generated:",
        *(f"#   {line}" for line in command_tree()),
    ]
    first = "#compdef txmq\n" if shell == "zsh" else ""
    return first + "\n".join(head) + "\n\n" + body


def write_all(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for shell, name in FILES.items():
        path = directory / name
        path.write_text(script(shell))
        written.append(path)
    return written


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "completions")
    for p in write_all(target):
        print(p)
