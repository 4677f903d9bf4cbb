"""The router's leg to a replica: one request's GenerateResponse messages (bytes, as the replica
serialized them), over one of two transports (`--replica-transport`).

- `mux` (default): every request the router sends a replica travels on one
  chunkserve.v1.GenerationMux/Multiplex stream to it (protos/chunkserve/v1/replica.proto), and
  the replica sends the messages of all its calls batched, about one gRPC message per engine
  step. Measured on a small machine, gRPC's per-call setup and per-message costs were most of
  what the router added (benchmarks/RESULTS.md, "Router overhead"); this leg pays them once per
  stream and per batch instead of per request and per token.
- `call`: one Generate call per request, the client's `authorization` forwarded on it. Also
  the fallback, per replica, when the replica answers Multiplex with UNIMPLEMENTED (an older
  chunkserve during a rolling upgrade) or UNAUTHENTICATED (the router has no --api-key, or
  another one, while the replicas want one: each client's own key then reaches the replica on
  its call), logged once.

A leg is an async iterator of message bytes that ends after the last one, or raises LegError
(the replica's status code and details, or UNAVAILABLE "the replica went down" when the health
check marks the replica down, or when the stream breaks); `close()` cancels what is still
running there (the client left, or the request moved). The front (grpc_front.py) does the
rest the same way for both: retries before the first token, the request id splice, Abort.

On the stream, a client that reads slowly holds up no other call: its messages wait in its
MuxCall (at most its request's tokens), where on its own Generate call gRPC's flow control would
have held them at the replica.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import grpc

from chunkserve_contracts.v1 import replica_pb2 as rpb

log = logging.getLogger(__name__)
TRANSPORTS = ("mux", "call")
MULTIPLEX = f"/{rpb.DESCRIPTOR.services_by_name['GenerationMux'].full_name}/Multiplex"
REPLICA_DOWN = "the replica went down"
# Multiplex refused before it answered anything: this replica gets per-call Generate instead.
FALLBACK_CODES = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAUTHENTICATED)
_CODES = {code.value[0]: code for code in grpc.StatusCode}
_END, _FALLBACK = object(), object()


class LegError(Exception):
    """A leg ended in error: the status code and details the client may be given."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class Leg(Protocol):
    """What the front reads a request's messages from."""

    def __aiter__(self) -> AsyncIterator[bytes]: ...

    async def __anext__(self) -> bytes: ...

    def close(self) -> None: ...


class CallLeg:
    """One Generate call (bytes in, bytes out) for one request."""

    def __init__(self, generate: grpc.aio.UnaryStreamMultiCallable, calls: set, data: bytes, metadata, timeout) -> None:
        self._call = generate(data, metadata=metadata, timeout=timeout)
        self._calls = calls  # the replica's in-flight calls, cancelled by its mark_down
        self._lost = False
        calls.add(self)

    def cancel(self) -> None:
        """The replica went down (Replica.mark_down): the reader gets LegError UNAVAILABLE."""
        self._lost = True
        self._call.cancel()

    def __aiter__(self) -> CallLeg:
        return self

    async def __anext__(self) -> bytes:
        try:
            chunk = await self._call.read()
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not self._lost or (task is not None and task.cancelling()):
                raise  # the client went away
            raise LegError(grpc.StatusCode.UNAVAILABLE, REPLICA_DOWN) from None
        except grpc.aio.AioRpcError as exc:
            raise LegError(exc.code(), exc.details() or "") from None
        if chunk is grpc.aio.EOF:
            raise StopAsyncIteration
        return chunk

    def close(self) -> None:
        self._calls.discard(self)
        self._call.cancel()  # ended already: nothing happens; else nothing runs for nobody


class MuxCall:
    """One request on a MuxStream: its messages, handed over by the stream's reader."""

    def __init__(self, stream: MuxStream, call_id: int, fallback: Callable[[], CallLeg]) -> None:
        self._stream = stream
        self.id = call_id
        self._fallback = fallback
        self._items: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._inner: CallLeg | None = None

    def push(self, item: object) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def __aiter__(self) -> MuxCall:
        return self

    async def __anext__(self) -> bytes:
        if self._inner is not None:
            return await self._inner.__anext__()
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        if isinstance(item, bytes):
            return item
        if item is _END:
            raise StopAsyncIteration
        if item is _FALLBACK:  # the replica has no Multiplex: this request goes as its own call
            self._inner = self._fallback()
            return await self._inner.__anext__()
        raise item  # type: ignore[misc]  # a LegError

    def close(self) -> None:
        if self._inner is not None:
            self._inner.close()
        else:
            self._stream.cancel(self.id)


