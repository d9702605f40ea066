"""Static slot KV cache: one row per active request, allocated once, exported and imported by row."""

from __future__ import annotations

import numpy as np
import torch


class SlotKVCache:
    """K and V as `[layers, slots, kv_heads, capacity, head_dim]` tensors.

    A slot holds one request's keys and values at their positions; a position is visible to a query
    only if the query is at or after it, so a slot reused by a new request needs no clearing.
    """

    def __init__(
        self, num_layers: int, num_slots: int, num_kv_heads: int, capacity: int, head_dim: int,
        dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, num_slots, num_kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots, self.capacity = num_slots, capacity

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """K and V bytes one token occupies across all layers."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def total_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def export_rows(self, slot: int, length: int) -> np.ndarray:
        """Copy positions 0..length-1 of a slot out as `[layers, 2, kv_heads, length, head_dim]`.

        A numpy array, so Ray's object store can hand it to another process without pickling.
        """
        rows = torch.stack((self.k[:, slot, :, :length], self.v[:, slot, :, :length]), dim=1)
        if rows.dtype == torch.bfloat16:  # numpy has no bfloat16: ship the raw 16-bit words
            rows = rows.view(torch.int16)
        return rows.cpu().numpy()

    def copy_rows(self, src: int, dst: int, length: int) -> None:
        """Positions 0..length-1 of slot `src` into slot `dst` (a fork sharing its sibling's prompt)."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    def import_rows(self, slot: int, rows: np.ndarray) -> int:
        """Write exported rows into a slot at positions 0..length-1; return the length."""
        tensor = torch.from_numpy(np.asarray(rows))
        if self.k.dtype == torch.bfloat16:
            tensor = tensor.view(torch.bfloat16)
        tensor = tensor.to(self.k.device)  # [layers, 2, kv_heads, length, head_dim]
        length = tensor.shape[3]
        if length > self.capacity:
            raise ValueError(f"{length} rows do not fit a slot of capacity {self.capacity}")
        self.k[:, slot, :, :length] = tensor[:, 0]
        self.v[:, slot, :, :length] = tensor[:, 1]
        return length
