"""Log-probabilities in OpenAI's shapes (chat and completions) from the engine's TokenLogprob
entries."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from scheduler.request import TokenLogprob

LOGPROB_FLOOR = -9999.0  # what OpenAI and vLLM report for -inf (not valid JSON)
SPIECE_SPACE = "\u2581"  # SentencePiece's word-start marker


def finite(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


class TokenTexts:
    """Each token id's text on its own, as vLLM reports tokens in log-probs: `decode([id])`, with
    the leading spaces of a SentencePiece piece that decode drops put back. A partial UTF-8
    character reads as U+FFFD. Cached: at most a vocabulary's worth of strings."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id]) or ""
            piece = self.tokenizer.convert_ids_to_tokens(token_id) or ""
            num_markers = len(piece) - len(piece.lstrip(SPIECE_SPACE))
            missing = num_markers - (len(text) - len(text.lstrip(" ")))
            if missing > 0:
                text = " " * missing + text
            self._texts[token_id] = text
        return text


def chat_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts) -> dict[str, Any]:
    """`choice.logprobs` of a chat completion: per token its text, log-prob, UTF-8 bytes and the
    alternatives."""

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        token = texts(token_id)
        return {
            "token": token,
            "logprob": finite(logprob),
            "bytes": list(token.encode("utf-8", errors="replace")),
        }

    return {
        "content": [
            one(e.token_id, e.logprob) | {"top_logprobs": [one(t, lp) for t, lp in e.top]}
            for e in entries
        ]
    }


def completion_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[TokenLogprob | None],
    texts: TokenTexts,
    text_offset: int = 0,
) -> dict[str, Any]:
    """`choice.logprobs` of a text completion. An entry of None (the prompt's first token, under
    echo) has no log-prob: null in `token_logprobs` and `top_logprobs`. Each `top_logprobs` dict
    holds the sampled token and the k most likely (so up to k + 1 entries, as OpenAI documents).
    `text_offset` counts, as vLLM does, the lengths of the token texts from `text_offset` (where
    this part starts in the returned text)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        token = texts(token_id)
        tokens.append(token)
        offsets.append(text_offset)
        text_offset += len(token)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(finite(entry.logprob))
        top = {token: finite(entry.logprob)}
        top.update((texts(t), finite(lp)) for t, lp in entry.top if texts(t) not in top)
        top_logprobs.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }
