"""Beam search for the OpenAI front (vLLM's `use_beam_search`), built the way vLLM's serving
layer builds it: on top of the engine, one-token requests per beam per step, not inside the
sampler.

Why there: beam search needs nothing from the executor but each beam's top log probabilities,
and a beam is a prompt the prefix cache mostly holds already (the beams of a step share all
but their last block), so a step of W beams costs W short prefills. The engine, the plan
contract and the greedy/sampling paths stay as they are.

The algorithm (vLLM's): start from the prompt; at each step every live beam asks for its next
token's top 2W log probabilities; each (beam, token) is a candidate with the beam's cumulative
log probability plus the token's; a candidate ending in an end-of-sequence token is complete
(unless ignore_eos), the others compete and the best W by score stay live. After max_tokens
steps (or when no beam is live) the best W of the complete and live beams are the answer,
best first. Score = cumulative logprob / (tokens ** length_penalty), tokens counting the prompt
and the output without a final end-of-sequence token, as vLLM counts them. Log probabilities
are the model's own (raw), so temperature has no part in it and is refused with it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from scheduler_svc.engine import Engine
from scheduler_svc.openai_fields import bad, get
from scheduler_svc.output import collect
from scheduler_svc.request import SamplingParams
from scheduler_svc.validation import MAX_LOGPROBS

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # each beam asks for its top 2W tokens' logprobs

# OpenAI fields a beam search request may carry besides the prompt and its own (n, max_tokens,
# length_penalty): what shapes the prompt or the answer, not the choice of tokens.
BEAM_FIELDS = {
    "model", "prompt", "messages", "n", "max_tokens", "max_completion_tokens", "use_beam_search", "length_penalty",
    "ignore_eos", "stream", "skip_special_tokens", "add_special_tokens", "truncate_prompt_tokens", "request_id",
    "priority", "cache_salt", "user", "add_generation_prompt", "continue_final_message", "chat_template",
    "chat_template_kwargs", "documents", "return_token_ids",
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class BeamOptions:
    width: int  # OpenAI's n: the beams kept, and the choices answered
    length_penalty: float = 1.0
    ignore_eos: bool = False


def options(body: dict[str, Any], n: int) -> BeamOptions:
    """The BeamOptions of a body with use_beam_search true; a 400 naming any field that would
    choose tokens another way (sampling, penalties, stop strings, constraints, logprobs...), as
    beam search does not honour it, and for stream (the answer comes whole)."""
    for name, value in body.items():
        if value is not None and value is not False and name not in BEAM_FIELDS:
            raise bad(name, f"{name} is not supported with use_beam_search")
    if body.get("stream"):
        raise bad("stream", "use_beam_search answers whole: stream is not supported with it")
    if not 1 <= n <= MAX_BEAM_WIDTH:
        raise bad("n", f"n (the beam width) must be in [1, {MAX_BEAM_WIDTH}] with use_beam_search, got {n}")
    penalty = get(body, "length_penalty", (int, float), "a number")
    if penalty is not None and penalty != penalty:
        raise bad("length_penalty", "length_penalty must be a number")
    return BeamOptions(n, 1.0 if penalty is None else float(penalty), bool(body.get("ignore_eos")))


@dataclass(slots=True)
class Beam:
    tokens: list[int]  # the prompt and the output
    output: list[int] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    ended: bool = False  # by an end-of-sequence token


def score(beam: Beam, length_penalty: float) -> float:
    """vLLM's beam score: the cumulative logprob over the length (prompt and output, a final
    end-of-sequence token not counted) to the power length_penalty."""
    return beam.cumulative_logprob / ((len(beam.tokens) - beam.ended) ** length_penalty)


async def search(engine: Engine, prompt: list[int], options: BeamOptions, max_tokens: int, base: Any) -> list[Beam]:
    """The best `options.width` beams, best first. `base` carries the request's cache salt,
    priority and tenant (a GenerateRequest), which every step's requests take."""
    width, eos = options.width, engine.eos_token_ids
    step = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * width, ignore_eos=True)
    live, done = [Beam(list(prompt))], []
    for _ in range(max_tokens):
        tops = await asyncio.gather(*(_top(engine, beam.tokens, step, base) for beam in live))
        candidates = []
        for beam, top in zip(live, tops):
            for token, logprob in top:
                ended = token in eos and not options.ignore_eos
                grown = Beam(beam.tokens + [token], beam.output + [token], beam.cumulative_logprob + logprob, ended)
                (done if ended else candidates).append(grown)
        live = sorted(candidates, key=lambda b: score(b, options.length_penalty), reverse=True)[:width]
        if not live:
            break
    return sorted(done + live, key=lambda b: score(b, options.length_penalty), reverse=True)[:width]


async def _top(engine: Engine, tokens: list[int], step: SamplingParams, base: Any) -> list[tuple[int, float]]:
    """(token, logprob) of the next token's top alternatives after `tokens`: one request of one
    token, aborted if the search is cancelled (the client left)."""
    stream = engine.add_request(tokens, step, base.cache_salt or None, base.priority, base.tenant)
    try:
        final = await collect(stream)
    finally:
        if not stream.finished:
            engine.abort(stream.request_id)
    if final.error is not None:
        raise final.error
    return [(t, v) for t, v, _ in final.logprobs[0].top]


def answer(engine: Engine, beams: list[Beam], prompt_tokens: int, chat: bool, skip_special: bool, ids: bool) -> dict:
    """The choices and usage of a beam search answer, in chat's or completions' shape."""
    choices = []
    for i, beam in enumerate(beams):
        text = engine.tokenizer.decode(beam.output[: len(beam.output) - beam.ended], skip_special_tokens=skip_special)
        choice: dict[str, Any] = {"index": i, "logprobs": None, "finish_reason": "stop" if beam.ended else "length"}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if ids:
            choice["token_ids"] = beam.output
        choices.append(choice)
    completion = sum(len(b.output) for b in beams)
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }
    return {"choices": choices, "usage": usage}


async def run(
    engine: Engine, prompt: list[int], options: BeamOptions, max_tokens: int, base: Any, gone: Awaitable[None]
) -> list[Beam] | None:
    """The search, or None when `gone` (the client's disconnect) comes first: then every step
    request still queued is aborted."""
    task = asyncio.ensure_future(search(engine, prompt, options, max_tokens, base))
    left = asyncio.ensure_future(gone)
    try:
        await asyncio.wait({task, left}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # its requests aborted
    return None if task.cancelled() else task.result()
