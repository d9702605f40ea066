"""OpenAI's Responses API, its reply: one choice's text (read as reasoning, content and tool calls,
as on chat) as output items, in a Response object or as the typed events that build it."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from deploy.serving.logprobs import TokenTexts, chat_logprobs
from deploy.serving.replies import Job, failed
from deploy.serving.responses.request import ResponsesBody
from deploy.serving.schemas import APIError
from deploy.serving.tools.call_readers import CallDelta, Delta
from scheduler.outputs import RequestOutput


class OutputItems:
    """One choice's deltas as Responses output items, and the stream events that build them (without
    their sequence numbers). Items come in the order their text does: reasoning, message text, each
    function call."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._logprobs: list[dict[str, Any]] = []  # of tokens whose text has not come yet

    def feed(
        self, delta: Delta, logprobs: list[dict[str, Any]] | None = None
    ) -> list[dict[str, Any]]:
        """The events of a delta; `logprobs` (of the tokens that brought it: only when all text is
        the message's) go with the message text."""
        self._logprobs += logprobs or []
        events = self._text("reasoning", delta.reasoning) if delta.reasoning else []
        if delta.content:
            events += self._text("message", delta.content)
        for call in delta.calls:
            events += self._call(call)
        return events

    def close(self, status: str) -> list[dict[str, Any]]:
        """The events that end the open item, which gets `status` (completed, or incomplete when
        cut)."""
        item = self._open
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        # log-probs of the last tokens, whose text was empty (EOS) or held back: with an empty delta
        events = self._text("message", "") if self._logprobs and item["type"] == "message" else []
        self._open = None
        item["status"] = status
        if item["type"] == "function_call":
            events.append(
                {
                    "type": "response.function_call_arguments.done",
                    **where,
                    "name": item["name"],
                    "arguments": item["arguments"],
                }
            )
        else:
            part = item["content"][0]
            kind = (
                "response.output_text" if item["type"] == "message" else "response.reasoning_text"
            )
            events.append(
                {"type": f"{kind}.done", **where, "content_index": 0, "text": part["text"]}
            )
            if item["type"] == "message":
                events[-1]["logprobs"] = part["logprobs"]
                events.append(
                    {
                        "type": "response.content_part.done",
                        **where,
                        "content_index": 0,
                        "part": part,
                    }
                )
        return events + [
            {"type": "response.output_item.done", "output_index": len(self.items) - 1, "item": item}
        ]

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close("completed")
        self.items.append(item)
        self._open = item
        events.append(
            {
                "type": "response.output_item.added",
                "output_index": len(self.items) - 1,
                "item": _snapshot(item),
            }
        )
        if item["type"] == "message":
            events.append(
                {
                    "type": "response.content_part.added",
                    "item_id": item["id"],
                    "output_index": len(self.items) - 1,
                    "content_index": 0,
                    "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                }
            )
        return events

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self._open["type"] != kind:
            part = (
                {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                if kind == "message"
                else {"type": "reasoning_text", "text": ""}
            )
            item = {
                "type": kind,
                "id": _item_id("msg" if kind == "message" else "rs"),
                "status": "in_progress",
                "content": [part],
            }
            events = self._add(
                item | ({"role": "assistant"} if kind == "message" else {"summary": []})
            )
        assert self._open is not None
        part = self._open["content"][0]
        part["text"] += text
        event = {
            "type": "response.output_text.delta"
            if kind == "message"
            else "response.reasoning_text.delta",
            "item_id": self._open["id"],
            "output_index": len(self.items) - 1,
            "content_index": 0,
            "delta": text,
        }
        if kind == "message":
            event["logprobs"], self._logprobs = self._logprobs, []
            part["logprobs"] += event["logprobs"]
        return events + [event]

    def _call(self, call: CallDelta) -> list[dict[str, Any]]:
        events = []
        if call.id is not None:  # a call's first piece
            events = self._add(
                {
                    "type": "function_call",
                    "id": _item_id("fc"),
                    "call_id": call.id,
                    "name": call.name,
                    "arguments": "",
                    "status": "in_progress",
                }
            )
        if call.arguments and self._open is not None and self._open["type"] == "function_call":
            self._open["arguments"] += call.arguments
            events.append(
                {
                    "type": "response.function_call_arguments.delta",
                    "item_id": self._open["id"],
                    "output_index": len(self.items) - 1,
                    "delta": call.arguments,
                }
            )
        return events


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _snapshot(item: dict[str, Any]) -> dict[str, Any]:
    """The item as it stands when added: empty text, no arguments yet."""
    copy = json.loads(json.dumps(item))
    for part in copy.get("content", []):
        part["text"] = ""
        if "logprobs" in part:
            part["logprobs"] = []
    if copy["type"] == "function_call":
        copy["arguments"] = ""
    return copy


class ResponseReplier:
    """Shapes one chat job's single choice into a Response object, or the stream of events that
    builds it."""

    def __init__(
        self, job: Job, model_name: str, texts: TokenTexts, body: ResponsesBody, chat: Any
    ) -> None:
        self.job = job
        self.model_name = model_name
        self.texts = texts
        self.body = body
        self.chat = chat
        self.created = int(time.time())
        self.resp_id = "resp_" + job.resp_id.split("-", 1)[-1]

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        num_output: int | None,
        last: RequestOutput | None = None,
    ) -> dict[str, Any]:
        num_input = self.job.num_prompt_tokens
        usage = (
            None
            if num_output is None
            else {
                "input_tokens": num_input,
                "input_tokens_details": {"cached_tokens": self.job.cached_tokens([last])},
                "output_tokens": num_output,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": num_input + num_output,
            }
        )
        extra = self.body.model_extra or {}
        return {
            "id": self.resp_id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": self.body.instructions,
            "max_output_tokens": self.body.max_output_tokens,
            "metadata": extra.get("metadata") or {},
            "model": self.model_name,
            "output": output,
            "parallel_tool_calls": self.chat.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": extra.get("reasoning"),
            "store": False,
            "temperature": self.chat.temperature,
            "text": self.body.text or {"format": {"type": "text"}},
            "tool_choice": self.body.tool_choice or ("auto" if self.body.tools else "none"),
            "tools": self.body.tools or [],
            "top_p": self.chat.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": extra.get("user"),
        }

    async def _read(
        self, merged: AsyncIterator[tuple[int, RequestOutput]]
    ) -> AsyncIterator[tuple[list[dict[str, Any]], RequestOutput]]:
        """For each engine output: the events its text adds (the closing ones with the last), and
        the output."""
        reader = self.job.readers()[0]
        items = OutputItems()
        num_tokens = 0
        async with aclosing(merged):
            async for _, out in merged:
                if out.finish_reason == "error":
                    raise failed(out)
                num_tokens += len(out.token_ids)
                delta = Delta(content=out.text) if reader is None else reader.feed(out.text)
                if out.finished and reader is not None:
                    delta = delta + reader.finish()
                logprobs = (
                    chat_logprobs(out.logprobs, self.texts)["content"]
                    if self.job.logprobs
                    else None
                )
                events = items.feed(delta, logprobs)
                if out.finished:
                    events += items.close(self._status(out))
                    self.output = items.items
                    self.num_tokens = num_tokens
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

        yield event(
            {"type": "response.created", "response": self.response("in_progress", [], None)}
        )
        yield event(
            {"type": "response.in_progress", "response": self.response("in_progress", [], None)}
        )
        try:
            # a client gone: its request aborted at once
            async with aclosing(self._read(merged)) as reading:
                async for events, out in reading:
                    for data in events:
                        yield event(data)
                    if out.finished:
                        status = self._status(out)
                        yield event(
                            {
                                "type": f"response.{status}",
                                "response": self.response(
                                    status, self.output, self.num_tokens, out
                                ),
                            }
                        )
        except APIError as e:
            yield event({"type": "error", "code": e.code, "message": e.message, "param": e.param})
