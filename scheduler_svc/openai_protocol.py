"""What OpenAI's JSON means in chunkserve's terms, for the HTTP front (http_api.py).

A request body becomes a chunkserve.v1 GenerateRequest: only types and OpenAI-only rules are
checked here (n, unsupported penalties, prompt batches), every range and limit by
validation.py through the gRPC front's own admission path, whose messages are then renamed
to the OpenAI field. Outputs become OpenAI choices, usage and error bodies.
"""

from __future__ import annotations

import json
import re
from typing import Any

import grpc
from starlette.responses import JSONResponse

from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from scheduler_svc.engine import Engine
from scheduler_svc.errors import InvalidRequestError, ServingError
from scheduler_svc.output import StreamDelta
from scheduler_svc.request import FinishReason
from scheduler_svc.validation import DEFAULT_MAX_TOKENS

COMPLETIONS_DEFAULT_MAX_TOKENS = DEFAULT_MAX_TOKENS  # vLLM's and OpenAI's 16, as on gRPC; chat runs to the context
_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
}
_FINISH = {FinishReason.STOP: "stop", FinishReason.STOP_SEQUENCE: "stop", FinishReason.LENGTH: "length"}
# Parameters we cannot honour: any value but the neutral one is refused rather than ignored.
_NEUTRAL = {
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "repetition_penalty": 1,
    "echo": False,
    "best_of": 1,
    "logit_bias": {},
}
# validation.py names GenerateRequest fields; say the OpenAI parameter instead.
_RENAMES = (("sampling.", ""), ("prompt.chat.messages", "messages"), ("prompt.chat", "messages"))
_RENAMES_PROMPT = (("prompt.text", "prompt"), ("prompt.token_ids", "prompt"))


