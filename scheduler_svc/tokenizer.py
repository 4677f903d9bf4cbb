"""Tokenizer, chat template and incremental detokenizer, without transformers or torch.

transformers' AutoTokenizer imports torch, and the scheduler process must not; the
`tokenizers` library reads the same tokenizer.json, and jinja2 renders the same chat
template (with the options Hugging Face uses), so token ids match transformers exactly.

Encoding goes through `encode_batch_fast`, which releases the GIL while the Rust code runs
(`encode` holds it for the whole call: a 1.6 MB prompt froze every other thread for 2 s),
so a prompt tokenized in a worker thread never stalls the event loop.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
import jinja2.sandbox
from tokenizers import Tokenizer as _HFTokenizer

# Context tokens the detokenizer decodes along with new ones, so that tokenizers whose
# decoding depends on the previous token (leading spaces) produce the same text.
_CONTEXT_TOKENS = 5


class Tokenizer:
    """Encodes prompts, renders chat messages, decodes ids; loaded from a model folder."""

    def __init__(self, folder: str | Path, chat_template: str | None = None) -> None:
        """chat_template: replaces the model's own (the server's --chat-template, as text)."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"no tokenizer.json in {folder} (pass --tokenizer with a folder that has one)")
        spec = path.read_text()
        self._tok = _HFTokenizer.from_str(spec)
        # Computed once: text longer than max_model_len tokens can be is refused unencoded.
        self.max_bytes_per_token, self.byte_bound_note = max_bytes_per_token(
            json.loads(spec), self._tok.get_vocab(with_added_tokens=True)
        )
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        template = cfg.get("chat_template")
        template_path = folder / "chat_template.jinja"
        if template is None and template_path.is_file():
            template = template_path.read_text()
        template = chat_template if chat_template is not None else template
        self._template = compile_template(template) if isinstance(template, str) else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return self._tok.token_to_id(self.eos_token) if self.eos_token else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a plain prompt, with the tokenizer's own special-token convention
        (BOS and the like) unless add_special_tokens is False.

        Releases the GIL while encoding (see the module docstring)."""
        return self._tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template reads a `tools` variable (renders tool definitions)."""
        return self._template is not None and "tools" in self._template.variables

    def apply_chat_template(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Renders messages with the model's template (plus the assistant prompt) and encodes.

        Raises ValueError when the model has no chat template or the template rejects the
        conversation (e.g. roles out of order).
        """
        return self.encode_rendered_chat(self.render_chat(messages))

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        template: Template | None = None,
        **variables: Any,
    ) -> str:
        """The text the chat template (or `template`, a per-request one) makes of the
        messages (see apply_chat_template); `variables` reach the template as Hugging Face's
        apply_chat_template passes them (tools, documents, chat_template_kwargs)."""
        template = template or self._template
        if template is None:
            raise ValueError("this model has no chat template; send the prompt as text")
        try:
            return template.jinja.render(
                {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", **variables},
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
            )
        except Exception as exc:  # a template is code: a bad one raises anything (TypeError on None + str)
            raise ValueError(f"chat template rejected the messages: {type(exc).__name__}: {exc}") from exc

    def encode_rendered_chat(self, text: str) -> list[int]:
        """Token ids of a rendered conversation (render_chat's output)."""
        # The template already wrote the special tokens it wants (transformers does the same).
        return self._tok.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        """One token's vocabulary string (transformers' convert_ids_to_tokens: "Ġhi", "<|im_end|>")."""
        return self._tok.id_to_token(token_id) or ""

    def id_to_text(self, token_id: int) -> str:
        """One token's text (for logprob alternatives)."""
        return self._tok.decode([token_id], skip_special_tokens=False)


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):  # older configs store {"content": ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_chat_template(value: str) -> str:
    """--chat-template's value: a file's text, or the template itself written inline (as vLLM
    takes it); ValueError when it is neither or does not compile."""
    path = Path(value).expanduser()
    if path.is_file():
        value = path.read_text()
    elif "{{" not in value and "{%" not in value:
        raise ValueError(f"--chat-template {value!r}: no such file, and not a Jinja template either")
    compile_template(value)
    return value


@dataclass(frozen=True, slots=True)
class Template:
    """A compiled chat template and the variables it reads (`tools` says it renders tools)."""

    jinja: jinja2.Template
    variables: frozenset[str]


@functools.lru_cache(maxsize=32)  # per-request templates repeat; the model's is compiled once anyway
def compile_template(source: str) -> Template:
    """Compiles a chat template in Hugging Face's sandboxed environment; ValueError when it
    is not valid Jinja."""

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    try:
        variables = frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
        return Template(env.from_string(source), variables)
    except jinja2.TemplateError as exc:
        raise ValueError(f"the chat template is not valid Jinja: {exc}") from None


# A character is at most 4 UTF-8 bytes; a normalizer that maps each character to at least one
# character (Unicode normal forms, lowercasing) shrinks text by at most this factor. The
# worst cases: NFKC/NFKD map a 4-byte mathematical letter to one ASCII byte (U+1D400 -> "A");
# NFC/NFD the 3-byte Kelvin sign to "K"; compositions shrink less (Hangul L+V+T 9 -> 3 bytes,
# a base letter and up to three marks into one 2-3 byte character).
_MAX_CHAR_SHRINK = 4.0
_PER_CHAR_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase"}
_PARTITIONING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}


