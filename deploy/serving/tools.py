"""Tool calling on chat: the grammar that forces a call, and the calls read back out of the generated text.

A request's `tool_choice` decides how its tools are used (`ToolUse`):
* `none`: the tools are shown to the chat template, the reply is text;
* a named function: the grammar forces that function's `parameters` schema; the whole output is the call's
  arguments (streamed as they are generated);
* `required`: the grammar forces a JSON array of `{"name", "parameters"}` objects, one per call (at most one
  when `parallel_tool_calls` is false), each call sent as soon as its object is complete;
* `auto`: the model decides, and the server's tool-call parser reads the calls out of the text: `hermes`
  (`<tool_call>{"name", "arguments"}</tool_call>` blocks: Qwen2.5/3, Hermes, SmolLM3), `llama3_json` (a reply
  that is `{"name", "parameters"}` objects: Llama 3.1/3.2) or `mistral` (a reply that is an array of
  `{"name", "arguments"}`: Mistral 7B v0.3; its [TOOL_CALLS] token is special, so not in the text).

One `CallReader` per choice turns the text, piece by piece, into content and tool-call deltas; a whole reply
is the same deltas gathered, so a stream and a whole reply always say the same thing.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

ToolCallParser = Literal["hermes", "llama3_json", "mistral"]
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_DECODER = json.JSONDecoder()


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class CallDelta:
    """A piece of tool call `index`: its id and name come with its first piece, its arguments in pieces."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def as_json(self) -> dict[str, Any]:
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.name is not None:
            function = {"name": self.name, **function}
        head = {"id": self.id, "type": "function"} if self.id is not None else {}
        return {"index": self.index, **head, "function": function}


