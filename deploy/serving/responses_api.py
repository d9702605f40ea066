"""OpenAI's Responses API (`POST /v1/responses`): a request becomes a chat body, and its one choice's text
(read as reasoning, content and tool calls, as on chat) becomes output items, whole or as typed events."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from deploy.serving.responses import Job, failed
from deploy.serving.schemas import APIError
from deploy.serving.tool_calls import CallDelta, Delta
from scheduler.outputs import RequestOutput

# Responses parameters pdserve does not implement: refused (400 naming them) unless at their no-op value.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "previous_response_id": (None,), "conversation": (None,), "prompt": (None,), "background": (None, False),
    "include": (None, []), "top_logprobs": (None, 0), "max_tool_calls": (None,), "truncation": (None, "disabled")}
# accepted and change nothing: responses are not stored, reasoning effort is the model's own
DESCRIPTIVE = ("store", "reasoning", "safety_identifier", "prompt_cache_key", "stream_options")
# chat's names for what this endpoint names otherwise (the others, e.g. seed or top_k, pass through as on chat)
CHAT_ONLY = ("messages", "n", "max_tokens", "max_completion_tokens", "logprobs", "response_format",
             "functions", "function_call", "echo", "best_of", "suffix")
# a chat parameter's error, named as this endpoint names it
RENAMED = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
           "response_format": "text"}


class ResponsesBody(BaseModel):
    """The Responses fields pdserve reads; any other field is checked as the chat endpoint checks it."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = Field(None, description="A system message before the input.")
    max_output_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    text: dict[str, Any] | None = Field(None, description="{format: {type: text | json_object | json_schema}}")
    stream: bool = False


def _message(role: str, content: Any, where: str) -> dict[str, Any]:
    if isinstance(content, list):  # content parts: only text is understood here
        if any(not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text")
               for part in content):
            raise APIError(400, f"{where}: only text content parts are supported", param="input")
        content = "".join(str(part.get("text", "")) for part in content)
    if not isinstance(content, str):
        raise APIError(400, f"{where}.content must be a string or a list of text parts", param="input")
    return {"role": role, "content": content}


def chat_messages(body: ResponsesBody) -> list[dict[str, Any]]:
    """The input items as chat messages: messages, function calls (joined into the assistant message they
    follow) and their outputs; reasoning items are left out, as chat templates leave out earlier thinking."""
    messages = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    names: dict[str, str] = {}  # call_id -> function name, for the tool message that answers it
    for i, item in enumerate(items):
        kind, where = item.get("type", "message"), f"input[{i}]"
        if kind == "message":
            messages.append(_message(str(item.get("role")), item.get("content"), where))
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            names[str(call["id"])] = str(item.get("name"))
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the calls of one turn: one message
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output, call_id = item.get("output"), str(item.get("call_id"))
            message = _message("tool", output, where) | {"tool_call_id": call_id}
            if call_id in names:
                message["name"] = names[call_id]
            messages.append(message)
        elif kind != "reasoning":
            raise APIError(400, f"{where}: input items of type {kind!r} are not supported (messages, function_call, "
                           "function_call_output and reasoning are)", param="input")
    return messages


