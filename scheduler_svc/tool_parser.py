"""Tool calls read out of generated text, whole or as it streams (vLLM's tool parsers' job).

Three shapes, one per tool_choice (openai_tools.py decides which):

- `auto`: the Hermes format (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, what
  vLLM's hermes parser reads and chunkserve's fallback tool prompt asks for), or a bare JSON
  call (`{"name": ..., "arguments": ...}` or a list of them, as Llama 3 JSON tool calling
  writes) whose name is one of the request's tools; anything else is content.
- `required`: the output is forced (a grammar) to vLLM's `[{"name": ..., "parameters": {...}}]`.
- a named function: the output is forced to that function's arguments object.

The parser is a state machine over characters: what it emits depends only on the text, never
on how the text was cut into deltas, so a streamed answer (`delta.tool_calls`: a call's id and
name first, then its arguments in fragments) concatenates to exactly the non-streamed one,
which is the same parser fed the whole text at once. Arguments are the model's own JSON text
for the value (not re-serialized). Text that might still turn into a tag or a call is held
back until it is decided; whitespace around calls is not content.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

START, END = "<tool_call>", "</tool_call>"
_ARGUMENT_KEYS = ("arguments", "parameters")


def new_call_id() -> str:
    """vLLM's tool call id shape."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class CallDelta:
    """New output of one tool call: its id and name on the first delta, then argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class Events:
    """What one feed produced: content text and tool call deltas (in order of their calls)."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def merge(self, other: Events) -> None:
        self.content += other.content
        for delta in other.calls:
            last = self.calls[-1] if self.calls else None
            if last is not None and last.index == delta.index and delta.id is None:
                last.arguments += delta.arguments
            else:
                self.calls.append(CallDelta(delta.index, delta.id, delta.name, delta.arguments))


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str


class _CallScanner:
    """Reads one JSON value that is a call object, or (list_of_calls) an array of them, one
    character at a time; reports a call's name when its string ends and the characters of its
    arguments value as they come (no whitespace around the value)."""

    def __init__(self, list_of_calls: bool) -> None:
        self.level = 2 if list_of_calls else 1  # the depth inside a call object
        self.depth = 0
        self.in_string = self.escape = False
        self.raw = ""  # the string being read, as written
        self.key: str | None = None  # the current key of the call object
        self.in_value = False  # between the key's colon and the value's end
        self.name: str | None = None
        self.done = False  # the whole value has closed

    def feed(self, c: str) -> tuple[str, str | None, bool]:
        """One character -> (argument characters, a name just read, whether a call object closed)."""
        in_args = self.in_value and self.key in _ARGUMENT_KEYS
        if self.in_string:
            name = None
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_string = False
                name = self._string_done() if self.depth == self.level else None
            if self.in_string:
                self.raw += c
            return (c if in_args else ""), name, False
        args, closed = "", False
        if self.depth == self.level and c in ",}]":
            self.in_value = False  # the value ends here
            if c == ",":
                self.key = None
        elif in_args and not (self.depth == self.level and c.isspace()):
            args = c
        if c == '"':
            self.in_string, self.raw = True, ""
        elif c == ":" and self.depth == self.level:
            self.in_value = True
        elif c in "{[":
            self.depth += 1
            if self.depth == self.level and c == "{":
                self.key, self.name, self.in_value = None, None, False
        elif c in "}]" and self.depth > 0:
            self.depth -= 1
            closed = self.depth == self.level - 1 and c == "}"
            self.done = self.depth == 0
        return args, None, closed

    def _string_done(self) -> str | None:
        try:
            text = json.loads(f'"{self.raw}"')
        except ValueError:
            text = self.raw
        if not self.in_value:
            self.key = text
            return None
        if self.key == "name":
            self.name = text
            return text
        return None