@dataclass
class Delta:
    """What a piece of generated text adds to a choice's message."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)
    reasoning: str = ""  # a reasoning model's thinking (deploy/serving/reasoning.py)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls or self.reasoning)

    @property
    def new_calls(self) -> int:
        """Calls this delta starts (a call's first piece carries its id)."""
        return sum(call.id is not None for call in self.calls)

    def __add__(self, other: Delta) -> Delta:
        return Delta(self.content + other.content, self.calls + other.calls, self.reasoning + other.reasoning)


def gather_calls(calls: list[CallDelta]) -> list[dict[str, Any]]:
    """Deltas joined into the message's `tool_calls`, in order of index."""
    whole: dict[int, dict[str, Any]] = {}
    for delta in calls:
        call = whole.setdefault(delta.index, {"id": delta.id, "type": "function",
                                              "function": {"name": delta.name, "arguments": ""}})
        call["function"]["arguments"] += delta.arguments
    return [whole[i] for i in sorted(whole)]


def partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of `text` may be the start of `tag` (held back until the next piece)."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-k:])), 0)


def _read_call(item: Any, index: int) -> CallDelta | None:
    """A parsed call object (`{"name", "arguments" or "parameters"}`) as call `index`'s whole delta; None if
    it is not one."""
    if not (isinstance(item, dict) and isinstance(item.get("name"), str)):
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    return CallDelta(index, call_id(), item["name"], arguments if isinstance(arguments, str)
                     else json.dumps(arguments, ensure_ascii=False))


class CallReader:
    """Reads one choice's text as it comes: `feed` each piece, then `finish` once."""

    def feed(self, text: str) -> Delta:
        raise NotImplementedError

    def finish(self) -> Delta:
        raise NotImplementedError


class NamedCall(CallReader):
    """The whole output is the arguments of the one function the request named."""

    def __init__(self, name: str) -> None:
        self.name, self.started = name, False

    def feed(self, text: str) -> Delta:
        if not text:
            return Delta()
        first, self.started = not self.started, True
        return Delta(calls=[CallDelta(0, call_id(), self.name, text) if first else CallDelta(0, arguments=text)])

    def finish(self) -> Delta:
        return Delta() if self.started else Delta(calls=[CallDelta(0, call_id(), self.name, "")])


class CallSequence(CallReader):
    """JSON call objects ({"name", "parameters" or "arguments"}) in a row: in an array (`required`, and the
    mistral parser) or separated by `;` (llama3_json). Each call goes out when its object is complete; text
    the sequence leaves unparsed (a reply cut by max_tokens) is returned as content at the end."""

    def __init__(self, bracketed: bool = True) -> None:
        self.separator = "," if bracketed else ";"
        self.text, self.pos, self.count, self.opened, self.closed = "", 0, 0, not bracketed, False

    def feed(self, text: str) -> Delta:
        self.text += text
        calls = []
        while not self.closed:
            i = self._skip_space(self.pos)
            if i == len(self.text):
                break
            if not self.opened:
                if self.text[i] != "[":
                    break
                self.opened, self.pos = True, i + 1
            elif self.text[i] == "]" and self.separator == ",":
                self.closed, self.pos = True, i + 1
            elif self.text[i] == self.separator and self.count:
                self.pos = i + 1
            else:
                try:
                    item, end = _DECODER.raw_decode(self.text, i)
                except json.JSONDecodeError:
                    break  # not complete yet
                if (call := _read_call(item, self.count)) is None:
                    break
                calls.append(call)
                self.count, self.pos = self.count + 1, end
        return Delta(calls=calls)

    def _skip_space(self, i: int) -> int:
        while i < len(self.text) and self.text[i].isspace():
            i += 1
        return i

    def finish(self) -> Delta:
        return Delta(self.text[self.pos:].strip())


class LeadingCalls(CallReader):
    """`auto` with the llama3_json or mistral parser: a reply that opens with a call (llama3_json: `{`, Llama
    3.1's JSON tool calls; mistral: `[`, the array after its [TOOL_CALLS] token, which as a special token is
    not in the text) is read as calls; any other reply is content, as it is."""

    def __init__(self, bracketed: bool) -> None:
        self.opener = "[" if bracketed else "{"
        self.calls: CallSequence | None = CallSequence(bracketed)  # None: the reply is content
        self.held: str | None = ""  # leading white space until the first character decides; None: decided

    def feed(self, text: str) -> Delta:
        if self.held is None:
            return self.calls.feed(text) if self.calls is not None else Delta(text)
        self.held += text
        if not self.held.strip():
            return Delta()
        text, self.held = self.held, None
        if not text.lstrip().startswith(self.opener):
            self.calls = None
            return Delta(text)
        return self.calls.feed(text)

    def finish(self) -> Delta:
        if self.held is not None:
            return Delta(self.held)
        return self.calls.finish() if self.calls is not None else Delta()


class HermesCalls(CallReader):
    """`auto` with the hermes parser: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks are
    calls, the text around them is content (stripped of leading and trailing white space). A block that does
    not parse stays in the content, and so does an unclosed one at the end that does not."""

    def __init__(self) -> None:
        self.text, self.inside, self.count = "", False, 0
        self.held, self.started = "", False  # white space not sent yet (it may end the content)

    def feed(self, text: str) -> Delta:
        self.text += text
        delta = Delta()
        while True:
            if not self.inside:
                at = self.text.find(_OPEN)
                if at < 0:
                    keep = partial_tag(self.text, _OPEN)
                    delta.content += self._content(self.text[:len(self.text) - keep])
                    self.text = self.text[len(self.text) - keep:]
                    return delta
                delta.content += self._content(self.text[:at])
                self.text, self.inside = self.text[at + len(_OPEN):], True
            else:
                at = self.text.find(_CLOSE)
                if at < 0:
                    return delta
                delta += self._block(self.text[:at], closed=True)
                self.text, self.inside = self.text[at + len(_CLOSE):], False

    def finish(self) -> Delta:
        delta = self._block(self.text, closed=False) if self.inside else Delta(self._content(self.text))
        self.text = ""
        return delta

    def _block(self, body: str, closed: bool) -> Delta:
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            call = None
        if (delta := _read_call(call, self.count)) is None:
            return Delta(self._content(_OPEN + body + (_CLOSE if closed else "")))
        self.count += 1
        return Delta(calls=[delta])

    def _content(self, text: str) -> str:
        """Content to send now: leading white space is dropped and trailing white space held back until more
        content follows it."""
        self.held += text
        if not self.held.strip():
            return ""
        if not self.started:
            self.held, self.started = self.held.lstrip(), True
        out = self.held.rstrip()
        self.held = self.held[len(out):]
        return out


@dataclass(frozen=True)
class ToolUse:
    """How one chat request uses its tools: `choice` is none, auto, required or named (`name`)."""

    choice: str
    tools: tuple[dict[str, Any], ...]  # as the request gave them (for the chat template)
    name: str | None = None
    parallel: bool = True
    parser: str | None = None  # auto: the server's tool-call parser (`ToolCallParser`)

    @property
    def schemas(self) -> dict[str, dict[str, Any]]:
        """Each function's parameters schema, by name (none given: it takes no arguments, `{}`)."""
        return {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in self.tools}

    @property
    def forced(self) -> list[str]:
        """The functions the grammar may force: the named one, or every one for `required`."""
        return [self.name] if self.choice == "named" else list(self.schemas) if self.choice == "required" else []

    @property
    def response_format(self) -> dict[str, Any] | None:
        """The response_format that forces the call (named, required); None when the model is free."""
        schemas = self.schemas
        if self.choice == "named":
            assert self.name is not None
            return {"type": "json_schema", "json_schema": {"name": self.name, "schema": schemas[self.name]}}
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                  "required": ["name", "parameters"]} for name, schema in schemas.items()]
        array: dict[str, Any] = {"type": "array", "minItems": 1,
                                 "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
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
            return HermesCalls() if self.parser == "hermes" else LeadingCalls(bracketed=self.parser == "mistral")
        return None

    def finish_reason(self, engine_reason: str | None, num_calls: int) -> str | None:
        """`tool_calls` when the model chose to call (auto, required) and stopped by itself; a named call keeps
        the engine's reason, as OpenAI's replies do."""
        if self.choice in ("auto", "required") and num_calls and engine_reason == "stop":
            return "tool_calls"
        return engine_reason
