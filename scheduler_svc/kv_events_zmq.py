"""KV cache events in vLLM's format: ZMQ PUB of msgpack `EventBatch`es (`--kv-events-config`).

What llm-d's KV cache indexer, Dynamo, SGLang's and vLLM's routers (vllm-router's `kv_aware`)
subscribe to, so they route to chunkserve without code of theirs. The wire format is vLLM's
`vllm/distributed/kv_events.py` (msgspec structs): each message is a 3-frame multipart
[topic, seq (8 bytes big-endian), payload], the payload an `EventBatch` [ts, [event, ...],
data_parallel_rank] (array_like), and each event a tagged struct in one of two layouts, chosen
by the config's chunkserve-only key `event_format`:

    "map" (default)  {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": ...,
                     "token_ids": [...], "block_size": 16, "lora_id": nil, "medium": nil,
                     "lora_name": nil}; {"type": "BlockRemoved", "block_hashes", "medium"};
                     {"type": "AllBlocksCleared"}: vLLM's current layout, what vllm-router
                     (0.1.17 on PyPI: "KV event must be a tagged map") and llm-d read
    "array"          ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                     lora_id, medium, lora_name], ["BlockRemoved", block_hashes, medium],
                     ["AllBlocksCleared"]: vLLM's earlier array_like layout (llm-d reads it too)

Block hashes are integers: the last 8 bytes of chunkserve's SHA-256 block hash, big-endian
(vLLM's default VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES; llm-d reads bytes the same way). They are
opaque keys for parent chaining and removal; consumers match prompts by token_ids and
block_size (vllm-router and llm-d hash the token ids themselves), which must agree.

Replay (vLLM's protocol): a DEALER/REQ client sends the first sequence number it wants as 8
bytes big-endian to `replay_endpoint` (ROUTER) and gets [seq, payload] frames then [-1, b""].
When the history (`buffer_steps` batches) no longer reaches back that far, it gets instead the
current cached set as one batch (AllBlocksCleared, then one BlockStored per block) numbered as
the last batch sent: the same snapshot the gRPC stream starts with.

pyzmq and msgspec are imported only when the flag is used (the `kv-events` extra).
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
from dataclasses import dataclass, fields
from typing import Any

from chunkserve_contracts.block_hash import external_hash
from scheduler_svc.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEventLog

log = logging.getLogger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig fields and defaults (the flag takes the same JSON)."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    event_format: str = "map"  # chunkserve's own key: "map" or "array" (the module docstring)


def parse_kv_events_config(text: str | None) -> KVEventsConfig | None:
    """The flag's JSON as a config, None when absent or disabled; ValueError names what is wrong
    (and says which packages to install when the publisher cannot load)."""
    if not text:
        return None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--kv-events-config is not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError("--kv-events-config must be a JSON object, e.g. '{\"enable_kv_cache_events\": true}'")
    known = {f.name: f for f in fields(KVEventsConfig)}
    for key, value in raw.items():
        if key not in known:
            raise ValueError(f"--kv-events-config: unknown field {key!r} (known: {', '.join(known)})")
        want = {"bool": bool, "int": int, "str": str, "str | None": str}[str(known[key].type)]
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            if not (value is None and known[key].type == "str | None"):
                raise ValueError(f"--kv-events-config: {key} must be {known[key].type}, got {value!r}")
    config = KVEventsConfig(**raw)
    if not config.enable_kv_cache_events or config.publisher == "null":
        return None
    if config.event_format not in ("map", "array"):
        raise ValueError(f"--kv-events-config: event_format must be map or array, got {config.event_format!r}")
    if config.publisher != "zmq":
        raise ValueError(f"--kv-events-config: publisher {config.publisher!r} is not supported (zmq or null)")
    for name in ("buffer_steps", "hwm", "max_queue_size"):
        if getattr(config, name) < 1:
            raise ValueError(f"--kv-events-config: {name} must be >= 1, got {getattr(config, name)}")
    try:
        import msgspec  # noqa: F401
        import zmq  # noqa: F401
    except ImportError as exc:
        raise ValueError(
            f"--kv-events-config needs pyzmq and msgspec ({exc.name} is missing): "
            "pip install 'chunkserve[kv-events]' (or pip install pyzmq msgspec)"
        ) from None
    return config


def wire_types(event_format: str = "map") -> dict[str, type]:
    """vLLM's msgspec structs in the given layout (field order is the wire format)."""
    import msgspec

    array_like = event_format == "array"

    class KVCacheEvent(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True):
        """Base of the tagged events (the tag is the class name, under "type" in a map)."""

    class VBlockStored(KVCacheEvent, tag="BlockStored"):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None

    class VBlockRemoved(KVCacheEvent, tag="BlockRemoved"):
        block_hashes: list[int]
        medium: str | None

    class VAllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
        pass

    class VEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]
        data_parallel_rank: int | None = None

    return {
        "BlockStored": VBlockStored,
        "BlockRemoved": VBlockRemoved,
        "AllBlocksCleared": VAllBlocksCleared,
        "EventBatch": VEventBatch,
    }


