"""Reasoning models on chat: the `<think>...</think>` part of a reply as `reasoning_content`, the
rest as content.

`--reasoning-parser` names how a model marks its reasoning, as vLLM's option does:
* `qwen3`: the reply opens with `<think>` (Qwen3 and QwQ write it themselves; with `enable_thinking:
  false` they do not, and the whole reply is content);
* `deepseek_r1`: the reply starts inside the reasoning (DeepSeek-R1's template opens `<think>` in
  the prompt), with or without `<think>` written again.

Either way the reasoning ends at `</think>`; a reply cut before it is all reasoning. `ThinkSplitter`
reads a choice's text piece by piece (tags split across pieces are held back), so a stream and a
whole reply agree.
"""

from __future__ import annotations

from deploy.config import REASONING_PARSERS
from deploy.serving.tools.call_readers import CallReader, Delta, partial_tag

_OPEN = "<think>"
_CLOSE = "</think>"


class ThinkSplitter:
    """Splits one choice's text into (reasoning, content) pieces."""

    def __init__(self, parser: str) -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(
                f"unknown reasoning parser {parser!r}; known: {', '.join(REASONING_PARSERS)}"
            )
        self.parser = parser
        self.state = "start" if parser == "qwen3" else "thinking"  # start: no text seen yet (qwen3)
        self.text = ""  # held back: maybe the start of a tag
        self.opened = True  # the reply's first text may still be `<think>`

    def feed(self, text: str) -> tuple[str, str]:
        self.text += text
        reasoning = content = ""
        while self.text:
            if self.state == "content":
                content, self.text = content + self.text, ""
            elif self.opened:  # before the reply's first text: `<think>` opens the reasoning
                stripped = self.text.lstrip()
                if stripped.startswith(_OPEN):
                    self.text = stripped[len(_OPEN) :]
                    self.state = "thinking"
                    self.opened = False
                elif _OPEN.startswith(stripped):
                    break  # maybe `<think>` still coming
                else:
                    self.opened = False
                    if self.state == "start":
                        self.state = "content"
            else:  # thinking
                at = self.text.find(_CLOSE)
                if at >= 0:
                    reasoning += self.text[:at]
                    self.text, self.state = self.text[at + len(_CLOSE) :], "content"
                else:
                    keep = partial_tag(self.text, _CLOSE)
                    reasoning += self.text[: len(self.text) - keep]
                    self.text = self.text[len(self.text) - keep :]
                    break
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held back: reasoning when the reply ended inside it, else content."""
        rest, self.text = self.text, ""
        return (rest, "") if self.state == "thinking" else ("", rest)


class MessageReader:
    """One choice's text as message deltas: reasoning split off first (if the server has a parser),
    then the rest read for tool calls (if the request has tools) or taken as content."""

    def __init__(self, reasoning: ThinkSplitter | None, calls: CallReader | None) -> None:
        self.reasoning = reasoning
        self.calls = calls

    def feed(self, text: str) -> Delta:
        return self._delta(
            *(self.reasoning.feed(text) if self.reasoning is not None else ("", text)), final=False
        )

    def finish(self) -> Delta:
        return self._delta(
            *(self.reasoning.finish() if self.reasoning is not None else ("", "")), final=True
        )

    def _delta(self, reasoning: str, content: str, final: bool) -> Delta:
        if self.calls is None:
            return Delta(content, reasoning=reasoning)
        delta = self.calls.feed(content) + (self.calls.finish() if final else Delta())
        return Delta(delta.content, delta.calls, reasoning)
