"""The OpenAI-compatible HTTP surface: completions, chat, models, health; SSE streams and error JSON.

`OpenAIServer` takes an engine client (anything with `generate(request)` streaming RequestOutputs), so
the same code serves through Ray Serve or against a fake in tests.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi.responses import JSONResponse, StreamingResponse

from deploy.prompts import build_request, encode_prompt
from deploy.serving.schemas import (
    APIError,
    ChatBody,
    ChatMessage,
    CompletionBody,
    DetokenizeBody,
    TokenizeBody,
    _SamplingBody,
)
from scheduler.outputs import RequestOutput
from scheduler.policy import QueueFullError
from scheduler.request import Request

MAX_COMPLETION_DEFAULT = 16  # OpenAI's default max_tokens for /v1/completions


class EngineClient(Protocol):
    def generate(self, request: Request) -> AsyncIterator[RequestOutput]: ...


@dataclass(frozen=True)
class ServedModel:
    name: str
    tokenizer: Any
    eos_token_ids: frozenset[int]
    capacity: int  # tokens per request: prompt + completion


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _unwrap(exc: BaseException) -> BaseException:
    """Ray wraps a remote exception; its cause is what the engine raised."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


class OpenAIServer:
    """Turns OpenAI bodies into requests, runs them through the engine, and shapes the replies."""

    def __init__(self, client: EngineClient, model: ServedModel) -> None:
        self.client, self.model = client, model

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model.name, "object": "model", "created": 0,
                                            "owned_by": "pdserve", "max_model_len": self.model.capacity}]}

    # ---- request building -------------------------------------------------------------------------
    def _check_common(self, body: _SamplingBody) -> None:
        self._check_model(body.model)

    def _build(self, body: _SamplingBody, prompt_ids: list[int], max_tokens: int | None, prefix: str) -> Request:
        num_prompt = len(prompt_ids)
        if not prompt_ids:
            raise APIError(400, "The prompt is empty.", param="prompt")
        if max_tokens is None:
            max_tokens = max(1, self.model.capacity - num_prompt)
        if num_prompt + max_tokens > self.model.capacity:
            raise APIError(400, f"This model's maximum context length is {self.model.capacity} tokens. However, "
                           f"you requested {num_prompt + max_tokens} tokens ({num_prompt} in the prompt, "
                           f"{max_tokens} for the completion).", param="max_tokens",
                           code="context_length_exceeded")
        try:
            return build_request(f"{prefix}-{uuid.uuid4().hex}", prompt_ids, max_tokens=max_tokens,
                                 eos_token_ids=self.model.eos_token_ids, temperature=body.temperature,
                                 top_p=body.top_p, top_k=body.top_k, seed=body.seed, stop=body.stop,
                                 ignore_eos=body.ignore_eos, priority=body.priority)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    def completion_request(self, body: CompletionBody) -> Request:
        self._check_common(body)
        prompt: Any = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, "Only one prompt per request is supported.", param="prompt")
            prompt = prompt[0]
        try:
            if isinstance(prompt, str):
                ids = encode_prompt(self.model.tokenizer, prompt=prompt)
            else:
                ids = encode_prompt(self.model.tokenizer, prompt_token_ids=list(prompt))
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from None
        return self._build(body, ids, body.max_tokens or MAX_COMPLETION_DEFAULT, "cmpl")

    def chat_request(self, body: ChatBody) -> Request:
        self._check_common(body)
        ids = self._chat_ids(body.messages)
        return self._build(body, ids, body.max_completion_tokens or body.max_tokens, "chatcmpl")

    def _chat_ids(self, chat: list[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        messages = []
        for m in chat:
            content = m.content
            if isinstance(content, list):  # content parts: only text is understood here
                if any(part.get("type") != "text" for part in content):
                    raise APIError(400, "Only text content parts are supported.", param="messages")
                content = "".join(str(part.get("text", "")) for part in content)
            messages.append({"role": m.role, "content": content or ""})
        try:
            if not add_generation_prompt:
                text = self.model.tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
                return self.model.tokenizer(text, add_special_tokens=False).input_ids
            return encode_prompt(self.model.tokenizer, messages=messages)
        except Exception as e:  # a chat template can raise anything on odd input
            raise APIError(400, f"The messages do not fit the model's chat template: {e}", param="messages") from None

    # ---- tokenizer endpoints ----------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model.name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.model.name}`.",
                           "invalid_request_error", "model", "model_not_found")

    def tokenize(self, body: TokenizeBody) -> dict[str, Any]:
        """The ids a completion (`prompt`) or a chat request (`messages`) would be given."""
        self._check_model(body.model)
        if body.messages is not None:
            ids = self._chat_ids(body.messages, body.add_generation_prompt)
        else:
            assert body.prompt is not None
            ids = self.model.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens).input_ids
        return {"count": len(ids), "max_model_len": self.model.capacity, "tokens": ids}

    def detokenize(self, body: DetokenizeBody) -> dict[str, Any]:
        self._check_model(body.model)
        vocab = len(self.model.tokenizer)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens has ids outside the vocabulary [0, {vocab}): {bad[:5]}", param="tokens")
        return {"prompt": self.model.tokenizer.decode(body.tokens)}

    # ---- running ----------------------------------------------------------------------------------
    async def _start(self, request: Request) -> tuple[RequestOutput, AsyncIterator[RequestOutput]]:
        """Submit and wait for the first output, so admission errors still get a proper status."""
        stream = self.client.generate(request)
        try:
            first = await stream.__anext__()
        except Exception as exc:
            cause = _unwrap(exc)
            if isinstance(cause, QueueFullError):
                raise APIError(429, f"The server is busy: {cause}. Retry shortly.", "rate_limit_error",
                               code="queue_full", headers={"Retry-After": "1"}) from None
            if isinstance(cause, ValueError):
                raise APIError(400, str(cause)) from None
            raise APIError(503, f"The engine is not available: {type(cause).__name__}: {cause}",
                           "service_unavailable", code="engine_unavailable") from None
        return first, stream

    async def completions(self, body: CompletionBody) -> JSONResponse | StreamingResponse:
        return await self._respond(body, self.completion_request(body), chat=False)

    async def chat(self, body: ChatBody) -> JSONResponse | StreamingResponse:
        return await self._respond(body, self.chat_request(body), chat=True)

    async def _respond(self, body: _SamplingBody, request: Request, chat: bool) -> JSONResponse | StreamingResponse:
        first, stream = await self._start(request)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self._sse(request, first, stream, chat, include_usage),
                                     media_type="text/event-stream")
        text, num_tokens, last = "", 0, first
        async for out in _rest(first, stream):
            text += out.text
            num_tokens += len(out.token_ids)
            last = out
        if last.finish_reason == "error":
            raise APIError(500, f"Generation failed: {last.error}", "server_error", code="engine_error")
        usage = _usage(request, num_tokens)
        created = int(time.time())
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": last.finish_reason}
            return JSONResponse({"id": request.req_id, "object": "chat.completion", "created": created,
                                 "model": self.model.name, "choices": [choice], "usage": usage})
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason}
        return JSONResponse({"id": request.req_id, "object": "text_completion", "created": created,
                             "model": self.model.name, "choices": [choice], "usage": usage})

    async def _sse(self, request: Request, first: RequestOutput, stream: AsyncIterator[RequestOutput], chat: bool,
                   include_usage: bool) -> AsyncIterator[str]:
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
            data: dict[str, Any] = {"id": request.req_id, "object": kind, "created": created,
                                    "model": self.model.name, "choices": choices}
            if include_usage:
                data["usage"] = usage
            return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

        if chat:
            yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        num_tokens, finished = 0, False
        try:
            async for out in _rest(first, stream):
                num_tokens += len(out.token_ids)
                finished = out.finished
                if out.finish_reason == "error":
                    error = APIError(500, f"Generation failed: {out.error}", "server_error", code="engine_error")
                    yield f"data: {json.dumps(error.body())}\n\n"
                    break
                if not out.text and not out.finished:
                    continue
                if chat:
                    delta: dict[str, Any] = {"content": out.text} if out.text else {}
                    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": out.finish_reason}
                else:
                    choice = {"index": 0, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason}
                yield chunk([choice])
        finally:
            cancel = getattr(stream, "cancel", None)
            if not finished and cancel is not None:  # the client went away: free the request's slot now
                cancel()
        if include_usage:
            yield chunk([], _usage(request, num_tokens))
        yield "data: [DONE]\n\n"


async def _rest(first: RequestOutput, stream: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    yield first
    if first.finished:
        return
    async for out in stream:
        yield out
        if out.finished:
            return


def _usage(request: Request, num_completion: int) -> dict[str, int]:
    num_prompt = len(request.prompt_ids)
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion}
