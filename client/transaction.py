"""The transactional producer: half message, local transaction, end transaction, check-backs.

Shape of RocketMQ's ``TransactionMQProducer``::

    class Orders(TransactionListener):
        async def execute_local_transaction(self, message, arg):
            await db.insert_order(arg, tx_id=message.tx_id)
            return LocalTransactionState.COMMIT_MESSAGE

        def check_local_transaction(self, message):   # sync works too
            return LocalTransactionState.COMMIT_MESSAGE if db.has(message.tx_id) else LocalTransactionState.ROLLBACK_MESSAGE

    async with TransactionProducer("order-group", Orders()) as p:
        result = await p.send_in_transaction(Message("orders", b"..."), arg=order)
        # the half is durable and the local transaction ran; the end is on its way:
        outcome = await result.end          # "committed", or None if it could not be delivered
        await p.flush()                     # every outstanding end answered (close() does this too)

The end transaction is pipelined (docs/client.md, "Pipelined end"):
`send_in_transaction` returns once the half message is acknowledged (durable
under sync flush), the local transaction has run and the end request is
queued on the connection; the end's reply arrives later, on `result.end`.
Should the broker die before the end is durable, the half stays pending and
the check-back asks `check_local_transaction`, so nothing is lost. Pass
``wait_end=True`` (per call or to the producer) to return only after the
broker has answered the end, as before.

Listener methods may be plain or ``async``. A plain `execute_local_transaction`
runs inline on the event loop (as RocketMQ runs it on the sending thread)
unless ``execute_in_executor=True``; a plain `check_local_transaction` always
runs in the executor, so a slow check never blocks the loop. A listener that
raises or returns None answers `UNKNOW`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import enum
import inspect
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from txmq.constants import PROP_PGROUP, PROP_TRAN_MSG, PROP_UNIQ_KEY
from txmq.txids import TxIds
from txmq.wire import ErrorCode, TxmqError

from .connection import DEFAULT_ADDRESS, Client, ConnectionLost
from .message import TX_HALF, Message, ReceivedMessage

log = logging.getLogger("txmq.client")


class LocalTransactionState(enum.Enum):
    """The outcome of a local transaction; the value is the wire `state`."""

    COMMIT_MESSAGE = "commit"
    ROLLBACK_MESSAGE = "rollback"
    UNKNOW = "unknown"  # RocketMQ's spelling

    UNKNOWN = "unknown"  # alias of UNKNOW

    @classmethod
    def coerce(cls, value: object) -> "LocalTransactionState":
        """Map a listener's answer to a state; anything unrecognised is `UNKNOW`."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            v = value.strip()
            try:
                return cls(v.lower())
            except ValueError:
                pass
            member = cls.__members__.get(v.upper())
            if member is not None:
                return member
            short = {"COMMIT": cls.COMMIT_MESSAGE, "ROLLBACK": cls.ROLLBACK_MESSAGE}.get(v.upper())
            if short is not None:
                return short
        if value is not None:
            log.warning("transaction listener returned %r; treated as UNKNOW", value)
        return cls.UNKNOW


class SendStatus(enum.Enum):
    SEND_OK = "SEND_OK"
    FLUSH_DISK_TIMEOUT = "FLUSH_DISK_TIMEOUT"  # the broker answered STORE_ERROR: the half is not durable


class TransactionListener(ABC):
    """Implement both methods, plain or ``async``; duck-typed objects work too."""

    @abstractmethod
    def execute_local_transaction(self, message: ReceivedMessage, arg: Any) -> Any:
        """Run the local transaction for a stored half message; return a `LocalTransactionState`."""

    @abstractmethod
    def check_local_transaction(self, message: ReceivedMessage) -> Any:
        """Tell the broker how a pending transaction ended; return a `LocalTransactionState`."""


