"""chunkserve.v1.GenerationMux: many Generate calls of one client (a router) on one stream.

Why: through a router every request was its own Generate call to the replica and every token
its own gRPC message, and on a small machine gRPC's per-call setup and per-message costs (tens
of microseconds of CPU each, on both sides) were most of what the router added (benchmarks/
RESULTS.md, "Router overhead"). Here one stream carries every call, and the messages of all the
calls that have output are sent as one MuxResponses per wake-up: about one gRPC message per
engine step for all requests, not one per request and token.

How: each call is admitted by GenerationServicer.submit, the one admission path (the same
validation, size limit, tokenize worker and engine as Generate; its bytes parsed by the same
guarded deserializer, so bad bytes end that call with INVALID_ARGUMENT, never the stream). No
task waits on a call's queue: its RequestStream's `on_put` marks the call ready and wakes the
stream's writer, which folds each ready call's deltas (output.fold, as stream_deltas does) and
serializes them exactly as Generate would (servicer.delta_to_proto, after the admission
message). Cancel aborts the call's request; the stream ending for any reason (the client gone,
cancelled, failed) aborts every open call's request: nothing runs, and no KV block is held,
for nobody. The call semantics are documented in protos/chunkserve/v1/replica.proto.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from chunkserve_contracts.v1 import replica_pb2 as rpb
from scheduler_svc.engine import Engine
from scheduler_svc.errors import ServingError
from scheduler_svc.output import RequestStream, fold
from scheduler_svc.servicer import GenerationServicer, Refused, delta_to_proto, guarded_deserializer
from scheduler_svc.validation import needs_tokenizer

log = logging.getLogger(__name__)
SERVICE = rpb.DESCRIPTOR.services_by_name["GenerationMux"].full_name
# A batch is cut in two past this size, far below the transport's message limit: a client that
# fell behind gets its backlog in several messages, never one it may refuse.
MAX_BATCH_BYTES = 4 << 20
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@dataclass(eq=False)
class _Call:
    """One open call: admitting (its task, text prompts) or admitted (its engine and stream)."""

    id: int
    client_request_id: str
    admitting: asyncio.Task[None] | None = None
    engine: Engine | None = None
    stream: RequestStream | None = None


class MuxSession:
    """The calls of one Multiplex stream and the batches of their messages."""

    def __init__(self, servicer: GenerationServicer, parse: Callable[[bytes], Any], peer: str = "") -> None:
        self.servicer = servicer
        self._parse = parse
        self._peer = peer
        self.calls: dict[int, _Call] = {}
        self._ready: dict[_Call, None] = {}  # calls whose stream got deltas since the last batch, in order
        self._full: list[rpb.MuxResponses] = []
        self._batch = rpb.MuxResponses()
        self._size = 0
        self._wake = asyncio.Event()
        self.input_done = False  # the client half-closed (or its side failed)
        self.fatal: tuple[grpc.StatusCode, str] | None = None  # ends the stream: a MuxRequest that is not one

    # ---- calls in --------------------------------------------------------------------------

    async def read(self, requests: AsyncIterator[Any]) -> None:
        """Takes the client's MuxRequests (Refused: bytes that are not one) until it half-closes."""
        try:
            async for request in requests:
                if isinstance(request, Refused):
                    self.fatal = (INVALID, request.reason)
                    return
                await self.receive(request)
        finally:
            self.input_done = True
            self._wake.set()

    async def receive(self, request: rpb.MuxRequest) -> None:
        """One MuxRequest: a start (admitted inline for token ids, in a task when the prompt is
        tokenized, so a long prompt never holds up the calls behind it) or a cancel."""
        kind = request.WhichOneof("kind")
        if (open_call := self.calls.get(request.call)) is not None:
            if kind == "cancel":
                self._end(open_call, grpc.StatusCode.CANCELLED, "cancelled by the client")
            else:
                self._end(open_call, INVALID, f"call {request.call} is already open; it is ended, its request aborted")
            return
        if kind != "generate":
            if kind is None:
                self._add(request.call, code=INVALID, details="a MuxRequest needs `generate` or `cancel`")
            return  # a cancel for a call that is not open: it ended already
        parsed = self._parse(request.generate)
        if isinstance(parsed, Refused):
            log.warning("refused a Multiplex call from %s: %s", self._peer, parsed.reason)
            self._add(request.call, code=INVALID, details=parsed.reason)
            return
        call = self.calls[request.call] = _Call(request.call, parsed.client_request_id)
        if needs_tokenizer(parsed):
            call.admitting = asyncio.get_running_loop().create_task(self._admit(call, parsed))
        else:
            await self._admit(call, parsed)

    async def _admit(self, call: _Call, request: pb.GenerateRequest) -> None:
        error: tuple[grpc.StatusCode, str] | None = None
        try:
            engine, stream = await self.servicer.submit(request)
        except ServingError as exc:
            error = (exc.code, str(exc))
        except Exception:  # a bug: this call fails, the stream and its other calls go on
            log.exception("admitting a Multiplex call failed")
            error = (grpc.StatusCode.INTERNAL, "internal error admitting the request (see the server log)")
        call.admitting = None  # done: nothing to cancel (a cancel while it awaited ended it there)
        if error is not None:
            self._end(call, *error)
            return
        call.engine, call.stream = engine, stream
        if self.calls.get(call.id) is not call:  # ended meanwhile (cannot happen: no await since submit)
            engine.abort(stream.request_id)
            return
        admission = pb.GenerateResponse(
            request_id=stream.request_id,
            client_request_id=call.client_request_id,
            prompt_tokens=stream.num_prompt_tokens,
        )
        self._add(call.id, message=admission.SerializeToString())
        stream.on_put = lambda: self._mark(call)
        if not stream.queue.empty():
            self._mark(call)

    def _mark(self, call: _Call) -> None:
        self._ready[call] = None
        self._wake.set()

    def _end(self, call: _Call, code: grpc.StatusCode | None = None, details: str = "") -> None:
        """Ends an open call that has not finished: its admission cancelled or its request
        aborted; the client told `code` (None: nobody to tell, the stream is over)."""
        if self.calls.get(call.id) is not call:
            return  # ended already
        del self.calls[call.id]
        self._ready.pop(call, None)
        if call.admitting is not None:
            call.admitting.cancel()  # before add_request, or done: the task never queues after this
        if call.stream is not None:
            call.stream.on_put = None
            if not call.stream.finished:
                call.engine.abort(call.stream.request_id)  # type: ignore[union-attr]
        if code is not None:
            self._add(call.id, code=code, details=details)

    def close(self) -> None:
        """The stream is over: every open call's request is aborted."""
        for call in list(self.calls.values()):
            self._end(call)

    # ---- batches out -----------------------------------------------------------------------

    def _add(
        self,
        call_id: int,
        message: bytes = b"",
        last: bool = False,
        code: grpc.StatusCode | None = None,
        details: str = "",
    ) -> None:
        if self._size > MAX_BATCH_BYTES:
            self._full.append(self._batch)
            self._batch, self._size = rpb.MuxResponses(), 0
        if code is None:
            self._batch.responses.add(call=call_id, message=message, last=last)
        else:
            self._batch.responses.add(call=call_id, code=code.value[0], details=details)
        self._size += len(message) + len(details) + 16
        self._wake.set()

    def _collect(self) -> None:
        """Every ready call's deltas, folded into one message each (or its error)."""
        ready, self._ready = self._ready, {}
        for call in ready:
            stream = call.stream
            if stream is None or stream.queue.empty():
                continue
            delta = stream.queue.get_nowait()
            while not stream.queue.empty() and not (delta.finished or delta.error is not None):
                delta = fold(delta, stream.queue.get_nowait())
            if delta.finished or delta.error is not None:
                del self.calls[call.id]
                stream.on_put = None
            if delta.error is not None:
                self._add(call.id, code=delta.error.code, details=str(delta.error))
            else:
                self._add(call.id, delta_to_proto(stream.request_id, delta).SerializeToString(), delta.finished)

    async def batches(self) -> AsyncIterator[rpb.MuxResponses]:
        """One MuxResponses per wake-up (more only past MAX_BATCH_BYTES), until the client
        half-closed and no call is open, or a fatal error."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            self._collect()
            if self._batch.responses:
                self._full.append(self._batch)
                self._batch, self._size = rpb.MuxResponses(), 0
            full, self._full = self._full, []
            for batch in full:
                yield batch
            if self.fatal is not None or (self.input_done and not self.calls):
                return


class MuxServicer:
    """chunkserve.v1.GenerationMux on the public port, over the Generation servicer's admission."""

    def __init__(self, servicer: GenerationServicer) -> None:
        self.servicer = servicer
        self._parse = guarded_deserializer(pb.GenerateRequest, servicer.max_request_bytes)

    async def Multiplex(
        self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[rpb.MuxResponses]:
        # Headers at once: the client waits for them before its first request, so a server
        # that refuses the stream (UNIMPLEMENTED, UNAUTHENTICATED) says so cleanly instead of
        # failing a write in flight (gRPC then reports INTERNAL, not the refusal).
        await context.send_initial_metadata(())
        session = MuxSession(self.servicer, self._parse, context.peer())
        reader = asyncio.get_running_loop().create_task(session.read(requests), name="multiplex-reader")
        try:
            async for batch in session.batches():
                yield batch
            if session.fatal is not None:
                log.warning("ended a Multiplex stream from %s: %s", context.peer(), session.fatal[1])
                await context.abort(*session.fatal)
        finally:
            reader.cancel()
            session.close()


def add_mux_servicer(servicer: MuxServicer, server: grpc.aio.Server) -> None:
    """Registers chunkserve.v1.GenerationMux with a MuxRequest deserializer that never raises
    (bytes that are not a MuxRequest end the stream with INVALID_ARGUMENT, one WARNING line)."""
    handlers = {
        "Multiplex": grpc.stream_stream_rpc_method_handler(
            servicer.Multiplex,
            request_deserializer=guarded_deserializer(rpb.MuxRequest, lambda: None),
            response_serializer=rpb.MuxResponses.SerializeToString,
        )
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
