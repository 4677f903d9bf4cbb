"""What OpenAI's JSON means in chunkserve's terms, for the HTTP front (http_api.py).

A request body becomes a chunkserve.v1 GenerateRequest plus a PromptSpec (openai_prompt.py:
the chat-template options gRPC has no fields for): only types and OpenAI-only rules are
checked here (n, prompt batches, every field rule of openai_fields.py), every range and limit
by validation.py through the gRPC front's own admission path, whose messages are then renamed
to the OpenAI field. Errors become OpenAI error bodies; outputs become choices in openai_choice.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import grpc
from starlette.responses import JSONResponse

from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from scheduler_svc.beam_search import BeamOptions
from scheduler_svc.beam_search import options as beam_options
from scheduler_svc.errors import InvalidRequestError, ServingError
from scheduler_svc.openai_fields import HttpError, bad, check_fields, get, get_uint
from scheduler_svc.openai_prompt import PromptSpec, chat_options, encoding_options
from scheduler_svc.openai_structured import set_proto, structured_constraint
from scheduler_svc.openai_tools import ToolPlan, tool_plan
from scheduler_svc.validation import DEFAULT_MAX_TOKENS

COMPLETIONS_DEFAULT_MAX_TOKENS = DEFAULT_MAX_TOKENS  # vLLM's and OpenAI's 16, as on gRPC; chat runs to the context
_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
}
# validation.py names GenerateRequest fields; say the OpenAI parameter instead.
_RENAMES = (
    ("sampling.", ""),
    ("prompt.chat.messages", "messages"),
    ("prompt.chat", "messages"),
    ("client_request_id", "request_id"),
)
_RENAMES_PROMPT = (("prompt.text", "prompt"), ("prompt.token_ids", "prompt"))
# OpenAI's n: choices per request, each a request of its own on the scheduler; bounded so one
# body cannot queue unbounded work.
MAX_CHOICES = 128
# Sampling defaults a model's generation_config.json may give (vLLM's --generation-config
# auto): the body field -> its key there.
GENERATION_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_tokens": "max_new_tokens",
}


@dataclass
class Settings:
    """What the server's flags decide for every HTTP request."""

    defaults: dict[str, Any] = field(default_factory=dict)  # GENERATION_DEFAULTS keys -> values
    trust_request_chat_template: bool = False
    reject_unknown_fields: bool = True  # --openai-unknown-fields reject


@dataclass
class OpenAIRequest:
    """A checked OpenAI body: the GenerateRequest, how to make its prompt, and how to answer."""

    proto: pb.GenerateRequest
    prompt: PromptSpec
    chat: bool
    streaming: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    request_id: str | None = None  # vLLM's request_id: the response's id
    n: int = 1  # choices: n requests of the one prompt (servicer.submit_choices)
    echo: bool = False  # completions: the prompt before the output (with logprobs: its tokens' too)
    # chat's echo (vLLM): the last message's content, put before the answer's, where its role is
    # the answer's (assistant; with add_generation_prompt false, whatever the last one's is).
    chat_echo: str = ""
    beam: BeamOptions | None = None  # vLLM's use_beam_search (beam_search.py)
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs field: the answer carries them
    choice_options: dict[str, bool] = field(default_factory=dict)  # Choice's keyword arguments


def error_response(exc: ServingError, chat: bool = False) -> JSONResponse:
    """The OpenAI error body for any ServingError; validation messages name the OpenAI field."""
    status, kind = _STATUS.get(exc.code, (500, "server_error"))
    message, param = str(exc), None
    if isinstance(exc, HttpError):
        status, kind, param = exc.status, exc.kind, exc.param
    elif isinstance(exc, InvalidRequestError):
        for old, new in _RENAMES + _RENAMES_PROMPT:
            message = message.replace(old, new)
        if "max_tokens" in message:
            param = "max_completion_tokens" if chat and "max_completion_tokens" in message else "max_tokens"
        else:
            param = (re.match(r"\w+", message) or [None])[0]
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


def accepted_names(served: str) -> set[str]:
    """The `model` values a request may name: the served name and, for a hub id such as
    HuggingFaceTB/SmolLM2-135M-Instruct, its short form (what earlier versions served)."""
    names = {served}
    if re.fullmatch(r"[\w-][\w.-]*/[\w.-]+", served):
        names.add(served.split("/")[1])
    return names


def tokenize_spec(body: dict[str, Any], chat: bool, settings: Settings) -> PromptSpec:
    """The prompt of a /tokenize body (vLLM's TokenizeCompletionRequest or TokenizeChatRequest)."""
    spec = PromptSpec()
    if chat:
        _chat_prompt(body, pb.GenerateRequest(), spec, settings)
        if (plan := tool_plan(body)) is not None:
            spec.tools = plan.tools  # rendered as for generation
    elif (prompt := get(body, "prompt", (str,), "a string")) is not None:
        spec.text = prompt
    else:
        raise bad("prompt", "prompt (a string) or messages is required")
    encoding_options(body, spec, chat)
    return spec


