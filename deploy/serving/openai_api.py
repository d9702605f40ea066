"""The OpenAI-compatible HTTP surface: completions, chat, responses, models; SSE streams and error
JSON.

`OpenAIServer` takes an engine client (anything with `generate(request)` streaming RequestOutputs),
so the same code serves through Ray Serve or against a fake in tests.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from deploy.engine_client import short_error, unwrap
from deploy.params import (
    ParameterError,
    check_context_length,
    check_token_ids,
    structured_format,
)
from deploy.prompts import encode_prompt
from deploy.serving.logprobs import TokenTexts
from deploy.serving.loras import LoraNames
from deploy.serving.replies import Job, Replier, Started, aclose, failed, merge_streams
from deploy.serving.responses.reply import ResponseReplier
from deploy.serving.responses.request import ResponsesBody, chat_fields, renamed
from deploy.serving.schemas import (
    APIError,
    ChatBody,
    ChatMessage,
    ChatTemplateOptions,
    CompletionBody,
    DetokenizeBody,
    LoadLoraBody,
    NamedToolChoice,
    TokenizeBody,
    UnloadLoraBody,
    _SamplingBody,
    validation_error,
)
from deploy.serving.tools.tool_use import ToolUse
from scheduler.cell.deadlines import QUEUE_TIMEOUT
from scheduler.outputs import RequestOutput
from scheduler.request import LoraRef, Request
from scheduler.step_planner import QueueFullError
from workers.lora import LoraError

log = logging.getLogger(__name__)

MAX_COMPLETION_DEFAULT = 16  # OpenAI's default max_tokens for /v1/completions


class EngineClient(Protocol):
    def generate(self, request: Request) -> AsyncIterator[RequestOutput]: ...


@dataclass(frozen=True)
class ServedModel:
    name: str
    tokenizer: Any
    eos_token_ids: frozenset[int]
    capacity: int  # tokens per request: prompt + completion
    # reads the calls of tool_choice auto out of the text (tools.py)
    tool_call_parser: str | None = None
    # splits a reasoning model's thinking off its replies (reasoning.py)
    reasoning_parser: str | None = None
    # a request not given a slot this long after its arrival gets 503 (--max-queue-time-s)
    max_queue_s: float | None = None
    # LoRA adapters served beside it, by name: a request's `model` picks one (--lora-modules,
    # and those loaded at run time)
    loras: LoraNames = field(default_factory=LoraNames)


def _name(index: int, count: int) -> str:
    """How an error names the prompt at fault: by its index when the request has several."""
    return f"prompt {index}: " if count > 1 else ""


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    """An earlier tool call as chat templates read it: its arguments as an object when they are JSON
    text (OpenAI sends a string; templates such as Qwen's write `arguments | tojson`), as vLLM
    passes them."""
    function = call.get("function")
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            arguments = json.loads(function["arguments"])
        except json.JSONDecodeError:
            return call
        if isinstance(arguments, dict):
            return {**call, "function": {**function, "arguments": arguments}}
    return call


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


class OpenAIServer:
    """Turns OpenAI bodies into requests, runs them through the engine, and shapes the replies."""

    def __init__(self, client: EngineClient, model: ServedModel) -> None:
        self.client = client
        self.model = model
        self.texts = TokenTexts(model.tokenizer)

    def models(self) -> dict[str, Any]:
        """The served model and each LoRA adapter, whose `parent` is the served model."""
        names = [self.model.name, *self.model.loras.all()]
        return {"object": "list", "data": [self.model_card(name) for name in names]}

    def model_card(self, model: str) -> dict[str, Any]:
        """`GET /v1/models/{model}`: the served model's or an adapter's card; 404 for another
        name."""
        lora = self._adapter(model)
        return {
            "id": model,
            "object": "model",
            "created": 0,
            "owned_by": "pdserve",
            "root": self.model.name if lora is None else lora.path,
            "parent": None if lora is None else self.model.name,
            "max_model_len": self.model.capacity,
        }

    # ---- request building
    def _build(
        self,
        body: _SamplingBody,
        prompts: list[list[int]],
        max_tokens: int | None,
        prefix: str,
        *,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        response_format: dict[str, Any] | None = None,
        lora: LoraRef | None = None,
    ) -> tuple[str, list[Request]]:
        """The response id and `n` Requests per prompt, prompt by prompt: choice p * n + i is choice
        i of prompt p. Choice i of a prompt samples as a single request of that prompt with seed + i
        would (one random base seed when none is given), so a list of prompts gives what one request
        per prompt with the same seed gives; a prompt's choices after its first may share the
        first's prompt KV (`fork_of`)."""
        resp_id = f"{prefix}-{uuid.uuid4().hex}"
        n = body.num_choices
        seed = body.seed if body.seed is not None else random.getrandbits(62)
        vocab_size = len(self.model.tokenizer)
        try:
            structured = body.structured(response_format)
            requests = []
            for p, prompt_ids in enumerate(prompts):
                limit = self._max_tokens(prompt_ids, max_tokens, _name(p, len(prompts)))
                first = f"{resp_id}-{p * n}"
                requests += [
                    body.request(
                        f"{resp_id}-{p * n + i}",
                        prompt_ids,
                        max_tokens=limit,
                        eos_token_ids=self.model.eos_token_ids,
                        vocab_size=vocab_size,
                        seed=seed + i,
                        logprobs=logprobs,
                        prompt_logprobs=prompt_logprobs,
                        structured=structured,
                        fork_of=first if i else None,
                        lora=lora,
                    )
                    for i in range(n)
                ]
            return resp_id, requests
        except ParameterError as e:
            raise APIError(400, str(e), param=e.param) from None
        except ValueError as e:
            raise APIError(400, str(e)) from None

    def _max_tokens(self, prompt_ids: list[int], max_tokens: int | None, which: str) -> int:
        """The completion's length for one prompt (default: the rest of the context); 400 if it
        cannot fit."""
        num_prompt = len(prompt_ids)
        if not prompt_ids:
            raise APIError(400, f"{which}The prompt is empty.", param="prompt")
        if max_tokens is None:
            max_tokens = max(1, self.model.capacity - num_prompt)
        try:
            check_context_length(num_prompt, max_tokens, self.model.capacity)
        except ParameterError as e:
            raise APIError(400, f"{which}{e}", param=e.param, code=e.code) from None
        return max_tokens

    def completion_job(self, body: CompletionBody) -> Job:
        """A completion of each prompt: `prompt` is a text, a list of token ids, or a list of either
        (a batch: `n` choices per prompt, numbered prompt by prompt, as vLLM and OpenAI do)."""
        lora = self._adapter(body.model)
        batch = (
            body.prompt
            if isinstance(body.prompt, list)
            and body.prompt
            and isinstance(body.prompt[0], (str, list))
            else [body.prompt]
        )
        prompts = []
        for p, prompt in enumerate(batch):
            try:
                prompts.append(
                    encode_prompt(self.model.tokenizer, prompt=prompt)
                    if isinstance(prompt, str)
                    else encode_prompt(self.model.tokenizer, prompt_token_ids=list(prompt))
                )
            except ValueError as e:
                raise APIError(400, f"{_name(p, len(batch))}{e}", param="prompt") from None
        max_tokens = MAX_COMPLETION_DEFAULT if body.max_tokens is None else body.max_tokens
        echo = bool(body.echo)
        # max_tokens 0 (echo only): the engine generates one token, which the reply leaves out (see
        # Job)
        resp_id, requests = self._build(
            body,
            prompts,
            max(max_tokens, 1),
            "cmpl",
            logprobs=body.logprobs,
            prompt_logprobs=body.logprobs if echo else None,
            lora=lora,
        )
        echo_texts = (
            tuple(
                prompt if isinstance(prompt, str) else self.model.tokenizer.decode(ids)
                for prompt, ids in zip(batch, prompts, strict=True)
            )
            if echo
            else None
        )
        return Job(
            resp_id,
            requests,
            chat=False,
            logprobs=body.logprobs is not None,
            echo=echo_texts,
            drop_generation=max_tokens == 0,
            choices_per_prompt=body.num_choices,
            token_ids=body.return_token_ids,
        )

    def chat_job(self, body: ChatBody) -> Job:
        lora = self._adapter(body.model)
        tools = self._tool_use(body)
        ids = self._chat_ids(body.messages, body)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        resp_id, requests = self._build(
            body,
            [ids],
            body.max_completion_tokens or body.max_tokens,
            "chatcmpl",
            logprobs=logprobs,
            response_format=tools and tools.response_format,
            lora=lora,
        )
        return Job(
            resp_id,
            requests,
            chat=True,
            logprobs=logprobs is not None,
            tools=tools,
            reasoning=self.model.reasoning_parser,
            choices_per_prompt=body.num_choices,  # one prompt, n choices: usage counts it once
            token_ids=body.return_token_ids,
        )

    def _tool_use(self, body: ChatBody) -> ToolUse | None:
        """How the request uses its tools (None: it has none); 400 for auto without a parser, or a
        function whose parameters the grammar cannot force."""
        if not body.tools:
            return None
        choice = body.tool_choice or "auto"
        name = None
        if isinstance(choice, NamedToolChoice):
            choice, name = "named", choice.function.name
        if choice == "auto" and self.model.tool_call_parser is None:
            param, given = (
                ("function_call", "functions")
                if body.legacy_functions
                else ("tool_choice", "tools")
            )
            raise APIError(
                400,
                f'`{param}` "auto" (the default with `{given}`) needs a server started with '
                '--tool-call-parser (e.g. hermes); "required" or a named function need none',
                param=param,
            )
        tools = ToolUse(
            choice,
            tuple(t.model_dump(exclude_none=True) for t in body.tools),
            name,
            body.parallel_tool_calls,
            self.model.tool_call_parser,
            body.legacy_functions,
        )
        for function in tools.forced:  # each schema on its own, so the error names the function
            try:
                structured_format(
                    {
                        "type": "json_schema",
                        "json_schema": {"name": function, "schema": tools.schemas[function]},
                    }
                )
            except ParameterError as e:
                raise APIError(400, f"tools: function {function!r}: {e}", param="tools") from None
        return tools

    def _chat_ids(self, chat: list[ChatMessage], options: ChatTemplateOptions) -> list[int]:
        messages = []
        for m in chat:
            content = m.content
            if isinstance(content, list):  # content parts: only text is understood here
                if any(part.get("type") != "text" for part in content):
                    raise APIError(400, "Only text content parts are supported.", param="messages")
                content = "".join(str(part.get("text", "")) for part in content)
            # a legacy function result is a tool message, and a legacy call a tool call, as
            # templates know them
            message: dict[str, Any] = {
                "role": "tool" if m.role == "function" else m.role,
                "content": content or "",
            }
            if m.name is not None:
                message["name"] = m.name
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            calls = m.tool_calls or (
                [{"type": "function", "function": m.function_call}] if m.function_call else []
            )
            if calls:
                message["tool_calls"] = [_template_call(call) for call in calls]
            messages.append(message)
        template = {
            "add_generation_prompt": options.add_generation_prompt,
            "continue_final_message": options.continue_final_message,
            **(options.chat_template_kwargs or {}),
        }
        if options.tools:
            template["tools"] = [tool.model_dump(exclude_none=True) for tool in options.tools]
        try:
            return encode_prompt(self.model.tokenizer, messages=messages, template=template)
        except Exception as e:  # a chat template can raise anything on odd input
            raise APIError(
                400, f"The messages do not fit the model's chat template: {e}", param="messages"
            ) from None

    # ---- LoRA adapters at run time
    def load_lora(self, body: LoadLoraBody) -> str:
        """vLLM's `/v1/load_lora_adapter`: 400 with the reason if it cannot be served."""
        if body.lora_name == self.model.name:
            raise APIError(
                400, f"{body.lora_name!r} is the served model's name.", param="lora_name"
            )
        try:
            self.model.loras.load(body.lora_name, body.lora_path)
        except LoraError as e:
            raise APIError(400, str(e), param="lora_path") from None
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    def unload_lora(self, body: UnloadLoraBody) -> str:
        """vLLM's `/v1/unload_lora_adapter`: requests running with it finish; 404 if no adapter
        has the name."""
        if not self.model.loras.unload(body.lora_name):
            raise APIError(
                404,
                f"The LoRA adapter '{body.lora_name}' cannot be found.",
                "not_found_error",
                "lora_name",
                "lora_not_found",
            )
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."

    # ---- tokenizer endpoints
    def _check_model(self, model: str | None) -> None:
        self._adapter(model)

    def _adapter(self, model: str | None) -> LoraRef | None:
        """The LoRA adapter a request's `model` names; None for the served model (or no name);
        404 for a name served neither as the model nor as an adapter."""
        if model is None or model == self.model.name:
            return None
        lora = self.model.loras.get(model)
        if lora is None:
            served = ", ".join(f"`{name}`" for name in [self.model.name, *self.model.loras.all()])
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves {served}.",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        return lora

    def tokenize(self, body: TokenizeBody) -> dict[str, Any]:
        """The ids a completion (`prompt`) or a chat request (`messages`) would be given."""
        self._check_model(body.model)
        if body.messages is not None:
            ids = self._chat_ids(body.messages, body)
        else:
            assert body.prompt is not None
            ids = self.model.tokenizer(
                body.prompt, add_special_tokens=body.add_special_tokens
            ).input_ids
        return {"count": len(ids), "max_model_len": self.model.capacity, "tokens": ids}

    def detokenize(self, body: DetokenizeBody) -> dict[str, Any]:
        self._check_model(body.model)
        try:
            check_token_ids("tokens", body.tokens, len(self.model.tokenizer))
        except ParameterError as e:
            raise APIError(400, str(e), param=e.param) from None
        return {"prompt": self.model.tokenizer.decode(body.tokens)}

    # ---- running
    async def _start(self, request: Request) -> Started:
        """Submit and wait for the first output, so admission errors (and a queue deadline that
        passed) still get a proper status."""
        request.max_queue_s = self.model.max_queue_s
        stream = self.client.generate(request)
        try:
            first = await anext(stream)
        except Exception as exc:
            cause = unwrap(exc)
            if isinstance(cause, QueueFullError):
                raise APIError(
                    429,
                    f"The server is busy: {cause}. Retry shortly.",
                    "rate_limit_error",
                    code="queue_full",
                    headers={"Retry-After": "1"},
                ) from None
            if isinstance(cause, ValueError):
                raise APIError(400, str(cause)) from None
            log.warning("request %s found no engine: %r", request.req_id, cause)
            raise APIError(
                503,
                f"The engine is not available ({short_error(cause)}); retry shortly.",
                "service_unavailable",
                code="engine_unavailable",
            ) from None
        if first.error_code == QUEUE_TIMEOUT:  # (nothing was generated: the reply can be a 503)
            raise failed(first)
        return first, stream

    async def _start_all(self, requests: list[Request]) -> list[Started]:
        """Submit every choice at once; if one is refused, the others are aborted and its error is
        the reply."""
        results = await asyncio.gather(*(self._start(r) for r in requests), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for result in results:
                if not isinstance(result, BaseException):
                    await aclose(result[1])
            raise errors[0]
        return results  # type: ignore[return-value]

    def responses_job(self, body: ResponsesBody) -> tuple[Job, ResponseReplier]:
        """OpenAI's Responses API: the job of the chat body asking for the same, and what shapes its
        one choice as a Response."""
        # its 400s name this endpoint's parameters; the chat body's are renamed
        fields = chat_fields(body)
        try:
            chat = ChatBody.model_validate(fields)
            job = self.chat_job(chat)
        except ValidationError as e:
            raise renamed(validation_error(e.errors())) from None
        except APIError as e:
            raise renamed(e) from None
        if job.logprobs and job.readers()[0] is not None:
            raise APIError(
                400,
                "log-probs are given with the message text only when all of the text is the "
                "message's: not with tools or a reasoning parser",
                param="include",
            )
        return job, ResponseReplier(job, self.model.name, self.texts, body, chat)

    def plan(
        self, body: CompletionBody | ChatBody | ResponsesBody
    ) -> tuple[Job, Replier | ResponseReplier]:
        """A body's engine requests and what shapes their reply: the one dispatch the endpoints and
        the batch job (OpenAI batch files) share. Raises APIError for what the endpoint refuses."""
        if isinstance(body, ResponsesBody):
            return self.responses_job(body)
        job = self.chat_job(body) if isinstance(body, ChatBody) else self.completion_job(body)
        return job, Replier(job, self.model.name, self.texts)

    async def respond(
        self, body: CompletionBody | ChatBody | ResponsesBody
    ) -> JSONResponse | StreamingResponse:
        """Run a body and answer it: whole, or as its endpoint's stream."""
        job, replier = self.plan(body)
        merged = merge_streams(await self._start_all(job.requests))
        if not body.stream:
            return JSONResponse(await replier.whole(merged))
        if isinstance(replier, ResponseReplier):
            return StreamingResponse(replier.sse(merged), media_type="text/event-stream")
        options = body.stream_options  # type: ignore[union-attr]
        include_usage = bool(options and options.include_usage)
        continuous = include_usage and bool(options and options.continuous_usage_stats)
        return StreamingResponse(
            replier.sse(merged, include_usage, continuous), media_type="text/event-stream"
        )
