"""Output processing: a sampled token becomes a stream delta, and deltas reach both fronts.

Separate from the step loop (engine.py) because it is about text, not scheduling: each
token is detokenized incrementally, checked for stop strings and given its logprobs here,
and a request's final delta carries its usage. Both public fronts read a stream the same
way, `stream_deltas` (gRPC and streamed HTTP) or `collect` (a non-streamed HTTP answer),
through the one folding rule `fold`, so they cannot disagree about what a request produced.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from scheduler_svc.errors import ServingError
from scheduler_svc.request import FinishReason, Request
from scheduler_svc.scheduler import TokenOutput
from scheduler_svc.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(slots=True)
class TokenLogprobs:
    """Logprob of a generated token and its top alternatives (id, logprob, text)."""

    logprob: float
    top: list[tuple[int, float, str]]
    rank: int = 0  # prompt logprobs: 1 + the number of tokens more likely; 0 unknown


@dataclass(slots=True)
class StreamDelta:
    """New output of one request; the last one has finished=True (or an error)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # With prompt logprobs, on the first token's delta: one per prompt token from the second
    # on, and the prompt's ids.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    matched_stop: str | None = None
    matched_stop_token_id: int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: ServingError | None = None


class RequestStream:
    """The consumer side of one request: an unbounded queue of deltas."""

    def __init__(self, request_id: str, num_prompt_tokens: int = 0) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.queue: asyncio.Queue[StreamDelta] = asyncio.Queue()
        self.finished = False
        # Called after each put: a reader of many streams (mux.py) is woken here instead of
        # awaiting each queue in a task of its own.
        self.on_put: Callable[[], None] | None = None

    def put(self, delta: StreamDelta) -> None:
        if delta.finished or delta.error is not None:
            self.finished = True
        self.queue.put_nowait(delta)
        if self.on_put is not None:
            self.on_put()


@dataclass(slots=True)
class LiveRequest:
    """A request the engine still streams to: its state, its stream and its detokenizer."""

    request: Request
    stream: RequestStream
    detok: IncrementalDetokenizer
    num_emitted: int = 0  # output tokens turned into deltas so far

    @classmethod
    def start(cls, request: Request, tokenizer: Tokenizer) -> LiveRequest:
        """A new request's stream, and a detokenizer that knows its prompt and stop strings."""
        params, prompt = request.sampling, request.prompt_token_ids
        detok = IncrementalDetokenizer(
            tokenizer, prompt, params.stop, params.skip_special_tokens, params.include_stop_str_in_output
        )
        return cls(request, RequestStream(request.request_id, len(prompt)), detok)

    def token_delta(self, out: TokenOutput, tokenizer: Tokenizer) -> StreamDelta:
        """The delta of one sampled token; final (finish_reason set) when the token ended the
        request, STOP_SEQUENCE when its text completed a stop string (the caller then
        finishes the request in the scheduler, which checks only token ids)."""
        token, reason = out.sampled.token_id, out.finish_reason
        self.num_emitted += 1
        # A token that stopped the request by id (EOS, stop id) contributes no text, unless the
        # request keeps its stop strings (vLLM's include_stop_str_in_output keeps that token's).
        # A grammar that completes (structured output) ends on an ordinary token: its text stays.
        params = self.request.sampling
        by_id = reason is FinishReason.STOP and (token in params.stop_token_ids or token in self.request.eos_token_ids)
        keep = not by_id or params.include_stop_str_in_output
        text = self.detok.add(token) if keep else ""
        if self.detok.matched_stop is not None:
            reason = FinishReason.STOP_SEQUENCE
        logprobs = []
        if self.request.sampling.logprobs is not None:
            top = [(t, lp, tokenizer.id_to_text(t)) for t, lp in out.sampled.top]
            logprobs = [TokenLogprobs(out.sampled.logprob, top)]
        if reason is None:
            delta = StreamDelta(token_ids=[token], text=text, logprobs=logprobs)
        else:
            # A verify step (speculative decoding) may have given tokens after this one: they are
            # not output, and usage does not count them.
            del self.request.output_token_ids[self.num_emitted :]
            delta = self.final(reason, text + self.detok.flush())
            delta.token_ids, delta.logprobs = [token], logprobs
        if self.num_emitted == 1 and params.prompt_logprobs is not None:
            delta.prompt_token_ids = list(self.request.prompt_token_ids)
            delta.prompt_logprobs = [
                TokenLogprobs(lp, [(t, v, tokenizer.id_to_text(t)) for t, v in top], rank)
                for lp, top, rank in self.request.prompt_logprobs
            ]
        if reason is FinishReason.STOP and token in params.stop_token_ids:
            delta.matched_stop_token_id = token
        return delta

    def final(self, reason: FinishReason, text: str) -> StreamDelta:
        """The request's last delta: why it ended, and its usage."""
        return StreamDelta(
            text=text,
            finished=True,
            finish_reason=reason,
            matched_stop=self.detok.matched_stop,
            prompt_tokens=self.request.num_prompt_tokens,
            completion_tokens=self.request.num_output_tokens,
            cached_tokens=self.request.num_cached_tokens,
        )


def fold(into: StreamDelta, delta: StreamDelta) -> StreamDelta:
    """Folds a later delta into an earlier one; a final one (finished or error) takes in all before it."""
    into.token_ids += delta.token_ids
    into.text += delta.text
    into.logprobs += delta.logprobs
    into.prompt_logprobs = into.prompt_logprobs or delta.prompt_logprobs
    into.prompt_token_ids = into.prompt_token_ids or delta.prompt_token_ids
    if delta.finished or delta.error is not None:
        kept = into.token_ids, into.text, into.logprobs, into.prompt_logprobs, into.prompt_token_ids
        into = delta
        into.token_ids, into.text, into.logprobs, into.prompt_logprobs, into.prompt_token_ids = kept
    return into


async def stream_deltas(stream: RequestStream) -> AsyncIterator[StreamDelta]:
    """Yields deltas until the final one, folding what queued up meanwhile (a slow reader
    gets fewer, larger messages)."""
    while True:
        delta = await stream.queue.get()
        while not stream.queue.empty() and not (delta.finished or delta.error):
            delta = fold(delta, stream.queue.get_nowait())
        yield delta
        if delta.finished or delta.error is not None:
            return


async def collect(stream: RequestStream) -> StreamDelta:
    """A request's whole output: every delta folded into its final one."""
    whole = StreamDelta()
    async for delta in stream_deltas(stream):
        whole = fold(whole, delta)
    return whole
