"""The generation parameters every way in takes (HTTP bodies, batch lines): one pydantic schema,
the checks a range cannot say, and the conversion to the engine's Request."""

from __future__ import annotations

import random
from typing import Any

from pydantic import BaseModel, Field, ValidationInfo, field_validator

from scheduler.request import MAX_LOGIT_BIAS, LoraRef, Request, SamplingParams


class ParameterError(ValueError):
    """A bad value of a request parameter; `param` names it (the HTTP edge answers 400 with it)."""

    code: str | None = None

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def parse_logit_bias(
    logit_bias: dict[str, float] | None, vocab_size: int | None = None
) -> dict[int, float]:
    """OpenAI's `logit_bias` (token-id strings -> bias in [-100, 100]) keyed by int; with
    `vocab_size`, every id must be in the vocabulary. Raises ParameterError naming logit_bias."""
    ids: dict[int, float] = {}
    for key, bias in (logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise ParameterError(
                "logit_bias",
                f"logit_bias keys must be token ids (integers as strings), got {key!r}",
            ) from None
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise ParameterError(
                "logit_bias", f"logit_bias has token id {token} outside the vocabulary {bound}"
            )
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise ParameterError(
                "logit_bias",
                f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, "
                f"{MAX_LOGIT_BIAS:g}], got {bias} for token {token}",
            )
        ids[token] = float(bias)
    return ids


def check_token_ids(param: str, token_ids: list[int], vocab_size: int) -> list[int]:
    """`token_ids`, if every one is in the vocabulary; else ParameterError naming `param`."""
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ParameterError(
            param, f"{param} has ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
        )
    return token_ids


def structured_format(
    response_format: dict[str, Any] | None, structured_outputs: dict[str, Any] | None = None
) -> str | None:
    """The canonical JSON of what constrains the output: OpenAI's `response_format` or vLLM's
    `structured_outputs` (at most one of them), or None for plain text. Raises ParameterError naming
    the parameter for a format the grammar cannot serve."""
    # plain text asks for nothing: it never needs the grammar module (nor its dependencies) to be
    # loaded
    text = response_format is None or response_format == {"type": "text"}
    if text and structured_outputs is None:
        return None
    if not text and structured_outputs is not None:
        raise ParameterError(
            "structured_outputs", "give `response_format` or `structured_outputs`, not both"
        )
    from workers.grammar import parse_response_format, parse_structured_outputs

    param = "response_format" if structured_outputs is None else "structured_outputs"
    try:
        if structured_outputs is None:
            return parse_response_format(response_format)  # type: ignore[arg-type]
        return parse_structured_outputs(structured_outputs)
    except ValueError as e:
        raise ParameterError(
            param, f"{param}: {e}" if param == "response_format" else str(e)
        ) from None


def check_context_length(num_prompt: int, max_tokens: int, capacity: int) -> None:
    """Raise ParameterError (code context_length_exceeded, as OpenAI answers) if the prompt and
    the completion do not fit in the model's context."""
    if num_prompt + max_tokens > capacity:
        error = ParameterError(
            "max_tokens",
            f"This model's maximum context length is {capacity} tokens. However, you requested "
            f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} for "
            "the completion).",
        )
        error.code = "context_length_exceeded"
        raise error


def null_is_the_default(model: type[BaseModel], value: Any, info: ValidationInfo) -> Any:
    """A field's value with null read as its default, as OpenAI's API takes `temperature`, `top_p`
    and `stream` and vLLM its `top_k` and `min_p` (for a field validator in "before" mode)."""
    if value is None and info.field_name is not None:
        return model.model_fields[info.field_name].default
    return value


