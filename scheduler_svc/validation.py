"""Checks a public GenerateRequest and turns it into a prompt and SamplingParams.

Every rejection is an InvalidRequestError (INVALID_ARGUMENT) whose message names the field,
raised before anything is queued. Unset optional fields get the defaults documented in
chunkserve.proto.

Every input is bounded before any work proportional to its size: a text prompt longer in
bytes than any prompt of max_model_len tokens can be is refused before it is encoded (see
tokenizer.max_bytes_per_token for why no valid prompt is refused), token ids are counted
before they are read, and a whole message larger than the largest valid request
(`Limits.max_request_bytes`) is refused by server.py before it is parsed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from scheduler_svc.errors import InvalidRequestError
from scheduler_svc.request import SamplingParams
from scheduler_svc.structured import MAX_SPEC_CHARS, Constraint
from scheduler_svc.tokenizer import Tokenizer

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_CLIENT_REQUEST_ID_BYTES = 256  # also tenant
MAX_STOP_TOKEN_IDS = 64  # checked against every sampled token
# An unset sampling.max_tokens with a text or token_ids prompt: vLLM's and OpenAI's
# completions default. A chat prompt runs to the rest of max_model_len (their chat default).
# Not max_model_len for all: a client whose protobuf loader silently drops the field (a
# Node proto-loader without keepCase) would otherwise run a short request to the context.
DEFAULT_MAX_TOKENS = 16
# Room in a request for everything but the prompt: sampling parameters (16 stop strings of
# 256 characters take at most 16.5 KiB), client_request_id, cache_salt, tenant,
# stop_token_ids, and the protobuf framing of chat messages.
# Plus a structured-output spec (sampling.structured): at most MAX_SPEC_CHARS characters of
# up to 4 UTF-8 bytes (a choice list's strings count as their JSON list).
# Plus bad words (sampling.bad_words): up to 4 UTF-8 bytes a character and a field's framing.
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 100
MAX_NON_PROMPT_BYTES = 64 * 1024 + 4 * MAX_SPEC_CHARS + MAX_BAD_WORDS * (4 * MAX_BAD_WORD_CHARS + 3)
# A token id is a uint32: at most 5 bytes as a varint in a packed repeated field.
_MAX_VARINT_BYTES = 5


@dataclass(frozen=True, slots=True)
class Limits:
    """What the server can take: from the model, the KV pool and the config."""

    max_model_len: int  # already capped by the KV pool and, with chunking off, the budget
    vocab_size: int
    # Most UTF-8 bytes of a text prompt (or a rendered chat) that can still be under
    # max_model_len tokens; None when the tokenizer allows no such bound (text is then only
    # bounded by the transport's message size limit).
    max_prompt_bytes: int | None = None

    @staticmethod
    def for_tokenizer(max_model_len: int, vocab_size: int, max_bytes_per_token: int | None) -> Limits:
        """Limits with the prompt byte bound of a tokenizer (Tokenizer.max_bytes_per_token):
        a valid prompt has at most max_model_len - 1 tokens, each covering at most
        max_bytes_per_token bytes of text, so a longer text cannot be valid."""
        bound = None if max_bytes_per_token is None else (max_model_len - 1) * max_bytes_per_token
        return Limits(max_model_len, vocab_size, bound)

    @property
    def max_request_bytes(self) -> int | None:
        """Serialized size of the largest valid GenerateRequest (None: no bound known): the
        largest prompt (text, rendered chat, or max_model_len - 1 ids as varints) plus
        MAX_NON_PROMPT_BYTES for every other field. Chat contents count as if the template
        copied them whole (whitespace a template trims away still counts here)."""
        if self.max_prompt_bytes is None:
            return None
        ids = (self.max_model_len - 1) * _MAX_VARINT_BYTES
        return max(self.max_prompt_bytes, ids) + MAX_NON_PROMPT_BYTES


def _fail(message: str) -> None:
    raise InvalidRequestError(message)


def check_client_request_id(request: pb.GenerateRequest) -> None:
    """The request's labels, at most MAX_CLIENT_REQUEST_ID_BYTES each: client_request_id is
    echoed to the client and tenant is kept as a key of the fair policy's accounts for as long
    as the server runs (cache_salt is bounded only by the request's byte bound)."""
    for name in ("client_request_id", "tenant"):
        label = getattr(request, name)
        if len(label) > MAX_CLIENT_REQUEST_ID_BYTES or len(label.encode()) > MAX_CLIENT_REQUEST_ID_BYTES:
            _fail(f"{name} has {len(label.encode())} UTF-8 bytes; at most {MAX_CLIENT_REQUEST_ID_BYTES}")


def check_known_fields(message: Message, path: str = "") -> None:
    """Refuses a field this server's proto does not have (a client built from a newer
    chunkserve.proto sends it; protobuf would keep it aside, unread), naming its number and
    the message it was sent in, nested messages included."""
    numbers = sorted({f.field_number for f in UnknownFieldSet(message)})
    if numbers:
        name = message.DESCRIPTOR.full_name
        _fail(
            f"{path or 'request'} has field number {', '.join(map(str, numbers))} that {name} does not have on this "
            "server, which cannot honour it (a client built from a newer chunkserve.proto?)"
        )
    for field, value in message.ListFields():
        if field.message_type is None:
            continue
        if field.message_type.GetOptions().map_entry:
            values = value.values() if field.message_type.fields_by_name["value"].message_type else []
        else:
            values = value if field.is_repeated else [value]
        for item in values:
            check_known_fields(item, f"{path}{field.name}" if not path else f"{path}.{field.name}")


def needs_tokenizer(request: pb.GenerateRequest) -> bool:
    """Whether tokenize_prompt runs the tokenizer (text or chat), which may take a while."""
    return request.WhichOneof("prompt") in ("text", "chat")


def _check_prompt_bytes(field: str, text: str, limits: Limits) -> None:
    bound = limits.max_prompt_bytes
    if bound is None or len(text) * 4 <= bound:  # a character is at most 4 UTF-8 bytes
        return
    # More characters than the bound decides it without encoding a copy.
    size = len(text) if len(text) > bound else len(text.encode())
    if size > bound:
        _fail(
            f"{field} has {'at least ' if size == len(text) else ''}{size} UTF-8 bytes; no text over "
            f"{bound} bytes fits in max_model_len {limits.max_model_len} tokens"
        )


def tokenize_prompt(request: pb.GenerateRequest, tokenizer: Tokenizer, limits: Limits) -> list[int]:
    """The prompt's token ids, from text, ids or chat messages.

    Text that certainly has too many tokens is refused before it is encoded. A chat is
    rendered first and the same bound applies to the rendered text, which is exactly what
    gets encoded (templates may trim or drop content, so the raw contents would prove
    nothing; rendering costs little next to encoding, and the message size bounds it).
    Text and chat prompts can take a while to encode: an event loop runs this in a thread.
    """
    kind = request.WhichOneof("prompt")
    if kind is None:
        _fail("prompt: set one of text, token_ids or chat")
    if kind == "text":
        if not request.text:
            _fail("prompt.text is empty")
        _check_prompt_bytes("prompt.text", request.text, limits)
        ids = tokenizer.encode(request.text)
    elif kind == "token_ids":
        count = len(request.token_ids.ids)
        if count >= limits.max_model_len:
            _fail(f"prompt has {count} tokens; max_model_len {limits.max_model_len} leaves no room to generate")
        ids = list(request.token_ids.ids)
        if ids and max(ids) >= limits.vocab_size:
            bad = next(t for t in ids if t >= limits.vocab_size)
            _fail(f"prompt.token_ids: id {bad} is outside the vocabulary (size {limits.vocab_size})")
    else:
        messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
        if not messages:
            _fail("prompt.chat.messages is empty")
        try:
            text = tokenizer.render_chat(messages)
        except ValueError as exc:
            raise InvalidRequestError(f"prompt.chat: {exc}") from None
        _check_prompt_bytes("prompt.chat (as rendered by the chat template)", text, limits)
        ids = tokenizer.encode_rendered_chat(text)
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
    presence, frequency, repetition = _penalties(s)
    allowed, logit_bias = _token_choices(s, limits)
    if s.HasField("max_tokens"):
        max_tokens = s.max_tokens
    elif request.WhichOneof("prompt") == "chat":
        max_tokens = room
    else:  # never more than fits: an unset field must not turn a valid prompt into an error
        max_tokens = min(DEFAULT_MAX_TOKENS, room)
    if max_tokens < 1:
        _fail("sampling.max_tokens must be >= 1")
    if num_prompt_tokens + max_tokens > limits.max_model_len:
        _fail(
            f"prompt ({num_prompt_tokens} tokens) + sampling.max_tokens ({max_tokens}) exceeds "
            f"max_model_len {limits.max_model_len}"
        )
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
    if len(s.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        _fail(f"sampling.stop_token_ids has {len(s.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS}")
    bad = next((t for t in s.stop_token_ids if t >= limits.vocab_size), None)
    if bad is not None:
        _fail(f"sampling.stop_token_ids: id {bad} is outside the vocabulary (size {limits.vocab_size})")
    logprobs = s.logprobs if s.HasField("logprobs") else None
    if logprobs is not None and logprobs > MAX_LOGPROBS:
        _fail(f"sampling.logprobs must be at most {MAX_LOGPROBS}, got {logprobs}")
    prompt_logprobs = s.prompt_logprobs if s.HasField("prompt_logprobs") else None
    if prompt_logprobs is not None and prompt_logprobs > MAX_LOGPROBS:
        _fail(f"sampling.prompt_logprobs must be at most {MAX_LOGPROBS}, got {prompt_logprobs}")
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
        skip_special_tokens=s.skip_special_tokens if s.HasField("skip_special_tokens") else True,
        include_stop_str_in_output=s.include_stop_str_in_output,
        constraint=structured_constraint(s),
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        logit_bias=logit_bias,
        prompt_logprobs=prompt_logprobs,
        allowed_token_ids=allowed,
    )


def _token_choices(s: pb.SamplingParams, limits: Limits) -> tuple[tuple[int, ...], tuple[tuple[int, float], ...]]:
    """(allowed_token_ids, logit_bias), sorted: ids inside the vocabulary, biases in [-100, 100]."""
    bad = next((t for t in s.allowed_token_ids if t >= limits.vocab_size), None)
    if bad is not None:
        _fail(f"sampling.allowed_token_ids: id {bad} is outside the vocabulary (size {limits.vocab_size})")
    for token, bias in s.logit_bias.items():
        if token >= limits.vocab_size:
            _fail(f"sampling.logit_bias: id {token} is outside the vocabulary (size {limits.vocab_size})")
        if not -100 <= bias <= 100:  # NaN fails too
            _fail(f"sampling.logit_bias[{token}] must be in [-100, 100], got {bias}")
    return tuple(sorted(set(s.allowed_token_ids))), tuple(sorted(s.logit_bias.items()))


def _penalties(s: pb.SamplingParams) -> tuple[float, float, float]:
    """(presence, frequency, repetition) in vLLM's ranges: [-2, 2], [-2, 2], > 0."""
    out = []
    for name, default in (("presence_penalty", 0.0), ("frequency_penalty", 0.0)):
        value = getattr(s, name) if s.HasField(name) else default
        if not -2 <= value <= 2:  # NaN fails too
            _fail(f"sampling.{name} must be in [-2, 2], got {value}")
        out.append(value)
    repetition = s.repetition_penalty if s.HasField("repetition_penalty") else 1.0
    if not (0 < repetition and math.isfinite(repetition)):
        _fail(f"sampling.repetition_penalty must be a finite number > 0, got {repetition}")
    return out[0], out[1], repetition


def structured_constraint(s: pb.SamplingParams) -> Constraint | None:
    """SamplingParams.structured as a checked Constraint (None when unset). Only its shape is
    checked here; whether it compiles is found off the event loop (scheduler_svc/grammar.py)."""
    if not s.HasField("structured"):
        return None
    kind = s.structured.WhichOneof("kind")
    if kind is None:
        _fail("sampling.structured is set but names no constraint (set one of its fields)")
    if kind == "json_object" and not s.structured.json_object:
        _fail("sampling.structured.json_object must be true (leave structured unset for free output)")
    if kind == "choice":
        spec = json.dumps(list(s.structured.choice.choices))
    elif kind == "json_object":
        spec = ""
    else:
        spec = getattr(s.structured, kind)
    try:
        return Constraint.make(kind, spec)
    except ValueError as exc:
        raise InvalidRequestError(f"sampling.structured.{exc}") from None


def bad_words_token_ids(words: list[str], tokenizer: Tokenizer, vocab_size: int) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad_words as token sequences: each word as written without its leading spaces,
    and with one leading space where that tokenizes to other tokens of the same count (the
    word inside text, for a tokenizer that folds the space into the word's first token);
    distinct, in order. Refuses more than MAX_BAD_WORDS, a blank or too long word, and an id
    the model's vocabulary lacks."""
    if len(words) > MAX_BAD_WORDS:
        _fail(f"sampling.bad_words has {len(words)} words; at most {MAX_BAD_WORDS}")
    out: dict[tuple[int, ...], None] = {}
    for word in words:
        if not word.strip():
            _fail("sampling.bad_words contains an empty or blank word")
        if len(word) > MAX_BAD_WORD_CHARS:
            _fail(f"sampling.bad_words: words must be at most {MAX_BAD_WORD_CHARS} characters")
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        for ids in (plain, spaced) if spaced[0] != plain[0] and len(spaced) == len(plain) else (plain,):
            if max(ids) >= vocab_size:
                _fail(f"sampling.bad_words: {word!r} has token id {max(ids)}, outside the vocabulary")
            out[ids] = None
    return tuple(out)
