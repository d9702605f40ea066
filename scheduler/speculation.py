"""Speculative decoding's proposals: n-gram (prompt lookup) drafts of a request's next tokens, and
the configuration that asks for them or for a draft model's (`--speculative-config`, vLLM's
form)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

METHODS = ("ngram", "draft_model")
# a draft token of a decode chunk that the worker's draft model proposes (`workers/drafter.py`)
PROPOSED = -2


@dataclass(frozen=True)
class SpeculativeConfig:
    """`method`: `ngram` (drafts looked up in the request's own tokens, here in the planner) or
    `draft_model` (drafts of `model`, a small model of the same vocabulary that the decode workers
    run beside the served one, with `quantization` as `--quantization` takes it);
    `num_speculative_tokens` (k): the most draft tokens a decode step verifies per request;
    `prompt_lookup_min`/`_max`: the n-gram lengths matched, longest first;
    `disable_by_batch_size`: no request speculates while this many or more decode at once (the
    step is compute-bound then: verifying drafts would cost the batch more than it gains)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    disable_by_batch_size: int | None = 16
    model: str | None = None
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative method {self.method!r}: pdserve proposes with {', '.join(METHODS)}"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError('speculative method "draft_model" needs the draft\'s "model"')
        if self.method == "ngram" and (self.model or self.quantization):
            raise ValueError(
                'speculative method "ngram" proposes without a model: leave out "model" and '
                '"quantization", or use "method": "draft_model"'
            )
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "prompt_lookup_min and prompt_lookup_max: 1 <= min <= max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(
                f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}"
            )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SpeculativeConfig:
        """The configuration of vLLM's `--speculative-config` JSON; ValueError with the reason
        (an unsupported method first: its own keys would be unknown). As vLLM, a `model` without
        a `method` is a draft model's."""
        method = values.get("method", "draft_model" if "model" in values else "ngram")
        if method not in METHODS:
            raise ValueError(
                f"speculative method {method!r}: pdserve proposes with {', '.join(METHODS)}"
            )
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"unknown speculative_config keys {unknown}: use {', '.join(sorted(known))}"
            )
        return cls(**(values | {"method": method}))

    @property
    def drafts_with_model(self) -> bool:
        return self.method == "draft_model"


@dataclass
class NgramIndex:
    """One request's tokens and, per n-gram length, the position each n-gram last ended at before
    the newest one: a lookup is a dict read, and each step indexes only the tokens it added."""

    min_n: int
    max_n: int
    tokens: list[int] = field(default_factory=list)
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # n-grams ending before this position are in `ends`

    def extend(self, tokens: list[int]) -> None:
        self.tokens += tokens

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix
        (of `max_n` down to `min_n` tokens) that occurred before; [] if none did."""
        tokens = self.tokens
        last = len(tokens) - 1
        # index the n-grams ending at indexed..last-1 (the suffix ending at `last` is the query)
        for end in range(self.indexed, last):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self.ends[tuple(tokens[end - n + 1 : end + 1])] = end
        self.indexed = max(self.indexed, last)
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            end = self.ends.get(tuple(tokens[last - n + 1 :]))
            if end is not None:
                return tokens[end + 1 : end + 1 + k]
        return []
