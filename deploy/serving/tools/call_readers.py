"""Tool calls read back out of generated text: one `CallReader` per choice turns the text, piece by
piece, into content and tool-call deltas (tools.py picks the reader a request's `tool_choice` and
the server's parser need). A whole reply is the same deltas gathered, so a stream and a whole reply
always say the same thing."""

from __future__ import annotations

import ast
import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

_OPEN = "<tool_call>"
_CLOSE = "</tool_call>"
_DECODER = json.JSONDecoder()


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class CallDelta:
    """A piece of tool call `index`: its id and name come with its first piece, its arguments in
    pieces."""

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
        return Delta(
            self.content + other.content, self.calls + other.calls, self.reasoning + other.reasoning
        )


def gather_calls(calls: list[CallDelta]) -> list[dict[str, Any]]:
    """Deltas joined into the message's `tool_calls`, in order of index."""
    whole: dict[int, dict[str, Any]] = {}
    for delta in calls:
        call = whole.setdefault(
            delta.index,
            {"id": delta.id, "type": "function", "function": {"name": delta.name, "arguments": ""}},
        )
        call["function"]["arguments"] += delta.arguments
    return [whole[i] for i in sorted(whole)]


def partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of `text` may be the start of `tag` (held back until the next
    piece)."""
    return next(
        (k for k in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-k:])), 0
    )


def _read_call(item: Any, index: int) -> CallDelta | None:
    """A parsed call object (`{"name", "arguments" or "parameters"}`) as call `index`'s whole delta;
    None if it is not one."""
    if not (isinstance(item, dict) and isinstance(item.get("name"), str)):
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    return CallDelta(
        index,
        call_id(),
        item["name"],
        arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False),
    )


class CallReader(ABC):
    """Reads one choice's text as it comes: `feed` each piece, then `finish` once."""

    @abstractmethod
    def feed(self, text: str) -> Delta:
        """What the next piece of the choice's text adds (text that may be part of a call is held
        back until it is known)."""

    @abstractmethod
    def finish(self) -> Delta:
        """What is left once the text has ended: text held back, a call cut short."""


class NamedCall(CallReader):
    """The whole output is the arguments of the one function the request named."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = False

    def feed(self, text: str) -> Delta:
        if not text:
            return Delta()
        first, self.started = not self.started, True
        return Delta(
            calls=[
                CallDelta(0, call_id(), self.name, text) if first else CallDelta(0, arguments=text)
            ]
        )

    def finish(self) -> Delta:
        return Delta() if self.started else Delta(calls=[CallDelta(0, call_id(), self.name, "")])


class CallSequence(CallReader):
    """JSON call objects ({"name", "parameters" or "arguments"}) in a row: in an array (`required`,
    and the mistral parser) or separated by `;` (llama3_json). Each call goes out when its object is
    complete; text the sequence leaves unparsed (a reply cut by max_tokens) is returned as content
    at the end."""

    def __init__(self, bracketed: bool = True) -> None:
        self.separator = "," if bracketed else ";"
        self.text = ""
        self.pos = 0
        self.count = 0
        self.opened = not bracketed
        self.closed = False

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
                self.opened = True
                self.pos = i + 1
            elif self.text[i] == "]" and self.separator == ",":
                self.closed = True
                self.pos = i + 1
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
        return Delta(self.text[self.pos :].strip())


class LeadingCalls(CallReader):
    """`auto` with the llama3_json or mistral parser: a reply that opens with a call (llama3_json:
    `{`, Llama 3.1's JSON tool calls; mistral: `[`, the array after its [TOOL_CALLS] token, which as
    a special token is not in the text) is read as calls; any other reply is content, as it is."""

    def __init__(self, bracketed: bool) -> None:
        self.opener = "[" if bracketed else "{"
        self.calls: CallSequence | None = CallSequence(bracketed)  # None: the reply is content
        # leading white space until the first character decides; None: decided
        self.held: str | None = ""

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
    """`auto` with the hermes parser: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
    blocks are calls, the text around them is content (stripped of leading and trailing white
    space). A block that does not parse stays in the content, and so does an unclosed one at the end
    that does not."""

    def __init__(self) -> None:
        self.text = ""
        self.inside = False
        self.count = 0
        self.held = ""
        self.started = False  # white space not sent yet (it may end the content)

    def feed(self, text: str) -> Delta:
        self.text += text
        delta = Delta()
        while True:
            if not self.inside:
                at = self.text.find(_OPEN)
                if at < 0:
                    keep = partial_tag(self.text, _OPEN)
                    delta.content += self._content(self.text[: len(self.text) - keep])
                    self.text = self.text[len(self.text) - keep :]
                    return delta
                delta.content += self._content(self.text[:at])
                self.text, self.inside = self.text[at + len(_OPEN) :], True
            else:
                at = self.text.find(_CLOSE)
                if at < 0:
                    return delta
                delta += self._block(self.text[:at], closed=True)
                self.text, self.inside = self.text[at + len(_CLOSE) :], False

    def finish(self) -> Delta:
        delta = (
            self._block(self.text, closed=False) if self.inside else Delta(self._content(self.text))
        )
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
        """Content to send now: leading white space is dropped and trailing white space held back
        until more content follows it."""
        self.held += text
        if not self.held.strip():
            return ""
        if not self.started:
            self.held, self.started = self.held.lstrip(), True
        out = self.held.rstrip()
        self.held = self.held[len(out) :]
        return out


class PythonicCalls(CallReader):
    """`auto` with the pythonic parser (Llama 3.2 and 4 write calls so): a reply that opens with `[`
    is a Python list of calls with keyword arguments, `[get_weather(city="Paris", days=2), now()]`;
    each call goes out, its arguments as JSON, as soon as the list up to it parses. A reply that
    opens otherwise is content, as it is, and so are the text after the list and what does not parse
    (a reply cut by max_tokens)."""

    def __init__(self) -> None:
        self.text = ""
        self.count = 0
        self.pos = 0  # pos: the end of the last call read, in the text's body
        self.is_list: bool | None = None  # None: only white space so far

    def feed(self, text: str) -> Delta:
        if self.is_list is False:
            return Delta(text)
        self.text += text
        body = self.text.lstrip()
        if self.is_list is None:
            if not body:
                return Delta()
            self.is_list = body.startswith("[")
            if not self.is_list:
                return Delta(self.text)
        if not any(c in text for c in ")]"):
            return Delta()  # no call (nor the list) can have been completed by this piece
        return self._read(body, body.rstrip().rstrip(",") + "]")

    def finish(self) -> Delta:
        if not self.is_list:
            return Delta(self.text if self.is_list is None else "")
        body = self.text.lstrip()
        for end in (i + 1 for i in range(len(body) - 1, -1, -1) if body[i] in ")]"):
            closed = body[end - 1] == "]"  # the list, then text; or a list cut after a call
            if _python_calls(candidate := body[:end] if closed else body[:end] + "]") is not None:
                delta = self._read(candidate)
                return delta + Delta(
                    (body[end:] if closed else body[self.pos :]).strip().lstrip(",").strip()
                )
        return Delta(body[self.pos :].strip().lstrip(",").strip())

    def _read(self, *candidates: str) -> Delta:
        """The calls not read yet of the first candidate text that parses as a list."""
        for candidate in candidates:
            try:
                tree = ast.parse(candidate, mode="eval").body
            except SyntaxError:
                continue
            calls = []
            for node in tree.elts[self.count :] if isinstance(tree, ast.List) else []:
                if (call := _python_call(node, self.count)) is None:
                    break  # e.g. a name whose parentheses are still to come
                calls.append(call)
                self.count, self.pos = self.count + 1, _end(candidate, node)
            return Delta(calls=calls)
        return Delta()


def _python_call(node: ast.expr, index: int) -> CallDelta | None:
    """`name(key=literal, ...)` as call `index`'s whole delta; None if the node is not such a
    call."""
    if not (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
    ) or any(keyword.arg is None for keyword in node.keywords):
        return None
    try:
        arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}
        return CallDelta(index, call_id(), node.func.id, json.dumps(arguments, ensure_ascii=False))
    # not a literal, or no JSON for it (a set, bytes)
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return None


def _python_calls(text: str) -> list[CallDelta] | None:
    """The calls of a text that is a whole list of calls; None if it is not one."""
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None
    calls = (
        [_python_call(node, i) for i, node in enumerate(tree.elts)]
        if isinstance(tree, ast.List)
        else [None]
    )
    return None if None in calls else calls  # type: ignore[return-value]


def _end(text: str, node: ast.expr) -> int:
    """The character offset in `text` where `node` ends (ast counts columns in UTF-8 bytes)."""
    assert node.end_lineno is not None and node.end_col_offset is not None
    lines = text.splitlines(keepends=True)
    before = "".join(lines[: node.end_lineno - 1])
    return len(before) + len(lines[node.end_lineno - 1].encode()[: node.end_col_offset].decode())
