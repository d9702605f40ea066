"""OpenAI batch files in the batch job: lines of `{"custom_id", "method", "url", "body"}`, as
OpenAI's Batch API and vLLM's run_batch take them, for /v1/chat/completions, /v1/completions and
/v1/responses.

Each body is checked, and its reply shaped, by the HTTP endpoints' own code (`OpenAIServer`, the
repliers), so a line's result is the body the server would have answered. A malformed line (not
JSON, no custom_id, an unknown url, a custom_id twice) stops the job before any work, naming the
line; a body the server would refuse gets its 4xx in its own result line, as OpenAI's batches report
it, and the others run.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from tqdm import tqdm

from deploy.batch import read_jsonl, write_atomically
from deploy.config import ReplyConfig
from deploy.driver import open_engine
from deploy.serving.loras import LoraNames
from deploy.serving.openai_api import OpenAIServer, ServedModel
from deploy.serving.replies import Job, Replier, merge_streams
from deploy.serving.responses.reply import ResponseReplier
from deploy.serving.responses.request import ResponsesBody
from deploy.serving.schemas import APIError, ChatBody, CompletionBody, validation_error
from scheduler.outputs import Completion, RequestOutput

BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatBody,
    "/v1/completions": CompletionBody,
    "/v1/responses": ResponsesBody,
}


class BatchLine(BaseModel):
    model_config = ConfigDict(extra="forbid")

    custom_id: str = Field(min_length=1)
    method: Literal["POST"] = "POST"
    url: Literal["/v1/chat/completions", "/v1/completions", "/v1/responses"]
    body: dict[str, Any]


def is_openai_batch(path: str | Path) -> bool:
    """Whether the file's first line is an OpenAI batch line (it has a custom_id), not a `pdserve
    generate` one."""
    with open(path, encoding="utf-8") as f:
        first = next((raw for raw in f if raw.strip()), "")
    try:
        line = json.loads(first)
    except json.JSONDecodeError:
        return False
    return isinstance(line, dict) and "custom_id" in line


def read_batch(path: str | Path) -> list[BatchLine]:
    """Parse every line before any work; raise BatchInputError naming the first malformed line."""
    return read_jsonl(path, BatchLine, "custom_id")


def plan(server: OpenAIServer, line: BatchLine) -> tuple[Job, Replier | ResponseReplier] | APIError:
    """The line's job and what shapes its reply, or the error the endpoint would answer."""
    try:
        body: Any = BODIES[line.url].model_validate(line.body)
    except ValidationError as e:
        return validation_error(e.errors())
    if body.stream:
        return APIError(
            400,
            "`stream` is not available in a batch: each result is written whole",
            param="stream",
        )
    try:
        return server.plan(body)
    except APIError as e:
        return e


async def _nothing_more() -> AsyncIterator[RequestOutput]:
    return  # a request's one output, already finished, is its stream's first
    yield


def _output(done: Completion) -> RequestOutput:
    return RequestOutput(
        done.req_id,
        done.token_ids,
        done.text,
        done.finish_reason,
        done.error,
        done.metrics,
        done.logprobs,
        done.prompt_logprobs,
    )


async def _replies(
    planned: list[tuple[Job, Replier | ResponseReplier] | APIError], results: dict[str, Completion]
) -> list[tuple[int, dict[str, Any]]]:
    """Each line's status code and body."""
    replies = []
    for item in planned:
        if isinstance(item, APIError):
            replies.append((item.status, item.body()))
            continue
        job, replier = item
        started = [(_output(results[r.req_id]), _nothing_more()) for r in job.requests]
        try:
            replies.append((200, await replier.whole(merge_streams(started))))
        except APIError as e:  # a failed generation: 500, as the server answers it
            replies.append((e.status, e.body()))
    return replies


def run_openai_batch(
    config: ReplyConfig, input_path: str, output_path: str, progress: bool = True
) -> list[dict]:
    """Read, check, generate, write OpenAI's batch output lines (in input order). Returns them."""
    lines = read_batch(input_path)
    with open_engine(config.engine()) as engine:
        model = ServedModel(
            config.model_name,
            engine.tokenizer,
            engine.eos_token_ids,
            engine.capacity,
            config.tool_call_parser,
            config.reasoning_parser,
            loras=LoraNames(config.loras),
        )
        # plans and shapes; the engine runs
        server = OpenAIServer(None, model)  # type: ignore[arg-type]
        planned = [plan(server, line) for line in lines]
        requests = [
            r for item in planned if not isinstance(item, APIError) for r in item[0].requests
        ]
        bar = tqdm(
            total=len(requests),
            desc="generate",
            unit="req",
            file=sys.stderr,
            disable=not progress,
            mininterval=1.0,
        )
        results = engine.run(requests, on_finish=lambda _: bar.update()) if requests else {}
        bar.close()
    replies = asyncio.run(_replies(planned, results))
    out = [
        {
            "id": f"batch_req_{uuid.uuid4().hex}",
            "custom_id": line.custom_id,
            "response": {
                "status_code": status,
                "request_id": f"req_{uuid.uuid4().hex}",
                "body": body,
            },
            "error": None,
        }
        for line, (status, body) in zip(lines, replies, strict=True)
    ]
    write_atomically(output_path, out)
    return out
