"""workers/grammar.py: greedy loops over random logits follow every structured output; bad options
are refused."""

import json
import re

import jsonschema
import pytest
import torch

from tests.factories import VOCAB, tiny_tokenizer
from workers.grammar import GrammarCompiler, parse_response_format, parse_structured_outputs

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
}
JSON_OBJECT = {"type": "json_object"}
JSON_SCHEMA = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
}
# added to tokens holding '"', '}' or ']' so that random strings and objects end soon
CLOSING_BIAS = 2.0
EOS_BIAS = 100.0  # added to EOS once the grammar allows it
MAX_TOKENS = 300


@pytest.fixture(scope="module")
def embedded() -> GrammarCompiler:
    from workers.loader import load_tokenizer

    return GrammarCompiler(load_tokenizer().tokenizer, 49152)  # SmolLM2-135M: vocab 49152


@pytest.fixture(scope="module")
def tiny() -> GrammarCompiler:
    return GrammarCompiler(tiny_tokenizer(), VOCAB + 16)  # a padded head: ids VOCAB.. are no tokens


def closing_bias(tokenizer, vocab_size: int) -> torch.Tensor:
    bias = torch.zeros(vocab_size)
    for i, piece in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        # byte-level pieces spell these ASCII characters as themselves
        if any(c in piece for c in '"}]'):
            bias[i] = CLOSING_BIAS
    return bias


def generate(compiler: GrammarCompiler, tokenizer, spec: str, seed: int) -> str:
    """Greedy over seeded random logits: mask, argmax, accept, until EOS. Checks every masked
    row."""
    matcher = compiler.matcher(spec)
    bias = closing_bias(tokenizer, compiler.vocab_size)
    special = set(tokenizer.all_special_ids) | {
        i for i, t in tokenizer.added_tokens_decoder.items() if t.special
    }
    never = sorted((special - {compiler.eos}) | set(range(len(tokenizer), compiler.vocab_size)))
    generator = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(MAX_TOKENS):
        logits = torch.randn(compiler.vocab_size, generator=generator) + bias
        matcher.mask_logits(logits)
        assert torch.isinf(logits[never]).all(), "a special or padding id was left allowed"
        if torch.isfinite(logits[compiler.eos]):
            logits[compiler.eos] += EOS_BIAS
        token = int(logits.argmax())
        assert torch.isfinite(logits[token]), "the grammar allowed nothing"
        matcher.accept(token)
        assert matcher.num_accepted == len(out) + 1
        if token == compiler.eos:
            assert _allowed(matcher, compiler.vocab_size) == [compiler.eos]  # after EOS: only EOS
            return tokenizer.decode(out)
        out.append(token)
    raise AssertionError(f"no EOS within {MAX_TOKENS} tokens: {tokenizer.decode(out)!r}")


def _allowed(matcher, vocab_size: int) -> list[int]:
    logits = torch.zeros(vocab_size)
    matcher.mask_logits(logits)
    return torch.isfinite(logits).nonzero().flatten().tolist()


def check_person(text: str) -> None:
    doc = json.loads(text)
    jsonschema.validate(doc, SCHEMA)
    assert list(doc) == ["name", "age", "color"]  # the schema's order, nothing else
    assert (
        isinstance(doc["name"], str)
        and type(doc["age"]) is int
        and doc["color"] in ("red", "green", "blue")
    )