class MuxStream:
    """One Multiplex stream to a replica, opened on the first request, carrying all of them:
    starts and cancels go out through one queue (never two writers), a reader task hands each
    response to its call. Once it ends (failed, refused, or `close`d) the replica makes a new
    one for the next request, unless it was refused (`unsupported`)."""

    def __init__(self, channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...], name: str) -> None:
        self._multiplex = channel.stream_stream(
            MULTIPLEX,
            request_serializer=rpb.MuxRequest.SerializeToString,
            response_deserializer=rpb.MuxResponses.FromString,
        )
        self._metadata = metadata
        self.name = name
        self._calls: dict[int, MuxCall] = {}
        self._ids = itertools.count(1)
        self._outbox: asyncio.Queue[rpb.MuxRequest | None] = asyncio.Queue()
        self._rpc: grpc.aio.StreamStreamCall | None = None
        self._reader: asyncio.Task[None] | None = None
        self.closed = False
        self.unsupported = False  # refused (FALLBACK_CODES): per-call Generate for this replica

    def open(self, data: bytes, fallback: Callable[[], CallLeg]) -> MuxCall:
        """Starts a request (`data`: a serialized GenerateRequest); `fallback` makes its
        per-call leg should the replica refuse Multiplex."""
        if self._reader is None:
            self._rpc = self._multiplex(self._requests(), metadata=self._metadata)
            self._reader = asyncio.get_running_loop().create_task(self._read(), name=f"multiplex {self.name}")
        call = MuxCall(self, next(self._ids), fallback)
        self._calls[call.id] = call
        self._outbox.put_nowait(rpb.MuxRequest(call=call.id, generate=data))
        return call

    def cancel(self, call_id: int) -> None:
        """The router is done with a call: when it is still open there, the replica aborts it."""
        if self._calls.pop(call_id, None) is not None and not self.closed:
            self._outbox.put_nowait(rpb.MuxRequest(call=call_id, cancel=True))

    async def _requests(self) -> AsyncIterator[rpb.MuxRequest]:
        # Nothing is written before the replica's headers: a replica that refuses the stream
        # answers without them, and a write in flight then would turn its UNIMPLEMENTED or
        # UNAUTHENTICATED into INTERNAL ("Internal error from Core"), hiding the refusal.
        await self._rpc.initial_metadata()  # type: ignore[union-attr]
        if self._rpc.done():  # type: ignore[union-attr]
            return
        while (request := await self._outbox.get()) is not None:
            yield request

    async def _read(self) -> None:
        why, answered = "the replica ended the stream", False
        try:
            async for batch in self._rpc:  # type: ignore[union-attr]
                answered = True
                for r in batch.responses:
                    self._dispatch(r)
        except grpc.aio.AioRpcError as exc:
            if not answered and exc.code() in FALLBACK_CODES:
                self.unsupported = True
                log.warning(
                    "replica %s refused Multiplex (%s: %s): its requests go as one Generate call each",
                    self.name,
                    exc.code().name,
                    exc.details(),
                )
            why = f"the stream to the replica failed ({exc.code().name}: {exc.details()})"
        finally:
            self._end_all(why)

    def _dispatch(self, r: rpb.MuxResponse) -> None:
        call = self._calls.get(r.call)
        if call is None:
            return  # cancelled by the router: what was on its way is dropped
        if r.code:
            del self._calls[r.call]
            call.push(LegError(_CODES.get(r.code, grpc.StatusCode.UNKNOWN), r.details))
            return
        call.push(r.message)
        if r.last:
            del self._calls[r.call]
            call.push(_END)

    def _end_all(self, why: str) -> None:
        """The stream is over: each open call moves to its own Generate call (refused) or ends
        UNAVAILABLE (retried elsewhere by the front when it streamed nothing yet)."""
        self.closed = True
        calls, self._calls = self._calls, {}
        for call in calls.values():
            call.push(_FALLBACK if self.unsupported else LegError(grpc.StatusCode.UNAVAILABLE, why))
        self._outbox.put_nowait(None)

    def close(self, why: str = REPLICA_DOWN) -> None:
        """Ends the stream now (the replica went down, or the router stops): its open calls end
        UNAVAILABLE `why`; the replica aborts their requests when it sees the stream cancelled."""
        if not self.closed:
            self._end_all(why)
        if self._rpc is not None:
            self._rpc.cancel()
        if self._reader is not None:
            self._reader.cancel()
