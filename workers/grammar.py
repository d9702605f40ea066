"""Grammar-constrained sampling, on xgrammar: OpenAI's `response_format` (json_object / json_schema)
and vLLM's `structured_outputs` (json, regex, choice, grammar, json_object).

`parse_response_format` and `parse_structured_outputs` validate a request's option at the HTTP edge
(no tokenizer needed) and return its canonical JSON text, the spec the engine carries. A worker
builds one `GrammarCompiler` from its tokenizer; `compiler.matcher(spec)` follows one request:
`mask_logits` before each draw, `accept` after it; when the grammar is complete only EOS is allowed.

xgrammar was picked over llguidance by the measured per-step mask cost on the CPU (see the commit
message). The output is one-line JSON (`", "` and `": "` between items, no other whitespace), so a
small model cannot loop on whitespace; properties come in the schema's order, and properties a
schema does not declare are not generated (xgrammar's strict mode), so every output validates
against the schema.
"""

from __future__ import annotations

import json
import os
import re
from collections import OrderedDict
from typing import Any

import numpy as np
import torch
import xgrammar as xgr

MAX_SCHEMA_CHARS = 65_536  # a guard at the HTTP edge: longer schemas are refused
CACHE_SIZE = 256  # compiled grammars kept per worker, least recently used dropped first
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# "[08:01:22] /project/cpp/x.cc:94: " on xgrammar errors
_XGR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")
_OBJECT_SCHEMA = '{"type": "object"}'
_OPTIONS: dict[str, Any] = {"any_whitespace": False, "strict_mode": True}
# vLLM's structured_outputs, one per request
_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's structured_outputs switches, at the values that describe what pdserve does anyway
_NO_OP_OPTIONS: dict[str, tuple[Any, ...]] = {
    "disable_fallback": (None, True, False),
    "disable_any_whitespace": (None, True),
    "disable_additional_properties": (None, True),
}


def _library_error(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return _XGR_PREFIX.sub("", lines[0]) if lines else type(error).__name__


def parse_response_format(response_format: dict) -> str | None:
    """Validate an OpenAI response_format and return its canonical JSON text (None for {"type":
    "text"}). Raises ValueError with a clear message for an unknown type, a missing/invalid schema,
    or a schema the library cannot compile."""
    if not isinstance(response_format, dict):
        raise ValueError("response_format must be an object")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"type": "json_object"})
    if kind != "json_schema":
        raise ValueError(
            f"response_format.type must be 'text', 'json_object' or 'json_schema', not {kind!r}"
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise ValueError("response_format.json_schema must be an object with 'name' and 'schema'")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            "response_format.json_schema.name must be 1-64 characters of a-z, A-Z, 0-9, _ or -"
        )
    if "schema" not in spec:
        raise ValueError("response_format.json_schema.schema is missing")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ValueError("response_format.json_schema.strict must be true or false")
    return _json_schema_spec(
        spec["schema"], name, bool(strict), "response_format.json_schema.schema"
    )


def _json_schema_spec(schema: Any, name: str, strict: bool, where: str) -> str:
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON object, not {type(schema).__name__}")
    try:
        schema_text = json.dumps(schema, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where} is not valid JSON: {e}") from None
    if len(schema_text) > MAX_SCHEMA_CHARS:
        raise ValueError(f"{where} is longer than {MAX_SCHEMA_CHARS} characters")
    try:  # builds the grammar without a tokenizer: well under a millisecond for a small schema
        xgr.Grammar.from_json_schema(schema_text, **_OPTIONS)
    except Exception as e:  # xgrammar raises RuntimeError for what it cannot convert
        raise ValueError(f"{where} is not supported: {_library_error(e)}") from None
    canonical = {"name": name, "schema": schema, "strict": strict}
    return json.dumps({"type": "json_schema", "json_schema": canonical}, ensure_ascii=False)


