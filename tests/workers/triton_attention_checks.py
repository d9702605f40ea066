"""The Triton paged attention's checks, run in a process of their own with TRITON_INTERPRET=1 set
before Triton is first imported: `python -m tests.workers.triton_attention_checks CHECK...` exits
0 when every check holds. `tests/workers/test_triton_attention.py` runs it.

The cases are `tests/workers/paged_cases.py`'s: shuffled blocks, rows sharing row 0's first
blocks, lengths ending mid-block, padding entries out of the pool's range, NaN wherever the pool
holds no key, so a read of a wrong or padding block shows. Tolerance: fp32 outputs within 1e-5 of
a float64 softmax (fp32 sums in another order). bf16 outputs within one bf16 ulp (2^-7 relative)
of it: the sums are fp32 and the output is rounded once, by truncation under Triton 3.9's
interpreter (half an ulp on a GPU, which also rounds the softmax weights to bf16 for the dot).
Against the torch ops (SDPA in bf16), the project's torch tolerance."""

import os
import sys

import torch
import torch.nn.functional as F

from tests.workers.paged_cases import (
    CHUNKS,
    LENGTHS,
    TOLERANCE,
    Kv8Case,
    PagedCase,
    prompt_chunks,
)
from workers.kernels import paged_decode_attention_torch

# (G, D): every group of the issue (1, 4, 7, padded to 16 rows) and head dim (112: not a power
# of two)
SHAPES = [(1, 64), (4, 128), (7, 112)]
DTYPES = [torch.float32, torch.bfloat16]


def assert_near(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """`got` within its dtype's bound of `want` (float64), and no NaN anywhere."""
    assert got.dtype in DTYPES and not got.isnan().any(), what
    err = (got.double() - want).abs()
    if got.dtype == torch.float32:
        bound = 1e-5 + 1e-5 * want.abs()
    else:
        bound = 2.0**-7 * want.abs() + 1e-6
    assert (err <= bound).all(), f"{what}: {float((err - bound).max())} past the bound"


def check_decode() -> None:
    """Every row against a float64 softmax over its own keys and against the torch ops."""
    from workers import triton_attention

    for dtype in DTYPES:
        for group, dim in SHAPES:
            case = PagedCase(dtype, group, dim)
            what = f"decode {dtype} G{group} D{dim}"
            got = triton_attention.decode_attention(case.query, *case.shuffled, case.lengths)
            assert got.shape == case.query.shape and got.dtype == dtype, what
            assert_near(got, case.reference(), what)
            in_torch = paged_decode_attention_torch(case.query, *case.shuffled, case.lengths)
            torch.testing.assert_close(got, in_torch, **TOLERANCE[dtype])
        check_rows_alone(PagedCase(dtype, 7, 112))


def check_rows_alone(case: PagedCase) -> None:
    """A row alone, and the tables padded wider (a second, empty span), give the batch's bits:
    the spans are fixed, not sized to the batch. The slot layout (one block of 50 keys a row: a
    block size not a power of two) matches the float64 softmax."""
    from workers import triton_attention

    got = triton_attention.decode_attention(case.query, *case.shuffled, case.lengths)
    k_pool, v_pool, tables = case.shuffled
    for row in (1, 2):  # blocks shared with row 0; a single key
        alone = triton_attention.decode_attention(
            case.query[row : row + 1],
            k_pool,
            v_pool,
            tables[row : row + 1],
            case.lengths[row : row + 1],
        )  # [1, KVH, G, D]
        assert torch.equal(alone[0], got[row]), row
    wider = torch.cat([tables, tables.new_full((len(LENGTHS), 20), -5)], 1)  # [B, MAXB + 20]
    padded = triton_attention.decode_attention(case.query, k_pool, v_pool, wider, case.lengths)
    assert torch.equal(padded, got)
    slot = triton_attention.decode_attention(case.query, *case.slot, case.lengths)
    assert_near(slot, case.reference(), "slot layout")


def check_spans() -> None:
    """Rows split over several spans (8 and 24 keys: spans ending mid-block and spanning blocks,
    rows with empty spans) merge to the one-span result within the dtype's bound."""
    from workers import triton_attention

    for dtype in DTYPES:
        case = PagedCase(dtype, 4, 128)
        want = case.reference()
        for keys in (8, 24):
            triton_attention.SPLIT_KEYS = keys
            got = triton_attention.decode_attention(case.query, *case.shuffled, case.lengths)
            assert_near(got, want, f"spans of {keys} {dtype}")
    triton_attention.SPLIT_KEYS = 256


def prompt_reference(case: PagedCase, query: torch.Tensor, firsts: torch.Tensor) -> torch.Tensor:
    """Each chunk's SDPA (float64) over its row's keys laid out contiguously, a token seeing the
    keys up to its own position: `[N, KVH, G, D]` float64."""
    out = torch.empty(query.shape, dtype=torch.float64)
    for row, (start, n) in enumerate(CHUNKS):
        first = int(firsts[row])
        q = query[first : first + n].double().permute(1, 2, 0, 3)  # [KVH, G, T, D]
        k, v = case.keys[:, row, :, None, : start + n].double()  # [KVH, 1, ctx, D] each
        positions = torch.arange(start, start + n)  # [T]
        visible = torch.arange(start + n)[None, :] <= positions[:, None]  # [T, ctx]
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=visible)  # [KVH, G, T, D]
        out[first : first + n] = attn.permute(2, 0, 1, 3)
    return out


