"""Grammar-constrained decoding in the scheduler: compiling a request's Constraint off the
event loop, and the matcher that gives each step its token mask and follows accepted tokens.

Library: llguidance (guidance-ai). It has a plain-Python/bytes API with no torch dependency,
reads the same tokenizer.json the scheduler already loads (through the `tokenizers` library's
Rust tokenizer), compiles JSON schemas, regexes and Lark grammars lazily (ms, not seconds)
and computes a 49K-token mask in microseconds. xgrammar needs torch for its masks, and the
scheduler process must never import torch (tests/test_structure.py).

How a constraint travels (docs/architecture.md, "Structured output"):
- admission (Engine.add_request) starts compiling on a small thread pool (`CompileTasks`);
  the request is scheduled for prefill chunks meanwhile, but never for a step that samples
  until its matcher is there (Scheduler holds back its last known token), so compile time
  hides behind prefill. A constraint that does not compile ends the request with
  INVALID_ARGUMENT (its blocks are freed like an abort's).
- each plan carries, per constrained entry that samples, the packed mask row of its next
  token (plan.TokenMask); the executor's sampler masks the logits with it.
- the scheduler feeds each accepted token to the matcher (Scheduler.update); a matcher that
  stops (the grammar is complete) finishes the request with reason STOP.
The matcher only ever sees tokens that were output, so preemption (recompute or swap), which
never takes an output token back, leaves it right; a request with a token in flight is not
planned again until that token is applied (async scheduling), since its mask depends on it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

from scheduler_svc.errors import InternalError, InvalidRequestError, ServingError
from scheduler_svc.request import FinishReason, Request, SamplingParams
from scheduler_svc.structured import Constraint, GrammarMatcher

log = logging.getLogger(__name__)

# Compiled grammars kept (fresh, unconsumed) for reuse: requests with the same constraint (a
# client's fixed schema, tool set) copy the compiled matcher instead of compiling again.
CACHE_SIZE = 64
# JSON as models usually write it (", " and ": "), and no free whitespace: a small model
# allowed unbounded whitespace can fill max_tokens with newlines.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarCompiler(Protocol):
    """Compiles constraints (the engine's view; tests pass a fake to control readiness)."""

    async def compile(self, constraint: Constraint) -> GrammarMatcher:
        """A fresh matcher for the constraint; raises ValueError when it does not compile."""
        ...

    def cached(self, constraint: Constraint) -> GrammarMatcher | None:
        """A fresh matcher at once when this constraint was compiled before (no wait, no
        thread hop: the request can sample in its first step), else None."""
        ...

    def prefetch(self, constraint: Constraint) -> None:
        """Starts compiling ahead of admission (before the prompt is tokenized); no result."""
        ...


class LLGuidanceMatcher:
    """A GrammarMatcher over one llguidance LLMatcher (one request's state)."""

    __slots__ = ("_m", "_row_bytes")

    def __init__(self, matcher: object, vocab_size: int) -> None:
        self._m = matcher
        self._row_bytes = 4 * ((vocab_size + 31) // 32)

    def token_mask(self) -> bytes:
        """The next token's packed mask: ceil(vocab / 32) little-endian int32 words, bit i = token
        i allowed (EOS only where the grammar accepts; the model's padding ids never).
        llguidance writes vocab // 32 + 1 words, one too many when 32 divides the vocabulary
        (always zero): cut to the plan's row length."""
        return self._m.compute_bitmask()[: self._row_bytes]

    def accept(self, token_id: int) -> bool:
        return self._m.consume_token(token_id)

    def draft_masks(self, draft: Sequence[int]) -> list[bytes]:
        """The masks after each token of the longest prefix of `draft` the grammar allows
        (row j: after its first j + 1 tokens), the state left as it was: the matcher walks the
        prefix, then rolls back over it."""
        allowed = self._m.validate_tokens(list(draft))
        rows = []
        for token in draft[:allowed]:
            if not self._m.consume_token(token):  # validate_tokens said it would: a bug upstream
                break
            rows.append(self.token_mask())
        if rows and not self._m.rollback(len(rows)):
            raise RuntimeError(f"grammar matcher could not roll back {len(rows)} draft tokens: {self.error()}")
        return rows

    def is_stopped(self) -> bool:
        return self._m.is_stopped()

    def error(self) -> str:
        return self._m.get_error()


class LLGuidanceCompiler:
    """Compiles constraints with llguidance on its own threads (llguidance drops the GIL while
    it builds a grammar, so the event loop keeps running)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int], threads: int = 2) -> None:
        """vocab_size is the model's (its logits' width): ids past the tokenizer's are the
        model's padding and are never allowed. Building the llguidance tokenizer takes ~0.4 s
        for a 49K vocabulary, so it starts now on the pool, ahead of the first compile."""
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[Constraint, object] = OrderedDict()
        self._inflight: dict[Constraint, Future] = {}
        self.vocab_size = vocab_size
        self._tokenizer: Future = self._pool.submit(_llg_tokenizer, tokenizer_json, vocab_size, list(eos_token_ids))

    @staticmethod
    def from_folder(folder: str | Path, vocab_size: int, eos_token_ids: Sequence[int]) -> LLGuidanceCompiler:
        return LLGuidanceCompiler((Path(folder) / "tokenizer.json").read_text(), vocab_size, eos_token_ids)

    def prefetch(self, constraint: Constraint) -> None:
        """Starts compiling now (the servicer calls it before tokenizing the prompt), so that
        admission usually finds the constraint compiled. Errors wait for the request's own
        compile, which shares this one."""
        self._compiled(constraint)

    async def compile(self, constraint: Constraint) -> GrammarMatcher:
        compiled = await asyncio.wrap_future(self._compiled(constraint))
        return LLGuidanceMatcher(compiled.deep_copy(), self.vocab_size)

    def cached(self, constraint: Constraint) -> LLGuidanceMatcher | None:
        with self._lock:
            compiled = self._cache.get(constraint)
            if compiled is None:
                return None
            self._cache.move_to_end(constraint)
        return LLGuidanceMatcher(compiled.deep_copy(), self.vocab_size)

    def compile_now(self, constraint: Constraint) -> LLGuidanceMatcher:
        """Compiles and waits (tests, benchmarks); ValueError when it does not compile."""
        return LLGuidanceMatcher(self._compiled(constraint).result().deep_copy(), self.vocab_size)

    def _compiled(self, constraint: Constraint) -> Future:
        """The compiled, never consumed matcher: from the cache, or the compile already under
        way for this constraint (one compile however many requests ask at once), or a new one."""
        with self._lock:
            compiled = self._cache.get(constraint)
            if compiled is not None:
                self._cache.move_to_end(constraint)
                done: Future = Future()
                done.set_result(compiled)
                return done
            future = self._inflight.get(constraint)
            if future is None:
                future = self._pool.submit(self._build, constraint)
                self._inflight[constraint] = future
            return future

    def _build(self, constraint: Constraint) -> object:
        import llguidance as llg

        try:
            try:
                tokenizer = self._tokenizer.result()
            except Exception as exc:
                raise ValueError(
                    f"structured output is unavailable: llguidance cannot read this tokenizer ({exc})"
                ) from None
            matcher = llg.LLMatcher(tokenizer, grammar_text(constraint), log_level=0)
            if matcher.is_error():
                raise ValueError(matcher.get_error().strip())
            with self._lock:
                self._cache[constraint] = matcher
                if len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            return matcher
        finally:
            with self._lock:
                self._inflight.pop(constraint, None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def grammar_text(constraint: Constraint) -> str:
    """llguidance's grammar for a constraint (ValueError on a schema it cannot read)."""
    import llguidance as llg

    kind, spec = constraint.kind, constraint.spec
    if kind in ("json_schema", "json_object"):
        schema = spec if kind == "json_schema" else '{"type": "object"}'
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec)
    if kind == "structural_tag":
        # A Lark grammar of lazy triggers (llguidance's own StructTag.to_grammar); each schema's
        # JSON written as everywhere else unless its own x-guidance says otherwise.
        tag = json.loads(spec)
        tags = [
            llg.StructTag(
                trigger=next(t for t in tag["triggers"] if s["begin"].startswith(t)),
                begin=s["begin"],
                grammar=_with_defaults(s["schema"]),
                end=s["end"],
            )
            for s in tag["structures"]
        ]
        return llg.LLMatcher.grammar_from_lark(llg.StructTag.to_grammar(tags))
    if kind == "choice":
        # A Lark alternation of JSON-quoted literals (llguidance's own grammar_from("choice")).
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(spec)))
    return llg.LLMatcher.grammar_from_lark(spec)