@dataclass(slots=True)
class TransactionSendResult:
    """What `send_in_transaction` returns.

    Every field but ``outcome`` and ``end_error`` is final when it returns.
    With a pipelined end those two are filled when the end's reply arrives:
    until then ``end`` is not done and ``outcome`` is None. ``await
    result.end`` gives the outcome (``committed`` / ``rolled_back`` /
    ``pending`` for an unknown state), None when the end could not be
    delivered (the broker checks back instead), or raises the broker's
    refusal (``CONFLICT``: an operator decided it the other way first;
    ``TX_NOT_FOUND``), which is also kept in ``end_error``.
    """

    send_status: SendStatus
    tx_id: str | None
    msg_id: str | None
    commit_log_offset: int  # of the half record; -1 when it was not stored
    half_offset: int
    local_state: LocalTransactionState
    topic: str
    queue_id: int
    outcome: str | None = None  # the broker's answer to end_transaction: committed | rolled_back | pending
    end: "asyncio.Future[str | None] | None" = field(default=None, repr=False, compare=False)
    end_error: TxmqError | None = field(default=None, compare=False)

    @property
    def end_done(self) -> bool:
        """True once the broker answered the end (or it failed, or there was none to send)."""
        return self.end is None or self.end.done()


@dataclass(frozen=True, slots=True)
class HalfResult:
    """What the broker said about a stored half message (step 1)."""

    tx_id: str
    msg_id: str
    topic: str
    queue_id: int
    half_offset: int
    commit_log_offset: int


