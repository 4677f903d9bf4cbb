"""KV cache events: what the prefix cache stored, evicted and forgot, for routers and gateways.

A router that knows which replica holds a prompt's prefix sends the request there and the
prefill of that prefix is skipped (chunkserve's own router, chunkserve/router/; llm-d, Dynamo,
SGLang's and vLLM's routers read the same events in vLLM's format, kv_events_zmq.py).

The block pool (block_pool.py) calls `KVEventLog` synchronously as it registers, evicts and
resets; the events of one event-loop turn (a step's planning or its result applied) go out
together as one batch with the next sequence number, like vLLM's one batch per step. Every
subscriber — a gRPC stream (scheduler_svc/replica.py) or the ZMQ publisher — gets every batch
in order. The last `buffer_steps` batches are kept, so a subscriber that missed some (by
sequence number) gets them again; one that joins late or fell further behind gets the current
cached set instead: an AllBlocksCleared then one BlockStored per cached block, parents first,
as of a sequence number, then the live batches after it. Applying those to an empty index
gives exactly the pool's cached set (tests/scheduler_svc/test_kv_events.py checks this
for random admit/finish/evict/reset sequences).

Off (no KVEventLog attached) costs the pool one `is not None` check per registration run,
eviction batch and reset: nothing per token or per step.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler_svc.block_pool import BlockPool


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks registered in the prefix cache: a chain, each block's parent the one before it."""

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None  # of the first block; None for a prompt's first block
    token_ids: tuple[int, ...]  # block_size per block, in order
    block_size: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks evicted: their hashes no longer hit."""

    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every cached block forgotten (an operator's reset, a new pool after the executor restarted)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """The events of one event-loop turn, in order. `replay` marks a snapshot batch (the cached
    set as of `seq`, starting with AllBlocksCleared) sent to a subscriber that joined late."""

    seq: int
    ts: float
    events: tuple[KVEvent, ...]
    replay: bool = False


Subscriber = Callable[[EventBatch], None]


@dataclass
class KVEventLog:
    """The event log of one scheduler: the pool's sink, a bounded history, the subscribers."""

    buffer_steps: int = 10_000
    pool: BlockPool | None = None
    _pending: list[KVEvent] = field(default_factory=list)
    _flush_scheduled: bool = False
    _history: deque[EventBatch] = field(init=False)
    _subscribers: list[Subscriber] = field(default_factory=list)
    next_seq: int = 0

    def __post_init__(self) -> None:
        if self.buffer_steps < 1:
            raise ValueError(f"buffer_steps must be >= 1, got {self.buffer_steps}")
        self._history = deque(maxlen=self.buffer_steps)

    # ---- the pool's sink (block_pool.KVEventSink) ----------------------------------------

    def stored(self, hashes: list[bytes], parent: bytes | None, token_ids: list[int], block_size: int) -> None:
        self._add(BlockStored(tuple(hashes), parent, tuple(token_ids), block_size))

    def removed(self, hashes: list[bytes]) -> None:
        self._add(BlockRemoved(tuple(hashes)))

    def cleared(self) -> None:
        self._add(AllBlocksCleared())

    def attach(self, pool: BlockPool) -> None:
        """Follows `pool` from now on (a server's first pool, or the new one after its executor
        came back): subscribers hear AllBlocksCleared first, since the new pool starts empty."""
        if self.pool is not None:
            self.pool.events = None
            self.cleared()
        self.pool = pool
        pool.events = self

    # ---- batching ------------------------------------------------------------------------

    def _add(self, event: KVEvent) -> None:
        self._pending.append(event)
        if self._flush_scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (tests, replay tools): every call is its own batch
            self.flush()
            return
        self._flush_scheduled = True
        loop.call_soon(self.flush)

    def flush(self) -> EventBatch | None:
        """Sends the pending events as one batch; None when there were none."""
        self._flush_scheduled = False
        if not self._pending:
            return None
        batch = EventBatch(self.next_seq, time.time(), tuple(self._pending))
        self.next_seq += 1
        self._pending = []
        self._history.append(batch)
        for subscriber in list(self._subscribers):
            subscriber(batch)
        return batch

    # ---- subscribing ---------------------------------------------------------------------

    def snapshot(self) -> EventBatch:
        """The cached set now, as the batch a late subscriber starts from: AllBlocksCleared, then
        each cached block as a BlockStored, parents first. Its seq is the last batch sent, so
        live batches go on from seq + 1."""
        self.flush()
        events: list[KVEvent] = [AllBlocksCleared()]
        if self.pool is not None:
            bs = self.pool.block_size
            for block in self.pool.cached_blocks():
                events.append(BlockStored((block.block_hash,), block.parent_hash, block.token_ids, bs))  # type: ignore[arg-type]
        return EventBatch(self.next_seq - 1, time.time(), tuple(events), replay=True)

    def since(self, seq: int) -> list[EventBatch]:
        """The batches from `seq` on, when the history still holds them all; otherwise (or for a
        seq never sent) the snapshot batch alone, which replaces everything before it."""
        self.flush()
        if 0 <= seq <= self.next_seq:
            kept = [b for b in self._history if b.seq >= seq]
            first = kept[0].seq if kept else self.next_seq
            if first == seq:
                return kept
        return [self.snapshot()]

    def subscribe(self, subscriber: Subscriber, from_seq: int | None = None) -> None:
        """Sends `subscriber` the batches from `from_seq` (None: the snapshot), then every new
        one. Synchronous: nothing can change the pool in between."""
        for batch in self.since(from_seq) if from_seq is not None else [self.snapshot()]:
            subscriber(batch)
        self._subscribers.append(subscriber)

    def unsubscribe(self, subscriber: Subscriber) -> None:
        if subscriber in self._subscribers:
            self._subscribers.remove(subscriber)


def apply(index: set[bytes], batch: EventBatch) -> None:
    """What a subscriber does with a batch when it only needs the set of cached hashes (the
    router's index, the tests): stored adds, removed drops, cleared empties."""
    for event in batch.events:
        if isinstance(event, BlockStored):
            index.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            index.difference_update(event.block_hashes)
        else:
            index.clear()
