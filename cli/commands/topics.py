"""txmq topics: the broker's topics, their queues and message counts."""

from typing import Annotated

import typer

from ..common import DEFAULT_BROKER, BrokerOpt, OutputOpt, TokenOpt
from ..console import render, resolve_output

EPILOG = """Examples:

  txmq topics

  txmq topics --system            # include RMQ_SYS_TRANS_HALF_TOPIC and friends

  txmq topics -o jsonl | jq -r .topic

Keys: topic, queues, messages, system."""


def register(app: typer.Typer) -> None:
    app.command("topics", epilog=EPILOG)(topics)


def topics(
    system: Annotated[bool, typer.Option("--system", "-s", help="Include the system topics (half, op, discard).")] = False,
    broker: BrokerOpt = DEFAULT_BROKER,
    token: TokenOpt = None,
    output: OutputOpt = None,
) -> None:
    """List topics with their queue counts and stored message counts."""
    from ..client_ops import call

    rows = [{"topic": t["topic"], "queues": t["queues"], "messages": t["messages"], "system": t["system"]}
            for t in call(broker, token, "list_topics", {"system": system})["topics"]]
    render(rows, resolve_output(output),
           columns=[("topic", "TOPIC"), ("queues", "QUEUES"), ("messages", "MESSAGES"), ("system", "SYSTEM")],
           empty="no topics yet (they are created by the first send)")
