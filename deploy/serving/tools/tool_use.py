"""Tool calling on chat: the grammar that forces a call, and the calls read back out of the
generated text.

A request's `tool_choice` decides how its tools are used (`ToolUse`):
* `none`: the tools are shown to the chat template, the reply is text;
* a named function: the grammar forces that function's `parameters` schema; the whole output is the
  call's arguments (streamed as they are generated);
* `required`: the grammar forces a JSON array of `{"name", "parameters"}` objects, one per call (at
  most one when `parallel_tool_calls` is false), each call sent as soon as its object is complete;
* `auto`: the model decides, and the server's tool-call parser reads the calls out of the text:
  `hermes` (`<tool_call>{"name", "arguments"}</tool_call>` blocks: Qwen2.5/3, Hermes, SmolLM3),
  `llama3_json` (a reply that is `{"name", "parameters"}` objects: Llama 3.1/3.2), `mistral` (a
  reply that is an array of `{"name", "arguments"}`: Mistral 7B v0.3; its [TOOL_CALLS] token is
  special, so not in the text) or `pythonic` (a reply that is a Python list of calls, `[f(x=1),
  g()]`: Llama 3.2 and 4).

The readers that turn the text into content and tool-call deltas are in tool_calls.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deploy.serving.tools.call_readers import (
    CallDelta,
    CallReader,
    CallSequence,
    HermesCalls,
    LeadingCalls,
    NamedCall,
    PythonicCalls,
    gather_calls,
)


@dataclass(frozen=True)
class ToolUse:
    """How one chat request uses its tools: `choice` is none, auto, required or named (`name`)."""

    choice: str
    tools: tuple[dict[str, Any], ...]  # as the request gave them (for the chat template)
    name: str | None = None
    parallel: bool = True
    parser: str | None = None  # auto: the server's tool-call parser (`ToolCallParser`)
    legacy: bool = False  # asked for with the legacy `functions`: one call, as `function_call`

    @property
    def schemas(self) -> dict[str, dict[str, Any]]:
        """Each function's parameters schema, by name (none given: it takes no arguments, `{}`)."""
        return {
            t["function"]["name"]: t["function"].get("parameters") or {"type": "object"}
            for t in self.tools
        }

    @property
    def forced(self) -> list[str]:
        """The functions the grammar may force: the named one, or every one for `required`."""
        return (
            [self.name]
            if self.choice == "named"
            else list(self.schemas)
            if self.choice == "required"
            else []
        )

    @property
    def response_format(self) -> dict[str, Any] | None:
        """The response_format that forces the call (named, required); None when the model is
        free."""
        schemas = self.schemas
        if self.choice == "named":
            assert self.name is not None
            return {
                "type": "json_schema",
                "json_schema": {"name": self.name, "schema": schemas[self.name]},
            }
        if self.choice != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                "required": ["name", "parameters"],
            }
            for name, schema in schemas.items()
        ]
        array: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
        }
        if not self.parallel:
            array["maxItems"] = 1
        return {"type": "json_schema", "json_schema": {"name": "tool_calls", "schema": array}}

    def reader(self) -> CallReader | None:
        """A reader for one choice's text; None when the reply is plain text (`none`)."""
        if self.choice == "named":
            assert self.name is not None
            return NamedCall(self.name)
        if self.choice == "required":
            return CallSequence()
        if self.choice == "auto":
            if self.parser == "hermes":
                return HermesCalls()
            return (
                PythonicCalls()
                if self.parser == "pythonic"
                else LeadingCalls(bracketed=self.parser == "mistral")
            )
        return None

    def finish_reason(self, engine_reason: str | None, num_calls: int) -> str | None:
        """`tool_calls` when the model chose to call (auto, required) and stopped by itself; a named
        call keeps the engine's reason, as OpenAI's replies do."""
        if self.choice in ("auto", "required") and num_calls and engine_reason == "stop":
            return "function_call" if self.legacy else "tool_calls"
        return engine_reason

    def message_calls(self, calls: list[CallDelta], stream: bool) -> dict[str, Any]:
        """A message's (or a delta's) calls as the request asked for them: `tool_calls`, or for the
        legacy `functions` its first call as `function_call` (that API has one call per reply)."""
        if not self.legacy:
            return {
                "tool_calls": [call.as_json() for call in calls] if stream else gather_calls(calls)
            }
        first = [call for call in calls if call.index == 0]
        if not first:
            return {}
        name = next((call.name for call in first if call.name is not None), None)
        arguments = "".join(call.arguments for call in first)
        return {
            "function_call": {"arguments": arguments} | ({"name": name} if name is not None else {})
        }
