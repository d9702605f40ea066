"""How workers/grammar.py's library was chosen: per-step mask cost of llguidance against xgrammar.

Not part of pdserve (llguidance is not a dependency). From the repository root:
    .venv/bin/pip install 'llguidance==1.9.*'
    # compile times, then the A/B per step:
    .venv/bin/python -m benchmarks.studies.grammar_choice llguidance xgrammar ab
    .venv/bin/pip uninstall -y llguidance
SmolLM2-135M tokenizer, one float32 logits row of 49,152, one torch thread; the figures are in
docs/BENCHMARKS.md ("Structured output").
"""
# ruff: noqa: B023 (closures over the loop's bitmask are called inside that iteration)

import json
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, ".")
torch.set_num_threads(1)

from workers.loader import load_tokenizer  # noqa: E402

info = load_tokenizer()
tok = info.tokenizer
V = 49152  # the model's vocab (logits row)
EOS = tok.eos_token_id

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
OBJECT = {"type": "object"}
# a larger schema: an array of objects, nested object, enums, numbers, booleans, optional fields
NESTED = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "email": {"type": "string", "format": "email"},
                "vip": {"type": "boolean"},
            },
            "required": ["name", "email"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "qty": {"type": "integer", "minimum": 1},
                    "price": {"type": "number"},
                    "size": {"enum": ["S", "M", "L", "XL"]},
                },
                "required": ["sku", "qty", "price"],
                "additionalProperties": False,
            },
        },
        "status": {"enum": ["new", "paid", "shipped", "cancelled"]},
        "note": {"type": ["string", "null"]},
    },
    "required": ["order_id", "customer", "items", "status"],
    "additionalProperties": False,
}
DOC_SCHEMA = {
    "name": "Marguerite-Anne de la Tour d'Auvergne, who wrote the reference manual for the "
    "lighthouse keepers of the northern coast in the spring of 1887 and also kept bees "
    "and a small orchard of pears behind the old customs house near the harbour wall",
    "age": 4312,
    "color": "green",
}
DOC_OBJECT = {
    "id": 17,
    "title": "Grammar-constrained decoding",
    "tags": ["json", "schema", "cpu"],
    "author": {"name": "Ada", "email": "ada@example.org", "active": True},
    "scores": [0.5, 1.25, -3, 1e3],
    "notes": None,
    "summary": "a short object with nesting, arrays, "
    "numbers and strings of moderate length to make about one hundred tokens",
}


DOC_NESTED = {
    "order_id": "ABC-1234",
    "customer": {"name": "Jo Doe", "email": "jo@example.com", "vip": True},
    "items": [
        {"sku": "tee-red", "qty": 2, "price": 12.5, "size": "M"},
        {"sku": "cap-blue", "qty": 1, "price": 9.99},
    ],
    "status": "paid",
    "note": None,
}


def tokens_of(doc: dict) -> list[int]:
    return tok.encode(json.dumps(doc), add_special_tokens=False) + [EOS]


CASES = (
    ("schema", SCHEMA, DOC_SCHEMA),
    ("json_object", OBJECT, DOC_OBJECT),
    ("nested", NESTED, DOC_NESTED),
)


def unpack_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Shared apply: int32 bitmask -> bool row via numpy unpackbits -> masked_fill_."""
    banned = np.unpackbits(
        ~bitmask.numpy().view(np.uint8), bitorder="little", count=logits.shape[0]
    )
    logits.masked_fill_(torch.from_numpy(banned.view(bool)), float("-inf"))


def sparse_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Shared apply (the one workers/grammar.py uses): -inf by index on the smaller side of the
    mask."""
    v = logits.shape[0]
    banned = np.unpackbits(~bitmask.numpy().view(np.uint8), bitorder="little", count=v).view(bool)
    n_banned = int(np.count_nonzero(banned))
    if n_banned * 2 > v:
        keep = torch.from_numpy(np.flatnonzero(~banned))
        vals = logits.index_select(0, keep)
        logits.fill_(float("-inf"))
        logits.index_copy_(0, keep, vals)
    elif n_banned:
        logits.index_fill_(0, torch.from_numpy(np.flatnonzero(banned)), float("-inf"))


def med_us(xs: list[float]) -> float:
    return statistics.median(xs) * 1e6


