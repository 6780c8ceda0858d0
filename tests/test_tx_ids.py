"""How a transaction is named: its id (RocketMQ's transaction id, the message id), or the id with its half copy's offsets."""

from __future__ import annotations

import pytest

from txmq.broker.transactions.ids import canonical, split_with_offsets


@pytest.mark.parametrize("text,parts", [
    ("7F3A:120:4", ("7F3A", 120, 4)),
    ("order:7:1:0:0", ("order:7:1", 0, 0)),  # the id keeps its own colons
    ("A:4611686018427387903:0", ("A", (1 << 62) - 1, 0)),
])
def test_the_form_with_offsets_splits_into_the_id_and_its_offsets(text, parts):
    assert split_with_offsets(text) == parts


@pytest.mark.parametrize("text", ["7F3A", "7F3A:120", ":1:2", "A:-1:2", "A:+1:2", "A:1:2x", "A: 1:2", "A:1:", "A:\u0661:2",
                                  "A:4611686018427387904:0", "A:" + "9" * 30 + ":0"])
def test_anything_else_is_no_form_with_offsets(text):
    assert split_with_offsets(text) is None


class Index:
    """What ``canonical`` reads of the transaction index: the pending ids and the decided ones."""

    def __init__(self, pending=(), decided=()) -> None:
        self.pending = dict.fromkeys(pending)
        self.decided = set(decided)

    def lookup(self, tx_id):
        return object() if tx_id in self.decided else None


def test_an_id_is_taken_apart_only_when_no_transaction_has_it_whole():
    idx = Index(pending=["01AB", "a:1:2"], decided=["b:3:4"])
    assert canonical(idx, "01AB") == "01AB"  # RocketMQ's form: the id itself
    assert canonical(idx, "01AB:96:0") == "01AB"  # the older form
    assert canonical(idx, "a:1:2") == "a:1:2"  # a pending transaction's own id
    assert canonical(idx, "b:3:4") == "b:3:4"  # a decided one's
    assert canonical(idx, "gone:5:6") == "gone"  # left for the caller's "not found", by its id
    assert canonical(idx, "unknown") == "unknown"
