"""CPU kernels compiled on first use: ragged decode attention, paged prompt attention and fused
elementwise ops, with torch fallbacks.

Why kernels: after the matmuls, a decode step's time went to its attention (each row reads its own
number of keys: one SDPA call per row forks the thread pool per row per layer, one call over the
slot span reads up to twice the keys) and to a dozen small eager ops per layer, each a dispatch and
a thread fork; and MKL's sgemm re-packs the weight on every call, which at decode's few rows costs
about as much as the multiply. So: a ragged attention kernel over every (row, KV head) pair in one
parallel loop, with scores in fp32 whatever the cache dtype (`csrc/decode_attention.cpp`); the
prompt chunks of a step likewise over their blocks where they lie, rather than gathered into a copy
per chunk per layer for SDPA (`csrc/prompt_attention.cpp`); residual add + RMSNorm, rotary + KV
cache write, and SiLU-mul as one pass each (`csrc/elementwise.cpp`); a step's LoRA updates of a
projection, whatever mix of adapters, in one call (`csrc/lora.cpp`); and a matmul over weights
packed once into 64-column panels, fp32 on AVX-512 and AVX2 and bf16 on AVX512-BF16 without AMX
(`csrc/gemm.cpp`; with AMX, oneDNN's AMX tiles over a copy of the weight reordered once into
oneDNN's layout, as vLLM's CPU backend does: 4-7x the packed kernel at 64-256 rows, and 1.3-2.6x
torch's own bf16 matmul, which reorders the weight on every call; blocked by the number of rows, so
bf16 decode rows are then not bit-identical whatever the batch). Every kernel computes a row alone,
in an order that does not depend on how many rows share the call.

An 8-bit KV cache (`--kv-cache-dtype int8|fp8`) has entry points of its own (`*_kv8`, `csrc/kv8.h`):
the cache write quantizes each row as the torch ops of `workers/kv_quant.py` do, byte for byte, and
both attention kernels read its values as floats times their rows' scales.

They are built from the files of `workers/csrc/` with `torch.utils.cpp_extension.load` (a C++
compiler, as `torch.compile` on CPU needs too) into torch's extension cache, once per machine type
and version of those files (about 40 s, the files compiled in parallel); where building fails, or
`PDSERVE_KERNELS=0` is set, each function here runs its torch ops instead (SDPA for attention).
The build uses -fopenmp because `at::parallel_for` is an OpenMP pragma in a header: without it the
loops run on one thread (libgomp.so.1 is the one torch has already loaded, so there is one thread
pool), and -ffp-contract=off so that fp32 `a*b + c*d` rounds as the eager ops do.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from workers.kv_quant import dequantize, quantize

log = logging.getLogger(__name__)

# an 8-bit cache layer's K and V scales, `[NB, KVH, BS]` each (`PagedKVCache.scales`)
Scales = tuple[torch.Tensor, torch.Tensor]


# bf16 matmuls on CPUs with AMX go to torch's (oneDNN's AMX tiles): faster, but blocked by the
# number of rows (tests turn it off to check the packed kernel there too)
LIBRARY_BF16_ON_AMX = True
# the kernels' C++ (.cpp files, their headers), beside this file in a checkout and in a wheel alike
CSRC = Path(__file__).resolve().parent / "csrc"
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]
_lock = threading.Lock()
_module: Any = None
_tried = False


def _machine_tag(csrc: Path = CSRC) -> str:
    """Built with -march=native, so one build per CPU type (a shared home directory must not mix
    them), torch version and the bytes of every file in `csrc`, headers included."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    digest = hashlib.sha1((flags + torch.__version__).encode())
    for path in sorted(p for p in csrc.iterdir() if p.is_file()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:10]


def build(
    csrc: Path = CSRC,
    name: str | None = None,
    build_directory: Path | None = None,
    cflags: list[str] | None = None,
) -> Any:
    """Compile every .cpp file of `csrc` into one module for this CPU (or load the one already
    built for these files), in torch's extension cache unless `build_directory` is given; `cflags`
    after CFLAGS (`-mno-avx512f` builds the AVX2 paths on an AVX-512 CPU). The files include their
    headers by path, so a compiler error names the real file and line: it is raised as a
    RuntimeError with the compiler's output."""
    from torch.utils.cpp_extension import load

    return load(
        name=name or f"pdserve_kernels_{_machine_tag(csrc)}",
        sources=sorted(str(path) for path in csrc.glob("*.cpp")),
        extra_include_paths=[str(csrc)],
        extra_cflags=CFLAGS + (cflags or []),
        extra_ldflags=["-fopenmp"],
        build_directory=None if build_directory is None else str(build_directory),
    )


