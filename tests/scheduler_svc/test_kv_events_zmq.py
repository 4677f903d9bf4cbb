"""vLLM-format KV events: the msgpack layout vLLM's msgspec structs give (what llm-d's and
vllm-router's decoders read), the flag's JSON, and a PUB/SUB + replay round trip on loopback."""

from __future__ import annotations

import asyncio

import pytest

from chunkserve_contracts.block_hash import external_hash, hash_block
from scheduler_svc.block_pool import BlockPool
from scheduler_svc.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEventLog
from scheduler_svc.kv_events_zmq import encode_batch, offset_endpoint, parse_kv_events_config, wire_types
from scheduler_svc.request import Request, SamplingParams

msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")


def test_wire_layouts_are_vllms_tagged_structs():
    h0 = hash_block(None, None, [1, 2])
    h1 = hash_block(h0, None, [3, 4])
    batch = EventBatch(7, 12.5, (BlockStored((h0, h1), None, (1, 2, 3, 4), 2), BlockRemoved((h0,)), AllBlocksCleared()))
    ints = [external_hash(h0), external_hash(h1)]
    raw = msgspec.msgpack.decode(encode_batch(batch, 3, wire_types("array"), msgspec.msgpack.Encoder()))
    assert (
        raw
        == [  # vLLM's array_like layout (llm-d's legacy decoder)
            12.5,
            [
                ["BlockStored", ints, None, [1, 2, 3, 4], 2, None, None, None],
                ["BlockRemoved", ints[:1], None],
                ["AllBlocksCleared"],
            ],
            3,
        ]
    )
    raw = msgspec.msgpack.decode(encode_batch(batch, 3, wire_types("map"), msgspec.msgpack.Encoder()))
    assert (
        raw
        == [  # tagged maps in a positional batch: what vllm-router's wire.rs reads
            12.5,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": ints,
                    "parent_block_hash": None,
                    "token_ids": [1, 2, 3, 4],
                    "block_size": 2,
                    "lora_id": None,
                    "medium": None,
                    "lora_name": None,
                },
                {"type": "BlockRemoved", "block_hashes": ints[:1], "medium": None},
                {"type": "AllBlocksCleared"},
            ],
            3,
        ]
    )
    assert external_hash(h1) == int.from_bytes(h1[-8:], "big") and 0 <= external_hash(h1) < 2**64
    # The parent of a chained store is the previous block's integer hash.
    chained = EventBatch(8, 1.0, (BlockStored((h1,), h0, (3, 4), 2),))
    raw = msgspec.msgpack.decode(encode_batch(chained, 0, wire_types("array"), msgspec.msgpack.Encoder()))
    assert raw[1][0][2] == external_hash(h0)


def test_flag_json_is_vllms():
    assert parse_kv_events_config(None) is None
    assert parse_kv_events_config('{"enable_kv_cache_events": false}') is None
    config = parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "zmq", "topic": "kv"}')
    assert config.endpoint == "tcp://*:5557" and config.topic == "kv" and config.buffer_steps == 10_000
    for bad, says in [
        ("{", "not valid JSON"),
        ('{"enable_kv_cache_events": true, "endpont": "x"}', "unknown field 'endpont'"),
        ('{"enable_kv_cache_events": true, "hwm": "10"}', "hwm must be int"),
        ('{"enable_kv_cache_events": true, "publisher": "nats"}', "publisher 'nats'"),
        ('{"enable_kv_cache_events": true, "buffer_steps": 0}', "buffer_steps must be >= 1"),
        ('{"enable_kv_cache_events": true, "event_format": "json"}', "event_format must be map or array"),
    ]:
        with pytest.raises(ValueError, match=says):
            parse_kv_events_config(bad)
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559" and offset_endpoint("ipc:///x", 1) == "ipc:///x_dp1"


def test_pub_sub_and_replay_on_loopback():
    from scheduler_svc.kv_events_zmq import ZmqPublisher

    async def main() -> tuple[list, list, list]:
        pool = BlockPool(8, 2, enable_caching=True)
        log = KVEventLog(buffer_steps=1)
        log.attach(pool)
        config = parse_kv_events_config(
            '{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:*", '
            '"replay_endpoint": "tcp://127.0.0.1:*", "topic": "kv@pod@m"}'
        )
        pub = ZmqPublisher(config, log)
        pub.start(asyncio.get_running_loop())
        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        sub.connect(pub.endpoint)
        got: list = []
        try:
            # PUB/SUB joins asynchronously: publish until the subscriber sees a batch.
            for i in range(200):
                r = Request(f"r{i}", i, [i * 10, i * 10 + 1, 5], SamplingParams(max_tokens=1))
                pool.allocate(r, 3)
                pool.cache_full_blocks(r, None, 3)
                pool.free(r)
                await asyncio.sleep(0.01)
                if i >= 2 and sub.poll(0):  # at least 3 batches: the history (1) cannot reach seq 0
                    break
            while sub.poll(200):
                got.append(sub.recv_multipart())
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(pub.replay_endpoint)
            replays = []
            for start in (log.next_seq - 1, 0):  # in the history (1 batch), then long gone: a snapshot
                dealer.send_multipart((b"", start.to_bytes(8, "big")))
                frames = []
                while True:
                    while not dealer.poll(0):
                        await asyncio.sleep(0.01)
                    _, seq, payload = dealer.recv_multipart()
                    if seq == (-1).to_bytes(8, "big", signed=True):
                        break
                    frames.append((int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))
                replays.append(frames)
            dealer.close(linger=0)
            return got, replays, sorted(external_hash(b.block_hash) for b in pool.cached_blocks())
        finally:
            sub.close(linger=0)
            pub.stop()

    got, (recent, snapshot), cached = asyncio.run(main())
    assert got and all(topic == b"kv@pod@m" for topic, _, _ in got)
    seqs = [int.from_bytes(seq, "big") for _, seq, _ in got]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # consecutive
    first = msgspec.msgpack.decode(got[0][2])
    assert first[1][0]["type"] == "BlockStored" and first[2] == 0
    assert len(recent) == 1
    ((seq, batch),) = snapshot
    assert batch[1][0] == {"type": "AllBlocksCleared"}
    assert sorted(h for e in batch[1][1:] for h in e["block_hashes"]) == cached