def _with_defaults(schema: dict) -> dict:
    """The schema with chunkserve's JSON options under its own x-guidance (which wins)."""
    own = schema.get("x-guidance", {})
    return {**schema, "x-guidance": {**_JSON_OPTIONS, **own}} if isinstance(own, dict) else schema


def _llg_tokenizer(tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> object:
    import llguidance as llg

    return llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_ids or None)


def check_constrained(sampling: SamplingParams) -> None:
    """Refuses what a constraint cannot honour (both fronts admit through Engine.add_request):
    ignore_eos and min_tokens would need EOS where the grammar forbids it, or other tokens
    where it is complete and allows only EOS."""
    if sampling.constraint is None:
        return
    if sampling.ignore_eos:
        raise InvalidRequestError("ignore_eos cannot be combined with structured output (the grammar decides the end)")
    if sampling.min_tokens:
        raise InvalidRequestError("min_tokens cannot be combined with structured output (the grammar decides the end)")


class CompileTasks:
    """One compile task per constrained request, on the event loop. A compiled matcher is set
    on the request (`request.matcher`), which the scheduler takes as "ready to sample", and
    `on_ready` is called (the engine wakes its loop); a failed compile calls `on_error`
    with an InvalidRequestError (the engine ends the request). Readiness only changes on
    the event loop, between steps."""

    def __init__(
        self,
        compiler: GrammarCompiler | None,
        on_ready: Callable[[Request], None],
        on_error: Callable[[Request, ServingError], None],
    ) -> None:
        self.compiler = compiler
        self._on_ready, self._on_error = on_ready, on_error
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def start(self, request: Request) -> None:
        """Starts compiling request's constraint; InvalidRequestError when this server cannot
        constrain output at all (no compiler: the tokenizer is not one llguidance reads)."""
        constraint = request.sampling.constraint
        if constraint is None:
            return
        if self.compiler is None:
            raise InvalidRequestError("structured output is not available with this model's tokenizer")
        if (matcher := self.compiler.cached(constraint)) is not None:
            request.matcher = matcher  # compiled before: ready for its first step
            return
        task = asyncio.get_running_loop().create_task(self._compile(request, constraint))
        self._tasks[request.request_id] = task

    def prefetch(self, constraint: Constraint | None) -> None:
        """Starts compiling a request's constraint before its prompt is tokenized (servicer)."""
        if constraint is not None and self.compiler is not None:
            self.compiler.prefetch(constraint)

    def cancel(self, request_id: str) -> None:
        """The request ended (abort, cancel, failure): its compile, if any, is not waited for."""
        task = self._tasks.pop(request_id, None)
        if task is not None:
            task.cancel()

    def cancel_all(self) -> None:
        for request_id in list(self._tasks):
            self.cancel(request_id)

    @property
    def pending(self) -> int:
        return len(self._tasks)

    async def _compile(self, request: Request, constraint: Constraint) -> None:
        try:
            matcher = await self.compiler.compile(constraint)
        except asyncio.CancelledError:
            raise
        except ValueError as exc:
            self._tasks.pop(request.request_id, None)
            self._on_error(request, InvalidRequestError(f"the {constraint.kind} constraint does not compile: {exc}"))
            return
        except Exception as exc:  # a bug in the library or here: this request fails, not the loop
            log.exception("compiling a %s constraint failed", constraint.kind)
            self._tasks.pop(request.request_id, None)
            self._on_error(request, InternalError(f"compiling the {constraint.kind} constraint failed: {exc}"))
            return
        self._tasks.pop(request.request_id, None)
        if not request.is_finished:
            request.matcher = matcher
            self._on_ready(request)


def advance_grammar(request: Request, token_id: int, reason: FinishReason | None) -> FinishReason | None:
    """Feeds an output token to the request's matcher; a complete grammar ends the request
    (STOP). The token was sampled under the matcher's own mask, so a refusal is a bug: it is
    logged and the request ends rather than go on unconstrained."""
    if not request.matcher.accept(token_id):
        log.error("request %s: token %d refused by its grammar after masking", request.request_id, token_id)
        return reason or FinishReason.STOP
    if reason is None and request.matcher.is_stopped():
        return FinishReason.STOP
    return reason
