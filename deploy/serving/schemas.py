"""OpenAI request bodies (pydantic, at the HTTP edge) and the error shape every failure uses."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from deploy.config import format_validation_errors
from deploy.params import GenerationParams, ParameterError, null_is_the_default
from scheduler.request import MAX_LOGPROBS

MAX_N = 16  # most choices one request may ask for (`n`)
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit on /v1/completions' `logprobs`

# OpenAI (and vLLM) parameters that would change what is generated and that pdserve does not
# implement: a request that sets one (to anything but its no-op value) is refused with a 400
# naming it, never served as if the parameter were not there. Their no-op values are accepted.
# `echo`, `best_of` and `top_logprobs` are implemented on the endpoint that declares them and land
# here only on the other one.
UNSUPPORTED: dict[str, Any] = {
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    # functions: on chat only
    "functions": (None, []),
    "function_call": (None, "none"),
    "suffix": (None, ""),
    # vLLM's: pdserve's text leaves special tokens out and stops before a stop string
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "include_stop_str_in_output": (None, False),
    "guided_whitespace_pattern": (None,),
    "guided_decoding_backend": (None, "xgrammar"),
    "structural_tag": (None,),
    "prediction": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
}
# vLLM's names for structured_outputs' fields until its 0.12: guided_regex is read as
# structured_outputs.regex
GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
# Fields that only describe or route the request: accepted, and they change nothing that is
# generated.
DESCRIPTIVE = (
    "user",
    "metadata",
    "store",
    "service_tier",
    "parallel_tool_calls",
    "reasoning_effort",
)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingBody(GenerationParams):
    """Fields both endpoints share. A field pdserve does not know is refused (as OpenAI itself
    answers "Unrecognized request argument"), and so is a known one it does not implement
    (`UNSUPPORTED`): nothing that could change the output is ever silently ignored."""

    model_config = ConfigDict(extra="allow")

    model: str | None = Field(None, description="The served model's name; optional, as in vLLM.")
    max_tokens: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(
        None, ge=1, le=MAX_N, description=f"Choices to generate (at most {MAX_N})."
    )
    return_token_ids: bool = Field(
        False,
        description="vLLM's extension: each choice carries `prompt_token_ids` (in its first "
        "chunk when streaming) and the `token_ids` it generated (per chunk when streaming).",
    )

    @field_validator("stream", mode="before")
    @classmethod
    def _null_stream(cls, value: Any, info: ValidationInfo) -> Any:
        return null_is_the_default(cls, value, info)

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @model_validator(mode="after")
    def _nothing_ignored(self) -> _SamplingBody:
        for name, value in (self.model_extra or {}).items():
            if name in GUIDED:
                if value is None:
                    continue
                if self.structured_outputs is not None:
                    raise ParameterError(
                        name,
                        f"`{name}` is `structured_outputs.{GUIDED[name]}`; give one "
                        "`structured_outputs` (or one guided_* field), not both",
                    )
                self.structured_outputs = {GUIDED[name]: value}
            elif name in UNSUPPORTED:
                if value not in UNSUPPORTED[name]:
                    raise UnsupportedParameter(
                        name,
                        f"`{name}` is not supported by this server yet; leave it "
                        "out (its default changes nothing)",
                    )
            elif name not in DESCRIPTIVE:
                raise UnsupportedParameter(name, f"Unrecognized request argument supplied: {name}")
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise UnsupportedParameter("stop", "`stop` takes at most 4 strings")
        return self


class CompletionBody(_SamplingBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(
        None, ge=0, description="Default 16; 0 only with echo (score the prompt)."
    )
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_COMPLETION_LOGPROBS,
        description="Log-probs of each token and of the k most likely.",
    )
    echo: bool | None = Field(
        False, description="Return the prompt (and its log-probs) before the completion."
    )
    best_of: int | None = Field(
        None, ge=1, description="Only equal to n: every generated choice is returned."
    )

    @model_validator(mode="after")
    def _choices_returned(self) -> CompletionBody:
        if self.best_of is not None and self.best_of != self.num_choices:
            raise UnsupportedParameter(
                "best_of",
                f"`best_of` must equal `n` ({self.num_choices}): pdserve "
                "returns every choice it generates",
            )
        if self.max_tokens == 0 and not self.echo:
            raise ParameterError(
                "max_tokens",
                "`max_tokens` 0 needs `echo: true` (the prompt is all there is to return)",
            )
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # `refusal`, `audio`, ...: nothing a template reads

    # function: a legacy result
    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = Field(
        None, description="An assistant's earlier tool calls."
    )
    tool_call_id: str | None = Field(None, description="A tool message: the call it answers.")
    function_call: dict[str, Any] | None = Field(
        None, description="A legacy assistant message's call."
    )


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="A JSON schema; none: the function takes no arguments"
    )
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionName


# apply_chat_template's own arguments, which chat_template_kwargs may not set
_TEMPLATE_ARGUMENTS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "tokenize",
        "add_generation_prompt",
        "continue_final_message",
        "return_dict",
        "return_tensors",
    }
)


class ChatTemplateOptions(BaseModel):
    """How messages become a prompt (vLLM's extensions): the generation prompt, continuing the last
    (assistant) message instead, and extra variables for the template (e.g. Qwen3's
    `enable_thinking`)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = Field(
        False, description="Continue the last message, an assistant's."
    )
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDef] | None = Field(
        None, description="Functions the model may call (shown to the template)."
    )

    def check_template_options(self, messages: list[ChatMessage] | None) -> None:
        names = [tool.function.name for tool in self.tools or ()]
        if len(set(names)) < len(names):
            raise ParameterError("tools", "`tools` names a function twice")
        if self.continue_final_message and self.add_generation_prompt:
            raise ParameterError(
                "continue_final_message",
                "`continue_final_message` needs `add_generation_prompt: false`",
            )
        if self.continue_final_message and messages and messages[-1].role != "assistant":
            raise ParameterError(
                "continue_final_message",
                "`continue_final_message` continues the last "
                "message, which must be the assistant's",
            )
        reserved = sorted(_TEMPLATE_ARGUMENTS & set(self.chat_template_kwargs or {}))
        if reserved:
            raise ParameterError(
                "chat_template_kwargs", f"`chat_template_kwargs` may not set {reserved}"
            )


