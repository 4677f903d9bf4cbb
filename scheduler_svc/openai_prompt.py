"""The prompt of an OpenAI request: its chat-template options and how it becomes token ids.

vLLM's chat and completions requests carry options the gRPC GenerateRequest has no fields
for: `add_generation_prompt`, `continue_final_message`, a per-request `chat_template`,
`chat_template_kwargs`, `documents`, `tools` (rendered by the template), `add_special_tokens`
and `truncate_prompt_tokens`; and chat messages richer than role + text (assistant tool
calls, tool results). A `PromptSpec` holds them; GenerationServicer.submit runs its `ids` on
the tokenize worker, off the event loop, in place of validation.tokenize_prompt, with the
same bounds (text over the byte bound is refused before it is encoded).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from scheduler_svc.errors import InvalidRequestError
from scheduler_svc.openai_fields import bad, get
from scheduler_svc.openai_tools import fallback_messages, native_messages
from scheduler_svc.tokenizer import Template, Tokenizer, compile_template
from scheduler_svc.validation import Limits

# Names the template gets from the request itself: chat_template_kwargs may not replace them.
_RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message"})


@dataclass
class PromptSpec:
    """A request's prompt and how to render and encode it."""

    text: str | None = None  # completions: a text prompt
    messages: list[dict[str, Any]] | None = None  # chat: the messages as the template gets them
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template: Template | None = None  # a per-request chat_template (None: the server's)
    variables: dict[str, Any] = field(default_factory=dict)  # tools, documents, chat_template_kwargs
    add_special_tokens: bool = False
    truncate: int | None = None  # keep only the last this many prompt tokens
    tools: list[dict[str, Any]] | None = None  # rendered by the template, or the fallback prompt

    def ids(self, tokenizer: Tokenizer, limits: Limits) -> list[int]:
        """The prompt's token ids; InvalidRequestError naming the OpenAI field otherwise."""
        if self.messages is None:
            text, where = self.text or "", "prompt"
        else:
            text, where = self._render(tokenizer), "messages (as rendered by the chat template)"
        if not text:
            raise InvalidRequestError("prompt is empty" if self.messages is None else "messages rendered empty")
        bound = limits.max_prompt_bytes
        if bound is not None and len(text) * 4 > bound and len(text.encode()) > bound:
            raise InvalidRequestError(
                f"{where} has {len(text.encode())} UTF-8 bytes; no text over {bound} bytes fits in "
                f"max_model_len {limits.max_model_len} tokens"
            )
        ids = tokenizer.encode(text, add_special_tokens=self.add_special_tokens)
        if self.truncate is not None:  # -1: as much as fits with one token to generate
            ids = ids[-(limits.max_model_len - 1 if self.truncate == -1 else self.truncate) :]
        if not ids:
            raise InvalidRequestError("prompt is empty after tokenization")
        if len(ids) >= limits.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; max_model_len {limits.max_model_len} leaves no room to generate"
            )
        return ids

    def _render(self, tokenizer: Tokenizer) -> str:
        messages, variables = self.messages, self.variables
        try:
            if self.tools is not None:  # openai_tools.py: natively when the template reads `tools`
                takes = "tools" in self.template.variables if self.template else tokenizer.template_takes_tools
                if takes:
                    messages, variables = native_messages(messages), {**variables, "tools": self.tools}
                else:
                    messages = fallback_messages(messages, self.tools)
            text = tokenizer.render_chat(messages, self.add_generation_prompt, self.template, **variables)
        except ValueError as exc:
            raise InvalidRequestError(f"messages: {exc}") from None
        if self.continue_final_message:
            text = _cut_after_final_message(text, self.messages[-1].get("content"))
        return text


def _cut_after_final_message(text: str, content: Any) -> str:
    """The rendered chat up to the end of the last message's content, so the model goes on
    with that message (Hugging Face's continue_final_message: templates may strip it)."""
    if isinstance(content, list):
        content = next((p.get("text", "") for p in reversed(content) if isinstance(p, dict)), "")
    content = content if isinstance(content, str) else ""
    for needle in (content, content.strip()):
        if needle and needle in text:
            return text[: text.rindex(needle) + len(needle)]
    raise InvalidRequestError(
        "messages: continue_final_message is set but the final message's content does not appear in the "
        "chat as the template renders it"
    )


def chat_options(body: dict[str, Any], spec: PromptSpec, trust_template: bool) -> None:
    """Fills spec's chat options from the body (vLLM's chat extras), checking their types."""
    continue_final = bool(get(body, "continue_final_message", (bool,), "a boolean"))
    add_prompt = get(body, "add_generation_prompt", (bool,), "a boolean")
    if continue_final and add_prompt:
        raise bad("continue_final_message", "continue_final_message and add_generation_prompt cannot both be true")
    spec.continue_final_message = continue_final
    spec.add_generation_prompt = (not continue_final) if add_prompt is None else add_prompt
    if continue_final and (not spec.messages or spec.messages[-1].get("role") != "assistant"):
        raise bad("continue_final_message", "continue_final_message needs an assistant message last")
    if (source := get(body, "chat_template", (str,), "a string")) is not None:
        if not trust_template:
            raise bad(
                "chat_template",
                "chat_template: this server does not run templates sent in requests (start it with "
                "--trust-request-chat-template, or give the template with --chat-template)",
            )
        try:
            spec.template = compile_template(source)
        except ValueError as exc:
            raise bad("chat_template", f"chat_template: {exc}") from None
    kwargs = get(body, "chat_template_kwargs", (dict,), "an object") or {}
    if clash := sorted(_RESERVED & set(kwargs)):
        raise bad("chat_template_kwargs", f"chat_template_kwargs may not set {', '.join(clash)}")
    spec.variables.update(kwargs)
    documents = get(body, "documents", (list,), "a list of objects")
    if documents is not None:
        if not all(isinstance(d, dict) for d in documents):
            raise bad("documents", "documents must be a list of objects (e.g. {title, text})")
        spec.variables["documents"] = documents
    if (effort := get(body, "reasoning_effort", (str,), "a string")) is not None:
        spec.variables["reasoning_effort"] = effort  # templates that reason read it (vLLM passes it too)


def encoding_options(body: dict[str, Any], spec: PromptSpec, chat: bool) -> None:
    """add_special_tokens (chat default false: the template writes them; completions true)
    and truncate_prompt_tokens (keep the last k tokens)."""
    add = get(body, "add_special_tokens", (bool,), "a boolean")
    spec.add_special_tokens = (not chat) if add is None else add
    truncate = get(body, "truncate_prompt_tokens", (int,), "an integer")
    if truncate is not None and truncate != -1 and truncate < 1:
        raise bad("truncate_prompt_tokens", f"truncate_prompt_tokens must be >= 1 (or -1), got {truncate}")
    spec.truncate = truncate
