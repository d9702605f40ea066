"""Static slot KV cache: one row per active request, allocated once, exported and imported by
row."""

from __future__ import annotations

import numpy as np
import torch


class SlotKVCache:
    """K and V as `[layers, slots, kv_heads, capacity, head_dim]` tensors, and a prefix-cache pool
    of `num_blocks` blocks of `block_size` positions, `[layers, blocks, kv_heads, block_size,
    head_dim]`.

    A slot holds one request's keys and values at their positions; a position is visible to a query
    only if the query is at or after it, so a slot reused by a new request needs no clearing.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        num_blocks: int = 0,
        block_size: int = 16,
    ) -> None:
        shape = (num_layers, num_slots, num_kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        pool = (num_layers, num_blocks, num_kv_heads, block_size, head_dim)
        self.pool_k = torch.zeros(pool, dtype=dtype, device=device)
        self.pool_v = torch.zeros(pool, dtype=dtype, device=device)
        self.num_slots = num_slots
        self.capacity = capacity
        self.block_size = block_size

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """K and V bytes one token occupies across all layers."""
        return (
            2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        )

    @property
    def total_bytes(self) -> int:
        return 2 * (self.k.numel() + self.pool_k.numel()) * self.k.element_size()

    def load_block(self, block: int, slot: int, start: int) -> None:
        """A pool block into a slot's positions start..start+block_size-1."""
        end = start + self.block_size
        self.k[:, slot, :, start:end] = self.pool_k[:, block]
        self.v[:, slot, :, start:end] = self.pool_v[:, block]

    def save_block(self, slot: int, start: int, block: int) -> None:
        """A slot's positions start..start+block_size-1 into a pool block."""
        end = start + self.block_size
        self.pool_k[:, block] = self.k[:, slot, :, start:end]
        self.pool_v[:, block] = self.v[:, slot, :, start:end]

    def export_rows(self, slot: int, start: int, end: int) -> np.ndarray:
        """Copy positions start..end-1 of a slot out as `[layers, 2, kv_heads, end - start,
        head_dim]`."""
        return self.export_spans([(slot, start, end)])

    def export_spans(self, spans: list[tuple[int, int, int]]) -> np.ndarray:
        """Copy each (slot, start, end) span out, one after another along the token axis of one
        `[layers, 2, kv_heads, tokens, head_dim]` array (one copy, one object for the store however
        many requests a step exported).

        A numpy array, so Ray's object store can hand it to another process without pickling; bf16
        rows travel as their raw 16-bit words.
        """
        total = sum(end - start for _, start, end in spans)
        layers, _, heads, _, dim = self.k.shape
        rows = torch.empty((layers, 2, heads, total, dim), dtype=self.k.dtype, device=self.k.device)
        at = 0
        for slot, start, end in spans:
            rows[:, 0, :, at : at + end - start] = self.k[:, slot, :, start:end]
            rows[:, 1, :, at : at + end - start] = self.v[:, slot, :, start:end]
            at += end - start
        if rows.dtype == torch.bfloat16:  # numpy has no bfloat16: ship the raw 16-bit words
            rows = rows.view(torch.int16)
        return rows.cpu().numpy()

    def copy_rows(self, src: int, dst: int, length: int) -> None:
        """Positions 0..length-1 of slot `src` into slot `dst` (a fork sharing its sibling's
        prompt)."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    def import_rows(self, slot: int, rows: np.ndarray, start: int = 0) -> int:
        """Write exported rows into a slot at positions start..start+length-1; return the length."""
        tensor = torch.from_numpy(np.asarray(rows))
        if self.k.dtype == torch.bfloat16:
            tensor = tensor.view(torch.bfloat16)
        tensor = tensor.to(self.k.device)  # [layers, 2, kv_heads, length, head_dim]
        length = tensor.shape[3]
        if start + length > self.capacity:
            raise ValueError(
                f"rows {start}..{start + length - 1} do not fit a slot of capacity {self.capacity}"
            )
        self.k[:, slot, :, start : start + length] = tensor[:, 0]
        self.v[:, slot, :, start : start + length] = tensor[:, 1]
        return length


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
    num_slots: int,
    capacity: int,
    num_blocks: int,
    block_size: int,
    per_token: int,
    device: torch.device,
    packed_weights: int = 0,
) -> None:
    """Raise MemoryError, with the numbers, if the slots, the prefix-cache pool and the CPU kernels'
    packed weight copies (`packed_weights` bytes, made at the first forward) do not fit in
    memory."""
    slots = num_slots * capacity * per_token
    pool = num_blocks * block_size * per_token
    free = available_bytes(device)
    if free is not None and slots + pool + packed_weights > free:
        raise MemoryError(
            f"the KV cache needs {(slots + pool) / 2**30:.2f} GiB ({num_slots} slots x {capacity} "
            "tokens = "
            f"{slots / 2**30:.2f} GiB, prefix cache {num_blocks * block_size} tokens = "
            f"{pool / 2**30:.2f} GiB, "
            f"{per_token} bytes per token) and the packed weights {packed_weights / 2**30:.2f} "
            "GiB, but "
            f"{device} has {free / 2**30:.2f} GiB available: lower slots, max_model_len or "
            "prefix_cache_tokens"
        )