def max_bytes_per_token(spec: dict[str, Any], vocab: dict[str, int]) -> tuple[int | None, str]:
    """The most UTF-8 bytes of input text one token can stand for, or None when no finite bound
    holds for this tokenizer; plus a note saying which (for the start-up log).

    Why the bound is sound. Encoding is: added tokens are cut out of the text as they are; the
    rest is normalized, split by the pre-tokenizer, and the model covers each piece with
    vocabulary tokens. A vocabulary token's string is never shorter in UTF-8 than the
    normalized text it covers: plain BPE/Unigram pieces are that text itself, ByteLevel writes
    each byte as a 1-2 byte character, Metaspace a 1-byte space as the 3-byte "▁", byte
    fallback a byte as "<0xNN>", WordPiece adds "##". So normalized bytes <= sum over tokens of
    the token string's bytes <= tokens * L, L = the longest string in the vocabulary (added
    tokens included; with ByteLevel a model token's characters are counted, not their UTF-8
    bytes, since each stands for exactly one byte). The normalizer shrinks text by at most a factor F (1 when there is none;
    _MAX_CHAR_SHRINK for per-character ones; |pattern| / |content| for a string Replace), so
    input bytes <= F * tokens * L: a text of more than F * L * (max_model_len - 1) bytes has at
    least max_model_len tokens and can never be a valid prompt. Special tokens the
    post-processor adds only make more tokens.

    It fails, and None is returned, where one token can cover unboundedly much text: a
    normalizer or pre-tokenizer that deletes characters (Strip, StripAccents, BertNormalizer,
    Precompiled, a Regex Replace, Whitespace splitting, Split/Punctuation with "Removed"), an
    unknown-token that swallows a whole word or run (WordPiece, WordLevel, BPE with fuse_unk
    or Unigram without complete byte fallback), added tokens that absorb surrounding
    whitespace (lstrip/rstrip), or a truncation setting (the text is cut, never too long).
    Unknown component types count as unsafe.
    """
    if spec.get("truncation"):
        return None, "tokenizer.json truncates input"
    stripping = [t["content"] for t in spec.get("added_tokens") or () if t.get("lstrip") or t.get("rstrip")]
    if stripping:
        return None, f"added token {stripping[0]!r} absorbs whitespace (lstrip/rstrip)"
    factor = _shrink_factor(spec.get("normalizer"))
    if factor is None:
        return None, "the normalizer can delete characters"
    if not _keeps_every_character(spec.get("pre_tokenizer")):
        return None, "the pre-tokenizer drops characters"
    model = spec.get("model") or {}
    kind = model.get("type")
    has_bytes = all(f"<0x{b:02X}>" in vocab for b in range(256))
    fallback = bool(model.get("byte_fallback")) and has_bytes
    if kind == "BPE":
        if model.get("unk_token") and model.get("fuse_unk") and not fallback:
            return None, "BPE fuses unknown characters into one token"
    elif kind == "Unigram":
        if model.get("unk_id") is not None and not fallback:
            return None, "Unigram fuses unknown characters into one token"
    else:
        return None, f"{kind} maps a whole unknown word to one token"
    added = {t["content"] for t in spec.get("added_tokens") or ()}
    byte_level = _uses_byte_level(spec.get("pre_tokenizer"))
    # An unknown character that becomes one unknown token covers at most 4 bytes.
    longest = max([4, *(len(token) if byte_level and token not in added else len(token.encode()) for token in vocab)])
    bound = math.ceil(longest * factor)
    return bound, f"a token covers at most {bound} bytes of text"