def _ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def build_request(body: dict[str, Any], chat: bool, settings: Settings | None = None) -> OpenAIRequest:
    """The checked request for an OpenAI body: types, OpenAI-only rules and every field rule
    (openai_fields) are checked here, ranges and limits by validation.py (via
    GenerationServicer.submit)."""
    settings = settings or Settings()
    check_fields(body, chat, settings.reject_unknown_fields)
    n = get(body, "n", (int,), "an integer")
    if n is not None and not 1 <= n <= MAX_CHOICES:
        raise bad("n", f"n must be in [1, {MAX_CHOICES}], got {n}")
    request = pb.GenerateRequest(cache_salt=get(body, "cache_salt", (str,), "a string") or "")
    request_id = get(body, "request_id", (str,), "a string")
    if request_id is not None:
        request.client_request_id = request_id  # bounded like gRPC's label
    spec = PromptSpec()
    if chat:
        _chat_prompt(body, request, spec, settings)
    else:
        _text_prompt(body, request, spec)
    encoding_options(body, spec, chat)
    if request.WhichOneof("prompt") == "token_ids" and spec.truncate not in (None, -1):
        del request.token_ids.ids[: -spec.truncate]
    _sampling(body, chat, request.sampling, settings.defaults)
    tools = _constrain(body, chat, request.sampling, spec)
    if (priority := get(body, "priority", (int,), "an integer")) is not None:
        if not -(2**31) <= priority < 2**31:
            raise bad("priority", f"priority must be a 32-bit integer, got {priority}")
        request.priority = priority
    out = OpenAIRequest(request, spec, chat, request_id=request_id, n=n or 1)
    if get(body, "use_beam_search", (bool,), "a boolean"):
        out.beam = beam_options(body, n or 1)
    elif body.get("length_penalty") not in (None, 1):
        raise bad("length_penalty", "length_penalty needs use_beam_search")
    _stream_options(body, out)
    if get(body, "echo", (bool,), "a boolean"):
        if chat:
            _chat_echo(out, tools)
        else:
            out.echo = True
            if request.sampling.HasField("logprobs"):  # the prompt's tokens get theirs too
                request.sampling.prompt_logprobs = request.sampling.logprobs
    if (k := get_uint(body, "prompt_logprobs")) is not None:  # vLLM's: in the answer, by token id
        if out.streaming:
            raise bad("prompt_logprobs", "prompt_logprobs is not available with stream (as vLLM)")
        request.sampling.prompt_logprobs = max(k, request.sampling.prompt_logprobs)
        out.prompt_logprobs = True
    out.choice_options = {
        "tools": tools,
        "want_logprobs": bool(body.get("logprobs")) if chat else body.get("logprobs") is not None,
        "return_token_ids": bool(get(body, "return_token_ids", (bool,), "a boolean")),
        "tokens_as_ids": bool(get(body, "return_tokens_as_token_ids", (bool,), "a boolean")),
    }
    return out


def _chat_echo(out: OpenAIRequest, tools: ToolPlan | None) -> None:
    """vLLM's chat echo: the answer starts with the last message's content when that message
    has the answer's role (a partial assistant message continued, for one)."""
    if tools is not None and tools.choice != "none":
        raise bad("echo", "echo with tools is not supported")
    last = (out.prompt.messages or [{}])[-1]
    if out.prompt.add_generation_prompt and last.get("role") != "assistant":
        return
    out.echo, out.chat_echo = True, last.get("content") or ""


def _constrain(body: dict[str, Any], chat: bool, s: pb.SamplingParams, spec: PromptSpec) -> ToolPlan | None:
    """Tools (chat) and structured output: the tools go into the prompt, a forced tool choice
    or a structured-output field into SamplingParams.structured (one of them at most)."""
    plan = tool_plan(body) if chat else None
    structured = structured_constraint(body)
    forced = plan.constraint() if plan is not None else None
    if forced is not None and structured is not None:
        raise bad(structured[0], f"{structured[0]} and tool_choice {plan.choice} both constrain the output")
    if plan is not None:
        spec.tools = plan.tools
    constraint = forced or (structured[1] if structured else None)
    if constraint is not None:
        set_proto(s, constraint)
    return plan


def _chat_prompt(body: dict[str, Any], request: pb.GenerateRequest, spec: PromptSpec, settings: Settings) -> None:
    request.chat.SetInParent()
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages must be a non-empty list of {role, content} objects")
    spec.messages = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise bad("messages", f"messages[{i}].content: only text parts are supported")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, str | None):
            raise bad("messages", f"messages[{i}] must be an object with a string role and content")
        request.chat.messages.add(role=m["role"], content=content or "")  # the proto form bounds the size
        spec.messages.append({**m, "content": content or ""})
    chat_options(body, spec, settings.trust_request_chat_template)


