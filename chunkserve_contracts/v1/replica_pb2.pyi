from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WatchKVEventsRequest(_message.Message):
    __slots__ = ("from_seq",)
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    from_seq: int
    def __init__(self, from_seq: _Optional[int] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "token_ids", "block_size")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_block_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., parent_block_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("stored", "removed", "cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: BlockStored
    removed: BlockRemoved
    cleared: AllBlocksCleared
    def __init__(self, stored: _Optional[_Union[BlockStored, _Mapping]] = ..., removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("seq", "timestamp", "events", "replay")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    REPLAY_FIELD_NUMBER: _ClassVar[int]
    seq: int
    timestamp: float
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    replay: bool
    def __init__(self, seq: _Optional[int] = ..., timestamp: _Optional[float] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ..., replay: _Optional[bool] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaLoad(_message.Message):
    __slots__ = ("num_running", "num_waiting", "kv_cache_usage", "pending_prefill_tokens", "num_decoding", "decode_context_tokens", "token_budget", "block_size", "num_device_blocks", "step_cost", "step_cost_fitted", "num_free_device_blocks", "pending_prefill_attention")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    PENDING_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODING_FIELD_NUMBER: _ClassVar[int]
    DECODE_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_DEVICE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STEP_COST_FIELD_NUMBER: _ClassVar[int]
    STEP_COST_FITTED_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_DEVICE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PENDING_PREFILL_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    pending_prefill_tokens: int
    num_decoding: int
    decode_context_tokens: int
    token_budget: int
    block_size: int
    num_device_blocks: int
    step_cost: _containers.RepeatedScalarFieldContainer[float]
    step_cost_fitted: bool
    num_free_device_blocks: int
    pending_prefill_attention: int
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., pending_prefill_tokens: _Optional[int] = ..., num_decoding: _Optional[int] = ..., decode_context_tokens: _Optional[int] = ..., token_budget: _Optional[int] = ..., block_size: _Optional[int] = ..., num_device_blocks: _Optional[int] = ..., step_cost: _Optional[_Iterable[float]] = ..., step_cost_fitted: _Optional[bool] = ..., num_free_device_blocks: _Optional[int] = ..., pending_prefill_attention: _Optional[int] = ...) -> None: ...

class MuxRequest(_message.Message):
    __slots__ = ("call", "generate", "cancel")
    CALL_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    call: int
    generate: bytes
    cancel: bool
    def __init__(self, call: _Optional[int] = ..., generate: _Optional[bytes] = ..., cancel: _Optional[bool] = ...) -> None: ...

class MuxResponse(_message.Message):
    __slots__ = ("call", "message", "code", "details", "last")
    CALL_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    call: int
    message: bytes
    code: int
    details: str
    last: bool
    def __init__(self, call: _Optional[int] = ..., message: _Optional[bytes] = ..., code: _Optional[int] = ..., details: _Optional[str] = ..., last: _Optional[bool] = ...) -> None: ...

class MuxResponses(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[MuxResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[MuxResponse, _Mapping]]] = ...) -> None: ...

class ListReplicasRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListReplicasResponse(_message.Message):
    __slots__ = ("replicas",)
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    def __init__(self, replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ...) -> None: ...

class DrainReplicaRequest(_message.Message):
    __slots__ = ("address", "drain")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    address: str
    drain: bool
    def __init__(self, address: _Optional[str] = ..., drain: _Optional[bool] = ...) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("address", "healthy", "draining", "cached_blocks", "in_flight", "load")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    address: str
    healthy: bool
    draining: bool
    cached_blocks: int
    in_flight: int
    load: ReplicaLoad
    def __init__(self, address: _Optional[str] = ..., healthy: _Optional[bool] = ..., draining: _Optional[bool] = ..., cached_blocks: _Optional[int] = ..., in_flight: _Optional[int] = ..., load: _Optional[_Union[ReplicaLoad, _Mapping]] = ...) -> None: ...
