"""Checks a public GenerateRequest and turns it into a prompt and SamplingParams.

Every rejection is an InvalidRequestError (INVALID_ARGUMENT) whose message names the field,
raised before anything is queued. Unset optional fields get the defaults documented in
chunkserve.proto.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from chunkserve.v1 import chunkserve_pb2 as pb
from scheduler_svc.errors import InvalidRequestError
from scheduler_svc.request import SamplingParams
from scheduler_svc.tokenizer import Tokenizer

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256


@dataclass(frozen=True, slots=True)
class Limits:
    """What the server can take: from the model, the KV pool and the config."""

    max_model_len: int  # already capped by the KV pool and, with chunking off, the budget
    vocab_size: int


def _fail(message: str) -> None:
    raise InvalidRequestError(message)


def tokenize_prompt(request: pb.GenerateRequest, tokenizer: Tokenizer, limits: Limits) -> list[int]:
    """The prompt's token ids, from text, ids or chat messages."""
    kind = request.WhichOneof("prompt")
    if kind is None:
        _fail("prompt: set one of text, token_ids or chat")
    if kind == "text":
        if not request.text:
            _fail("prompt.text is empty")
        ids = tokenizer.encode(request.text)
    elif kind == "token_ids":
        ids = list(request.token_ids.ids)
        bad = next((t for t in ids if t >= limits.vocab_size), None)
        if bad is not None:
            _fail(f"prompt.token_ids: id {bad} is outside the vocabulary (size {limits.vocab_size})")
    else:
        messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
        if not messages:
            _fail("prompt.chat.messages is empty")
        try:
            ids = tokenizer.apply_chat_template(messages)
        except ValueError as exc:
            raise InvalidRequestError(f"prompt.chat: {exc}") from None
    if not ids:
        _fail("prompt is empty after tokenization")
    if len(ids) >= limits.max_model_len:
        _fail(f"prompt has {len(ids)} tokens; max_model_len {limits.max_model_len} leaves no room to generate")
    return ids


def sampling_params(request: pb.GenerateRequest, num_prompt_tokens: int, limits: Limits) -> SamplingParams:
    """Validated SamplingParams with defaults filled in."""
    s = request.sampling
    room = limits.max_model_len - num_prompt_tokens
    temperature = s.temperature if s.HasField("temperature") else 1.0
    if not math.isfinite(temperature) or temperature < 0:
        _fail(f"sampling.temperature must be a finite number >= 0, got {temperature}")
    top_k = s.top_k if s.HasField("top_k") else 0
    if top_k < -1:
        _fail(f"sampling.top_k must be >= 0 (0 or -1 = off), got {top_k}")
    top_p = s.top_p if s.HasField("top_p") else 1.0
    if not (0 < top_p <= 1):
        _fail(f"sampling.top_p must be in (0, 1], got {top_p}")
    min_p = s.min_p if s.HasField("min_p") else 0.0
    if not (0 <= min_p <= 1):
        _fail(f"sampling.min_p must be in [0, 1], got {min_p}")
    max_tokens = s.max_tokens if s.HasField("max_tokens") else room
    if max_tokens < 1:
        _fail("sampling.max_tokens must be >= 1")
    if num_prompt_tokens + max_tokens > limits.max_model_len:
        _fail(f"prompt ({num_prompt_tokens} tokens) + sampling.max_tokens ({max_tokens}) exceeds "
              f"max_model_len {limits.max_model_len}")
    min_tokens = s.min_tokens if s.HasField("min_tokens") else 0
    if min_tokens > max_tokens:
        _fail(f"sampling.min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})")
    if len(s.stop) > MAX_STOP_STRINGS:
        _fail(f"sampling.stop has {len(s.stop)} strings; at most {MAX_STOP_STRINGS}")
    for stop in s.stop:
        if not stop:
            _fail("sampling.stop contains an empty string")
        if len(stop) > MAX_STOP_STRING_LEN:
            _fail(f"sampling.stop strings must be at most {MAX_STOP_STRING_LEN} characters")
    bad = next((t for t in s.stop_token_ids if t >= limits.vocab_size), None)
    if bad is not None:
        _fail(f"sampling.stop_token_ids: id {bad} is outside the vocabulary (size {limits.vocab_size})")
    logprobs = s.logprobs if s.HasField("logprobs") else None
    if logprobs is not None and logprobs > MAX_LOGPROBS:
        _fail(f"sampling.logprobs must be at most {MAX_LOGPROBS}, got {logprobs}")
    return SamplingParams(
        temperature=temperature,
        top_k=max(top_k, 0),
        top_p=top_p,
        min_p=min_p,
        seed=s.seed if s.HasField("seed") else None,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        logprobs=logprobs,
    )
