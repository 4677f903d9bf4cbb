"""Tokenizer, chat template and incremental detokenizer, without transformers or torch.

transformers' AutoTokenizer imports torch, and the scheduler process must not; the
`tokenizers` library reads the same tokenizer.json, and jinja2 renders the same chat
template (with the options Hugging Face uses), so token ids match transformers exactly.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as _HFTokenizer

# Context tokens the detokenizer decodes along with new ones, so that tokenizers whose
# decoding depends on the previous token (leading spaces) produce the same text.
_CONTEXT_TOKENS = 5


class Tokenizer:
    """Encodes prompts, renders chat messages, decodes ids; loaded from a model folder."""

    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"no tokenizer.json in {folder} (pass --tokenizer with a folder that has one)")
        self._tok = _HFTokenizer.from_file(str(path))
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        template = cfg.get("chat_template")
        template_path = folder / "chat_template.jinja"
        if template is None and template_path.is_file():
            template = template_path.read_text()
        self._template = _compile_template(template) if isinstance(template, str) else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return self._tok.token_to_id(self.eos_token) if self.eos_token else None

    def encode(self, text: str) -> list[int]:
        """Token ids of a plain prompt, with the tokenizer's own special-token convention."""
        return self._tok.encode(text, add_special_tokens=True).ids

    def apply_chat_template(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Renders messages with the model's template (plus the assistant prompt) and encodes.

        Raises ValueError when the model has no chat template or the template rejects the
        conversation (e.g. roles out of order).
        """
        if self._template is None:
            raise ValueError("this model has no chat template; send the prompt as text")
        try:
            text = self._template.render(
                messages=list(messages), add_generation_prompt=True,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template rejected the messages: {exc}") from exc
        # The template already wrote the special tokens it wants (transformers does the same).
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def id_to_text(self, token_id: int) -> str:
        """One token's text (for logprob alternatives)."""
        return self._tok.decode([token_id], skip_special_tokens=False)


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):  # older configs store {"content": ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def _compile_template(source: str) -> jinja2.Template:
    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    return env.from_string(source)


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas that never split a character.

    Decodes a small window (a few context tokens plus the unread ones) rather than the whole
    output each time. A window whose text ends in U+FFFD is an incomplete UTF-8 sequence:
    its bytes are held back until the next token completes them. Stop strings are matched
    here too; text that could be the start of a stop string is held back until it is not.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], stop: Sequence[str] = ()) -> None:
        self._tok = tokenizer
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = tuple(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""  # all output text decoded so far (cut at a matched stop)
        self._sent = 0  # characters of self.text already returned
        self.matched_stop: str | None = None

    def add(self, token_id: int) -> str:
        """Adds one token; returns the text now safe to stream (maybe empty)."""
        self._ids.append(token_id)
        prefix = self._tok.decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._tok.decode(self._ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new_text = full[len(prefix):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            start = max(0, len(self.text) - self._hold)
            self.text += new_text
            if self._stop and self._match_stop(start):
                return self.flush()
        return self._take(len(self.text) - self._hold)

    def _match_stop(self, start: int) -> bool:
        best = None
        for stop in self._stop:
            at = self.text.find(stop, start)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return False
        self.text = self.text[:best[0]]
        self.matched_stop = best[1]
        return True

    def flush(self) -> str:
        """Everything not yet returned (call when the request finishes).

        Bytes of a character the output ended in the middle of come out as U+FFFD, as
        decoding the whole output would give them; they are never dropped.
        """
        if self.matched_stop is None and self._read_offset < len(self._ids):
            prefix = self._tok.decode(self._ids[self._prefix_offset:self._read_offset])
            self.text += self._tok.decode(self._ids[self._prefix_offset:])[len(prefix):]
            self._prefix_offset = self._read_offset = len(self._ids)
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        if end <= self._sent:
            return ""
        out = self.text[self._sent:end]
        self._sent = end
        return out