@pytest.mark.parametrize("which", ["embedded", "tiny"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_logits_give_valid_json(
    which: str, seed: int, request: pytest.FixtureRequest
) -> None:
    compiler = request.getfixturevalue(which)
    tokenizer = compiler.tokenizer
    text = generate(compiler, tokenizer, parse_response_format(JSON_OBJECT), seed)
    assert isinstance(json.loads(text), dict), text
    check_person(generate(compiler, tokenizer, parse_response_format(JSON_SCHEMA), seed))


def test_mask_leaves_only_eos_when_complete(tiny: GrammarCompiler) -> None:
    matcher = tiny.matcher(parse_response_format(JSON_OBJECT))
    logits = torch.zeros(tiny.vocab_size)
    matcher.mask_logits(logits)
    assert torch.isinf(logits[tiny.eos]) and torch.isfinite(logits).sum() > 0
    for token in tiny.tokenizer.encode('{"a": [1, true]}', add_special_tokens=False):
        matcher.accept(token)
    assert _allowed(matcher, tiny.vocab_size) == [tiny.eos]
    batch = torch.zeros(2, tiny.vocab_size)
    matcher.mask_logits(batch[1])  # a row of a batch, masked in place
    assert torch.isfinite(batch[0]).all() and torch.isfinite(
        batch[1]
    ).nonzero().flatten().tolist() == [tiny.eos]
    matcher.accept(tiny.eos)
    with pytest.raises(ValueError, match="after the end"):
        matcher.accept(tiny.eos)


class _DeadEnd:
    """A library matcher stuck where its grammar allows no token at all."""

    def is_terminated(self) -> bool:
        return False

    def fill_next_token_bitmask(self, bitmask: torch.Tensor) -> None:
        bitmask.zero_()

    def accept_token(self, token_id: int) -> bool:
        return False


def test_a_dead_end_ends_with_eos(tiny: GrammarCompiler) -> None:
    matcher = tiny.matcher(parse_response_format(JSON_OBJECT))
    matcher._matcher = _DeadEnd()
    assert _allowed(matcher, tiny.vocab_size) == [tiny.eos]  # EOS rather than a row of -inf
    with pytest.raises(ValueError, match="not allowed"):
        matcher.accept(5)
    matcher.accept(tiny.eos)
    assert matcher.num_accepted == 1


def test_accept_refuses_what_the_grammar_does_not_allow(embedded: GrammarCompiler) -> None:
    tokenizer = embedded.tokenizer
    matcher = embedded.matcher(parse_response_format(JSON_SCHEMA))
    for token in (
        tokenizer.encode("hello", add_special_tokens=False)[0],
        embedded.eos,
        -1,
        embedded.vocab_size,
    ):
        with pytest.raises(ValueError, match="not allowed"):
            matcher.accept(token)
    prefix = tokenizer.encode('{"name": "Ann', add_special_tokens=False)
    for token in prefix:
        matcher.accept(token)
    for token in tokenizer.all_special_ids:  # <|im_start|> spelled inside a string is still no text
        with pytest.raises(ValueError, match="not allowed"):
            matcher.accept(token)
    with pytest.raises(ValueError, match="not allowed"):
        # a raw newline inside a string
        matcher.accept(tokenizer.encode("\n", add_special_tokens=False)[0])
    assert matcher.num_accepted == len(prefix)  # refusals leave the matcher as it was
    for token in tokenizer.encode('", "age": 7, "color": "red"}', add_special_tokens=False):
        matcher.accept(token)
    matcher.accept(embedded.eos)


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"type": "yaml"}, "response_format.type"),
        ({}, "response_format.type"),
        ("json_object", "must be an object"),
        ({"type": "json_schema"}, "json_schema must be an object"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema is missing"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": ["type", "object"]}},
            "must be a JSON object",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": True}},
            "must be a JSON object",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}},
            "must be a JSON object",
        ),
        ({"type": "json_schema", "json_schema": {"name": "has space", "schema": SCHEMA}}, "name"),
        ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "name"),
        (
            {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": SCHEMA, "strict": "yes"},
            },
            "strict",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}},
            "not supported",
        ),
        (
            {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "["}},
            },
            "not supported",
        ),
        (
            {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "string", "minLength": 5, "maxLength": 2},
                },
            },
            "not supported",
        ),
    ],
)
def test_parse_response_format_refuses(bad, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_response_format(bad)


def test_parse_response_format_accepts() -> None:
    assert parse_response_format({"type": "text"}) is None
    assert json.loads(parse_response_format(JSON_OBJECT)) == {"type": "json_object"}
    spec = json.loads(
        parse_response_format(
            {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
        )
    )
    assert spec == {
        "type": "json_schema",
        "json_schema": {"name": "p", "schema": SCHEMA, "strict": False},
    }
    # order kept
    assert list(spec["json_schema"]["schema"]["properties"]) == ["name", "age", "color"]


def test_compiler_caches_and_refuses(tiny: GrammarCompiler) -> None:
    spec = parse_response_format(JSON_SCHEMA)
    assert tiny._compiled(spec) is tiny._compiled(spec)
    with pytest.raises(ValueError, match="no grammar"):
        tiny.matcher(json.dumps({"type": "text"}))
    with pytest.raises(ValueError, match="1-D float row"):
        tiny.matcher(spec).mask_logits(torch.zeros(2, tiny.vocab_size))


PERSON_TEXT = json.dumps(SCHEMA)
FANCY_CHOICES = ['say "hi"', "back\\slash", "café ☕", "a|b"]


@pytest.mark.parametrize("which", ["embedded", "tiny"])
@pytest.mark.parametrize(
    ("options", "check"),
    [
        ({"regex": r"[0-9]{3}-[a-z]{2,5}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", t)),
        ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
        ({"choice": FANCY_CHOICES}, lambda t: t in FANCY_CHOICES),
        (
            {"grammar": 'root ::= "(" num ("," num)* ")"\nnum ::= [0-9]+'},
            lambda t: re.fullmatch(r"\(\d+(,\d+)*\)", t),
        ),
        (
            {"grammar": 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]+/'},
            lambda t: re.fullmatch(r"yes|no|maybe \d+", t),
        ),
        ({"json": PERSON_TEXT, "disable_any_whitespace": True}, lambda t: check_person(t) is None),
        ({"json": SCHEMA}, lambda t: check_person(t) is None),
        ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
    ],
    ids=["regex", "choice", "choice-escaped", "ebnf", "lark", "json-text", "json", "json_object"],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_structured_outputs_are_followed(
    which: str, options, check, seed: int, request: pytest.FixtureRequest
) -> None:
    compiler = request.getfixturevalue(which)
    text = generate(compiler, compiler.tokenizer, parse_structured_outputs(options), seed)
    assert check(text) not in (None, False), text


@pytest.mark.parametrize(
    "bad, message",
    [
        ({}, "exactly one of"),
        ({"regex": "a", "choice": ["b"]}, "exactly one of"),
        ({"json_object": False}, "exactly one of"),
        ("regex", "must be an object"),
        ({"regex": "("}, "structured_outputs.regex is not supported: .*parenthesis"),
        ({"regex": 5}, "must be a string"),
        ({"choice": []}, "non-empty list of strings"),
        ({"choice": ["a", 1]}, "non-empty list of strings"),
        ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar is not supported"),
        ({"grammar": "start: nothing_here"}, "structured_outputs.grammar is not supported"),
        ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
        ({"json": ["type", "object"]}, "structured_outputs.json must be a JSON object"),
        ({"json": {"type": "frobnicate"}}, "structured_outputs.json is not supported"),
        ({"json_object": "yes"}, "must be true"),
        ({"regex": "a", "whitespace_pattern": " "}, "whitespace_pattern is not supported"),
        ({"regex": "a", "structural_tag": "{}"}, "structural_tag is not supported"),
        (
            {"json": SCHEMA, "disable_any_whitespace": False},
            "disable_any_whitespace false is not supported",
        ),
    ],
)
def test_parse_structured_outputs_refuses(bad, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_structured_outputs(bad)


def test_a_choice_is_matched_whole_and_only_then_ends(tiny: GrammarCompiler) -> None:
    tokenizer = tiny.tokenizer
    matcher = tiny.matcher(
        parse_structured_outputs({"choice": ["ab", "abc"], "disable_fallback": True})
    )
    for token in tokenizer.encode("ab", add_special_tokens=False):
        matcher.accept(token)
    allowed = _allowed(matcher, tiny.vocab_size)
    assert tiny.eos in allowed and len(allowed) > 1  # "ab" may end, or go on to "abc"
    with pytest.raises(ValueError, match="not allowed"):
        matcher.accept(tokenizer.encode("x", add_special_tokens=False)[0])