def parse_structured_outputs(options: dict) -> str:
    """Validate vLLM's `structured_outputs` (exactly one of json, regex, choice, grammar,
    json_object) and return its canonical JSON text, the spec the engine carries. A choice becomes a
    grammar of its strings; a grammar is EBNF (GBNF, xgrammar's dialect) when it has a `::=` rule,
    else Lark. Raises ValueError naming the field at fault."""
    if not isinstance(options, dict):
        raise ValueError("structured_outputs must be an object")
    for key, value in options.items():
        if key in _NO_OP_OPTIONS:
            if value not in _NO_OP_OPTIONS[key]:
                raise ValueError(
                    f"structured_outputs.{key} {json.dumps(value)} is not supported: pdserve's "
                    "JSON is one line with only the schema's properties, from its one backend"
                )
        elif key not in _KINDS:
            raise ValueError(
                f"structured_outputs.{key} is not supported; give one of {', '.join(_KINDS)}"
            )
    given = [key for key in _KINDS if options.get(key) not in (None, False)]
    if len(given) != 1:
        raise ValueError(
            f"structured_outputs takes exactly one of {', '.join(_KINDS)}, not {given or 'none'}"
        )
    kind = given[0]
    value = options[given[0]]
    where = f"structured_outputs.{kind}"
    if kind == "json_object":
        if value is not True:
            raise ValueError(f"{where} must be true")
        return json.dumps({"type": "json_object"})
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where} is not valid JSON: {e}") from None
        return _json_schema_spec(value, "structured_outputs", True, where)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise ValueError(f"{where} must be a non-empty list of strings")
        value = "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
        kind = "grammar"
    if not isinstance(value, str):
        raise ValueError(f"{where} must be a string")
    if len(value) > MAX_SCHEMA_CHARS:
        raise ValueError(f"{where} is longer than {MAX_SCHEMA_CHARS} characters")
    spec = (
        {"type": "regex", "regex": value}
        if kind == "regex"
        else {"type": "grammar", "grammar": value, "syntax": "ebnf" if "::=" in value else "lark"}
    )
    try:
        _text_grammar(spec)
    # xgrammar raises RuntimeError (or its own error type) for a bad pattern or rule
    except Exception as e:
        raise ValueError(f"{where} is not supported: {_library_error(e)}") from None
    return json.dumps(spec, ensure_ascii=False)


def _text_grammar(spec: dict[str, Any]) -> Any:
    """The xgrammar Grammar of a canonical regex or grammar spec."""
    if spec["type"] == "regex":
        return xgr.Grammar.from_regex(spec["regex"])
    if spec["syntax"] == "ebnf":
        return xgr.Grammar.from_ebnf(spec["grammar"])
    return xgr.Grammar.from_lark(spec["grammar"])


def _schema_of(canonical: str) -> str:
    spec = json.loads(canonical)
    if spec["type"] == "json_object":
        return _OBJECT_SCHEMA
    return json.dumps(spec["json_schema"]["schema"], ensure_ascii=False)


def _special_ids(tokenizer: Any) -> set[int]:
    """The tokenizer's special tokens (added ones included): never text, so never inside the
    JSON."""
    ids = {int(i) for i in getattr(tokenizer, "all_special_ids", []) if i is not None}
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids.update(int(i) for i, token in decoder.items() if getattr(token, "special", False))
    return ids


