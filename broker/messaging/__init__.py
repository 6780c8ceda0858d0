"""The messaging service every front end calls (service.py) and the typed records it answers with (types.py)."""

from .operations import Operations
from .service import Messaging
from .types import (
    MAX_NAME,
    NATIVE_RULES,
    ROCKETMQ4_RULES,
    ROCKETMQ5_RULES,
    CheckBack,
    EndOutcome,
    EndStatus,
    MessageKind,
    Outgoing,
    PullResult,
    PullStatus,
    PushTarget,
    Record,
    SendReceipt,
    SendRules,
    SentBack,
    StoreError,
    TxRef,
)

__all__ = ["Messaging", "Operations", "MAX_NAME", "Record", "NATIVE_RULES", "ROCKETMQ4_RULES", "ROCKETMQ5_RULES", "CheckBack", "EndOutcome", "EndStatus", "MessageKind", "Outgoing",
           "PullResult", "PullStatus", "PushTarget", "SendReceipt", "SendRules", "SentBack", "StoreError", "TxRef"]
