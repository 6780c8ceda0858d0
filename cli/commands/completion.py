"""Shell completion: `txmq completion bash|zsh|fish` prints a script, and `txmq` answers each Tab.

The scripts call `txmq` with _TXMQ_COMPLETE set on each Tab (Typer's
completion protocol), so they always match the installed commands; each
also records the command tree it was generated from. main.py hands such a
call to `answer_tab`. The copies in completions/ are regenerated with
`scripts/gen-completions.sh` (`txmq completion SHELL` for each shell), and
tests/test_cli_completion.py fails when they are out of date.
"""

import sys
from enum import Enum
from typing import Annotated, Any

import typer

from ..globalopts import FLAGS, split_globals
from .context import complete_name

COMPLETE_VAR = "_TXMQ_COMPLETE"

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


def completion(
    ctx: typer.Context,
    shell: Annotated[Shell, typer.Argument(metavar="SHELL", help="bash, zsh or fish.", show_default=False)],
) -> None:
    """Print the shell completion script for txmq."""
    sys.stdout.write(script(shell.value, ctx.find_root().command))
    sys.stdout.flush()


def command_tree(command: Any, prefix: str = "txmq") -> list[str]:
    """One line per command under the click command given (the app's, for the root), e.g. 'txmq inspect half'."""
    subs = getattr(command, "commands", None)
    if not subs:
        return [prefix]
    lines: list[str] = []
    for name in sorted(subs):
        if not subs[name].hidden:
            lines.extend(command_tree(subs[name], f"{prefix} {name}"))
    return lines


def script(shell: str, root: Any) -> str:
    """The completion script for shell, listing the commands of the app's click command root."""
    body = {"bash": _BASH, "zsh": _ZSH, "fish": _FISH}[shell]
    head = [
        f"# txmq completion for {shell}: generated from the app by `txmq completion {shell}`; do not edit.",
        f"# Install: {_INSTALL[shell]}",
        "# On each Tab the shell asks `txmq` itself (with _TXMQ_COMPLETE set). Commands when generated:",
        *(f"#   {line}" for line in command_tree(root)),
    ]
    first = "#compdef txmq\n" if shell == "zsh" else ""
    return first + "\n".join(head) + "\n\n" + body


def answer_tab() -> None:
    """Set up Typer's shell completion for a Tab (_TXMQ_COMPLETE set), taught the global options:
    skipped before the command, --context NAME completed. Then running the app answers the Tab."""
    from typer._click.shell_completion import CompletionItem, add_completion_class
    from typer._completion_classes import BashComplete, FishComplete, ZshComplete, completion_init

    completion_init()

    def get_completion_args(self: Any) -> tuple[list[str], str]:
        args, incomplete = super(type(self), self).get_completion_args()
        self._after_context = bool(args) and args[-1] == "--context"
        rest, _moved, tail, _context, _debug = split_globals(args[:-1] if self._after_context else args)
        return rest + tail, incomplete

    def get_completions(self: Any, args: list[str], incomplete: str) -> list[Any]:
        if self._after_context:
            return [CompletionItem(n) for n in complete_name(incomplete)]
        items = super(type(self), self).get_completions(args, incomplete)
        if incomplete.startswith("--"):
            items += [CompletionItem(f) for f in FLAGS if f.startswith(incomplete)]
        return items

    for shell, cls in (("bash", BashComplete), ("zsh", ZshComplete), ("fish", FishComplete)):
        add_completion_class(type(cls.__name__, (cls,), {"get_completion_args": get_completion_args,
                                                         "get_completions": get_completions}), shell)
