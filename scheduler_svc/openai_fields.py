"""Every request field of vLLM's OpenAI server, and what chunkserve does with it.

The rule (issue 33): a field either works as vLLM documents it or is refused with a 400
naming it; it is never accepted and silently ignored. The tables below are the audit of
vLLM's ChatCompletionRequest and CompletionRequest (vllm/entrypoints/openai/protocol.py),
plus the OpenAI fields with a behaviour vLLM does not implement (`functions`, `suffix`):

- read by openai_protocol.build_request / openai_prompt / openai_tools: HANDLED;
- accepted only at their neutral value (the one that changes nothing): NEUTRAL;
- accepted, with no effect to honour here (say why): NO_EFFECT;
- refused whenever set (not null, not empty; `audio` and `web_search_options` even empty):
  REFUSED, with the reason.

OpenAI's own Chat Completions fields that vLLM's request lacks (`store`, `audio`,
`web_search_options`, ...) are classified the same way, so a client asking OpenAI's API for
web search or audio gets a 400 rather than a plain text answer.

A field in none of these is unknown: refused with a 400 naming it (a client's typo, or a
feature of another server, would otherwise be ignored without a word). vLLM accepts unknown
fields and logs that it ignored them; `--openai-unknown-fields warn` does that (one warning per
field name, not per request), for clients or gateways that add fields of their own.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from scheduler_svc.errors import ServingError

log = logging.getLogger(__name__)

_COMMON_HANDLED = {
    "model", "max_tokens", "n", "seed", "stop", "stream", "stream_options", "temperature", "top_p", "top_k",
    "min_p", "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "truncate_prompt_tokens", "add_special_tokens", "response_format", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern", "structural_tag",
    "structured_outputs", "priority", "request_id", "return_tokens_as_token_ids", "cache_salt", "return_token_ids",
    "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids",
    "prompt_logprobs", "bad_words", "use_beam_search", "length_penalty",
}  # fmt: skip
CHAT_HANDLED = _COMMON_HANDLED | {
    "messages", "top_logprobs", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls",
    "add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs", "documents",
    "reasoning_effort", "echo",
}  # fmt: skip
COMPLETION_HANDLED = _COMMON_HANDLED | {"prompt", "echo"}

# Any value but this one needs a feature chunkserve does not have.
NEUTRAL: dict[str, Any] = {
    "best_of": 1,
    # OpenAI's own fields (its API reference, Chat Completions) that vLLM's request omits:
    "store": False,  # store the completion for OpenAI's evals and distillation: nothing is stored here
    "modalities": ["text"],  # audio output
    "verbosity": "medium",  # a shorter or longer answer than the model's own
    # SGLang's fields, which vllm-router (PyPI; its cache_aware, round_robin, ... policies) writes
    # into every request it forwards, at these values:
    "no_stop_trim": False,  # true: the stop string stays in the text (use include_stop_str_in_output)
    "return_hidden_states": False,
}
NO_EFFECT = {
    "user": "an end-user label for the client's own records; vLLM does not use it either",
    "spaces_between_special_tokens": "the fast tokenizer never inserts spaces between special tokens "
    "(as vLLM's fast detokenizer)",
    "include_reasoning": "no reasoning parser runs, so there is no reasoning content to include or drop",
    "separate_reasoning": "no reasoning parser runs, so there is no reasoning content to separate (SGLang's field, "
    "which vllm-router sends with every chat request)",
    "stream_reasoning": "no reasoning parser runs, so no reasoning content is streamed either way (SGLang's field)",
    "safety_identifier": "an end-user label for OpenAI's abuse monitoring, like `user`",
    "metadata": "tags for OpenAI's stored completions; nothing is stored here, and tags change no output",
    "service_tier": "a billing and latency tier at OpenAI; one tier here, and it changes no output",
    "prompt_cache_key": "a hint for OpenAI's prompt cache; the prefix cache here matches prompts by their tokens",
    "prediction": "predicted output is a speed hint at OpenAI (the output is the same without it)",
}
REFUSED = {
    "logits_processors": "custom logits processors are not supported",
    "mm_processor_kwargs": "multimodal inputs are not supported",
    "kv_transfer_params": "disaggregated serving is not supported",
    "vllm_xargs": "no extension reads extra arguments",
    "prompt_embeds": "prompt embeddings are not supported",
    "suffix": "suffix is not supported (as vLLM)",
    "functions": "the legacy `functions` parameter is not supported; use `tools`",
    "function_call": "the legacy `function_call` parameter is not supported; use `tool_choice`",
    "audio": "audio output is not supported",
    "web_search_options": "web search is not supported",
}
# Refused even empty: OpenAI reads `web_search_options: {}` as "search, with the defaults".
_PRESENCE_ASKS = {"audio", "web_search_options"}
_WARNED: set[str] = set()
_MAX_WARNED = 256  # unknown names are logged once each; this bounds the set


class HttpError(ServingError):
    """A refusal the HTTP front decides itself (auth, unknown model, a field rule) with its
    HTTP status, OpenAI error type and the parameter it names."""

    def __init__(self, message: str, status: int, kind: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param


def bad(param: str, message: str) -> HttpError:
    """The 400 naming a request field."""
    return HttpError(message, 400, "invalid_request_error", param)


def check_fields(body: dict[str, Any], chat: bool, reject_unknown: bool = True) -> None:
    """Refuses a field chunkserve cannot honour (a 400 naming it), and an unknown one unless
    `reject_unknown` is off (then it is logged once per name)."""
    handled = CHAT_HANDLED if chat else COMPLETION_HANDLED
    for name, value in body.items():
        if name in handled or name in NO_EFFECT or value is None:
            continue
        if name in NEUTRAL:
            neutral = NEUTRAL[name]
            if value != neutral or isinstance(value, bool) != isinstance(neutral, bool):
                raise bad(name, f"{name} is not supported (only {json.dumps(neutral)})")
        elif name in REFUSED:
            if value not in ([], {}, "") or name in _PRESENCE_ASKS:
                raise bad(name, f"{name}: {REFUSED[name]}")
        elif reject_unknown:
            raise bad(
                name,
                f"{name} is not a request field chunkserve knows, so it cannot honour it "
                "(the server's --openai-unknown-fields warn accepts and logs such fields, as vLLM does)",
            )
        elif name not in _WARNED and len(_WARNED) < _MAX_WARNED:
            _WARNED.add(name)
            log.warning("request field %r is not one chunkserve knows; ignored (as vLLM ignores unknown fields)", name)


def get(body: dict[str, Any], name: str, kinds: tuple[type, ...], what: str) -> Any:
    """body[name] if of one of `kinds` (JSON true is not a number), None when absent or null."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise bad(name, f"{name} must be {what}, got {json.dumps(value)[:64]}")
    return value


def get_uint(body: dict[str, Any], name: str, bits: int = 32) -> int | None:
    value = get(body, name, (int,), "an integer")
    if value is not None and not 0 <= value < 1 << bits:
        raise bad(name, f"{name} must be in [0, {(1 << bits) - 1}], got {value}")
    return value