def load_kernels() -> Any:
    """The compiled module, building it on first call; None where it cannot be built or is
    disabled."""
    global _module, _tried
    with _lock:
        if not _tried:
            _tried = True
            if os.environ.get("PDSERVE_KERNELS", "1") != "0":
                try:
                    _module = build()
                # no compiler, no headers, an unknown CPU: torch ops do the work
                except Exception as error:
                    log.warning("CPU kernels unavailable (%s); using torch ops", error)
        return _module


def _module_for(x: torch.Tensor) -> Any:
    """The compiled module where it applies to `x` (a CPU tensor in fp32 or bf16), else None."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    return load_kernels()


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    scales: Scales | None = None,
) -> torch.Tensor | None:
    """Attention of `query [B, KVH, G, D]` (a decode row's query heads grouped by KV head) over keys
    0..lengths[b]-1 of the paged cache `k_cache`/`v_cache [NB, KVH, BS, D]`: key t of row b is at
    offset t % BS of block block_tables[b, t // BS] (`block_tables [B, MAXB]` int64; entries past
    ceil(lengths[b] / BS) are padding, never read). Returns `[B, KVH, G, D]`, bit for bit what the
    row's keys laid out contiguously give, or None when the kernel does not apply (not CPU, another
    dtype, no compiler): `paged_decode_attention_torch` does the work then. An 8-bit cache comes
    with its `scales`."""
    module = _module_for(query)
    if module is None:
        return None
    if scales is not None:
        return module.decode_attention_kv8(
            query.contiguous(),
            k_cache,
            v_cache,
            *scales,
            block_tables.contiguous(),
            lengths.contiguous(),
            query.shape[-1] ** -0.5,
        )  # [B, KVH, G, D]
    return module.decode_attention(
        query.contiguous(),
        k_cache,
        v_cache,
        block_tables.contiguous(),
        lengths.contiguous(),
        query.shape[-1] ** -0.5,
    )  # [B, KVH, G, D]


def prompt_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    starts: torch.Tensor,
    firsts: torch.Tensor,
    counts: torch.Tensor,
    scales: Scales | None = None,
) -> torch.Tensor | None:
    """Causal attention of prompt chunks over the paged cache, where the blocks lie: chunk c's
    `counts[c]` tokens are rows `firsts[c]`.. of `query [N, KVH, G, D]`, at positions `starts[c]`..,
    and its keys those of the blocks `block_tables[c]` names (`[C, MAXB]` int64), a token seeing
    every key up to its own position. Returns `[N, KVH, G, D]`, or None when the kernel does not
    apply (not CPU, another dtype, no compiler, a head dim that is not a multiple of 4): the
    caller gathers each chunk's blocks for SDPA then. An 8-bit cache comes with its `scales`."""
    module = _module_for(query)
    if module is None or not module.prompt_attention_available(query.shape[3]):
        return None
    if scales is not None:
        return module.prompt_attention_kv8(
            query.contiguous(),
            k_cache,
            v_cache,
            *scales,
            block_tables.contiguous(),
            starts,
            firsts,
            counts,
            query.shape[-1] ** -0.5,
        )  # [N, KVH, G, D]
    return module.prompt_attention(
        query.contiguous(),
        k_cache,
        v_cache,
        block_tables.contiguous(),
        starts,
        firsts,
        counts,
        query.shape[-1] ** -0.5,
    )  # [N, KVH, G, D]