def chat_fields(body: ResponsesBody) -> dict[str, Any]:
    """The chat body that asks for what `body` asks for; 400 for what this server does not implement."""
    fields: dict[str, Any] = {}
    for name, value in (body.model_extra or {}).items():
        if name in UNSUPPORTED:
            if value not in UNSUPPORTED[name]:
                raise APIError(400, f"`{name}` is not supported by this server (responses are not stored)"
                               if name in ("previous_response_id", "conversation") else
                               f"`{name}` is not supported by this server yet; leave it out",
                               param=name, code="unsupported_parameter")
        elif name in CHAT_ONLY:
            raise APIError(400, f"Unrecognized request argument supplied: {name}", param=name,
                           code="unsupported_parameter")
        elif name not in DESCRIPTIVE:
            fields[name] = value
    fields |= {"model": body.model, "messages": chat_messages(body), "max_completion_tokens": body.max_output_tokens}
    text_format = (body.text or {}).get("format")
    if text_format is not None:
        if not isinstance(text_format, dict):
            raise APIError(400, "text.format must be an object", param="text")
        schema = {key: value for key, value in text_format.items() if key in ("name", "schema", "strict")}
        fields["response_format"] = {"type": "json_schema", "json_schema": schema} \
            if text_format.get("type") == "json_schema" else text_format
    if body.tools is not None:
        fields["tools"] = []
        for i, tool in enumerate(body.tools):
            if tool.get("type") != "function":
                raise APIError(400, f"tools[{i}]: only function tools are supported, not {tool.get('type')!r}",
                               param="tools")
            fields["tools"].append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    if isinstance(body.tool_choice, dict):
        if body.tool_choice.get("type") != "function":
            raise APIError(400, "tool_choice must be none, auto, required or {type: function, name}",
                           param="tool_choice")
        fields["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.get("name")}}
    elif body.tool_choice is not None:
        fields["tool_choice"] = body.tool_choice
    return fields


def renamed(error: APIError) -> APIError:
    """A chat parameter's error with the parameter named as on this endpoint."""
    error.param = RENAMED.get(error.param or "", error.param)
    return error


class OutputItems:
    """One choice's deltas as Responses output items, and the stream events that build them (without their
    sequence numbers). Items come in the order their text does: reasoning, message text, each function call."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None

    def feed(self, delta: Delta) -> list[dict[str, Any]]:
        events = self._text("reasoning", delta.reasoning) if delta.reasoning else []
        if delta.content:
            events += self._text("message", delta.content)
        for call in delta.calls:
            events += self._call(call)
        return events

    def close(self, status: str) -> list[dict[str, Any]]:
        """The events that end the open item, which gets `status` (completed, or incomplete when cut)."""
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        if item["type"] == "function_call":
            events = [{"type": "response.function_call_arguments.done", **where, "name": item["name"],
                       "arguments": item["arguments"]}]
        else:
            part = item["content"][0]
            kind = "response.output_text" if item["type"] == "message" else "response.reasoning_text"
            events = [{"type": f"{kind}.done", **where, "content_index": 0, "text": part["text"]}]
            if item["type"] == "message":
                events[0]["logprobs"] = []
                events.append({"type": "response.content_part.done", **where, "content_index": 0, "part": part})
        return events + [{"type": "response.output_item.done", "output_index": len(self.items) - 1, "item": item}]

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close("completed")
        self.items.append(item)
        self._open = item
        events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                       "item": _snapshot(item)})
        if item["type"] == "message":
            events.append({"type": "response.content_part.added", "item_id": item["id"],
                           "output_index": len(self.items) - 1, "content_index": 0,
                           "part": {"type": "output_text", "text": "", "annotations": []}})
        return events

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self._open["type"] != kind:
            part = {"type": "output_text", "text": "", "annotations": []} if kind == "message" else \
                {"type": "reasoning_text", "text": ""}
            item = {"type": kind, "id": _item_id("msg" if kind == "message" else "rs"), "status": "in_progress",
                    "content": [part]}
            events = self._add(item | ({"role": "assistant"} if kind == "message" else {"summary": []}))
        assert self._open is not None
        self._open["content"][0]["text"] += text
        event = {"type": "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta",
                 "item_id": self._open["id"], "output_index": len(self.items) - 1, "content_index": 0, "delta": text}
        return events + [event | ({"logprobs": []} if kind == "message" else {})]

    def _call(self, call: CallDelta) -> list[dict[str, Any]]:
        events = []
        if call.id is not None:  # a call's first piece
            events = self._add({"type": "function_call", "id": _item_id("fc"), "call_id": call.id,
                                "name": call.name, "arguments": "", "status": "in_progress"})
        if call.arguments and self._open is not None and self._open["type"] == "function_call":
            self._open["arguments"] += call.arguments
            events.append({"type": "response.function_call_arguments.delta", "item_id": self._open["id"],
                           "output_index": len(self.items) - 1, "delta": call.arguments})
        return events


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _snapshot(item: dict[str, Any]) -> dict[str, Any]:
    """The item as it stands when added: empty text, no arguments yet."""
    copy = json.loads(json.dumps(item))
    for part in copy.get("content", []):
        part["text"] = ""
    if copy["type"] == "function_call":
        copy["arguments"] = ""
    return copy


class ResponseReplier:
    """Shapes one chat job's single choice into a Response object, or the stream of events that builds it."""

    def __init__(self, job: Job, model_name: str, body: ResponsesBody, chat: Any) -> None:
        self.job, self.model_name, self.body, self.chat = job, model_name, body, chat
        self.created = int(time.time())
        self.resp_id = "resp_" + job.resp_id.split("-", 1)[-1]

    def response(self, status: str, output: list[dict[str, Any]], num_output: int | None,
                 last: RequestOutput | None = None) -> dict[str, Any]:
        num_input = self.job.num_prompt_tokens
        usage = None if num_output is None else {
            "input_tokens": num_input, "input_tokens_details": {"cached_tokens": self.job.cached_tokens([last])},
            "output_tokens": num_output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": num_input + num_output}
        extra = self.body.model_extra or {}
        return {"id": self.resp_id, "object": "response", "created_at": self.created, "status": status,
                "background": False, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": self.body.instructions, "max_output_tokens": self.body.max_output_tokens,
                "metadata": extra.get("metadata") or {}, "model": self.model_name, "output": output,
                "parallel_tool_calls": self.chat.parallel_tool_calls, "previous_response_id": None,
                "reasoning": extra.get("reasoning"), "store": False, "temperature": self.chat.temperature,
                "text": self.body.text or {"format": {"type": "text"}}, "tool_choice": self.body.tool_choice or
                ("auto" if self.body.tools else "none"), "tools": self.body.tools or [], "top_p": self.chat.top_p,
                "truncation": "disabled", "usage": usage, "user": extra.get("user")}

    async def _read(self, merged: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[
            tuple[list[dict[str, Any]], RequestOutput]]:
        """For each engine output: the events its text adds (the closing ones with the last), and the output."""
        reader, items, num_tokens = self.job.readers()[0], OutputItems(), 0
        async with aclosing(merged):
            async for _, out in merged:
                if out.finish_reason == "error":
                    raise failed(out)
                num_tokens += len(out.token_ids)
                delta = Delta(content=out.text) if reader is None else reader.feed(out.text)
                if out.finished and reader is not None:
                    delta = delta + reader.finish()
                events = items.feed(delta)
                if out.finished:
                    events += items.close(self._status(out))
                    self.output, self.num_tokens = items.items, num_tokens
                yield events, out

    def _status(self, out: RequestOutput) -> str:
        return "incomplete" if out.finish_reason == "length" else "completed"

    async def whole(self, merged: AsyncIterator[tuple[int, RequestOutput]]) -> dict[str, Any]:
        last = None
        async for _, out in self._read(merged):
            last = out
        assert last is not None and last.finished
        return self.response(self._status(last), self.output, self.num_tokens, last)

    async def sse(self, merged: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[str]:
        number = 0

        def event(data: dict[str, Any]) -> str:
            nonlocal number
            data = data | {"sequence_number": number}
            number += 1
            return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

        yield event({"type": "response.created", "response": self.response("in_progress", [], None)})
        yield event({"type": "response.in_progress", "response": self.response("in_progress", [], None)})
        try:
            async with aclosing(self._read(merged)) as reading:  # a client gone: its request aborted at once
                async for events, out in reading:
                    for data in events:
                        yield event(data)
                    if out.finished:
                        status = self._status(out)
                        yield event({"type": f"response.{status}",
                                     "response": self.response(status, self.output, self.num_tokens, out)})
        except APIError as e:
            yield event({"type": "error", "code": e.code, "message": e.message, "param": e.param})