class TransactionProducer:
    def __init__(
        self,
        group: str,
        listener: Any,
        address: str = DEFAULT_ADDRESS,
        token: str | None = None,
        check_concurrency: int = 16,
        executor: concurrent.futures.Executor | None = None,
        *,
        execute_in_executor: bool = False,
        wait_end: bool = False,
        **client_options: Any,
    ) -> None:
        if not group:
            raise ValueError("a transactional producer needs a group")
        self.group = group
        self.wait_end = wait_end  # default of send_in_transaction(wait_end=...)
        self._ends: set[asyncio.Future[str | None]] = set()  # pipelined ends not answered yet
        self._end_retries: set[asyncio.Task[dict[str, Any]]] = set()  # ends sent again, waiting for a reconnect
        self.ends_sent = 0
        self.ends_confirmed = 0
        # pipelined ends that failed, by reason: conflict, not_found, refused, lost (the broker checks back)
        self.end_failures: collections.Counter[str] = collections.Counter()
        self.listener = listener
        self.executor = executor
        self.execute_in_executor = execute_in_executor
        self.check_concurrency = check_concurrency
        self._tx_props = {PROP_TRAN_MSG: "true", PROP_PGROUP: group}
        self._client = Client(address, token=token, producer_groups=(group,), push_handler=self._on_push, **client_options)
        self._check_sem: asyncio.Semaphore | None = None
        self._check_tasks: set[asyncio.Task[None]] = set()
        # One check per transaction at a time: the broker pushes a pending one again on every check
        # pass, and a slow check must not pile up a task (and a message body) per pass.
        self._checks_queued: dict[str, dict[str, Any]] = {}  # tx_id -> its newest push, waiting for a slot
        self._checks_running: set[str] = set()
        self.checks_answered = 0

    @property
    def client(self) -> Client:
        return self._client

    async def start(self) -> "TransactionProducer":
        self._check_sem = asyncio.Semaphore(self.check_concurrency)
        await self._client.start()
        return self

    @property
    def ends_outstanding(self) -> int:
        """Pipelined end requests sent and not answered yet."""
        return len(self._ends)

    async def flush(self, timeout: float | None = None) -> int:
        """Wait until every pipelined end so far is answered (or failed); returns how many are still outstanding.

        ``timeout`` None waits as long as the ends' own request timeout.
        """
        if not self._ends:
            return 0
        await asyncio.wait(set(self._ends), timeout=timeout)
        return len(self._ends)

    async def close(self) -> None:
        """Wait for the outstanding ends (up to the request timeout), stop answering check-backs, disconnect."""
        if self._ends and not self._client._closed:
            await self.flush(self._client.request_timeout)
        for task in list(self._check_tasks):
            task.cancel()
        if self._check_tasks:
            await asyncio.gather(*self._check_tasks, return_exceptions=True)
        await self._client.close()
        if self._end_retries:  # they fail at once now: settle their ends before returning
            await asyncio.gather(*self._end_retries, return_exceptions=True)

    async def __aenter__(self) -> "TransactionProducer":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- sending ------------------------------------------------------

    async def send_in_transaction(
        self, message: Message, arg: Any = None, *, timeout: float | None = None, wait_end: bool | None = None
    ) -> TransactionSendResult:
        """Send a half message, run the local transaction if it was stored, then end the transaction.

        Returns once the end request is queued on the connection (pipelined;
        its reply arrives on ``result.end``), or with ``wait_end=True`` once
        the broker answered it (default: the producer's ``wait_end``).
        Raises the send's `TxmqError` when the half was refused; a
        `STORE_ERROR` (not durable) instead returns a result with
        `FLUSH_DISK_TIMEOUT` and `ROLLBACK_MESSAGE`, without calling the listener.
        With ``wait_end=True`` a refused end (CONFLICT, TX_NOT_FOUND) raises.
        """
        fields = message.send_fields(self._tx_props)
        try:
            half = await self._send_half(fields, timeout)
        except TxmqError as exc:
            return await self._not_durable(message, exc)
        state = await self._run_execute(self._view(fields, half), arg)
        if wait_end if wait_end is not None else self.wait_end:
            return await self._finish(half, state, timeout)
        return self._finish_pipelined(half, state, timeout)

    async def send_half(self, message: Message, *, timeout: float | None = None) -> HalfResult:
        """Step 1 alone: store the half message (properties TRAN_MSG, PGROUP; the broker adds UNIQ_KEY)."""
        return await self._send_half(message.send_fields(self._tx_props), timeout)

    async def _send_half(self, fields: dict[str, Any], timeout: float | None) -> HalfResult:
        r = await self._client.request("send", fields, timeout)
        return HalfResult(r["tx_id"], r.get("msg_id", r["tx_id"]), r["topic"], r["queue_id"], r["half_offset"], r["commit_log_offset"])

    async def end_transaction(
        self, half: HalfResult, state: LocalTransactionState, *, from_check: bool = False, timeout: float | None = None
    ) -> str | None:
        """Step 3 alone. Returns the broker's outcome, or None if it could not be told (the check-back will ask)."""
        try:
            r = await self._client.request("end_transaction", self._end_fields(half, state, from_check), timeout)
        except (TxmqError, TimeoutError) as exc:
            if isinstance(exc, TxmqError) and not exc.retriable:
                raise
            log.warning("end_transaction(%s, %s) not delivered (%s); the broker will check back", half.tx_id, state.value, exc)
            return None
        return r.get("outcome")

    def _end_fields(self, half: HalfResult, state: LocalTransactionState, from_check: bool) -> dict[str, Any]:
        return {
            "group": self.group,
            "tx_id": half.tx_id,
            "commit_log_offset": half.commit_log_offset,
            "half_offset": half.half_offset,
            "state": state.value,
            "from_check": from_check,
        }

    @staticmethod
    def _view(fields: dict[str, Any], half: HalfResult) -> ReceivedMessage:
        # The request is already encoded, so its properties map can be reused.
        props = fields["properties"]
        props[PROP_UNIQ_KEY] = half.tx_id
        return ReceivedMessage(
            topic=half.topic,
            queue_id=half.queue_id,
            queue_offset=half.half_offset,
            commit_log_offset=half.commit_log_offset,
            msg_id=half.msg_id,
            body=fields["body"],
            properties=props,
            tx_id=half.tx_id,
            tx_type=TX_HALF,
        )

    async def _run_execute(self, view: ReceivedMessage, arg: Any) -> LocalTransactionState:
        fn = self.listener.execute_local_transaction
        try:
            if self.execute_in_executor and not inspect.iscoroutinefunction(fn):
                result = await asyncio.get_running_loop().run_in_executor(self.executor, fn, view, arg)
            else:
                result = fn(view, arg)
            if inspect.isawaitable(result):
                result = await result
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("execute_local_transaction failed for %s; state UNKNOW", view.tx_id)
            return LocalTransactionState.UNKNOW
        return LocalTransactionState.coerce(result)

    async def _finish(self, half: HalfResult, state: LocalTransactionState, timeout: float | None) -> TransactionSendResult:
        outcome = await self.end_transaction(half, state, timeout=timeout)
        end = asyncio.get_running_loop().create_future()
        end.set_result(outcome)
        return TransactionSendResult(
            SendStatus.SEND_OK, half.tx_id, half.msg_id, half.commit_log_offset, half.half_offset,
            state, half.topic, half.queue_id, outcome, end,
        )

    def _finish_pipelined(self, half: HalfResult, state: LocalTransactionState, timeout: float | None) -> TransactionSendResult:
        """Queue the end request and return; the reply completes ``result.end`` (and the counters) later.

        The request goes out in this loop iteration's write, together with
        whatever the caller sends next (the next half shares the broker's
        group-commit fsync with this end). On a lost connection the end is
        sent again once the client reconnects (end_transaction is safe to
        repeat); if that fails too, the broker checks back.
        """
        loop = asyncio.get_running_loop()
        fields = self._end_fields(half, state, False)
        end: asyncio.Future[str | None] = loop.create_future()
        result = TransactionSendResult(
            SendStatus.SEND_OK, half.tx_id, half.msg_id, half.commit_log_offset, half.half_offset,
            state, half.topic, half.queue_id, None, end,
        )
        self._ends.add(end)
        end.add_done_callback(self._ends.discard)
        self.ends_sent += 1
        try:
            reply: asyncio.Future[dict[str, Any]] = self._client.send_request("end_transaction", fields, timeout)
        except TxmqError as exc:  # no live connection right now
            self._end_failed(result, fields, timeout, exc, retried=False)
        else:
            reply.add_done_callback(partial(self._end_replied, result, fields, timeout, False))
        return result

    def _end_replied(self, result: TransactionSendResult, fields: dict[str, Any], timeout: float | None,
                     retried: bool, reply: "asyncio.Future[dict[str, Any]]") -> None:
        if reply.cancelled():
            self._end_failed(result, fields, timeout, TimeoutError("end_transaction cancelled"), retried=True)
            return
        exc = reply.exception()
        if exc is not None:
            self._end_failed(result, fields, timeout, exc, retried)
            return
        outcome = reply.result().get("outcome")
        result.outcome = outcome
        self.ends_confirmed += 1
        end = result.end
        if end is not None and not end.done():
            end.set_result(outcome)

    def _end_failed(self, result: TransactionSendResult, fields: dict[str, Any], timeout: float | None,
                    exc: BaseException, retried: bool) -> None:
        end = result.end
        assert end is not None
        # not delivered (the broker checks back): a timeout, a lost connection, or the client closed meanwhile
        lost = isinstance(exc, (TimeoutError, ConnectionLost)) or (isinstance(exc, TxmqError) and exc.retriable)
        if lost and not retried and not self._client._closed:
            # The retrying path waits for a reconnect; the result's end stays open meanwhile.
            task = asyncio.get_running_loop().create_task(self._client.request("end_transaction", fields, timeout))
            self._end_retries.add(task)
            task.add_done_callback(self._end_retries.discard)
            task.add_done_callback(partial(self._end_replied, result, fields, timeout, True))
            return
        if lost:
            self.end_failures["lost"] += 1
            log.warning("end_transaction(%s, %s) not delivered (%s); the broker will check back", fields["tx_id"], fields["state"], exc)
            if not end.done():
                end.set_result(None)
            return
        if isinstance(exc, TxmqError):
            reason = {ErrorCode.TX_CONFLICT: "conflict", ErrorCode.TX_NOT_FOUND: "not_found"}.get(exc.code, "refused")
            result.end_error = exc
        else:
            reason = "refused"
            result.end_error = TxmqError(f"end_transaction failed: {exc!r}", ErrorCode.INTERNAL)
        self.end_failures[reason] += 1
        log.warning("end_transaction(%s, %s) refused: %s", fields["tx_id"], fields["state"], exc)
        if not end.done():
            end.set_exception(result.end_error)
            end.exception()  # retrieved: an end nobody awaits is counted and logged, not reported again at exit

    async def _not_durable(self, message: Message, exc: TxmqError) -> TransactionSendResult:
        """A refused half: re-raise, except STORE_ERROR, which is a rollback without the local transaction."""
        if exc.code != ErrorCode.STORE_ERROR:
            raise exc
        f = exc.fields
        if all(k in f for k in ("tx_id", "commit_log_offset", "half_offset")):
            # The broker told us where the record went: make sure it is never committed by a check.
            half = HalfResult(f["tx_id"], f.get("msg_id", f["tx_id"]), message.topic, -1, f["half_offset"], f["commit_log_offset"])
            try:
                await self.end_transaction(half, LocalTransactionState.ROLLBACK_MESSAGE)
            except TxmqError as end_exc:
                log.warning("rollback of undurable half %s failed: %s", half.tx_id, end_exc)
        return TransactionSendResult(
            SendStatus.FLUSH_DISK_TIMEOUT, f.get("tx_id"), f.get("msg_id"), f.get("commit_log_offset", -1),
            f.get("half_offset", -1), LocalTransactionState.ROLLBACK_MESSAGE, message.topic, f.get("queue_id", -1),
        )

    # ---- check-backs ----------------------------------------------------

    def _on_push(self, op: str, fields: dict[str, Any]) -> None:
        if op != "check_transaction":
            log.debug("push %r ignored", op)
            return
        tx_id = fields.get("tx_id")
        if not isinstance(tx_id, str):
            log.error("malformed check_transaction push (no tx_id): %s", fields)
            return
        if tx_id in self._checks_queued:  # still waiting for a slot: it answers for the newest copy
            self._checks_queued[tx_id] = fields
            return
        if tx_id in self._checks_running:  # being answered: the broker asks again if it stays pending
            return
        self._checks_queued[tx_id] = fields
        task = asyncio.get_running_loop().create_task(self._answer_check(tx_id))
        self._check_tasks.add(task)
        task.add_done_callback(self._check_tasks.discard)

    async def _answer_check(self, tx_id: str) -> None:
        assert self._check_sem is not None
        try:
            async with self._check_sem:
                fields = self._checks_queued.pop(tx_id)
                self._checks_running.add(tx_id)
                await self._check_and_answer(tx_id, fields)
        finally:
            self._checks_queued.pop(tx_id, None)  # cancelled while waiting for a slot
            self._checks_running.discard(tx_id)

    async def _check_and_answer(self, tx_id: str, fields: dict[str, Any]) -> None:
        try:
            view = ReceivedMessage.from_map(fields["message"])
            half = HalfResult(tx_id, view.msg_id, view.topic, view.queue_id, fields["half_offset"], fields["commit_log_offset"])
        except (KeyError, TypeError, ValueError) as exc:
            log.error("malformed check_transaction push (%r): %s", exc, fields)
            return
        group = fields.get("group", self.group)
        if group != self.group:
            log.warning("check_transaction for group %r reached producer of %r; answering anyway", group, self.group)
        state = await self._run_check(view)
        try:
            await self.end_transaction(half, state, from_check=True)
        except TxmqError as exc:
            log.warning("answer to check of %s refused: %s", half.tx_id, exc)
            return
        self.checks_answered += 1

    async def _run_check(self, view: ReceivedMessage) -> LocalTransactionState:
        fn = self.listener.check_local_transaction
        try:
            if inspect.iscoroutinefunction(fn):
                result = await fn(view)
            else:
                result = await asyncio.get_running_loop().run_in_executor(self.executor, fn, view)
                if inspect.isawaitable(result):
                    result = await result
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("check_local_transaction failed for %s; state UNKNOW", view.tx_id)
            return LocalTransactionState.UNKNOW
        return LocalTransactionState.coerce(result)


__all__ = [
    "HalfResult",
    "LocalTransactionState",
    "SendStatus",
    "TransactionListener",
    "TransactionProducer",
    "TransactionSendResult",
    "TxIds",
]