def _shrink_factor(normalizer: dict[str, Any] | None) -> float | None:
    """Most input bytes per normalized byte, None when unbounded or unknown."""
    if normalizer is None:
        return 1.0
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1.0
        for child in normalizer.get("normalizers", ()):
            f = _shrink_factor(child)
            if f is None:
                return None
            factor *= f
        return factor
    if kind in _PER_CHAR_NORMALIZERS:
        return _MAX_CHAR_SHRINK
    if kind in ("Prepend", "ByteLevel"):  # only add characters / map a byte to 1-2 bytes
        return 1.0
    if kind == "Replace" and "String" in (normalizer.get("pattern") or {}):
        pattern, content = len(normalizer["pattern"]["String"].encode()), len(normalizer["content"].encode())
        return None if content == 0 else max(1.0, pattern / content)
    return None


def _uses_byte_level(pre: dict[str, Any] | None) -> bool:
    if pre is None:
        return False
    if pre.get("type") == "Sequence":
        return any(_uses_byte_level(p) for p in pre.get("pretokenizers", ()))
    return pre.get("type") == "ByteLevel"


def _keeps_every_character(pre: dict[str, Any] | None) -> bool:
    if pre is None:
        return True
    kind = pre.get("type")
    if kind == "Sequence":
        return all(_keeps_every_character(p) for p in pre.get("pretokenizers", ()))
    return kind in _PARTITIONING_PRE_TOKENIZERS and pre.get("behavior") != "Removed"


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas that never split a character.

    Decodes a small window (a few context tokens plus the unread ones) rather than the whole
    output each time. A window whose text ends in U+FFFD is an incomplete UTF-8 sequence:
    its bytes are held back until the next token completes them. Stop strings are matched
    here too; text that could be the start of a stop string is held back until it is not.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._include_stop = include_stop  # the matched stop string stays in the text
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
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        full = self._tok.decode(self._ids[self._prefix_offset :], self._skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new_text = full[len(prefix) :]
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
        self.text = self.text[: best[0] + (len(best[1]) if self._include_stop else 0)]
        self.matched_stop = best[1]
        return True

    def flush(self) -> str:
        """Everything not yet returned (call when the request finishes).

        Bytes of a character the output ended in the middle of come out as U+FFFD, as
        decoding the whole output would give them; they are never dropped.
        """
        if self.matched_stop is None and self._read_offset < len(self._ids):
            prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
            self.text += self._tok.decode(self._ids[self._prefix_offset :], self._skip)[len(prefix) :]
            self._prefix_offset = self._read_offset = len(self._ids)
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        if end <= self._sent:
            return ""
        out = self.text[self._sent : end]
        self._sent = end
        return out
