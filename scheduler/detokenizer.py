"""Incremental detokenization that never splits a UTF-8 character, with stop-string matching."""

from __future__ import annotations

import functools
from typing import Any

_PROMPT_CONTEXT = 4  # prompt tokens decoded with the output so a leading space survives
# transformers' fast tokenizer classes whose decode (without clean-up) is their backend's decode
_PLAIN_FAST = {"TokenizersBackend._decode", "PreTrainedTokenizerFast._decode"}


def _plain_backend(tokenizer: Any) -> Any:
    """The `tokenizers` backend of a plain fast tokenizer (its decode is the backend's), else
    None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    cls = type(tokenizer)
    if (
        backend is not None
        and getattr(cls._decode, "__qualname__", "") in _PLAIN_FAST
        and cls.decode.__qualname__ == "PreTrainedTokenizerBase.decode"
    ):
        return backend
    return None


def decoder(tokenizer: Any) -> Any:
    """ids -> text, skipping special tokens, no clean-up of spaces. For a plain fast tokenizer it
    calls the `tokenizers` backend directly, the same result without transformers' per-call argument
    handling (most of the cost at a decode step's rate); any other tokenizer goes through its own
    `decode`."""
    backend = _plain_backend(tokenizer)
    if backend is not None:
        return functools.partial(backend.decode, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
    )


def _streamable(tokenizer: Any) -> Any:
    """The backend of a plain fast tokenizer with a byte-level decoder, where text is its tokens'
    bytes joined (so a decode that grows always extends the last one), and `tokenizers` has
    DecodeStream; else None."""
    backend = _plain_backend(tokenizer)
    if backend is None or type(backend.decoder).__name__ != "ByteLevel":
        return None
    try:
        from tokenizers.decoders import DecodeStream  # noqa: F401
    except ImportError:  # tokenizers before 0.21: the Python path
        return None
    return backend


def _stream(backend: Any, window: list[int]) -> Any:
    """token -> new text or None: what `IncrementalDetokenizer`'s two decodes per token give, in one
    call into the backend (`tokenizers`' DecodeStream runs the same algorithm in Rust). `window`:
    the tokens decoded so far that the next token's text is cut after (their text must end on a
    whole character)."""
    from tokenizers.decoders import DecodeStream

    stream = DecodeStream(skip_special_tokens=True)
    for token_id in window:
        stream.step(backend, token_id)
    return functools.partial(stream.step, backend)


class IncrementalDetokenizer:
    """Turns a request's output tokens into text as they arrive.

    `push(token)` returns the text that became final: a token that ends inside a multi-byte
    character yields nothing until the character completes, and text that could be the start of a
    stop string is held back until it cannot. On a stop string the text is cut before it and
    `stopped` is set; stop strings match only once `min_tokens` tokens have been pushed. Output that
    ends inside a character (bytes of a character never completed) gives no text for it.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: list[int],
        stop_strings: tuple[str, ...] = (),
        min_tokens: int = 0,
    ) -> None:
        self._decode = decoder(tokenizer)
        self.ids = list(prompt_ids[-_PROMPT_CONTEXT:])
        # one call per token from the first text on, or from the start when the prompt ends on a
        # whole character
        self._backend = _streamable(tokenizer)
        self._step = None
        if self._backend is not None and not self._decode(self.ids).endswith("\ufffd"):
            self._step = _stream(self._backend, self.ids)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.holdback = max((len(s) for s in self.stop_strings), default=1) - 1
        self.text = ""  # all final text so far
        self.num_emitted = 0  # characters of `text` already returned by push/flush
        self.stopped = False
        self.num_pushed = 0
        self.min_tokens = min_tokens

    def resume(self, output_ids: list[int], num_sent: int) -> None:
        """Continue a request whose first outputs were detokenized elsewhere and `num_sent`
        characters of their text reached the client: what was held back then (a possible stop
        string's start, a broken character) is emitted by the next push or flush, and nothing is
        emitted twice."""
        for token_id in output_ids:
            self.push(token_id)
        self.num_emitted = min(num_sent, len(self.text))

    def push(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self.num_pushed += 1
        if self._step is not None:
            new = self._step(token_id)
            if not new:
                return ""
        else:
            self.ids.append(token_id)
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.ids[self.prefix_offset :])
            if len(full) <= len(prefix) or full.endswith("\ufffd"):
                return ""  # an incomplete character, or a token with no text (e.g. a special token)
            new = full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            if self._backend is not None:
                self._step = _stream(self._backend, self.ids[self.prefix_offset :])
        old_len = len(self.text)
        self.text += new
        self._match_stop(old_len)
        limit = len(self.text) if self.stopped else len(self.text) - self.holdback
        return self._emit(limit)

    def _match_stop(self, old_len: int) -> None:
        if not self.stop_strings or self.num_pushed < self.min_tokens:
            return
        window = max(0, old_len - self.holdback)
        hits = [i for i in (self.text.find(s, window) for s in self.stop_strings) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def _emit(self, limit: int) -> str:
        if limit <= self.num_emitted:
            return ""
        delta = self.text[self.num_emitted : limit]
        self.num_emitted = limit
        return delta

    def flush(self) -> str:
        """At the end of the request: whatever was held back."""
        return self._emit(len(self.text))