def check_prompt() -> None:
    """Chunks from position 0 and from inside cached blocks (27, 30), one token, one whole block;
    a chunk alone gives its bits in the batch."""
    from workers import triton_attention

    for dtype in DTYPES:
        for group, dim in SHAPES:
            case = PagedCase(dtype, group, dim)
            what = f"prompt {dtype} G{group} D{dim}"
            query, starts, firsts, counts = prompt_chunks(case, CHUNKS)
            chunks = (starts, firsts, counts)
            got = triton_attention.prompt_attention(query, *case.shuffled, *chunks)
            assert got.shape == query.shape and got.dtype == dtype, what
            assert_near(got, prompt_reference(case, query, firsts), what)
            k_pool, v_pool, tables = case.shuffled
            row = 1  # 5 tokens from position 27, in row 0's shared blocks
            alone = triton_attention.prompt_attention(
                query[37:42],
                k_pool,
                v_pool,
                tables[row : row + 1],
                starts[row : row + 1],
                torch.tensor([0]),
                counts[row : row + 1],
            )  # [5, KVH, G, D]
            assert torch.equal(alone, got[37:42]), what


def check_kv8() -> None:
    """An 8-bit cache (int8, fp8) read as bytes and scales: decode rows and prompt chunks against
    a float64 softmax over the dequantized keys (a NaN scale past a row's keys shows a stray
    read)."""
    from workers import triton_attention

    # each format with each query dtype once: the interpreter is slow
    for kind, dtype, group, dim in (
        ("int8", torch.float32, 4, 128),
        ("int8", torch.bfloat16, 7, 112),
        ("fp8", torch.float32, 7, 112),
        ("fp8", torch.bfloat16, 1, 64),
    ):
        case = Kv8Case(kind, dtype, group, dim)
        what = f"{kind} {dtype} G{group} D{dim}"
        args = (*case.shuffled, case.lengths, case.scales)
        got = triton_attention.decode_attention(case.query, *args)
        assert_near(got, case.reference(), f"decode {what}")
        query, starts, firsts, counts = prompt_chunks(case, CHUNKS)
        chunks = (starts, firsts, counts, case.scales)
        got = triton_attention.prompt_attention(query, *case.shuffled, *chunks)
        assert_near(got, prompt_reference(case, query, firsts), f"prompt {what}")


def model_logits(rows: list[tuple[list[int], list[int], int]]) -> list[torch.Tensor]:
    """The tiny Llama's logits (fp32) for `rows` of (block table, token ids, first position) run
    step after step, each step's last token's: the first row alone, then the rest as one step of
    decode rows (all but the last) and a prompt chunk (the last), over a fresh cache."""
    from tests.factories import tiny_model
    from workers.kv_cache import PagedKVCache
    from workers.model import BatchLayout

    model = tiny_model("llama")
    spec = model.spec
    cache = PagedKVCache(spec.num_layers, 12, spec.num_kv_heads, 16, spec.head_dim)
    out = []
    for step, num_decode in ((rows[:1], 0), (rows[1:], len(rows) - 2)):
        ids, layout = BatchLayout.pack(step, num_decode, 16, "cpu")
        ends = torch.tensor([len(tokens) for _, tokens, _ in step]).cumsum(0) - 1  # [rows]
        out.append(model(ids, layout, cache, ends))  # [rows, vocab]
    return out


def check_model() -> None:
    """The model's attention wired to the kernels (the C++ kernels off, so the CPU takes the GPU
    path under the interpreter): a 40-token prompt, then its next token and a second chunk of
    another prompt from inside its blocks, both over shuffled blocks; the logits match the torch
    ops' (gather + SDPA) within fp32's rounding."""
    from workers import kernels, model, triton_attention

    kernels.load_kernels = lambda: None
    calls = []

    def counting(name: str):  # the kernel's wrapper, recording that the model called it
        kernel = getattr(triton_attention, name)

        def counted(*args):
            calls.append(name)
            return kernel(*args)

        return counted

    for name in ("decode_attention", "prompt_attention"):
        setattr(triton_attention, name, counting(name))
    table = [7, 2, 9]
    tokens = torch.randint(2, 200, (41,), generator=torch.Generator().manual_seed(3)).tolist()
    # the second step's chunk writes positions 20..39 of the same blocks again, with the keys
    # the first step wrote there, and attends from inside block 2
    rows = [(table, tokens[:40], 0), (table, tokens[40:], 40), (table, tokens[20:40], 20)]
    with_triton = model_logits(rows)
    assert set(calls) == {"decode_attention", "prompt_attention"}, calls
    model.triton_attention = None
    in_torch = model_logits(rows)
    for got, want in zip(with_triton, in_torch, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


CHECKS = {
    "decode": check_decode,
    "spans": check_spans,
    "prompt": check_prompt,
    "kv8": check_kv8,
    "model": check_model,
}

if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    for name in sys.argv[1:]:
        CHECKS[name]()
    print("ok")
