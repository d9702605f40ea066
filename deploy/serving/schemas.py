"""OpenAI request bodies (pydantic, at the HTTP edge) and the error shape every failure uses."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# OpenAI parameters that would change what is generated and that pdserve does not implement yet: a
# request that sets one (to anything but its no-op value) is refused with a 400 naming it, never served
# as if the parameter were not there. Their no-op values are accepted.
UNSUPPORTED: dict[str, Any] = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "n": (None, 1),
    "best_of": (None, 1), "logit_bias": (None, {}), "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "repetition_penalty": (None, 1, 1.0), "min_tokens": (None, 0),
    "response_format": (None, {"type": "text"}), "tools": (None, []), "tool_choice": (None, "none"),
    "functions": (None, []), "function_call": (None, "none"), "suffix": (None, ""),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "structured_outputs": (None,), "prediction": (None,), "audio": (None,), "modalities": (None, ["text"]),
}
# Fields that only describe or route the request: accepted, and they change nothing that is generated.
DESCRIPTIVE = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "reasoning_effort")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingBody(BaseModel):
    """Fields both endpoints share. A field pdserve does not know is refused (as OpenAI itself answers
    "Unrecognized request argument"), and so is a known one it does not implement (`UNSUPPORTED`):
    nothing that could change the output is ever silently ignored."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="pdserve extension: 0 disables")
    seed: int | None = None
    stop: str | list[str] | None = Field(None, description="Up to 4 strings; the text stops before any of them.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="pdserve extension: do not stop at EOS")
    priority: int = Field(0, description="pdserve extension: lower is more urgent")

    @model_validator(mode="after")
    def _nothing_ignored(self) -> _SamplingBody:
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED:
                if value not in UNSUPPORTED[name]:
                    raise UnsupportedParameter(name, f"`{name}` is not supported by this server yet; leave it "
                                                     "out (its default changes nothing)")
            elif name not in DESCRIPTIVE:
                raise UnsupportedParameter(name, f"Unrecognized request argument supplied: {name}")
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise UnsupportedParameter("stop", "`stop` takes at most 4 strings")
        return self


class CompletionBody(_SamplingBody):
    prompt: str | list[str] | list[int] | list[list[int]]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # `name`, `tool_call_id`, ...: the chat template decides

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatBody(_SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class TokenizeBody(BaseModel):
    """vLLM's `/tokenize`: a prompt (text) or chat messages, tokenized as a generation request would be."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeBody:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


class UnsupportedParameter(ValueError):
    """A request parameter pdserve refuses; `param` names it for the 400."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class APIError(Exception):
    """An error for the client: status, OpenAI error type, message, the parameter at fault."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