class ChatBody(_SamplingBody, ChatTemplateOptions):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = Field(False, description="Return each output token's log-prob.")
    top_logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="With logprobs: also the k most likely tokens at each position.",
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        description=(
            "Default: auto when tools are given (it needs the server's --tool-call-parser)."
        ),
    )
    parallel_tool_calls: bool = Field(
        True, description="false: at most one call (tool_choice required)"
    )
    functions: list[FunctionDef] | None = Field(
        None, description="Legacy (before tools): the functions to call."
    )

    function_call: Literal["none", "auto"] | FunctionName | None = Field(
        None, description="Legacy tool_choice."
    )
    _legacy: bool = PrivateAttr(False)

    @field_validator("parallel_tool_calls", mode="before")
    @classmethod
    def _null_parallel_tool_calls(cls, value: Any, info: ValidationInfo) -> Any:
        return null_is_the_default(cls, value, info)

    @property
    def legacy_functions(self) -> bool:
        """The request uses the legacy `functions`: its reply carries one `function_call`."""
        return self._legacy

    @model_validator(mode="after")
    def _logprobs_asked(self) -> ChatBody:
        # as the tools they stand for
        if self.functions is not None or self.function_call is not None:
            if self.tools is not None or self.tool_choice is not None:
                raise ParameterError(
                    "functions", "give `tools` or the legacy `functions`, not both"
                )
            if not self.functions:
                raise ParameterError("function_call", "`function_call` needs `functions`")
            call = self.function_call or "auto"
            if isinstance(call, FunctionName) and call.name not in [
                function.name for function in self.functions
            ]:
                raise ParameterError(
                    "function_call",
                    f"`function_call` names {call.name!r}, which is not one of `functions`",
                )
            self.tools = [
                ToolDef(type="function", function=function) for function in self.functions
            ]
            self.tool_choice = (
                call if isinstance(call, str) else NamedToolChoice(type="function", function=call)
            )
            self.parallel_tool_calls = False
            self._legacy = True
        if self.top_logprobs and not self.logprobs:
            raise ParameterError("top_logprobs", "`top_logprobs` needs `logprobs: true`")
        self.check_template_options(self.messages)
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ParameterError(
                "tool_choice", "`tool_choice` needs `tools` (the functions to choose from)"
            )
        if (
            isinstance(self.tool_choice, NamedToolChoice)
            and self.tools
            and self.tool_choice.function.name not in [tool.function.name for tool in self.tools]
        ):
            raise ParameterError(
                "tool_choice",
                f"`tool_choice` names {self.tool_choice.function.name!r}, which "
                "is not one of `tools`",
            )
        forced = self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)
        constrained = (
            "structured_outputs"
            if self.structured_outputs is not None
            else "response_format"
            if self.response_format not in (None, {"type": "text"})
            else None
        )
        if forced and constrained:
            raise ParameterError(
                constrained,
                f"`{constrained}` cannot be combined with a forced `tool_choice` "
                "(required or a named function): the call's own schema decides "
                "the output",
            )
        return self


class TokenizeBody(ChatTemplateOptions):
    """vLLM's `/tokenize`: a prompt (text) or chat messages, tokenized as a generation request would
    be."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeBody:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        self.check_template_options(self.messages)
        return self


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


class LoadLoraBody(BaseModel):
    """vLLM's `POST /v1/load_lora_adapter`: a PEFT checkpoint every worker can read, and the
    `model` name requests will give it."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraBody(BaseModel):
    """vLLM's `POST /v1/unload_lora_adapter` (its `lora_int_id` accepted and unused)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class UnsupportedParameter(ParameterError):
    """A request parameter pdserve refuses."""

    code = "unsupported_parameter"


class APIError(Exception):
    """An error for the client: status, OpenAI error type, message, the parameter at fault."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def validation_error(errors: Any) -> APIError:
    """The 400 for a body that does not validate: `param` is the request's parameter, the message
    says where."""
    cause = (errors[0].get("ctx") or {}).get("error") if errors else None
    if isinstance(cause, ParameterError):
        return APIError(400, str(cause), param=cause.param, code=cause.code)
    where = [p for p in (errors[0].get("loc", ()) if errors else ()) if p != "body"]
    return APIError(
        400,
        f"Invalid request: {format_validation_errors(errors, skip=('body',))}",
        # the request's parameter; the message says where in it
        param=str(where[0]) if where else None,
    )
