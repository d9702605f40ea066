"""The paged KV cache: one pool of fixed-size blocks per worker, read and written through block
tables, exported and imported by position."""

from __future__ import annotations

import math
import mmap
from typing import Any

import numpy as np
import torch

from workers.kv_quant import SCALE_BYTES, SCALE_DTYPE, kv_format, row_bytes, storage_dtype

_HUGE_PAGE = 2 << 20


class PagedKVCache:
    """K and V as `[layers, num_blocks, kv_heads, block_size, head_dim]` tensors: one pool of
    blocks, a request's positions in the blocks of its table (position p in block
    `block_table[p // block_size]` at offset `p % block_size`).

    Which block holds what is decided by the scheduler (`scheduler/block_pool.py`); the cache only
    reads and writes the blocks it is told. A position is visible to a query only if the query is at
    or after it, so a block reused by a new request needs no clearing.

    With `kv_cache_dtype` int8 or fp8 (`workers/kv_quant.py`) K and V hold one byte per value, and
    `k_scale`/`v_scale` `[layers, num_blocks, kv_heads, block_size]` (fp16) a scale per row;
    otherwise they are None and K and V are in `dtype`.

    With `scratch_block`, the pool holds one block more, `scratch_block` (= num_blocks), that no
    block table names: the padding rows of a CUDA graph's decode step write there
    (`workers/decode_graphs.py`).
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        num_kv_heads: int,
        block_size: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kv_cache_dtype: str = "auto",
        scratch_block: bool = False,
    ) -> None:
        pool_blocks = num_blocks + 1 if scratch_block else num_blocks
        shape = (num_layers, pool_blocks, num_kv_heads, block_size, head_dim)
        device = torch.device(device)
        storage = storage_dtype(kv_cache_dtype, dtype)
        self.k = _pool(shape, storage, device)
        self.v = _pool(shape, storage, device)
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        self.kv_cache_dtype = kv_format(kv_cache_dtype)  # auto, int8 or fp8
        if self.kv_cache_dtype != "auto":
            self.k_scale = _pool(shape[:-1], SCALE_DTYPE, device)
            self.v_scale = _pool(shape[:-1], SCALE_DTYPE, device)
        self.num_blocks = num_blocks  # the blocks block tables name
        self.scratch_block = num_blocks if scratch_block else None
        self.block_size = block_size

    @classmethod
    def for_model(
        cls,
        model: Any,
        num_blocks: int,
        block_size: int,
        kv_cache_dtype: str = "auto",
        scratch_block: bool = False,
    ) -> PagedKVCache:
        """A cache of `num_blocks` blocks for a DecoderLM: its layers and KV heads, on its device,
        in its dtype (a packed model's: its activations') or 8-bit."""
        spec = model.local_spec  # a tensor-parallel rank keeps its own KV heads only
        weight = model.model.embed_tokens.weight
        return cls(
            spec.num_layers,
            num_blocks,
            spec.num_kv_heads,
            block_size,
            spec.head_dim,
            dtype=weight.dtype,
            device=weight.device,
            kv_cache_dtype=kv_cache_dtype,
            scratch_block=scratch_block,
        )

    @staticmethod
    def bytes_per_token(
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        kv_cache_dtype: str = "auto",
    ) -> int:
        """K and V bytes one token occupies across all layers (8-bit: their scales too)."""
        return 2 * num_layers * num_kv_heads * row_bytes(head_dim, dtype, kv_cache_dtype)

    @property
    def dtype_name(self) -> str:
        """What the cache holds its values as: int8, fp8, or the model's dtype (float32...)."""
        if self.kv_cache_dtype != "auto":
            return self.kv_cache_dtype
        return str(self.k.dtype).removeprefix("torch.")

    @property
    def total_bytes(self) -> int:
        pools = [self.k, self.v, self.k_scale, self.v_scale]
        return sum(p.numel() * p.element_size() for p in pools if p is not None)

    def scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A layer's K and V scales `[num_blocks, kv_heads, block_size]` each (None unless
        8-bit): the kernels take them beside the layer's K and V."""
        if self.k_scale is None or self.v_scale is None:
            return None
        return self.k_scale[layer], self.v_scale[layer]

    def locate(self, block_table: list[int], start: int, end: int) -> tuple[list[int], list[int]]:
        """The (block, offset) of each position start..end-1 of a request with `block_table`."""
        size = self.block_size
        blocks = [block_table[p // size] for p in range(start, end)]
        offsets = [p % size for p in range(start, end)]
        return blocks, offsets

    def copy_block(self, src: int, dst: int) -> None:
        """Block `src` into block `dst` (a fork's copy of its sibling's partly filled block)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]
        if self.k_scale is not None and self.v_scale is not None:
            self.k_scale[:, dst] = self.k_scale[:, src]
            self.v_scale[:, dst] = self.v_scale[:, src]

    def export_spans(self, spans: list[tuple[list[int], int, int]]) -> torch.Tensor:
        """Copy each (block table, start, end) span out, one after another along the token axis of
        one contiguous `[layers, 2, kv_heads, tokens, head_dim]` tensor on the cache's device (one
        copy, one object to send however many requests a step exported). An 8-bit cache's rows
        are bytes, `[layers, 2, kv_heads, tokens, head_dim + 2]`: each row's values, then its fp16
        scale's two bytes."""
        blocks: list[int] = []
        offsets: list[int] = []
        for table, start, end in spans:
            span_blocks, span_offsets = self.locate(table, start, end)
            blocks += span_blocks
            offsets += span_offsets
        index_b = torch.tensor(blocks, device=self.k.device)  # [tokens]
        index_o = torch.tensor(offsets, device=self.k.device)  # [tokens]
        keys = self.k[:, index_b, :, index_o]  # [tokens, layers, kv_heads, head_dim]
        values = self.v[:, index_b, :, index_o]  # [tokens, layers, kv_heads, head_dim]
        if self.k_scale is not None and self.v_scale is not None:
            # [tokens, layers, kv_heads, head_dim + 2] each: the rows as bytes, scales after
            keys = _with_scales(keys, self.k_scale[:, index_b, :, index_o])
            values = _with_scales(values, self.v_scale[:, index_b, :, index_o])
        rows = torch.stack((keys, values), dim=2)  # [tokens, layers, 2, kv_heads, width]
        return rows.permute(1, 2, 3, 0, 4).contiguous()  # [layers, 2, kv_heads, tokens, width]

    def import_rows(
        self, block_table: list[int], rows: torch.Tensor | np.ndarray, start: int = 0
    ) -> int:
        """Write exported rows into a request's blocks at positions start..start+length-1; return
        the length. bf16 rows may come as their raw 16-bit words (as numpy carries them); an 8-bit
        cache takes the bytes `export_spans` gives (values and scale per row)."""
        tensor = torch.as_tensor(rows)
        if self.k.dtype == torch.bfloat16 and tensor.dtype == torch.int16:
            tensor = tensor.view(torch.bfloat16)
        eight_bit = self.k_scale is not None
        width = self.k.shape[-1] + (SCALE_BYTES if eight_bit else 0)
        if tensor.shape[-1] != width or (tensor.dtype == torch.uint8) != eight_bit:
            raise ValueError(
                f"KV rows of {tensor.shape[-1]} {tensor.dtype} elements do not fit a "
                f"{self.kv_cache_dtype} cache of {self.k.dtype} rows of {width}: the prefill and "
                "decode workers must share one kv_cache_dtype"
            )
        tensor = tensor.to(self.k.device)  # [layers, 2, kv_heads, length, width]
        length = tensor.shape[3]
        if start + length > len(block_table) * self.block_size:
            raise ValueError(
                f"rows {start}..{start + length - 1} do not fit a table of {len(block_table)} "
                f"blocks of {self.block_size}"
            )
        blocks, offsets = self.locate(block_table, start, start + length)
        index_b = torch.tensor(blocks, device=self.k.device)  # [length]
        index_o = torch.tensor(offsets, device=self.k.device)  # [length]
        rows_k = tensor[:, 0].permute(2, 0, 1, 3)  # [length, layers, kv_heads, width]
        rows_v = tensor[:, 1].permute(2, 0, 1, 3)  # [length, layers, kv_heads, width]
        pools = ((self.k, self.k_scale, rows_k), (self.v, self.v_scale, rows_v))
        for pool, scale, rows_of in pools:
            if scale is None:
                pool[:, index_b, :, index_o] = rows_of
                continue
            dim = pool.shape[-1]
            pool[:, index_b, :, index_o] = rows_of[..., :dim].view(pool.dtype)
            scale_bytes = rows_of[..., dim:].contiguous()  # [length, layers, kv_heads, 2]
            scale[:, index_b, :, index_o] = scale_bytes.view(scale.dtype)[..., 0]
        return length


def _with_scales(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """8-bit rows `[..., head_dim]` and their fp16 scales `[...]` as bytes `[..., head_dim + 2]`."""
    scale_bytes = scales.contiguous()[..., None].view(torch.uint8)  # [..., 2]
    return torch.cat((values.view(torch.uint8), scale_bytes), dim=-1)  # [..., head_dim + 2]


def _pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed K or V pool. On a CPU it is a mapping of its own, asked for 2 MiB pages where the OS
    has them (Linux's transparent huge pages) and laid from a 2 MiB boundary: a decode row reads
    its keys a block (a few KiB) at a time from anywhere in the pool, and on 4 KiB pages nearly
    every block is a TLB miss (the decode-attention kernel read its KV 0.95-1.10x as fast as on
    4 KiB pages, 12% faster before it prefetched the values:
    `benchmarks/studies/decode_attention.py`). A mapping of its own, because memory from malloc
    may be pages already touched, which stay small. Its pages are zero until written, as
    `torch.zeros`' are."""
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or size == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    # private and anonymous (Python's default is shared, which Linux keeps in 4 KiB pages): each
    # page zero-filled as it is first touched
    memory = mmap.mmap(-1, size + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(memory, dtype=torch.uint8)  # keeps the mapping alive
    skip = -raw.data_ptr() % _HUGE_PAGE
    return raw[skip : skip + size].view(dtype).view(shape)


def available_bytes(device: torch.device) -> int | None:
    """Memory free for new tensors on the device (MemAvailable on a CPU host); None if unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def check_fits(
    num_blocks: int,
    block_size: int,
    per_token: int,
    device: torch.device,
    packed_weights: int = 0,
) -> None:
    """Raise MemoryError, with the numbers, if the KV blocks and the CPU kernels' packed weight
    copies (`packed_weights` bytes, made at the first forward) do not fit in memory."""
    pool = num_blocks * block_size * per_token
    free = available_bytes(device)
    if free is not None and pool + packed_weights > free:
        raise MemoryError(
            f"the KV cache needs {pool / 2**30:.2f} GiB ({num_blocks} blocks of {block_size} "
            f"tokens, {per_token} bytes per token) and the packed weights "
            f"{packed_weights / 2**30:.2f} GiB, but {device} has {free / 2**30:.2f} GiB "
            "available: lower kv_cache_memory (or slots and max_model_len)"
        )