class GenerationParams(BaseModel):
    """How to generate, as the HTTP bodies and the batch lines take it: one field per parameter,
    its range checked here and nowhere else at the edge. `request()` turns it into the engine's
    Request. A null penalty, min_tokens or stop_token_ids means its default, as OpenAI's clients
    send them."""

    temperature: float = Field(1.0, ge=0, le=2, description="0 is greedy.")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, description="extension: 0 (or -1, as vLLM takes it) disables")
    min_p: float = Field(
        0.0,
        ge=0,
        le=1,
        description=(
            "extension (vLLM's): tokens less likely than min_p times the most likely are "
            "dropped; 0 disables"
        ),
    )
    seed: int | None = Field(None, description="Seeds the draws; random when not given.")
    stop: str | list[str] | None = Field(
        None, description="Up to 4 strings; the text stops before any of them."
    )
    stop_token_ids: list[int] | None = Field(
        None, description="extension (vLLM's): token ids that end the reply"
    )
    ignore_eos: bool = Field(False, description="pdserve extension: do not stop at EOS")
    priority: int = Field(0, description="pdserve extension: lower is more urgent")
    timeout: float | None = Field(
        None,
        gt=0,
        description="pdserve extension: seconds from arrival; a request not finished by then ends "
        "with an error (Ray modes)",
    )
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(
        None, gt=0, le=2, description="extension: > 1 discourages repeats"
    )
    min_tokens: int | None = Field(
        None, ge=0, description="extension: no stop (EOS, stop ids or strings) before this many"
    )
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (as a string) -> bias in [-100, 100]."
    )
    response_format: dict[str, Any] | None = Field(
        None,
        description=(
            "{type: text | json_object | json_schema}; checked by the grammar when the request is "
            "built"
        ),
    )
    structured_outputs: dict[str, Any] | None = Field(
        None,
        description=(
            "extension (vLLM's): exactly one of json (a schema), regex, choice (a list of "
            "strings), grammar (EBNF or Lark) or json_object; the output follows it"
        ),
    )

    @field_validator("temperature", "top_p", "top_k", "min_p", mode="before")
    @classmethod
    def _null_sampling(cls, value: Any, info: ValidationInfo) -> Any:
        return null_is_the_default(cls, value, info)

    @field_validator("top_k")
    @classmethod
    def _top_k_off(cls, value: int) -> int:
        return 0 if value == -1 else value

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        parse_logit_bias(value)  # the vocabulary is checked when the request is built
        return value

    def structured(self, response_format: dict[str, Any] | None = None) -> str | None:
        """What constrains the output (`structured_format`), `response_format` standing in for
        the body's own when given (the Responses API's `text.format`)."""
        return structured_format(response_format or self.response_format, self.structured_outputs)

    def request(
        self,
        req_id: str,
        prompt_ids: list[int],
        *,
        max_tokens: int,
        eos_token_ids: frozenset[int],
        vocab_size: int,
        seed: int | None = None,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        structured: str | None = None,
        fork_of: str | None = None,
        lora: LoraRef | None = None,
    ) -> Request:
        """The engine's Request: the model's EOS a stop token unless ignore_eos, `seed` standing
        in for the body's (a choice's own), a random seed if neither is given. Raises
        ParameterError naming the parameter for a value that cannot be served."""
        min_tokens = self.min_tokens or 0
        if min_tokens > max_tokens:
            raise ParameterError(
                "min_tokens", f"min_tokens ({min_tokens}) must be <= max_tokens ({max_tokens})"
            )
        stop_ids = check_token_ids("stop_token_ids", self.stop_token_ids or [], vocab_size)
        stops = frozenset(stop_ids) | (frozenset() if self.ignore_eos else eos_token_ids)
        logit_bias = parse_logit_bias(self.logit_bias, vocab_size)
        if seed is None:
            seed = self.seed if self.seed is not None else random.getrandbits(62)
        repetition_penalty = self.repetition_penalty
        sampling = SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty,
            min_tokens=min_tokens,
            suppress_ids=stops if min_tokens else frozenset(),
            logit_bias=tuple(sorted(logit_bias.items())),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            structured=structured,
        )
        stop = self.stop
        return Request(
            req_id=req_id,
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            sampling=sampling,
            stop_token_ids=stops,
            stop_strings=(stop,) if isinstance(stop, str) else tuple(stop or ()),
            priority=self.priority,
            fork_of=fork_of,
            timeout_s=self.timeout,
            lora=lora,
        )
