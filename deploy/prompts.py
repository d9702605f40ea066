"""Prompts as the engine takes them: text, chat messages or token ids encoded, and the chat
template (shared by the batch job and HTTP)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deploy.params import check_token_ids


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
