"""The offline batch job: JSONL requests in, JSONL results out (`pdserve generate`)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from tqdm import tqdm

from deploy.config import EngineConfig, format_validation_errors
from deploy.driver import open_engine
from deploy.params import GenerationParams, check_context_length
from deploy.prompts import encode_prompt
from deploy.serving.logprobs import finite
from scheduler.outputs import Completion
from scheduler.request import MAX_LOGPROBS, Request, TokenLogprob

Line = TypeVar("Line", bound=BaseModel)


class BatchInputError(ValueError):
    """A bad input line; the message names the line. Nothing has been written."""


class GenerateLine(GenerationParams):
    """One input line: the HTTP bodies' generation parameters, and exactly one of prompt, messages
    (chat) or prompt_token_ids."""

    model_config = ConfigDict(extra="forbid")

    id: str | int
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_token_ids: list[int] | None = None
    max_tokens: int = Field(16, ge=1)
    arrival_s: float = Field(
        0.0, ge=0, description="Submit this many seconds after the run starts."
    )
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="Each output token's log-prob and the k most likely; None: none.",
    )
    prompt_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="The same for the prompt."
    )


def read_jsonl(path: str | Path, schema: type[Line], key: str) -> list[Line]:
    """Parse and check every line before any work; raise BatchInputError naming the first bad line:
    one that does not validate as `schema`, or repeats another line's `key`."""
    lines: list[Line] = []
    seen: dict[str, int] = {}
    with open(path, encoding="utf-8") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                line = schema.model_validate_json(raw)
            except ValidationError as e:
                problems = format_validation_errors(e.errors(), whole="line")
                raise BatchInputError(f"{path}:{number}: {problems}") from None
            name = str(getattr(line, key))
            if name in seen:
                raise BatchInputError(f"{path}:{number}: {key} {name!r} repeats line {seen[name]}")
            seen[name] = number
            lines.append(line)
    if not lines:
        raise BatchInputError(f"{path}: no requests")
    return lines


def read_lines(path: str | Path) -> list[GenerateLine]:
    return read_jsonl(path, GenerateLine, "id")


def to_requests(
    lines: list[GenerateLine], tokenizer: Any, eos_token_ids: frozenset[int], capacity: int
) -> list[Request]:
    requests = []
    for number, line in enumerate(lines, start=1):
        try:
            prompt_ids = encode_prompt(tokenizer, line.prompt, line.messages, line.prompt_token_ids)
            check_context_length(len(prompt_ids), line.max_tokens, capacity)
            request = line.request(
                str(line.id),
                prompt_ids,
                max_tokens=line.max_tokens,
                eos_token_ids=eos_token_ids,
                vocab_size=len(tokenizer),
                logprobs=line.logprobs,
                prompt_logprobs=line.prompt_logprobs,
                structured=line.structured(),
            )
        except ValueError as e:
            raise BatchInputError(f"request {line.id!r} (entry {number}): {e}") from None
        requests.append(request)
    return requests


def logprobs_json(entry: TokenLogprob) -> dict[str, Any]:
    """One token's log-probs in a result line (-inf written as -9999.0, as the HTTP API does)."""
    return {
        "token_id": entry.token_id,
        "logprob": finite(entry.logprob),
        "top": [[token_id, finite(logprob)] for token_id, logprob in entry.top],
    }


def result_line(done: Completion, request: Request) -> dict[str, Any]:
    """The output line of a finished request, with the log-probs it asked for: `logprobs` one per
    output token, `prompt_logprobs` one per prompt token (the first null: nothing precedes it)."""
    line: dict[str, Any] = {
        "id": done.req_id,
        "token_ids": done.token_ids,
        "text": done.text,
        "finish_reason": done.finish_reason,
        "prompt_tokens": done.prompt_tokens,
        "metrics": {k: round(v, 6) if isinstance(v, float) else v for k, v in done.metrics.items()},
    }
    if done.error:
        line["error"] = done.error
    if request.sampling.logprobs is not None:
        line["logprobs"] = [logprobs_json(entry) for entry in done.logprobs]
    if request.sampling.prompt_logprobs is not None:
        line["prompt_logprobs"] = [
            None,
            *(logprobs_json(entry) for entry in done.prompt_logprobs or []),
        ]
    return line


def write_atomically(path: str | Path, lines: list[dict[str, Any]]) -> None:
    """All lines or nothing: write a temporary file beside the target, then rename it over."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(
        dir=path.parent if str(path.parent) else ".", prefix=f".{path.name}."
    )
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for line in lines:
                f.write(json.dumps(line, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def run_generate(
    config: EngineConfig, input_path: str, output_path: str, progress: bool = True
) -> list[dict]:
    """Read, check, generate, write. Returns the written lines (in input order)."""
    lines = read_lines(input_path)
    timed = next((line for line in lines if line.timeout is not None), None)
    if timed is not None and config.mode == "local":  # (the local engine has no deadlines)
        raise BatchInputError(
            f"request {timed.id!r}: timeout is enforced in the Ray modes (colocated, "
            "disaggregated), not in local mode"
        )
    arrivals = {str(line.id): line.arrival_s for line in lines}
    bar = tqdm(
        total=len(lines),
        desc="generate",
        unit="req",
        file=sys.stderr,
        disable=not progress,
        mininterval=1.0,
    )
    with open_engine(config) as engine:
        requests = to_requests(lines, engine.tokenizer, engine.eos_token_ids, engine.capacity)
        results = engine.run(requests, arrivals, on_finish=lambda _: bar.update())
    bar.close()
    out = [result_line(results[r.req_id], r) for r in requests]
    write_atomically(output_path, out)
    return out
