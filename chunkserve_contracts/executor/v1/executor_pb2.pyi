from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CutStepsRequest(_message.Message):
    __slots__ = ("step_id",)
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    def __init__(self, step_id: _Optional[int] = ...) -> None: ...

class CutStepsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("scheduler_version",)
    SCHEDULER_VERSION_FIELD_NUMBER: _ClassVar[int]
    scheduler_version: str
    def __init__(self, scheduler_version: _Optional[str] = ...) -> None: ...

class ModelConfig(_message.Message):
    __slots__ = ("architecture", "num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "head_dim", "vocab_size", "max_position_embeddings", "eos_token_ids")
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_ATTENTION_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITION_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    architecture: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, architecture: _Optional[str] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_attention_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_position_embeddings: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("model", "model_name", "model_path", "dtype", "device", "block_size", "num_device_blocks", "num_host_blocks", "attention_backend", "max_num_batched_tokens", "version", "tensor_parallel_size")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_DEVICE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    model: ModelConfig
    model_name: str
    model_path: str
    dtype: str
    device: str
    block_size: int
    num_device_blocks: int
    num_host_blocks: int
    attention_backend: str
    max_num_batched_tokens: int
    version: str
    tensor_parallel_size: int
    def __init__(self, model: _Optional[_Union[ModelConfig, _Mapping]] = ..., model_name: _Optional[str] = ..., model_path: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., block_size: _Optional[int] = ..., num_device_blocks: _Optional[int] = ..., num_host_blocks: _Optional[int] = ..., attention_backend: _Optional[str] = ..., max_num_batched_tokens: _Optional[int] = ..., version: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "has_seed", "seed", "num_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "num_prompt_logprobs", "allowed_token_ids", "bad_words")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    NUM_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    has_seed: bool
    seed: int
    num_logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    num_prompt_logprobs: int
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedCompositeFieldContainer[BadWord]
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., has_seed: _Optional[bool] = ..., seed: _Optional[int] = ..., num_logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., num_prompt_logprobs: _Optional[int] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[_Union[BadWord, _Mapping]]] = ...) -> None: ...

class BadWord(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class NewSequence(_message.Message):
    __slots__ = ("seq_id", "sampling", "prompt_token_ids", "output_token_ids")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    sampling: SamplingParams
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ScheduledSequence(_message.Message):
    __slots__ = ("seq_id", "num_computed_tokens", "num_new_tokens", "token_ids", "block_ids", "replace_block_table", "sample", "token_masks", "draft_token_ids", "prompt_logprob_first", "prompt_logprob_rows", "next_token_id")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    REPLACE_BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_MASKS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROB_FIRST_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROB_ROWS_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    num_computed_tokens: int
    num_new_tokens: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    replace_block_table: bool
    sample: bool
    token_masks: _containers.RepeatedCompositeFieldContainer[TokenMask]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprob_first: int
    prompt_logprob_rows: int
    next_token_id: int
    def __init__(self, seq_id: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., num_new_tokens: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_ids: _Optional[_Iterable[int]] = ..., replace_block_table: _Optional[bool] = ..., sample: _Optional[bool] = ..., token_masks: _Optional[_Iterable[_Union[TokenMask, _Mapping]]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., prompt_logprob_first: _Optional[int] = ..., prompt_logprob_rows: _Optional[int] = ..., next_token_id: _Optional[int] = ...) -> None: ...

class TokenMask(_message.Message):
    __slots__ = ("position", "bits")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    position: int
    bits: bytes
    def __init__(self, position: _Optional[int] = ..., bits: _Optional[bytes] = ...) -> None: ...

class BlockCopy(_message.Message):
    __slots__ = ("src", "dst")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    src: int
    dst: int
    def __init__(self, src: _Optional[int] = ..., dst: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("step_id", "new_seqs", "seqs", "finished_seq_ids", "swap_out", "swap_in", "follows_step_id", "num_steps", "stream_steps")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_SEQS_FIELD_NUMBER: _ClassVar[int]
    SEQS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    FOLLOWS_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    STREAM_STEPS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_seqs: _containers.RepeatedCompositeFieldContainer[NewSequence]
    seqs: _containers.RepeatedCompositeFieldContainer[ScheduledSequence]
    finished_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    swap_out: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    swap_in: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    follows_step_id: int
    num_steps: int
    stream_steps: bool
    def __init__(self, step_id: _Optional[int] = ..., new_seqs: _Optional[_Iterable[_Union[NewSequence, _Mapping]]] = ..., seqs: _Optional[_Iterable[_Union[ScheduledSequence, _Mapping]]] = ..., finished_seq_ids: _Optional[_Iterable[int]] = ..., swap_out: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., swap_in: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., follows_step_id: _Optional[int] = ..., num_steps: _Optional[int] = ..., stream_steps: _Optional[bool] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class SampledToken(_message.Message):
    __slots__ = ("seq_id", "token_id", "logprob", "top")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, seq_id: _Optional[int] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("step_id", "sampled", "execute_ns", "swap_ns", "forward_ns", "sample_ns", "num_tokens", "start_unix_ns", "num_threads", "prompt_logprobs", "num_steps", "more_steps")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    EXECUTE_NS_FIELD_NUMBER: _ClassVar[int]
    SWAP_NS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_NS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    START_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    NUM_THREADS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    MORE_STEPS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sampled: _containers.RepeatedCompositeFieldContainer[SampledToken]
    execute_ns: int
    swap_ns: int
    forward_ns: int
    sample_ns: int
    num_tokens: int
    start_unix_ns: int
    num_threads: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprob]
    num_steps: int
    more_steps: bool
    def __init__(self, step_id: _Optional[int] = ..., sampled: _Optional[_Iterable[_Union[SampledToken, _Mapping]]] = ..., execute_ns: _Optional[int] = ..., swap_ns: _Optional[int] = ..., forward_ns: _Optional[int] = ..., sample_ns: _Optional[int] = ..., num_tokens: _Optional[int] = ..., start_unix_ns: _Optional[int] = ..., num_threads: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprob, _Mapping]]] = ..., num_steps: _Optional[int] = ..., more_steps: _Optional[bool] = ...) -> None: ...

class StepOutcome(_message.Message):
    __slots__ = ("result", "error")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    result: StepResponse
    error: StepError
    def __init__(self, result: _Optional[_Union[StepResponse, _Mapping]] = ..., error: _Optional[_Union[StepError, _Mapping]] = ...) -> None: ...

class StepError(_message.Message):
    __slots__ = ("step_id", "code", "message")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    code: int
    message: str
    def __init__(self, step_id: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class PromptLogprob(_message.Message):
    __slots__ = ("seq_id", "position", "token_id", "logprob", "top", "rank")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    position: int
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    rank: int
    def __init__(self, seq_id: _Optional[int] = ..., position: _Optional[int] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., rank: _Optional[int] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
