"""The HTTP front's surroundings, as vLLM's server has them: an access log line per request,
CORS, JSON error bodies for unknown routes and wrong methods, /tokenize, /detokenize and /render.

Kept apart from http_api.py (generation) so that file stays about requests and streams.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from scheduler_svc.openai_fields import bad, get
from scheduler_svc.openai_protocol import GENERATION_DEFAULTS
from scheduler_svc.request import SamplingParams
from scheduler_svc.tokenizer import Tokenizer

log = logging.getLogger(__name__)
access_log = logging.getLogger("chunkserve.access")
_KINDS = {404: "not_found_error", 405: "invalid_request_error"}


class AccessLog:
    """One INFO line per HTTP request once its response ends (a stream: when it closes):
    client, method, path, status and duration, like uvicorn's access log plus the time.
    Pure ASGI, so streamed responses pass through untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), [0]

        async def send_and_note(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            client = scope.get("client") or ("-", 0)
            access_log.info(
                '%s:%s "%s %s" %d %.1f ms',
                client[0],
                client[1],
                scope["method"],
                scope["path"],
                status[0] or 500,  # no response started: the app failed or the client left first
                (time.perf_counter() - start) * 1e3,
            )


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 / 405 (and any HTTPException) in OpenAI's error shape."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    if status == 404:
        message = f"no route {request.method} {request.url.path}"
    elif status == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
    else:
        message = getattr(exc, "detail", None) or "internal error"
    body = {"error": {"message": message, "type": _KINDS.get(status, "server_error"), "param": None, "code": status}}
    headers = getattr(exc, "headers", None)  # 405 names the allowed methods
    return JSONResponse(body, status, headers=headers)


def tokenize_response(ids: list[int], tokenizer: Tokenizer, max_model_len: int, strs: bool) -> dict[str, Any]:
    """vLLM's /tokenize answer: count, max_model_len, tokens, token_strs (vocabulary strings)."""
    return {
        "count": len(ids),
        "max_model_len": max_model_len,
        "tokens": ids,
        "token_strs": [tokenizer.id_to_token(t) for t in ids] if strs else None,
    }


def render_response(request_id: str, ids: list[int], params: SamplingParams) -> dict[str, Any]:
    """The /render answer in vLLM's shape (its GenerateRequest: request_id, token_ids, features,
    sampling_params), the sampling parameters under vLLM's names, as chunkserve resolved them
    (the model's generation defaults filled in); `structured_outputs` as vLLM's parameters
    name a constraint (`json`, `json_object`, `regex`, `choice`, `grammar`), null without one."""
    sampling = {
        "temperature": params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "min_p": params.min_p,
        "seed": params.seed,
        "max_tokens": params.max_tokens,
        "min_tokens": params.min_tokens,
        "stop": list(params.stop),
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": params.ignore_eos,
        "logprobs": params.logprobs,
        "skip_special_tokens": params.skip_special_tokens,
        "include_stop_str_in_output": params.include_stop_str_in_output,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        "logit_bias": {str(t): v for t, v in params.logit_bias} or None,
        "allowed_token_ids": list(params.allowed_token_ids) or None,
        "structured_outputs": _structured(params),
    }
    return {"request_id": request_id, "token_ids": ids, "features": None, "sampling_params": sampling}


def _structured(params: SamplingParams) -> dict[str, Any] | None:
    c = params.constraint
    if c is None:
        return None
    if c.kind == "json_object":
        return {"json_object": True}
    spec = (
        json.loads(c.spec) if c.kind in ("json_schema", "choice") else c.spec
    )  # JSON text -> its value (a tag stays text, as vLLM)
    return {"json" if c.kind == "json_schema" else c.kind: spec}


def detokenize_ids(body: dict[str, Any], vocab_size: int) -> list[int]:
    """The `tokens` of a /detokenize body, each a token id of this vocabulary."""
    tokens = get(body, "tokens", (list,), "a list of token ids")
    if tokens is None:
        raise bad("tokens", "tokens is required (a list of token ids)")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in tokens):
        raise bad("tokens", f"tokens must be token ids in [0, {vocab_size})")
    return tokens


def parse_origins(value: str) -> tuple[str, ...]:
    """--allowed-origins: comma-separated, or a JSON list as vLLM takes it; empty = no CORS."""
    value = value.strip()
    if value.startswith("["):
        try:
            origins = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"--allowed-origins {value!r}: not a JSON list ({exc})") from None
        if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
            raise ValueError(f"--allowed-origins {value!r}: a JSON list must hold strings")
        return tuple(origins)
    return tuple(o.strip() for o in value.split(",") if o.strip())


# transformers' GenerationConfig defaults: a generation_config.json that repeats one changes
# nothing in vLLM (it applies GenerationConfig.to_diff_dict()), nor here.
_HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


def generation_defaults(setting: str, model_path: str) -> dict[str, Any]:
    """The HTTP API's sampling defaults under --generation-config (vLLM's meaning): `auto`
    reads the model folder's generation_config.json, `vllm` gives none, anything else is a
    folder holding one. The fields vLLM takes from it: temperature, top_p, top_k, min_p,
    repetition_penalty and max_new_tokens (which caps max_tokens)."""
    if setting == "vllm" or (setting == "auto" and not model_path):
        return {}
    folder = Path(model_path if setting == "auto" else setting).expanduser()
    path = folder / "generation_config.json"
    if not path.is_file():
        if setting != "auto":
            raise ValueError(f"--generation-config {setting}: no generation_config.json in that folder")
        return {}
    try:
        config = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    defaults = {}
    for name, key in GENERATION_DEFAULTS.items():
        value = config.get(key)
        if value is None or _HF_DEFAULTS.get(key) == value:  # vLLM reads the diff from transformers' defaults
            continue
        if isinstance(value, bool) or not isinstance(value, int if name in ("top_k", "max_tokens") else int | float):
            log.warning("%s: %s=%r is not a number of the right kind; not applied", path, key, value)
            continue
        defaults[name] = value
    if defaults:
        log.info("HTTP sampling defaults from %s: %s", path, defaults)
    return defaults
