"""OpenAI tools: checked, rendered into the prompt, and forced or parsed (issue 33 item 2).

- `tools` reach the chat template as Hugging Face's apply_chat_template passes them (`tools=`,
  assistant `tool_calls` with their arguments as objects, `tool` messages as they are) when the
  template reads a `tools` variable. A template that does not (SmolLM2-135M-Instruct's, the
  default model's) gets the fallback: the tool list in the system message in the Hermes format
  vLLM's examples use (`<tools>` signatures, calls as `<tool_call>{"name", "arguments"}</tool_call>`),
  earlier calls rendered the same way and tool results as `<tool_response>` user turns.
- `tool_choice`: `none` (tools rendered, nothing parsed), `auto` (tool_parser.py reads Hermes
  blocks or a bare JSON call), `required` (the output is forced by a JSON schema to vLLM's
  `[{"name", "parameters"}]`, at most one item with parallel_tool_calls false) and a named
  function (forced to that function's parameters object), as vLLM builds them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from scheduler_svc.openai_fields import bad, get
from scheduler_svc.structured import Constraint
from scheduler_svc.tool_parser import Events, ToolParser

FALLBACK_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


@dataclass
class ToolPlan:
    """A request's tools and what tool_choice makes of them."""

    tools: list[dict[str, Any]]  # as sent: {"type": "function", "function": {name, description, parameters}}
    choice: str  # none, auto, required, named
    named: str | None = None
    parallel: bool = True

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def parameters(self, name: str) -> dict[str, Any]:
        params = next(t["function"].get("parameters") for t in self.tools if t["function"]["name"] == name)
        return params or {"type": "object", "properties": {}}

    def constraint(self) -> Constraint | None:
        """The grammar a forced choice needs (None for none / auto)."""
        if self.choice == "named":
            schema = self.parameters(self.named)
        elif self.choice == "required":
            schema = self._required_schema()
        else:
            return None
        try:
            return Constraint.make("json_schema", json.dumps(schema))
        except ValueError as exc:
            raise bad("tools", f"tools: {exc}") from None

    def _required_schema(self) -> dict[str, Any]:
        """vLLM's schema for tool_choice required: a non-empty array of {name, parameters},
        each item one of the tools and nothing else; the tools' $defs hoisted to the top."""
        items, defs = [], {}
        for tool in self.tools:
            params = dict(self.parameters(tool["function"]["name"]))
            for name, schema in params.pop("$defs", {}).items():
                if defs.setdefault(name, schema) != schema:
                    raise bad("tools", f"tools: two tools define $defs/{name} differently")
            items.append(
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [tool["function"]["name"]]},
                        "parameters": params,
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,  # vLLM's leaves it open: a weak model then adds keys
                }
            )
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return schema


def tool_plan(body: dict[str, Any]) -> ToolPlan | None:
    """The body's tools and tool_choice, checked as vLLM checks them; None without tools."""
    tools = get(body, "tools", (list,), "a list of tools")
    choice = body.get("tool_choice")
    parallel = get(body, "parallel_tool_calls", (bool,), "a boolean")
    if not tools:
        if choice not in (None, "none"):
            raise bad("tool_choice", "tool_choice needs tools")
        return None
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise bad("tools", f"tools[{i}] must be {{type: function, function: {{name, parameters}}}}")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise bad("tools", f"tools[{i}].function.name must be a non-empty string")
        if not isinstance(function.get("parameters"), dict | None):
            raise bad("tools", f"tools[{i}].function.parameters must be a JSON schema object")
    plan = ToolPlan(tools, "auto", parallel=parallel is not False)
    if choice is None or choice in ("none", "auto", "required"):
        plan.choice = choice or "auto"
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        plan.choice, plan.named = "named", choice["function"].get("name")
        if plan.named not in plan.names:
            raise bad("tool_choice", f"tool_choice names {plan.named!r}, which is not one of the tools")
    else:
        raise bad("tool_choice", 'tool_choice must be "none", "auto", "required" or {type: function, function: {name}}')
    return plan


def native_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that renders tools: assistant tool_calls' arguments as objects
    (what Hugging Face templates expect; vLLM converts them the same way)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and isinstance(calls, list):
            m = {**m, "tool_calls": [_with_object_arguments(c) for c in calls]}
        out.append(m)
    return out


def fallback_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that knows nothing of tools: the tool prompt in the system
    message, calls and results written out in the Hermes format."""
    signatures = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    prompt = FALLBACK_SYSTEM.format(tools=signatures)
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m.get("role"), m.get("content") or ""
        if role == "assistant" and isinstance(m.get("tool_calls"), list):
            blocks = [_hermes_block(c) for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(([content] if content else []) + blocks)})
        elif role == "tool":
            result = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool_results"):  # consecutive results: one user turn
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "_tool_results": True})
        else:
            out.append({"role": role, "content": content})
    for m in out:
        m.pop("_tool_results", None)
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out


def _function(call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError("an assistant tool_calls entry must be {type: function, function: {name, arguments}}")
    return function


def _arguments(function: dict[str, Any]) -> Any:
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return {} if arguments is None else arguments


def _with_object_arguments(call: Any) -> dict[str, Any]:
    function = _function(call)
    return {**call, "function": {**function, "arguments": _arguments(function)}}


def _hermes_block(call: Any) -> str:
    function = _function(call)
    payload = {"name": function["name"], "arguments": _arguments(function)}
    return f"<tool_call>\n{json.dumps(payload, ensure_ascii=False)}\n</tool_call>"


def tool_message(events: Events, parser: ToolParser, stream: bool, finished: bool) -> dict[str, Any]:
    """A chat choice's `delta` (streamed: this step's content and call fragments, a call's id,
    type and name on its first fragment) or `message` (the whole answer; content null when
    the model only called tools)."""
    if not stream:
        calls = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in parser.calls
        ]
        content = events.content or (None if calls else "")
        return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
    delta: dict[str, Any] = {}
    if events.content:
        delta["content"] = events.content
    if events.calls:
        delta["tool_calls"] = [
            {"index": d.index, "id": d.id, "type": "function", "function": {"name": d.name, "arguments": d.arguments}}
            if d.id is not None
            else {"index": d.index, "function": {"arguments": d.arguments}}
            for d in events.calls
        ]
    return delta if delta or finished else {"content": ""}
