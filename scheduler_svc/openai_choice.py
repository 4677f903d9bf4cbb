"""OpenAI's answer shapes for the HTTP front (http_api.py): one choice of a completion or
chat completion as it is built from a request's stream deltas (text or message, logprobs in
either API's shape, tool calls, echo), and the usage of a response."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from scheduler_svc.engine import Engine
from scheduler_svc.openai_tools import ToolPlan, tool_message
from scheduler_svc.output import StreamDelta
from scheduler_svc.request import FinishReason
from scheduler_svc.tool_parser import ToolParser

_FINISH = {FinishReason.STOP: "stop", FinishReason.STOP_SEQUENCE: "stop", FinishReason.LENGTH: "length"}


def usage(*finals: StreamDelta) -> dict[str, Any]:
    """OpenAI's usage of a response of one or more choices (n): the prompt counted once (the
    first choice's cached tokens), the completion tokens of all choices (as vLLM)."""
    first, completion = finals[0], sum(f.completion_tokens for f in finals)
    return {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": first.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": first.cached_tokens},
    }


class Choice:
    """One choice being built: text and logprobs in the shape of chat or completions."""

    def __init__(
        self,
        engine: Engine,
        chat: bool,
        want_logprobs: bool,
        return_token_ids: bool = False,
        tokens_as_ids: bool = False,
        tools: ToolPlan | None = None,
        index: int = 0,
        echo: str | None = None,
    ) -> None:
        self.engine, self.chat, self.want_logprobs, self.offset = engine, chat, want_logprobs, 0
        self.index = index  # of this choice in the response (OpenAI's n)
        # echo: the prompt's text (completions) or the last message's (chat), before the first delta's.
        self.echo = echo
        # vLLM's extra parameter: each choice (each streamed chunk) also names its token ids.
        self.return_token_ids = return_token_ids
        # vLLM's return_tokens_as_token_ids: logprob tokens as "token_id:N" (any token JSON-safe).
        self.tokens_as_ids = tokens_as_ids
        # Tool calls read out of the text (tool_choice auto, required or named), tool_parser.py.
        self.tools = tools if tools is not None and tools.choice != "none" else None
        self.parser = ToolParser(tools.choice, tools.names, tools.named) if self.tools else None

    def token_text(self, token_id: int, text: str | None = None) -> str:
        if self.tokens_as_ids:
            return f"token_id:{token_id}"
        return self.engine.tokenizer.id_to_text(token_id) if text is None else text

    def logprobs(self, d: StreamDelta) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        texts = [self.token_text(t) for t in d.token_ids]
        if self.chat:

            def entry(text: str, logprob: float) -> dict[str, Any]:
                return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

            content = [
                {**entry(text, lp.logprob), "top_logprobs": [entry(self.token_text(t, s), v) for t, v, s in lp.top]}
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
            "top_logprobs": [{self.token_text(t, s): v for t, v, s in lp.top} for lp in d.logprobs],
            "text_offset": offsets,
        }

    def _echoed(self, d: StreamDelta) -> tuple[str, dict[str, Any] | None]:
        """The first delta's text and logprobs after the prompt's (completions' echo): the
        prompt's first token has no logprob (null, as OpenAI and vLLM)."""
        prompt, self.echo = self.echo or "", None
        if not self.want_logprobs:
            return prompt + d.text, None
        lps = [None, *d.prompt_logprobs]
        tokens = [self.token_text(t) for t in d.prompt_token_ids[: len(lps)]]
        offsets = []
        for text in tokens:
            offsets.append(self.offset)
            self.offset += len(text)
        out = self.logprobs(d)
        return prompt + d.text, {
            "tokens": tokens + out["tokens"],
            "token_logprobs": [lp and lp.logprob for lp in lps] + out["token_logprobs"],
            "top_logprobs": [lp and {self.token_text(t, s): v for t, v, s in lp.top} for lp in lps]
            + out["top_logprobs"],
            "text_offset": offsets + out["text_offset"],
        }

    def body(self, d: StreamDelta, stream: bool) -> dict[str, Any]:
        reason = _FINISH.get(d.finish_reason, "abort") if d.finished else None
        choice: dict[str, Any] = {"index": self.index, "logprobs": None, "finish_reason": reason}
        if not self.chat:
            if self.echo is not None and (d.token_ids or d.finished):
                choice["text"], choice["logprobs"] = self._echoed(d)
            else:
                choice["text"], choice["logprobs"] = d.text, self.logprobs(d)
            return self._with_ids(choice, d)
        choice["logprobs"] = self.logprobs(d)
        text = d.text
        if self.echo is not None and (d.token_ids or d.finished):  # chat's echo (no tools with it)
            text, self.echo = self.echo + text, None
        if self.parser is not None:
            events = self.parser.feed(d.text)
            if d.finished:
                events.merge(self.parser.finish())
            if d.finished and self.parser.calls and self.tools.choice != "named" and reason == "stop":
                choice["finish_reason"] = "tool_calls"  # as OpenAI (a forced named function says stop)
            choice["delta" if stream else "message"] = tool_message(events, self.parser, stream, d.finished)
        elif stream:
            choice["delta"] = {"content": text} if text or not d.finished else {}
        else:
            choice["message"] = {"role": "assistant", "content": text}
        return self._with_ids(choice, d)

    def _with_ids(self, choice: dict[str, Any], d: StreamDelta) -> dict[str, Any]:
        if self.return_token_ids:
            choice["token_ids"] = list(d.token_ids)
        return choice


def prompt_logprobs_json(d: StreamDelta, text: Callable[[int, str | None], str]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs` answer: null for the first prompt token, then per token a map
    from token id to its logprob, rank and text: the prompt's own token and the top ones."""
    out: list[dict[str, Any] | None] = [None]
    for token, lp in zip(d.prompt_token_ids[1:], d.prompt_logprobs):
        entry = {str(token): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": text(token, None)}}
        for rank, (t, v, s) in enumerate(lp.top, start=1):
            entry.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": text(t, s)})
        out.append(entry)
    return out
