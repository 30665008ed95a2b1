"""The common request answered in the connections' callbacks: no Task, no coroutine, no future.

Most requests are the same case: a client's whole request in one read, a service that needs no hold, no pod
ejected, a kept connection to the pod picked, and the engine's whole small answer in one read. For that case
(proxy.Router._forward_now decides, before it has done anything it cannot undo) the request is written to the
engine from the client's protocol callback (front.py), and the answer to the client from the engine's (upstream.py),
through one Exchange. What the coroutine path (proxy.Router._forward) would do in that case is done the same way,
by the same functions: the budget, the pick, the in-flight count, the relay's metrics (relay.Relay.whole_now).

Any other turn hands the request to the coroutine path where it stands (`hand_over`: proxy.Router._forward with the
exchange as its first attempt): no connection kept to the pod picked (the coroutine path connects), a connection
that fails (resent on a new one, or another pod: retry.py), a head
that is not a whole small answer (a stream, a large or partial body, a 503 that may be an asleep engine's), a
deadline. The client gone first (front.FrontProtocol.connection_lost: `abandon`) closes the engine's connection
and counts a 499, as the coroutine path's cancellation does.
"""
from __future__ import annotations

from typing import Any

from kaon_operator.router.endpoints import Endpoint, ServiceKey
from kaon_operator.router.upstream import Response


class Exchange:
    """One request on the fast path, from the write to the engine to the answer (or the hand-over)."""

    __slots__ = ("router", "request", "key", "target", "model", "payload", "body", "reserved", "source", "arrival",
                 "dispatched", "received", "conn", "data", "deadline", "sent", "upstream", "error", "answered",
                 "handed", "taken", "finished")

    def __init__(self, router: Any, request: Any, key: ServiceKey, target: Endpoint, model: str, payload: dict,
                 body: bytes, reserved: int, source: str, arrival: float, received: float):
        self.router, self.request, self.key, self.target = router, request, key, target
        self.model, self.payload, self.body = model, payload, body
        """What the coroutine path needs for another attempt (proxy.Router._choose) after a hand-over."""
        self.reserved, self.source = reserved, source
        """The bytes taken from the body budget (released once, by whoever ends the request)."""
        self.arrival, self.received = arrival, received
        self.dispatched = 0.0
        self.conn: Any = None  # upstream._Connection, set by Pool.send_now
        self.data = b""
        self.deadline = 0.0
        self.sent = False
        """Sent on a kept connection, counted in flight; False: handed over at once (no connection kept to the pod)."""
        self.upstream: Response | None = None
        self.error: BaseException | None = None
        self.answered = False
        """Whether any byte of an answer came before the connection failed (retry.py, rule 1)."""
        self.handed = False
        """Handed to the coroutine path (hand_over)."""
        self.taken = False
        """The coroutine path has begun on it: from then on its own handlers end the request."""
        self.finished = False
        """Answered here, or abandoned."""

    # what the engine's connection calls (upstream._Connection: the part of a future it uses) -------------

    def done(self) -> bool:
        return self.finished or self.handed or self.upstream is not None or self.error is not None

    def set_result(self, response: Response) -> None:
        self.upstream = response  # acted on once the whole read is parsed (headed): the body may be in it

    def set_exception(self, error: BaseException) -> None:
        """The connection failed before the head (closed, reset, not HTTP) or its deadline passed: the coroutine path
        goes on from here (a new connection to the same pod, or another pod), as when Pool.request raised."""
        if self.finished or self.handed:
            return
        self.error = error
        conn = self.conn
        self.answered = conn.received
        conn.head_due = None
        conn.now = None
        conn.close()
        self.hand_over()

    def headed(self) -> None:
        """The read that brought the head is parsed: a whole small answer goes to the client now; any other goes on
        through the coroutine path (relay.py), as it would have after Pool.request returned."""
        upstream = self.upstream
        if self.finished or self.handed or upstream is None or self.error is not None:
            return
        self.conn.head_due = None
        router = self.router
        whole = None
        if upstream.status != 503:  # (a 503 may be an asleep engine's: proxy._asleep, on the coroutine path)
            whole = router.relay.whole_now(self.request, upstream, self.key, self.target,
                                           self.dispatched - self.arrival)
        if whole is None:
            self.hand_over()
            return
        self.finished = True
        router._release(self.target)
        router.budget.release(self.reserved, self.source)
        router.answered_now += 1
        self.request.conn.answer_now(self.request, whole)

    # the client's side ---------------------------------------------------------------------------------

    def hand_over(self) -> None:
        """On through the coroutine path (proxy.Router._forward, resumed with this exchange as its first attempt)."""
        self.handed = True
        self.request.conn.hand_over(self.request, self.router._forward(self.request, self))

    def abandon(self) -> None:
        """The client went away (front.FrontProtocol.connection_lost) before the coroutine path took the request: the
        engine's request is closed (it aborts), the pod's count and the budget given back; a 499 when no answer had
        begun, as the coroutine path counts a cancellation."""
        if self.taken or self.finished:
            return  # taken: its task is cancelled, and the coroutine path's own handlers end it
        self.finished = True
        router = self.router
        if self.upstream is not None:
            self.upstream.release()  # closes the connection unless the answer was whole
        elif self.error is None and self.conn is not None:
            self.conn.head_due = None
            self.conn.close()
        if self.sent:
            router._release(self.target)
        router.budget.release(self.reserved, self.source)
        if self.upstream is None:
            router.metrics.count(self.key, 499)

