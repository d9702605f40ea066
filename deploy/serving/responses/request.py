"""OpenAI's Responses API (`POST /v1/responses`), its request: the body, and the chat body that asks
for the same (response_items.py shapes the reply)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from deploy.params import null_is_the_default
from deploy.serving.schemas import APIError
from scheduler.request import MAX_LOGPROBS

# Responses parameters pdserve does not implement: refused (400 naming them) unless at their no-op
# value.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "previous_response_id": (None,),
    "conversation": (None,),
    "prompt": (None,),
    "background": (None, False),
    "max_tool_calls": (None,),
    "truncation": (None, "disabled"),
}
LOGPROBS = "message.output_text.logprobs"  # the one `include` there is something to include for
# accepted and change nothing: responses are not stored, reasoning effort is the model's own
DESCRIPTIVE = ("store", "reasoning", "safety_identifier", "prompt_cache_key", "stream_options")
# chat's names for what this endpoint names otherwise (the others, e.g. seed or top_k, pass through
# as on chat)
CHAT_ONLY = (
    "messages",
    "n",
    "max_tokens",
    "max_completion_tokens",
    "logprobs",
    "response_format",
    "functions",
    "function_call",
    "echo",
    "best_of",
    "suffix",
)
# a chat parameter's error, named as this endpoint names it
RENAMED = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text",
}


class ResponsesBody(BaseModel):
    """The Responses fields pdserve reads; any other field is checked as the chat endpoint checks
    it."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = Field(None, description="A system message before the input.")
    max_output_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    text: dict[str, Any] | None = Field(
        None, description="{format: {type: text | json_object | json_schema}}"
    )
    include: list[str] | None = Field(
        None, description=f"[{LOGPROBS!r}]: the output text's log-probs"
    )
    top_logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="With log-probs: the k most likely tokens at each position too.",
    )
    stream: bool = False

    @field_validator("stream", mode="before")
    @classmethod
    def _null_stream(cls, value: Any, info: ValidationInfo) -> Any:
        return null_is_the_default(cls, value, info)


def _message(role: str, content: Any, where: str) -> dict[str, Any]:
    if isinstance(content, list):  # content parts: only text is understood here
        if any(
            not isinstance(part, dict)
            or part.get("type") not in ("input_text", "output_text", "text")
            for part in content
        ):
            raise APIError(400, f"{where}: only text content parts are supported", param="input")
        content = "".join(str(part.get("text", "")) for part in content)
    if not isinstance(content, str):
        raise APIError(
            400, f"{where}.content must be a string or a list of text parts", param="input"
        )
    return {"role": role, "content": content}


def chat_messages(body: ResponsesBody) -> list[dict[str, Any]]:
    """The input items as chat messages: messages, function calls (joined into the assistant message
    they follow) and their outputs; reasoning items are left out, as chat templates leave out
    earlier thinking."""
    messages = (
        [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    )
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    names: dict[str, str] = {}  # call_id -> function name, for the tool message that answers it
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            messages.append(_message(str(item.get("role")), item.get("content"), where))
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
            }
            names[str(call["id"])] = str(item.get("name"))
            last = messages[-1] if messages else None
            # the calls of one turn: one message
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            call_id = str(item.get("call_id"))
            message = _message("tool", output, where) | {"tool_call_id": call_id}
            if call_id in names:
                message["name"] = names[call_id]
            messages.append(message)
        elif kind != "reasoning":
            raise APIError(
                400,
                f"{where}: input items of type {kind!r} are not supported (messages, "
                "function_call, "
                "function_call_output and reasoning are)",
                param="input",
            )
    return messages


def chat_fields(body: ResponsesBody) -> dict[str, Any]:
    """The chat body that asks for what `body` asks for; 400 for what this server does not
    implement."""
    fields: dict[str, Any] = {}
    for name, value in (body.model_extra or {}).items():
        if name in UNSUPPORTED:
            if value not in UNSUPPORTED[name]:
                raise APIError(
                    400,
                    f"`{name}` is not supported by this server (responses are not stored)"
                    if name in ("previous_response_id", "conversation")
                    else f"`{name}` is not supported by this server yet; leave it out",
                    param=name,
                    code="unsupported_parameter",
                )
        elif name in CHAT_ONLY:
            raise APIError(
                400,
                f"Unrecognized request argument supplied: {name}",
                param=name,
                code="unsupported_parameter",
            )
        elif name not in DESCRIPTIVE:
            fields[name] = value
    fields |= {
        "model": body.model,
        "messages": chat_messages(body),
        "max_completion_tokens": body.max_output_tokens,
    }
    unknown = sorted(set(body.include or ()) - {LOGPROBS})
    if unknown:
        raise APIError(
            400,
            f"`include` {unknown} is not supported (responses are not stored, and there are no "
            f"hosted tools); {LOGPROBS!r} is",
            param="include",
            code="unsupported_parameter",
        )
    if LOGPROBS in (body.include or ()) or body.top_logprobs:
        fields |= {"logprobs": True, "top_logprobs": body.top_logprobs or 0}
    text_format = (body.text or {}).get("format")
    if text_format is not None:
        if not isinstance(text_format, dict):
            raise APIError(400, "text.format must be an object", param="text")
        schema = {
            key: value for key, value in text_format.items() if key in ("name", "schema", "strict")
        }
        fields["response_format"] = (
            {"type": "json_schema", "json_schema": schema}
            if text_format.get("type") == "json_schema"
            else text_format
        )
    if body.tools is not None:
        fields["tools"] = []
        for i, tool in enumerate(body.tools):
            if tool.get("type") != "function":
                raise APIError(
                    400,
                    f"tools[{i}]: only function tools are supported, not {tool.get('type')!r}",
                    param="tools",
                )
            fields["tools"].append(
                {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
            )
    if isinstance(body.tool_choice, dict):
        if body.tool_choice.get("type") != "function":
            raise APIError(
                400,
                "tool_choice must be none, auto, required or {type: function, name}",
                param="tool_choice",
            )
        fields["tool_choice"] = {
            "type": "function",
            "function": {"name": body.tool_choice.get("name")},
        }
    elif body.tool_choice is not None:
        fields["tool_choice"] = body.tool_choice
    return fields


def renamed(error: APIError) -> APIError:
    """A chat parameter's error with the parameter named as on this endpoint."""
    error.param = RENAMED.get(error.param or "", error.param)
    return error