def run_steps(name, ids, fill, apply, accept, check_allowed, reset=None, reps=1):
    fill_t = []
    apply_t = []
    acc_t = []
    row = torch.randn(V)
    for rep in range(reps):
        if rep:
            reset()  # the same document again from the start
        for t in ids:
            logits = row.clone()
            t0 = time.perf_counter()
            fill()
            t1 = time.perf_counter()
            apply(logits)
            t2 = time.perf_counter()
            assert check_allowed(logits, t), (name, t, tok.decode([t]))
            t3 = time.perf_counter()
            ok = accept(t)
            t4 = time.perf_counter()
            assert ok, (name, t)
            fill_t.append(t1 - t0)
            apply_t.append(t2 - t1)
            acc_t.append(t4 - t3)
    tot = [a + b + c for a, b, c in zip(fill_t, apply_t, acc_t, strict=True)]
    print(
        f"  {name:38s} steps={len(fill_t):3d} fill={med_us(fill_t):7.1f}us "
        f"apply={med_us(apply_t):7.1f}us "
        f"accept={med_us(acc_t):5.1f}us | total median={med_us(tot):6.1f}us "
        f"mean={statistics.mean(tot) * 1e6:6.1f}us "
        f"p90={statistics.quantiles(tot, n=10)[-1] * 1e6:6.1f}us; "
        f"fill p90={statistics.quantiles(fill_t, n=10)[-1] * 1e6:5.1f}us "
        f"max={max(fill_t) * 1e6:6.1f}us"
    )


def bench_llguidance():
    import llguidance
    import llguidance.hf
    import llguidance.torch as lltorch

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=V)
    print(
        f"llguidance {llguidance.__version__}: tokenizer init "
        f"{(time.perf_counter() - t0) * 1e3:.0f} ms"
    )
    for label, schema, doc in CASES:
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
            m = llguidance.LLMatcher(lltok, grammar, log_level=1)
            times.append(time.perf_counter() - t0)
            assert not m.is_error(), m.get_error()
        print(
            f"  compile {label}: first {times[0] * 1e3:.2f} ms, median "
            f"{statistics.median(times) * 1e3:.2f} ms"
        )
        ids = tokens_of(doc)
        bitmask = lltorch.allocate_token_bitmask(1, V)
        m = llguidance.LLMatcher(lltok, grammar)
        run_steps(
            f"llg {label} (unpackbits apply)",
            ids,
            lambda m=m: lltorch.fill_next_token_bitmask(m, bitmask),
            lambda lg: unpack_apply(lg, bitmask[0]),
            lambda t, m=m: m.consume_token(t),
            lambda lg, t: lg[t] > float("-inf"),
        )
        m = llguidance.LLMatcher(lltok, grammar)
        holder = {}

        def fill_bias(m=m):
            holder["b"] = m.compute_logit_bias()

        def apply_bias(lg):
            lg.masked_fill_(
                torch.frombuffer(bytearray(holder["b"]), dtype=torch.uint8)[: lg.shape[0]] == 0,
                float("-inf"),
            )

        run_steps(
            f"llg {label} (logit_bias apply)",
            ids,
            fill_bias,
            apply_bias,
            lambda t, m=m: m.consume_token(t),
            lambda lg, t: lg[t] > float("-inf"),
        )
        m = llguidance.LLMatcher(lltok, grammar)
        run_steps(
            f"llg {label} (validate+consume)",
            ids,
            lambda m=m: lltorch.fill_next_token_bitmask(m, bitmask),
            lambda lg: unpack_apply(lg, bitmask[0]),
            lambda t, m=m: (t == EOS or m.validate_tokens([t]) == 1) and m.consume_token(t),
            lambda lg, t: lg[t] > float("-inf"),
        )
        m = llguidance.LLMatcher(lltok, grammar)
        run_steps(
            f"llg {label} (sparse apply) x5",
            ids,
            lambda m=m: lltorch.fill_next_token_bitmask(m, bitmask),
            lambda lg: sparse_apply(lg, bitmask[0]),
            lambda t, m=m: m.consume_token(t),
            lambda lg, t: lg[t] > float("-inf"),
            reset=m.reset,
            reps=5,
        )


def bench_xgrammar():
    import xgrammar as xgr

    t0 = time.perf_counter()
    xinfo = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V)
    t1 = time.perf_counter()
    print(
        f"xgrammar {xgr.__version__ if hasattr(xgr, '__version__') else ''}: tokenizer init "
        f"{(t1 - t0) * 1e3:.0f} ms"
    )
    for label, schema, doc in CASES:
        times = []
        for _ in range(3):
            compiler = xgr.GrammarCompiler(xinfo, max_threads=1, cache_enabled=False)
            t0 = time.perf_counter()
            compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=True)
            times.append(time.perf_counter() - t0)
        print(
            f"  compile {label}: first {times[0] * 1e3:.2f} ms, median "
            f"{statistics.median(times) * 1e3:.2f} ms "
            f"(fresh compiler each, 1 thread)"
        )
        ids = tokens_of(doc)
        bitmask = xgr.allocate_token_bitmask(1, V)
        for apply_label, apply in (
            ("cpu kernel apply", lambda lg: xgr.apply_token_bitmask_inplace(lg, bitmask[0])),
            ("unpackbits apply", lambda lg: unpack_apply(lg, bitmask[0])),
            ("sparse apply) x5 (", lambda lg: sparse_apply(lg, bitmask[0])),
        ):
            m = xgr.GrammarMatcher(compiled)
            reps = 5 if "x5" in apply_label else 1
            run_steps(
                f"xgr {label} ({apply_label})",
                ids,
                lambda m=m: m.fill_next_token_bitmask(bitmask),
                apply,
                lambda t, m=m: m.accept_token(t),
                lambda lg, t: lg[t] > float("-inf"),
                reset=m.reset,
                reps=reps,
            )


