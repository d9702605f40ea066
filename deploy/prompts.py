"""Turning a user's generation parameters into a validated Request (shared by the batch job and
HTTP)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from deploy.params import ParameterError, check_token_ids
from scheduler.request import Request, SamplingParams


def read_chat_template(value: str) -> str:
    """`--chat-template`, as vLLM takes it: a file holding a Jinja chat template, or the template
    itself. Raises ValueError for a value that is neither."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"chat_template {value!r} is neither a file nor a Jinja template")


def use_chat_template(tokenizer: Any, chat_template: str | None) -> Any:
    """The tokenizer with `chat_template` (the template's text, as the config holds it; None: the
    model's own) for its chats."""
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def encode_prompt(
    tokenizer: Any,
    prompt: str | None = None,
    messages: list[dict[str, Any]] | None = None,
    prompt_token_ids: list[int] | None = None,
    template: dict[str, Any] | None = None,
) -> list[int]:
    """Exactly one of: text (tokenized with the tokenizer's special tokens), chat messages (through
    the model's chat template, generation prompt added unless `template`, the template's arguments,
    says otherwise) or token ids (checked against the vocabulary)."""
    given = [x is not None for x in (prompt, messages, prompt_token_ids)]
    if sum(given) != 1:
        raise ValueError("give exactly one of prompt, messages or prompt_token_ids")
    if prompt_token_ids is not None:
        return list(check_token_ids("prompt_token_ids", prompt_token_ids, len(tokenizer)))
    if messages is not None:
        if not messages:
            raise ValueError("messages is empty")
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, **({"add_generation_prompt": True} | (template or {}))
        )
        return tokenizer(text, add_special_tokens=False).input_ids
    assert prompt is not None
    return tokenizer(prompt).input_ids


def build_request(
    req_id: str,
    prompt_ids: list[int],
    *,
    max_tokens: int,
    eos_token_ids: frozenset[int],
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    priority: int = 0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
    min_tokens: int = 0,
    logit_bias: dict[int, float] | None = None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    structured: str | None = None,
    fork_of: str | None = None,
) -> Request:
    """A Request with the model's EOS as a stop token unless ignore_eos; a random seed if none is
    given. Raises ValueError for a value out of range (ParameterError, naming it, for
    min_tokens)."""
    stop_strings = (stop,) if isinstance(stop, str) else tuple(stop or ())
    stops = frozenset(stop_token_ids) | (frozenset() if ignore_eos else eos_token_ids)
    if min_tokens > max_tokens:
        raise ParameterError(
            "min_tokens", f"min_tokens ({min_tokens}) must be <= max_tokens ({max_tokens})"
        )
    sampling = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        seed=random.getrandbits(62) if seed is None else seed,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        repetition_penalty=repetition_penalty,
        min_tokens=min_tokens,
        suppress_ids=stops if min_tokens else frozenset(),
        logit_bias=tuple(sorted((int(t), float(b)) for t, b in (logit_bias or {}).items())),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        structured=structured,
    )
    return Request(
        req_id=req_id,
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        sampling=sampling,
        stop_token_ids=stops,
        stop_strings=stop_strings,
        priority=priority,
        fork_of=fork_of,
    )