class GrammarMatcher:
    """Follows one request's output."""

    def __init__(self, compiled: Any, allowed_words: np.ndarray, eos: int, vocab_size: int) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)
        self._allowed_words = allowed_words  # int32 bitmask words: ids the grammar may ever pick
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._eos = eos
        self._vocab_size = vocab_size
        self._num_accepted = 0
        self._ended = False  # EOS accepted

    @property
    def num_accepted(self) -> int:
        return self._num_accepted

    @property
    def ended(self) -> bool:
        """EOS was accepted: the reply is complete."""
        return self._ended

    def _banned(self) -> np.ndarray | None:
        """A bool row of the tokens not allowed next, or None when only EOS is."""
        if self._ended or self._matcher.is_terminated():
            return None
        self._matcher.fill_next_token_bitmask(self._bitmask)
        words = self._bitmask.numpy()[0]
        np.bitwise_and(words, self._allowed_words, out=words)
        banned = np.unpackbits(
            ~words.view(np.uint8), bitorder="little", count=self._vocab_size
        ).view(bool)
        # a dead end (an unsatisfiable schema) ends with EOS
        return None if banned.all() else banned

    def mask_logits(self, logits: torch.Tensor) -> None:
        """Set every token the grammar does not allow next to -inf, in place, on a 1-D float row
        [vocab_size]. When the grammar is complete only EOS (the tokenizer's eos) is allowed."""
        if (
            logits.dim() != 1
            or logits.shape[0] != self._vocab_size
            or not logits.is_floating_point()
        ):
            raise ValueError(
                f"mask_logits takes a 1-D float row of {self._vocab_size}, not "
                f"{tuple(logits.shape)}"
            )
        banned = self._banned()
        if banned is None:
            eos_logit = logits[self._eos].clone()
            logits.fill_(float("-inf"))
            logits[self._eos] = eos_logit
        elif logits.device.type != "cpu":
            logits.masked_fill_(
                torch.from_numpy(banned).to(logits.device, non_blocking=True), float("-inf")
            )
        # mostly banned: keep the allowed few
        elif int(np.count_nonzero(banned)) * 2 > self._vocab_size:
            keep = torch.from_numpy(np.flatnonzero(~banned))
            kept = logits.index_select(0, keep)
            logits.fill_(float("-inf"))
            logits.index_copy_(0, keep, kept)
        # mostly allowed (inside a string): ban the few by index; cheaper than a full masked_fill_
        else:
            logits.index_fill_(0, torch.from_numpy(np.flatnonzero(banned)), float("-inf"))

    def accept(self, token_id: int) -> None:
        """Advance by a sampled token; raise ValueError if the grammar does not allow it."""
        token_id = int(token_id)
        if self._ended:
            raise ValueError(
                f"token {token_id} after the end of the grammar (EOS already accepted)"
            )
        word = self._allowed_words[token_id // 32] if 0 <= token_id < self._vocab_size else 0
        ever_allowed = bool((int(word) >> (token_id % 32)) & 1)
        # as mask_logits allowed it
        dead_end_eos = lambda: token_id == self._eos and self._banned() is None
        if not ever_allowed or not (self._matcher.accept_token(token_id) or dead_end_eos()):
            raise ValueError(
                f"token {token_id} is not allowed by the grammar after {self._num_accepted} tokens"
            )
        self._ended = token_id == self._eos
        self._num_accepted += 1


class GrammarCompiler:
    """One per worker: built from the tokenizer and the model's vocab size (logits row length, may
    exceed len(tokenizer)); caches compiled grammars by spec text."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            raise ValueError("the tokenizer has no eos_token_id: a grammar needs one to end on")
        if not 0 <= eos < vocab_size:
            raise ValueError(f"the tokenizer's eos {eos} is outside the vocab of {vocab_size}")
        self.tokenizer = tokenizer
        self.eos = int(eos)
        self.vocab_size = int(vocab_size)
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=[self.eos]
        )
        self._compiler = xgr.GrammarCompiler(
            info, max_threads=min(4, os.cpu_count() or 1), cache_enabled=False
        )
        allowed = np.zeros(self.vocab_size, dtype=bool)
        # ids past the tokenizer are padding: never
        allowed[: min(len(tokenizer), self.vocab_size)] = True
        allowed[[i for i in _special_ids(tokenizer) if 0 <= i < self.vocab_size]] = False
        allowed[self.eos] = True  # the grammar decides when EOS may come
        padded = np.zeros(-(-self.vocab_size // 32) * 32, dtype=bool)
        padded[: self.vocab_size] = allowed
        self._allowed_words = np.packbits(padded, bitorder="little").view(np.int32)
        self._cache: OrderedDict[str, Any] = OrderedDict()

    def _compiled(self, spec: str) -> Any:
        """The compiled grammar of a response_format's JSON text, from the cache when seen
        before."""
        if spec in self._cache:
            self._cache.move_to_end(spec)
            return self._cache[spec]
        try:
            parsed = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"a grammar spec must be JSON text: {e}") from None
        if not isinstance(parsed, dict) or parsed.get("type") not in (
            "json_object",
            "json_schema",
            "regex",
            "grammar",
        ):
            raise ValueError(
                f"{spec[:80]!r} has no grammar: a spec is a canonical structured output"
            )
        try:
            if parsed["type"] in ("regex", "grammar"):
                compiled = self._compiler.compile_grammar(_text_grammar(parsed))
            else:
                canonical = parse_response_format(parsed)
                assert canonical is not None
                compiled = self._compiler.compile_json_schema(_schema_of(canonical), **_OPTIONS)
        except ValueError:
            raise
        except Exception as e:
            raise ValueError(
                f"the structured output cannot be compiled: {_library_error(e)}"
            ) from None
        self._cache[spec] = compiled
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return compiled

    def matcher(self, spec: str) -> GrammarMatcher:
        return GrammarMatcher(self._compiled(spec), self._allowed_words, self.eos, self.vocab_size)