def paged_decode_attention_torch(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    scales: Scales | None = None,
) -> torch.Tensor:
    """`decode_attention` in torch ops, on any device: gathers every row's MAXB blocks and masks
    keys t >= lengths[b], one SDPA call for the batch. It reads (and copies) MAXB * BS keys per row
    however short the row, and sums in SDPA's order: close to the kernel, not bit for bit. An
    8-bit cache's gathered rows are dequantized with their `scales` into the query's dtype.
    `query [B, KVH, G, D]` -> `[B, KVH, G, D]`, contiguous."""
    batch, kv_heads, _, dim = query.shape
    block_size = k_cache.shape[2]
    device = query.device
    block_tables = block_tables.to(device)
    lengths = lengths.to(device)
    max_blocks = block_tables.shape[1]
    # padding entries may hold any value (-1, NB): point them at block 0 so the gather stays in
    # bounds (an out-of-range index is a device assert on CUDA); the mask hides what they bring
    used = torch.arange(max_blocks, device=device) * block_size < lengths[:, None]  # [B, MAXB]
    tables = torch.where(used, block_tables, torch.zeros_like(block_tables))  # [B, MAXB]
    span = max_blocks * block_size
    visible = torch.arange(span, device=device) < lengths[:, None]  # [B, MAXB BS]

    def gather(cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        rows = cache[tables]  # [B, MAXB, KVH, BS, D]
        if scale is not None:
            rows = dequantize(rows, scale[tables], query.dtype)  # [B, MAXB, KVH, BS, D]
        rows = rows.transpose(1, 2).reshape(batch, kv_heads, span, dim)  # [B, KVH, MAXB BS, D]
        # Past a row's length lies whatever the pool holds (never-written memory may be NaN), and
        # the mask alone does not hide it: NaN + -inf is NaN in a score, 0 * NaN in the output.
        # The gather made a copy: zero it there.
        rows.masked_fill_(~visible[:, None, :, None], 0)  # [B, KVH, MAXB BS, D]
        return rows.to(query.dtype)  # [B, KVH, MAXB BS, D]

    k_scale, v_scale = (None, None) if scales is None else scales
    attn = F.scaled_dot_product_attention(
        query, gather(k_cache, k_scale), gather(v_cache, v_scale), attn_mask=visible[:, None, None]
    )  # [B, KVH, G, D]
    # CUDA's SDPA may hand back a strided view; callers view the result as [B, H, D]
    return attn.contiguous()  # [B, KVH, G, D]


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, norm: Any) -> torch.Tensor:
    """`norm(x + delta)` for the RMSNorm module `norm`, adding `delta` into `x [N, hidden]` in place
    (the residual stream); without a delta, `norm(x)`."""
    module = _module_for(x)
    if module is None:
        if delta is not None:
            x += delta  # [N, hidden]
        return norm(x)  # [N, hidden]
    return module.add_rms_norm(x, delta, norm.weight, norm.eps)  # [N, hidden]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_and_cache(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    scales: Scales | None = None,
) -> torch.Tensor:
    """Rotate the q and k heads of `qkv [N, H + 2 KVH, D]` by `cos`, `sin [N, 1, D]`, write k and v
    into `k_cache`/`v_cache [S, KVH, C, D]` at (slots[n], positions[n]); return the rotated q `[N,
    H, D]`. An 8-bit cache takes each k and v row quantized (`workers/kv_quant.py`), its scale
    into `scales [S, KVH, C]` at the same place: the kernel and the torch ops write the same
    bytes."""
    module = _module_for(qkv)
    if module is not None and scales is not None:
        # [N, H, D]
        return module.rope_and_cache_kv8(
            qkv, cos, sin, k_cache, v_cache, *scales, slots, positions, num_heads
        )
    if module is not None and k_cache.dtype == qkv.dtype:
        # [N, H, D]
        return module.rope_and_cache(qkv, cos, sin, k_cache, v_cache, slots, positions, num_heads)
    num_kv_heads = k_cache.shape[1]
    qk = qkv[:, : num_heads + num_kv_heads]
    v = qkv[:, num_heads + num_kv_heads :]  # [N, H+KVH, D], [N, KVH, D]
    qk = qk * cos + rotate_half(qk) * sin  # [N, H+KVH, D]: q and k rotate in one pass
    if scales is not None:
        for rows, cache, scale in (
            (qk[:, num_heads:], k_cache, scales[0]),
            (v, v_cache, scales[1]),
        ):
            values, row_scales = quantize(rows, cache.dtype)  # [N, KVH, D], [N, KVH]
            cache[slots, :, positions] = values
            scale[slots, :, positions] = row_scales
        return qk[:, :num_heads]  # [N, H, D]
    k_cache[slots, :, positions] = qk[:, num_heads:].to(k_cache.dtype)
    v_cache[slots, :, positions] = v.to(v_cache.dtype)
    return qk[:, :num_heads]  # [N, H, D]


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of `gate_up [N, 2 I]`, the two halves side by side: `[N, I]`."""
    module = _module_for(gate_up)
    if module is None:
        gate, up = gate_up.chunk(2, dim=-1)  # [N, I] each
        return F.silu(gate) * up  # [N, I]
    return module.silu_mul(gate_up)  # [N, I]


def lora_add(
    out: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    slot_of: torch.Tensor,
    ranks: torch.Tensor,
    firsts: torch.Tensor,
) -> bool:
    """Add to `out [N, O]`, a fused projection of `x [N, I]`, each token's LoRA update in one call
    (`csrc/lora.cpp`): token n of slot `slot_of[n]` (-1: the base model's) gains, for each module
    m of the projection (columns `firsts[m]..firsts[m + 1]`), `B[s, :r, cols].T @ (A[s, m R : m R
    + r] @ x[n])` with `r = ranks[s, m]`; `a [S, M R, I]`, `b [S, R, O]`. False where the kernel
    does not apply: `LoraBatch.add` does the work with torch ops then."""
    module = _module_for(x)
    if module is None or not out.is_contiguous():
        return False
    module.lora_add(out, x.contiguous(), a, b, slot_of, ranks, firsts)
    return True


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x [M, K], weight [N, K], bias)`, through the packed-weight kernel where this CPU
    has one for x's dtype (AVX-512 or AVX2 for fp32, AVX512-BF16 for bf16), and in bf16 on a CPU
    with AMX (while `LIBRARY_BF16_ON_AMX` holds) through oneDNN's AMX tiles over a copy of the
    weight in oneDNN's blocked layout (`_onednn_linear`).

    Either copy (as much memory again as the weight) is made on first use and kept as an attribute
    of `weight`, tagged with the weight's version counter: writing into the weight (a state dict
    loaded into it, or into a view of it) makes the next call pack it again (a weight made in
    inference mode has no version counter: it is packed once). A packed quantized weight
    (`workers/quantized.py`) multiplies itself."""
    if not isinstance(weight, torch.Tensor):
        return weight.linear(x, bias)  # [M, N]
    module = _module_for(x)
    bf16 = x.dtype == torch.bfloat16
    if module is not None and bf16 and x.dim() == 2 and LIBRARY_BF16_ON_AMX and module.amx_bf16():
        return _onednn_linear(x, weight, bias)
    if (
        module is None
        or x.dim() != 2
        or not module.packed_linear_available(bf16)
        or (bf16 and x.shape[1] % 2)
    ):
        return F.linear(x, weight, bias)
    version = _version(weight)
    packed = getattr(weight, "_pdserve_packed", None)
    if packed is None or packed[0] != version:
        n, k = weight.shape
        panels = F.pad(weight.detach(), (0, 0, 0, -n % 64)).view(-1, 64, k)  # [P, 64, K]
        if bf16:  # k pairs side by side: [P, K/2, 64, 2]
            panels = panels.view(-1, 64, k // 2, 2).transpose(1, 2)
        else:
            panels = panels.transpose(1, 2)  # [P, K, 64]
        packed = (version, panels.contiguous())
        weight._pdserve_packed = packed
    return module.packed_linear(x.contiguous(), packed[1], bias, weight.shape[0])  # [M, N]


# the batch oneDNN lays a reordered weight out for: a decode step's rows. It is a hint, not a
# limit (any number of rows multiplies by the copy), and at this one the results equal torch's
# own bf16 matmul's for the embedded model's shapes from 1 to 288 rows (oneDNN 3.12; beyond, it
# blocks some shapes differently for the plain and the reordered weight)
_ONEDNN_ROWS = 64


def _onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """bf16 `F.linear` on oneDNN's AMX tiles over the weight reordered once into oneDNN's blocked
    layout, as vLLM's CPU backend does: torch's matmul reorders the plain weight on every call,
    which at a decode step's few rows costs as much as the multiply (1.3-2.6x the time at 1-256
    rows, and at the 49,152-row vocabulary projection). Where this torch has no oneDNN linear:
    F.linear."""
    version = _version(weight)
    reordered = getattr(weight, "_pdserve_onednn", None)
    if reordered is None or reordered[0] != version:
        try:
            copy = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _ONEDNN_ROWS)
        except (AttributeError, RuntimeError) as error:
            log.warning("no oneDNN linear in this torch (%s); using F.linear", error)
            copy = None
        reordered = (version, copy)
        weight._pdserve_onednn = reordered
    if reordered[1] is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), reordered[1], bias, "none", [], "")


def _version(weight: torch.Tensor) -> int:
    """The weight's version counter (-1 for an inference tensor: it keeps none)."""
    return -1 if weight.is_inference() else weight._version
