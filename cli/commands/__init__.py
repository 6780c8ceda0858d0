"""The command groups of `txmq`, one module each, wired into the app here.

Each module imports only typer and the CLI's own light modules at import
time; the client, the broker, the store and pyspark are imported inside the
command functions, so `txmq --help` and shell completion stay fast
(tests/test_cli_completion.py checks it).
"""

from __future__ import annotations

import typer

from . import bench, broker, checker, completion, config, consume, context, discard, groups, inspect, message, read, resolve, send, spark
from . import migrate, scheduled, stats, store, topics


def register_all(app: typer.Typer) -> None:
    with _panel(app, "Messages"):
        send.register(app)
        consume.register(app)
        topics.register(app)
        read.register(app)  # txmq read (no group, no commit)
        app.add_typer(message.app, name="message")
        app.add_typer(groups.app, name="groups")
        app.add_typer(scheduled.app, name="scheduled")
    with _panel(app, "Transactions"):
        app.add_typer(inspect.app, name="inspect")
        resolve.register(app)
        checker.register(app)
        app.add_typer(discard.app, name="discard")
    with _panel(app, "Broker"):
        app.add_typer(broker.app, name="broker")
        app.add_typer(config.app, name="config")
        stats.register(app)
        bench.register(app)  # txmq bench
        store.register(app)  # txmq store verify|repair (offline)
        migrate.register(app)  # txmq migrate --to NAMESRV (onto RocketMQ 4)
    with _panel(app, "Analysis"):
        spark.register(app)  # txmq spark-export (cli/commands/spark.py)
    with _panel(app, "Shell"):
        completion.register(app)
        app.add_typer(context.app, name="context")  # txmq context add|list|use|remove|show


class _panel:
    """Put the commands and groups registered inside the block under one heading of `txmq --help`."""

    def __init__(self, app: typer.Typer, title: str) -> None:
        self.app, self.title = app, title

    def __enter__(self) -> None:
        self.n_cmds = len(self.app.registered_commands)
        self.n_groups = len(self.app.registered_groups)

    def __exit__(self, *exc: object) -> None:
        for info in [*self.app.registered_commands[self.n_cmds:], *self.app.registered_groups[self.n_groups:]]:
            info.rich_help_panel = self.title