class ToolParser:
    """One choice's tool calls (see the module docstring for the shapes)."""

    def __init__(
        self,
        mode: str,
        tool_names: Collection[str] = (),
        named: str | None = None,
        call_id: Callable[[], str] = new_call_id,
    ) -> None:
        if mode not in ("auto", "required", "named"):
            raise ValueError(f"unknown tool parser mode {mode!r}")
        self.mode, self.tool_names, self.named, self._id = mode, set(tool_names), named, call_id
        self.calls: list[ToolCall] = []
        self._buffer = ""  # text not yet decided
        self._state = "start"  # start, content, block (inside <tool_call>), json (a bare call), after
        self._scanner = _CallScanner(list_of_calls=mode == "required")
        self._block = ""  # the current block's or bare JSON's text (content if it holds no call)
        self._pending = ""  # argument characters read before the call's name
        self._block_calls = 0  # calls made before the current block
        self._open = False  # the current call was emitted (id and name)
        self._space = ""  # whitespace held back (content, or the end of named arguments)
        if mode == "required":
            self._state = "json"

    # ---- public ---------------------------------------------------------------------------

    def feed(self, text: str) -> Events:
        """More output text -> the content and call deltas now decided."""
        out = Events()
        if self.mode == "named":
            self._named(out, text)
            return out
        self._buffer += text
        while self._buffer and self._step(out):
            pass
        return out

    def finish(self) -> Events:
        """The end of the output: what was held back is decided."""
        out = Events()
        if self.mode == "named":
            self._named(out, "")
            if not self.calls[0].arguments:
                self._add_args(out, "{}")
            return out
        if self._state == "block" or (self._state == "json" and self.mode == "auto"):
            if len(self.calls) == (self._block_calls if self._state == "block" else 0):
                self._content(out, self._block + self._buffer)
        else:
            self._content(out, self._buffer)
        self._buffer = ""
        self._close_call(out)
        if not self.calls:
            out.content += self._space
        self._space = ""
        return out

    # ---- states ---------------------------------------------------------------------------

    def _step(self, out: Events) -> bool:
        """Consumes what it can of the buffer; False when it must wait for more text."""
        if self._state == "start":
            stripped = self._buffer.lstrip()
            if not stripped:
                return False
            if stripped[0] in "{[" and self.mode == "auto" and self.tool_names:
                self._space += self._buffer[: len(self._buffer) - len(stripped)]
                self._buffer, self._state = stripped, "json"
                self._scanner, self._block = _CallScanner(list_of_calls=stripped[0] == "["), ""
            else:
                self._state = "content"
            return True
        if self._state in ("content", "after"):
            return self._read_content(out)
        if self._state == "block":
            return self._read_block(out)
        return self._read_json(out)

    def _read_content(self, out: Events) -> bool:
        at = self._buffer.find(START)
        if at == -1:
            keep = _partial_suffix(self._buffer, START)
            self._content(out, self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return False
        self._content(out, self._buffer[:at])
        # The whitespace before the tag is the block's: dropped if it holds a call, else content.
        self._block, self._space = self._space + START, ""
        self._buffer = self._buffer[at + len(START) :]
        self._state, self._scanner, self._block_calls = "block", _CallScanner(list_of_calls=False), len(self.calls)
        return True

    def _read_block(self, out: Events) -> bool:
        scanner = self._scanner
        while self._buffer:
            c = self._buffer[0]
            if not scanner.in_string and c == "<":
                if self._buffer.startswith(END):
                    self._buffer, self._block = self._buffer[len(END) :], self._block + END
                    self._end_block(out)
                    return True
                if END.startswith(self._buffer):
                    return False  # maybe the end tag: wait for more
                if scanner.depth == 0:
                    self._end_block(out)  # no call here: the block's text is content
                    return True
            elif scanner.done:
                if not c.isspace():
                    self._end_block(out)
                    return True
                self._block += c
                self._buffer = self._buffer[1:]
                continue
            self._scan(out, c)
            self._buffer = self._buffer[1:]
        return False

    def _end_block(self, out: Events) -> None:
        if len(self.calls) == self._block_calls:
            self._content(out, self._block)
        self._close_call(out)
        self._state, self._block = "after", ""

    def _read_json(self, out: Events) -> bool:
        scanner = self._scanner
        while self._buffer and not scanner.done:
            self._scan(out, self._buffer[0])
            self._buffer = self._buffer[1:]
            if self.mode == "auto" and not self.calls and scanner.name is not None:
                if scanner.name not in self.tool_names:  # a JSON answer, not a call
                    self._content(out, self._block)
                    self._state, self._pending = "content", ""
                    return True
        if not scanner.done:
            return False
        if self.mode == "auto" and not self.calls:
            self._content(out, self._block)
        self._close_call(out)
        self._state = "after"
        return True

    # ---- helpers --------------------------------------------------------------------------

    def _scan(self, out: Events, c: str) -> None:
        self._block += c
        args, name, closed = self._scanner.feed(c)
        if name is not None and not self._open:
            if self._state == "block" or self.mode == "required" or name in self.tool_names:
                self._open = True
                self.calls.append(ToolCall(self._id(), name, ""))
                out.calls.append(CallDelta(len(self.calls) - 1, self.calls[-1].id, name, ""))
                args, self._pending = self._pending + args, ""
        if args:
            if self._open:
                self._add_args(out, args)
            else:
                self._pending += args
        if closed:
            self._close_call(out)

    def _add_args(self, out: Events, args: str) -> None:
        self.calls[-1].arguments += args
        out.merge(Events(calls=[CallDelta(len(self.calls) - 1, arguments=args)]))

    def _close_call(self, out: Events) -> None:
        if self._open and not self.calls[-1].arguments:
            self._add_args(out, "{}")
        self._open, self._pending = False, ""

    def _named(self, out: Events, text: str) -> None:
        """A forced function: the whole output is its arguments (no whitespace around)."""
        if not self.calls:
            self.calls.append(ToolCall(self._id(), self.named or "", ""))
            out.calls.append(CallDelta(0, self.calls[0].id, self.named, ""))
            self._open = True
        text = self._space + text
        if not self.calls[0].arguments:
            text = text.lstrip()
        body = text.rstrip()
        self._space = text[len(body) :]
        if body:
            self._add_args(out, body)

    def _content(self, out: Events, text: str) -> None:
        """Content, with whitespace held back until non-space text follows (whitespace next to
        a call is dropped)."""
        if not text:
            return
        stripped = text.rstrip()
        if stripped:
            out.content += self._space + stripped
            self._space = text[len(stripped) :]
        else:
            self._space += text


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