def _text_prompt(body: dict[str, Any], request: pb.GenerateRequest, spec: PromptSpec) -> None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and (isinstance(prompt[0], str) or _ids(prompt[0])):
        if len(prompt) != 1:
            raise bad("prompt", f"prompt: one prompt per request, got a batch of {len(prompt)}")
        prompt = prompt[0]
    if isinstance(prompt, str):
        request.text = spec.text = prompt
    elif _ids(prompt):
        if not all(0 <= t < 1 << 32 for t in prompt):
            raise bad("prompt", "prompt: token ids must be >= 0")
        request.token_ids.ids.extend(prompt)
    else:
        raise bad("prompt", "prompt must be a string or a list of token ids")


def _sampling(body: dict[str, Any], chat: bool, s: pb.SamplingParams, defaults: dict[str, Any]) -> None:
    """The SamplingParams of a body; a field the body leaves unset takes the server's
    generation defaults (--generation-config), then chunkserve's."""
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = get(body, name, (int, float), "a number")
        if value is not None or (value := defaults.get(name)) is not None:
            setattr(s, name, value)
    top_k = get(body, "top_k", (int,), "an integer")
    if top_k is not None or (top_k := defaults.get("top_k")) is not None:
        s.top_k = max(min(top_k, 2**31 - 1), -(2**31))
    if (seed := get_uint(body, "seed", 64)) is not None:
        s.seed = seed
    _logit_bias(body, s)
    max_tokens = get_uint(body, "max_completion_tokens") if chat else None
    max_tokens = max_tokens if max_tokens is not None else get_uint(body, "max_tokens")
    if max_tokens is None and not chat:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    if (cap := defaults.get("max_tokens")) is not None:  # the model's max_new_tokens caps it (as vLLM)
        max_tokens = cap if max_tokens is None else min(max_tokens, cap)
    if max_tokens is not None:
        s.max_tokens = max_tokens
    if (min_tokens := get_uint(body, "min_tokens")) is not None:
        s.min_tokens = min_tokens
    stop = get(body, "stop", (str, list), "a string or a list of strings")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not all(isinstance(x, str) for x in stop):
        raise bad("stop", "stop must be a string or a list of strings")
    s.stop.extend(stop)
    bad_words = get(body, "bad_words", (list,), "a list of strings") or []
    if not all(isinstance(w, str) for w in bad_words):
        raise bad("bad_words", "bad_words must be a list of strings")
    s.bad_words.extend(bad_words)
    allowed = body.get("allowed_token_ids") or []
    if not _ids(allowed) or not all(0 <= t < 1 << 32 for t in allowed):
        raise bad("allowed_token_ids", "allowed_token_ids must be a list of token ids")
    s.allowed_token_ids.extend(allowed)
    stop_ids = body.get("stop_token_ids") or []
    if not _ids(stop_ids) or not all(0 <= t < 1 << 32 for t in stop_ids):
        raise bad("stop_token_ids", "stop_token_ids must be a list of token ids")
    s.stop_token_ids.extend(stop_ids)
    if get(body, "ignore_eos", (bool,), "a boolean"):
        s.ignore_eos = True
    if (skip := get(body, "skip_special_tokens", (bool,), "a boolean")) is not None:
        s.skip_special_tokens = skip
    if get(body, "include_stop_str_in_output", (bool,), "a boolean"):
        s.include_stop_str_in_output = True
    if chat:
        if get(body, "logprobs", (bool,), "a boolean"):
            s.logprobs = get_uint(body, "top_logprobs") or 0
        elif body.get("top_logprobs"):
            raise bad("top_logprobs", "top_logprobs needs logprobs: true")
    elif (logprobs := get_uint(body, "logprobs")) is not None:
        s.logprobs = logprobs


def _logit_bias(body: dict[str, Any], s: pb.SamplingParams) -> None:
    """OpenAI's {"token id": bias}; values clamped to [-100, 100] as vLLM does (ids outside
    the vocabulary are refused by validation.py, naming the id)."""
    bias = get(body, "logit_bias", (dict,), "an object mapping token ids to numbers")
    for key, value in (bias or {}).items():
        if not (isinstance(key, str) and key.isdigit() and int(key) < 1 << 32):
            raise bad("logit_bias", f"logit_bias: {key!r} is not a token id")
        if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
            raise bad("logit_bias", f"logit_bias[{key!r}] must be a number")
        s.logit_bias[int(key)] = min(100.0, max(-100.0, float(value)))


def _stream_options(body: dict[str, Any], out: OpenAIRequest) -> None:
    out.streaming = bool(get(body, "stream", (bool,), "a boolean"))
    options = get(body, "stream_options", (dict,), "an object")
    if options is None:
        return
    if not out.streaming:
        raise bad("stream_options", "stream_options needs stream: true")
    for name in ("include_usage", "continuous_usage_stats"):
        if not isinstance(options.get(name), bool | None):
            raise bad("stream_options", f"stream_options.{name} must be a boolean")
    out.include_usage = bool(options.get("include_usage"))
    # vLLM: usage in every chunk, only together with include_usage
    out.continuous_usage = out.include_usage and bool(options.get("continuous_usage_stats"))