class HttpError(ServingError):
    """A refusal decided here (auth, unknown model, body size) with its HTTP status."""

    def __init__(self, message: str, status: int, kind: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param


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


def get(body: dict[str, Any], name: str, kinds: tuple[type, ...], what: str) -> Any:
    """body[name] if of one of `kinds` (JSON true is not a number), None when absent or null."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise HttpError(f"{name} must be {what}, got {json.dumps(value)[:64]}", 400, "invalid_request_error", name)
    return value


def _get_uint(body: dict[str, Any], name: str, bits: int = 32) -> int | None:
    value = get(body, name, (int,), "an integer")
    if value is not None and not 0 <= value < 1 << bits:
        raise HttpError(f"{name} must be in [0, {(1 << bits) - 1}], got {value}", 400, "invalid_request_error", name)
    return value


def _ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def build_request(body: dict[str, Any], chat: bool) -> pb.GenerateRequest:
    """The GenerateRequest for an OpenAI body; types and OpenAI-only rules are checked here,
    ranges and limits by validation.py (via GenerationServicer.submit)."""
    bad = lambda name, msg: HttpError(msg, 400, "invalid_request_error", name)  # noqa: E731
    n = get(body, "n", (int,), "an integer")
    if n not in (None, 1):
        raise bad("n", f"n must be 1 (one choice per request), got {n}")
    for name, neutral in _NEUTRAL.items():
        if body.get(name) not in (None, neutral):
            raise bad(name, f"{name} is not supported (only {json.dumps(neutral)})")
    request = pb.GenerateRequest(cache_salt=get(body, "cache_salt", (str,), "a string") or "")
    if chat:
        request.chat.SetInParent()
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise bad("messages", "messages must be a list of {role, content} objects")
        for i, m in enumerate(messages):
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):  # content parts: text only
                if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                    raise bad("messages", f"messages[{i}].content: only text parts are supported")
                content = "".join(str(p.get("text", "")) for p in content)
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, str | None):
                raise bad("messages", f"messages[{i}] must be an object with a string role and content")
            request.chat.messages.add(role=m["role"], content=content or "")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and (isinstance(prompt[0], str) or _ids(prompt[0])):
            if len(prompt) != 1:
                raise bad("prompt", f"prompt: one prompt per request, got a batch of {len(prompt)}")
            prompt = prompt[0]
        if isinstance(prompt, str):
            request.text = prompt
        elif _ids(prompt):
            if not all(0 <= t < 1 << 32 for t in prompt):
                raise bad("prompt", "prompt: token ids must be >= 0")
            request.token_ids.ids.extend(prompt)
        else:
            raise bad("prompt", "prompt must be a string or a list of token ids")
    s = request.sampling
    for name in ("temperature", "top_p", "min_p"):
        if (value := get(body, name, (int, float), "a number")) is not None:
            setattr(s, name, value)
    if (top_k := get(body, "top_k", (int,), "an integer")) is not None:
        s.top_k = max(min(top_k, 2**31 - 1), -(2**31))
    if (seed := _get_uint(body, "seed", 64)) is not None:
        s.seed = seed
    max_tokens = _get_uint(body, "max_completion_tokens") if chat else None
    max_tokens = max_tokens if max_tokens is not None else _get_uint(body, "max_tokens")
    if max_tokens is None and not chat:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    if max_tokens is not None:
        s.max_tokens = max_tokens
    if (min_tokens := _get_uint(body, "min_tokens")) is not None:
        s.min_tokens = min_tokens
    stop = get(body, "stop", (str, list), "a string or a list of strings")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not all(isinstance(x, str) for x in stop):
        raise bad("stop", "stop must be a string or a list of strings")
    s.stop.extend(stop)
    stop_ids = body.get("stop_token_ids") or []
    if not _ids(stop_ids) or not all(0 <= t < 1 << 32 for t in stop_ids):
        raise bad("stop_token_ids", "stop_token_ids must be a list of token ids")
    s.stop_token_ids.extend(stop_ids)
    if get(body, "ignore_eos", (bool,), "a boolean"):
        s.ignore_eos = True
    if chat:
        if get(body, "logprobs", (bool,), "a boolean"):
            s.logprobs = _get_uint(body, "top_logprobs") or 0
        elif body.get("top_logprobs"):
            raise bad("top_logprobs", "top_logprobs needs logprobs: true")
    elif (logprobs := _get_uint(body, "logprobs")) is not None:
        s.logprobs = logprobs
    if (priority := get(body, "priority", (int,), "an integer")) is not None:
        if not -(2**31) <= priority < 2**31:
            raise bad("priority", f"priority must be a 32-bit integer, got {priority}")
        request.priority = priority
    return request


def usage(final: StreamDelta) -> dict[str, Any]:
    return {
        "prompt_tokens": final.prompt_tokens,
        "completion_tokens": final.completion_tokens,
        "total_tokens": final.prompt_tokens + final.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": final.cached_tokens},
    }


class Choice:
    """One choice being built: text and logprobs in the shape of chat or completions."""

    def __init__(self, engine: Engine, chat: bool, want_logprobs: bool, return_token_ids: bool = False) -> None:
        self.engine, self.chat, self.want_logprobs, self.offset = engine, chat, want_logprobs, 0
        # vLLM's extra parameter: each choice (each streamed chunk) also names its token ids.
        self.return_token_ids = return_token_ids

    def logprobs(self, d: StreamDelta) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        texts = [self.engine.tokenizer.id_to_text(t) for t in d.token_ids]
        if self.chat:

            def entry(text: str, logprob: float) -> dict[str, Any]:
                return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

            content = [
                {**entry(text, lp.logprob), "top_logprobs": [entry(s, v) for _, v, s in lp.top]}
                for text, lp in zip(texts, d.logprobs)
            ]
            return {"content": content}
        offsets = []
        for text in texts:
            offsets.append(self.offset)
            self.offset += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [lp.logprob for lp in d.logprobs],
            "top_logprobs": [{s: v for _, v, s in lp.top} for lp in d.logprobs],
            "text_offset": offsets,
        }

    def body(self, d: StreamDelta, stream: bool) -> dict[str, Any]:
        reason = _FINISH.get(d.finish_reason, "abort") if d.finished else None
        choice: dict[str, Any] = {"index": 0, "logprobs": self.logprobs(d), "finish_reason": reason}
        if not self.chat:
            choice["text"] = d.text
        elif stream:
            choice["delta"] = {"content": d.text} if d.text or not d.finished else {}
        else:
            choice["message"] = {"role": "assistant", "content": d.text}
        if self.return_token_ids:
            choice["token_ids"] = list(d.token_ids)
        return choice
