"""What the tool-calling tests script: a reply that calls two tools in hermes' format, a chat
template that shows the tools, and the OpenAI server on a scripted engine reading tool calls."""

from deploy.serving.openai_api import OpenAIServer
from tests.deploy.serving.fake_engine import make_server

HERMES = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": '
    "2}}\n"
    '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n'
)

TOOL_TEMPLATE = (
    "{% if tools %}<|tools|>{{ tools | map(attribute='function') | map(attribute='name') | "
    "join(',') }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}"
    "[call {{ c['function']['name'] }} {{ c['function']['arguments'] | tojson }}]"
    "{% endfor %}{% if m.get('tool_call_id') %}[for {{ m['tool_call_id'] }}]{% endif %}{{ '\\n' "
    "}}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def server(
    engine,  # type: ignore[no-untyped-def]
    parser: str | None = "hermes",
    tokenizer=None,  # type: ignore[no-untyped-def]
    reasoning: str | None = None,
) -> OpenAIServer:
    """The server on `engine`, reading tool calls with `parser` (hermes unless told)."""
    return make_server(engine, parser=parser, reasoning=reasoning, tokenizer=tokenizer)
