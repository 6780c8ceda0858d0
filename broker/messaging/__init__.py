"""The messaging service every front end calls (service.py) and the typed records it answers with (types.py)."""

from .service import Messaging, then
from .types import (
    NATIVE_RULES,
    ROCKETMQ4_RULES,
    ROCKETMQ5_RULES,
    EndOutcome,
    EndStatus,
    MessageKind,
    Outgoing,
    PullResult,
    PullStatus,
    SendReceipt,
    SendRules,
    TxRef,
)

__all__ = ["Messaging", "then", "NATIVE_RULES", "ROCKETMQ4_RULES", "ROCKETMQ5_RULES", "EndOutcome", "EndStatus", "MessageKind", "Outgoing",
           "PullResult", "PullStatus", "SendReceipt", "SendRules", "TxRef"]