def bench_ab(reps: int = 20) -> None:
    """Both libraries in one loop, alternating document by document (the machine is shared and
    noisy): mask fill + sparse apply + accept per step."""
    import llguidance
    import llguidance.hf
    import llguidance.torch as lltorch
    import xgrammar as xgr

    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=V)
    compiler = xgr.GrammarCompiler(
        xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V), max_threads=1
    )
    bitmask = torch.full((1, (V + 31) // 32), -1, dtype=torch.int32)
    row = torch.randn(V)
    print(f"A/B, {reps} passes per document, alternating libraries; per-step microseconds")
    for label, schema, doc in CASES:
        ids = tokens_of(doc)
        llm = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(schema))
        xm = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema)))
        libs = {
            "llguidance": (
                llm,
                lambda m: lltorch.fill_next_token_bitmask(m, bitmask),
                lambda m, t: m.consume_token(t),
            ),
            "xgrammar": (
                xm,
                lambda m: m.fill_next_token_bitmask(bitmask),
                lambda m, t: m.accept_token(t),
            ),
        }
        times = {name: ([], []) for name in libs}
        for _ in range(reps):
            for name, (m, fill, accept) in libs.items():
                m.reset()
                for t in ids:
                    logits = row.clone()
                    t0 = time.perf_counter()
                    fill(m)
                    t1 = time.perf_counter()
                    sparse_apply(logits, bitmask[0])
                    assert accept(m, t)
                    t2 = time.perf_counter()
                    times[name][0].append(t1 - t0)
                    times[name][1].append(t2 - t0)
        for name, (fill_t, tot) in times.items():
            q = statistics.quantiles
            print(
                f"  {label:11s} {name:10s} steps={len(tot)} fill median={med_us(fill_t):5.1f} "
                f"p90={q(fill_t, n=10)[-1] * 1e6:5.1f} mean={statistics.mean(fill_t) * 1e6:5.1f} | "
                f"fill+apply+accept median={med_us(tot):5.1f} p90={q(tot, n=10)[-1] * 1e6:5.1f} "
                f"mean={statistics.mean(tot) * 1e6:5.1f}"
            )


def bench_module(reps: int = 20) -> None:
    """workers/grammar.py as built (xgrammar, one-line JSON): compile, then mask_logits + accept per
    step."""
    from workers.grammar import GrammarCompiler, parse_response_format

    t0 = time.perf_counter()
    compiler = GrammarCompiler(tok, V)
    print(f"workers/grammar.py: GrammarCompiler init {(time.perf_counter() - t0) * 1e3:.0f} ms")
    row = torch.randn(V)
    for label, schema, doc in CASES:
        rf = (
            {"type": "json_object"}
            if schema is OBJECT
            else {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        )
        t0 = time.perf_counter()
        spec = parse_response_format(rf)
        t1 = time.perf_counter()
        compiler._compiled(spec)
        t2 = time.perf_counter()
        ids = tok.encode(json.dumps(doc), add_special_tokens=False) + [EOS]
        mask_t = []
        acc_t = []
        for _ in range(reps):
            m = compiler.matcher(spec)
            for t in ids:
                logits = row.clone()
                a = time.perf_counter()
                m.mask_logits(logits)
                b = time.perf_counter()
                m.accept(t)
                c = time.perf_counter()
                mask_t.append(b - a)
                acc_t.append(c - b)
        tot = [x + y for x, y in zip(mask_t, acc_t, strict=True)]
        q = statistics.quantiles
        print(
            f"  {label:11s} parse_response_format {(t1 - t0) * 1e3:5.2f} ms, compile "
            f"{(t2 - t1) * 1e3:6.2f} ms | "
            f"{len(tot)} steps: mask_logits median={med_us(mask_t):5.1f}us "
            f"mean={statistics.mean(mask_t) * 1e6:5.1f} "
            f"| +accept median={med_us(tot):5.1f} p90={q(tot, n=10)[-1] * 1e6:5.1f} "
            f"mean={statistics.mean(tot) * 1e6:5.1f}us"
        )


if __name__ == "__main__":
    print(
        f"torch threads=1, vocab={V}, schema doc tokens={len(tokens_of(DOC_SCHEMA))}, "
        f"object doc tokens={len(tokens_of(DOC_OBJECT))}"
    )
    for which in sys.argv[1:] or ["llguidance", "xgrammar", "ab"]:
        {
            "llguidance": bench_llguidance,
            "xgrammar": bench_xgrammar,
            "ab": bench_ab,
            "module": bench_module,
        }[which]()
