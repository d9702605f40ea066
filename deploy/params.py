"""OpenAI generation parameters that need more than a range check: shared by the batch job and the
HTTP edge."""

from __future__ import annotations

from typing import Any

from scheduler.request import MAX_LOGIT_BIAS


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