def encode_batch(batch: EventBatch, rank: int, types: dict[str, type], encoder: Any) -> bytes:
    """One EventBatch as vLLM's msgpack bytes."""
    events: list[Any] = []
    for e in batch.events:
        if isinstance(e, BlockStored):
            parent = external_hash(e.parent_block_hash) if e.parent_block_hash is not None else None
            hashes = [external_hash(h) for h in e.block_hashes]
            events.append(types["BlockStored"](hashes, parent, list(e.token_ids), e.block_size, None, None, None))
        elif isinstance(e, BlockRemoved):
            events.append(types["BlockRemoved"]([external_hash(h) for h in e.block_hashes], None))
        elif isinstance(e, AllBlocksCleared):
            events.append(types["AllBlocksCleared"]())
    return encoder.encode(types["EventBatch"](batch.ts, events, rank))


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """vLLM's rule for data-parallel ranks: a tcp port + rank, other transports `_dp<rank>`."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


class ZmqPublisher:
    """Publishes the log's batches on a PUB socket from a thread; answers replay requests."""

    def __init__(self, config: KVEventsConfig, event_log: KVEventLog, rank: int = 0) -> None:
        import msgspec
        import zmq

        self.config = config
        self.rank = rank
        self._log = event_log
        self._types = wire_types(config.event_format)
        self._encoder = msgspec.msgpack.Encoder()
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        endpoint = offset_endpoint(config.endpoint, rank)
        # vLLM's heuristic: bind a wildcard or local endpoint, connect to a remote one.
        if any(s in endpoint for s in ("*", "::")) or endpoint.startswith(("ipc://", "inproc://")):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
        self._replay = None
        self.replay_endpoint = None
        if config.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(offset_endpoint(config.replay_endpoint, rank))
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._topic = config.topic.encode()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="kv-events-zmq", daemon=True)
        self._running = False

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Subscribes to the log (live batches only: a PUB subscriber has no state to replay
        onto; it asks the replay endpoint) and starts the thread."""
        self._loop = loop
        self._running = True
        self._log.subscribe(self._on_batch, from_seq=self._log.next_seq)
        self._thread.start()
        log.info("KV cache events (vLLM format) published on %s", self.endpoint)

    def _on_batch(self, batch: EventBatch) -> None:
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            log.warning("KV events queue full (%d): batch %d dropped", self.config.max_queue_size, batch.seq)

    def _run(self) -> None:
        while self._running or not self._queue.empty():
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:
                    log.exception("KV events replay failed")
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                break
            payload = encode_batch(batch, self.rank, self._types, self._encoder)
            self._pub.send_multipart((self._topic, batch.seq.to_bytes(8, "big"), payload))

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()  # type: ignore[union-attr]
        if len(frames) != 3:
            log.warning("invalid KV events replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        assert self._loop is not None
        since = asyncio.run_coroutine_threadsafe(self._since(int.from_bytes(start, "big")), self._loop)
        for batch in since.result(timeout=10):
            if batch.seq >= 0:  # a replay of a log that never sent anything is empty
                payload = encode_batch(batch, self.rank, self._types, self._encoder)
                self._replay.send_multipart((client, b"", batch.seq.to_bytes(8, "big"), payload))  # type: ignore[union-attr]
        self._replay.send_multipart((client, b"", END_SEQ, b""))  # type: ignore[union-attr]

    async def _since(self, seq: int) -> list[EventBatch]:
        return self._log.since(seq)

    def stop(self) -> None:
        self._log.unsubscribe(self._on_batch)
        if self._running:
            self._running = False
            self._queue.put(None)
            self._thread.join(timeout=2.0)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
