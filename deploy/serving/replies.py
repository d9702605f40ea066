"""Engine outputs as OpenAI replies: whole bodies and SSE chunks, for n choices, with log-probs and
echo."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from deploy.serving.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from deploy.serving.reasoning import MessageReader, ThinkSplitter
from deploy.serving.schemas import APIError
from deploy.serving.tools.call_readers import Delta
from deploy.serving.tools.tool_use import ToolUse
from scheduler.cell.deadlines import QUEUE_TIMEOUT, TIMEOUT
from scheduler.outputs import RequestOutput
from scheduler.request import Request, TokenLogprob

# the error code of the streams a draining ingress ends at its drain timeout
SHUTTING_DOWN = "shutting_down"
# a stream's first output, and the stream
Started = tuple[RequestOutput, AsyncIterator[RequestOutput]]


@dataclass(frozen=True)
class Job:
    """One HTTP request: its engine requests (one per choice) and how their outputs are returned."""

    resp_id: str
    requests: list[Request]  # choice i is requests[i]; a prompt's choices are consecutive
    chat: bool
    logprobs: bool = False  # the reply carries log-probs (the requests asked the engine for them)
    # completions' `echo`: each prompt's text, returned before its choices' text
    echo: tuple[str, ...] | None = None
    # echo with max_tokens 0 (how lm-eval-harness scores a prompt): the engine needs max_tokens >=
    # 1, so it generates one token, which the reply leaves out of text, log-probs and usage. (vLLM
    # does the same, but counts that token in usage.completion_tokens; we report 0, what the reply
    # holds.)
    drop_generation: bool = False
    # `n`: choice i answers prompt i // n (completions take a list of prompts)
    choices_per_prompt: int = 1
    tools: ToolUse | None = None  # chat with tools: how the text becomes content and tool calls
    reasoning: str | None = None  # chat: the server's reasoning parser (reasoning.py)
    # vLLM's `return_token_ids`: choices carry their prompt's and their generated token ids
    token_ids: bool = False

    def readers(self) -> list[MessageReader | None]:
        """One reader per choice, turning its text into message deltas (None: the text is the
        content)."""
        if self.tools is None and self.reasoning is None:
            return [None] * len(self.requests)
        return [
            MessageReader(
                ThinkSplitter(self.reasoning) if self.reasoning is not None else None,
                self.tools.reader() if self.tools is not None else None,
            )
            for _ in self.requests
        ]

    @property
    def num_prompt_tokens(self) -> int:
        """Every prompt's tokens, each prompt counted once however many choices it has (as usage
        counts them)."""
        return sum(len(r.prompt_ids) for r in self.requests[:: self.choices_per_prompt])

    def cached_tokens(self, finished: list[RequestOutput | None]) -> int:
        """Of those prompt tokens, how many came from the prefix cache (known once a prompt's first
        choice has finished: its last output's metrics say)."""
        return sum(
            int(out.metrics.get("cached_tokens", 0))
            for out in finished[:: self.choices_per_prompt]
            if out is not None
        )


async def aclose(stream: AsyncIterator[RequestOutput]) -> None:
    """Close a stream (before its end, that aborts its request in the engine), if it can be
    closed."""
    close = getattr(stream, "aclose", None)
    if close is not None:
        await close()


async def merge_streams(started: list[Started]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of every choice's stream as they come, tagged with the choice index; each stream
    ends at its finished output. Closing this (a client that went away, or an error) cancels every
    stream still open, which aborts its request in the engine."""
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, first: RequestOutput, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            out = first
            queue.put_nowait((index, out))
            while not out.finished:
                out = await anext(stream)
                queue.put_nowait((index, out))
        except Exception as e:  # a stream that failed (or ended early) fails the whole reply
            queue.put_nowait(
                (
                    index,
                    e
                    if not isinstance(e, StopAsyncIteration)
                    else RuntimeError("the engine's stream ended before its request finished"),
                )
            )
        finally:
            queue.put_nowait((index, None))
            await aclose(stream)

    tasks = [
        asyncio.create_task(pump(i, first, stream)) for i, (first, stream) in enumerate(started)
    ]
    try:
        num_open = len(tasks)
        while num_open:
            index, item = await queue.get()
            if item is None:
                num_open -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def failed(out: RequestOutput) -> APIError:
    """The error a failed output answers: its message is the engine's short one (which names the
    request; the server logs any details under that id)."""
    if out.unavailable:  # its cell was lost and no other could take it in time
        return APIError(
            503,
            f"Generation was interrupted: {out.error}. Retry shortly.",
            "service_unavailable",
            code="engine_unavailable",
            headers={"Retry-After": "5"},
        )
    if out.error_code == QUEUE_TIMEOUT:
        return APIError(
            503,
            f"The server is busy: {out.error}. Retry shortly.",
            "service_unavailable",
            code="queue_timeout",
            headers={"Retry-After": "1"},
        )
    if out.error_code == TIMEOUT:
        return APIError(
            504, f"Timed out: {out.error}", "timeout_error", param="timeout", code="timeout"
        )
    if out.error_code == SHUTTING_DOWN:
        return APIError(
            503,
            f"Generation was interrupted: {out.error}.",
            "service_unavailable",
            code=SHUTTING_DOWN,
            headers={"Retry-After": "5"},
        )
    return APIError(500, f"Generation failed: {out.error}", "server_error", code="engine_error")


class Replier:
    """Shapes one job's outputs into OpenAI's chat or text-completion objects."""

    def __init__(self, job: Job, model_name: str, texts: TokenTexts) -> None:
        self.job = job
        self.model_name = model_name
        self.texts = texts
        self.created = int(time.time())

    def _piece(
        self, index: int, out: RequestOutput, with_prompt: bool, text_offset: int
    ) -> tuple[str, Any, int]:
        """Text, log-probs and number of tokens choice `index` returns for `out` (its prompt first,
        if echoed)."""
        job = self.job
        text = ""
        token_ids: list[int] = []
        entries: list[TokenLogprob | None] = []
        if with_prompt and job.echo is not None:
            text = job.echo[index // job.choices_per_prompt]
            token_ids = list(job.requests[index].prompt_ids)
            entries = [None, *(out.prompt_logprobs or [])] if job.logprobs else []
        if not job.drop_generation:
            text += out.text
            token_ids += out.token_ids
            entries += out.logprobs
        if not job.logprobs:
            return text, None, len(token_ids)
        if job.chat:
            return text, chat_logprobs(out.logprobs, self.texts), len(token_ids)
        return (
            text,
            completion_logprobs(token_ids, entries, self.texts, text_offset),
            len(token_ids),
        )

    def _finish_reason(self, out: RequestOutput, num_calls: int = 0) -> str | None:
        if self.job.drop_generation and out.finished:
            return "length"  # max_tokens 0 was reached, whatever the one token generated said
        if self.job.tools is not None:
            return self.job.tools.finish_reason(out.finish_reason, num_calls)
        return out.finish_reason

    def _choice(
        self,
        index: int,
        text: str,
        logprobs: Any,
        finish_reason: str | None,
        stream: bool,
        read: Delta | None = None,
        ids: tuple[list[int] | None, list[int]] | None = None,
    ) -> dict:
        """One choice of a reply or chunk; `read`: the choice's text read as content, reasoning and
        tool calls; `ids`: its prompt's token ids (None after a stream's first chunk) and the ids
        it generated, returned when the job asks for them."""
        choice: dict[str, Any] = {"index": index} | self._content(text, stream, read)
        choice |= {"logprobs": logprobs, "finish_reason": finish_reason}
        if self.job.token_ids and ids is not None:
            choice |= {"prompt_token_ids": ids[0], "token_ids": ids[1]}
        return choice

    def _content(self, text: str, stream: bool, read: Delta | None) -> dict[str, Any]:
        """A choice's text as completions' `text`, a chat chunk's `delta` or a chat reply's
        `message`."""
        if not self.job.chat:
            return {"text": text}
        if read is not None:
            text = read.content
        if stream:
            delta: dict[str, Any] = {"content": text} if text else {}
            if read is not None and read.reasoning:
                delta["reasoning_content"] = read.reasoning
            if read is not None and read.calls and self.job.tools is not None:
                delta |= self.job.tools.message_calls(read.calls, stream=True)
            return {"delta": delta}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.job.reasoning is not None and read is not None:
            message["reasoning_content"] = read.reasoning or None
        if read is not None and read.calls and self.job.tools is not None:
            message |= {
                "content": text or None,
                **self.job.tools.message_calls(read.calls, stream=False),
            }
        return {"message": message}

    def usage(self, num_completion: int, finished: list[RequestOutput | None]) -> dict[str, Any]:
        """Tokens so far; the prompts' tokens served from the prefix cache, of the choices
        `finished`."""
        num_prompt = self.job.num_prompt_tokens
        return {
            "prompt_tokens": num_prompt,
            "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion,
            "prompt_tokens_details": {"cached_tokens": self.job.cached_tokens(finished)},
        }

    def _num_generated(self, out: RequestOutput) -> int:
        return len(self._generated_ids(out))

    def _generated_ids(self, out: RequestOutput) -> list[int]:
        return [] if self.job.drop_generation else list(out.token_ids)

    async def whole(self, merged: AsyncIterator[tuple[int, RequestOutput]]) -> dict[str, Any]:
        """The non-streaming body: every choice gathered to its end. A failed choice fails the
        reply."""
        outs = [RequestOutput(r.req_id) for r in self.job.requests]
        async with aclosing(merged):
            async for index, out in merged:
                if out.finish_reason == "error":
                    raise failed(out)
                done = outs[index]
                done.token_ids += out.token_ids
                done.text += out.text
                done.logprobs += out.logprobs
                if out.prompt_logprobs is not None:
                    done.prompt_logprobs = out.prompt_logprobs
                done.finish_reason = out.finish_reason
                done.metrics = out.metrics
        choices = []
        for index, (done, reader) in enumerate(zip(outs, self.job.readers(), strict=True)):
            text, logprobs, _ = self._piece(index, done, True, 0)
            read = reader.feed(text) + reader.finish() if reader is not None else None
            num_calls = read.new_calls if read is not None else 0
            choices.append(
                self._choice(
                    index,
                    text,
                    logprobs,
                    self._finish_reason(done, num_calls),
                    stream=False,
                    read=read,
                    ids=(list(self.job.requests[index].prompt_ids), self._generated_ids(done)),
                )
            )
        return {
            "id": self.job.resp_id,
            "object": "chat.completion" if self.job.chat else "text_completion",
            "created": self.created,
            "model": self.model_name,
            "choices": choices,
            "usage": self.usage(sum(self._num_generated(done) for done in outs), list(outs)),
        }

    async def sse(
        self,
        merged: AsyncIterator[tuple[int, RequestOutput]],
        include_usage: bool,
        continuous_usage: bool = False,
    ) -> AsyncIterator[str]:
        """The SSE stream: chunks of different choices interleave, each naming its choice's index. A
        chunk carries the log-probs of the tokens it brings, even when their text is still held back
        (empty). With usage, a last chunk carries it (and every chunk `usage: null`); with
        `continuous_usage` too (vLLM's `continuous_usage_stats`), every chunk carries the usage so
        far."""
        kind = "chat.completion.chunk" if self.job.chat else "text_completion"

        def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
            data: dict[str, Any] = {
                "id": self.job.resp_id,
                "object": kind,
                "created": self.created,
                "model": self.model_name,
                "choices": choices,
            }
            if include_usage:
                data["usage"] = usage
            return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

        num_choices = len(self.job.requests)
        finished: list[RequestOutput | None] = [None] * num_choices

        def so_far(num_tokens: int) -> dict[str, Any] | None:
            return self.usage(num_tokens, finished) if continuous_usage else None

        if self.job.chat:
            for index in range(num_choices):
                yield chunk(
                    [
                        {
                            "index": index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    so_far(0),
                )
        started = [False] * num_choices
        text_lens = [0] * num_choices
        num_tokens = 0
        readers = self.job.readers()
        num_calls = [0] * num_choices
        async with aclosing(merged):
            async for index, out in merged:
                if out.finish_reason == "error":
                    yield f"data: {json.dumps(failed(out).body())}\n\n"
                    break
                num_tokens += self._num_generated(out)
                if out.finished:
                    finished[index] = out
                first = not started[index]
                text, logprobs, num_piece_tokens = self._piece(index, out, first, text_lens[index])
                started[index] = True
                text_lens[index] += len(text)
                read = None
                if (reader := readers[index]) is not None:
                    read = reader.feed(text) + (reader.finish() if out.finished else Delta())
                    num_calls[index] += read.new_calls
                generated = self._generated_ids(out)
                if (
                    not (read if read is not None else text)
                    and not out.finished
                    and not (logprobs and num_piece_tokens)
                    and not (self.job.token_ids and (generated or first))
                ):
                    continue
                logprobs = logprobs if num_piece_tokens else None
                yield chunk(
                    [
                        self._choice(
                            index,
                            text,
                            logprobs,
                            self._finish_reason(out, num_calls[index]),
                            stream=True,
                            read=read,
                            ids=(
                                list(self.job.requests[index].prompt_ids) if first else None,
                                generated,
                            ),
                        )
                    ],
                    so_far(num_tokens),
                )
        if include_usage:
            yield chunk([], self.usage(num_tokens, finished))
        yield "data: [DONE]\n\n"
