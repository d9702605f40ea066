"""OpenAI generation parameters that need more than a range check: shared by the batch job and the HTTP edge."""

from __future__ import annotations

from typing import Any

MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on each bias


def parse_logit_bias(logit_bias: dict[str, float] | None, vocab_size: int | None = None) -> dict[int, float]:
    """OpenAI's `logit_bias` (token-id strings -> bias in [-100, 100]) keyed by int; with `vocab_size`, every id
    must be in the vocabulary. Raises ValueError naming logit_bias."""
    ids: dict[int, float] = {}
    for key, bias in (logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise ValueError(f"logit_bias keys must be token ids (integers as strings), got {key!r}") from None
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise ValueError(f"logit_bias has token id {token} outside the vocabulary {bound}")
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {token}")
        ids[token] = float(bias)
    return ids


def structured_format(response_format: dict[str, Any] | None) -> str | None:
    """The canonical JSON of a `response_format` that constrains the output, or None for plain text.
    Raises ValueError (message starting with response_format) for a format the grammar cannot serve."""
    # plain text asks for nothing: it never needs the grammar module (nor its dependencies) to be loaded
    if response_format is None or response_format == {"type": "text"}:
        return None
    from workers.grammar import parse_response_format

    try:
        return parse_response_format(response_format)
    except ValueError as e:
        raise ValueError(f"response_format: {e}") from None
