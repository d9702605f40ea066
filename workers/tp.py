"""One rank of a tensor-parallel model: its slice of each weight, and the collectives its forward
runs (Megatron style: column-parallel q/k/v and gate/up, row-parallel o and down, vocab-parallel
embedding and LM head)."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import uuid
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from workers import kernels
from workers.tp_split import RankShard, even_range, rank_shard

# the shared-memory all-reduce's slots (`csrc/shm_reduce.cpp`): a tensor of more bytes (a long
# prompt chunk of a wide model) goes through torch.distributed
SHM_SLOT_BYTES = 4 << 20
# how long a rank waits for the others' partial sums before it gives up (a dead one is noticed
# sooner: its process is gone)
SHM_TIMEOUT_S = 600.0

# our parameter names' endings, by how a rank slices them
_HEAD_ROWS = {"self_attn.q_proj.": "q", "self_attn.k_proj.": "kv", "self_attn.v_proj.": "kv"}
_MLP_ROWS = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
_VOCAB_ROWS = ("model.embed_tokens.weight", "lm_head.weight")
_ROW_PARALLEL = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


class TensorParallel:
    """Rank `shard.rank` of a tensor-parallel group: which part of the model it holds, and the
    process group (`torch.distributed`; None: the default one) its partial sums are reduced over.

    Every rank of a group runs the same forward on the same batch; the row-parallel projections
    (o, down) and the embedding each end in one all-reduce, and rank 0 gathers the logits."""

    def __init__(self, shard: RankShard, group: Any = None) -> None:
        self.shard = shard
        self.group = group
        self.shared: torch.Tensor | None = None  # the shared-memory all-reduce's region
        self._shm_all_reduce: Any = None  # its kernel (`csrc/shm_reduce.cpp`), with the region
        self.pids: torch.Tensor | None = None  # [size]: every rank's process, for that reduce
        self.num_reduces = 0  # shared-memory all-reduces so far (each rank counts the same)
        self._attached = False

    @classmethod
    def for_model(cls, config: Any, tp_size: int, rank: int, group: Any = None) -> TensorParallel:
        """Rank `rank` of `tp_size` of a model of Hugging Face `config`."""
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        shard = rank_shard(
            heads, kv_heads, config.intermediate_size, config.vocab_size, tp_size, rank
        )
        return cls(shard, group)

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def size(self) -> int:
        return self.shard.tp_size

    def local_spec(self, spec: Any) -> Any:
        """The sizes this rank's layers have: its heads, MLP columns and vocab rows."""
        return dataclasses.replace(
            spec,
            num_heads=len(self.shard.q_heads),
            num_kv_heads=len(self.shard.kv_heads),
            intermediate_size=len(self.shard.intermediate),
            vocab_size=len(self.shard.vocab),
        )

    def slice(self, name: str, tensor: torch.Tensor, head_dim: int) -> torch.Tensor:
        """This rank's part of the full tensor `name` (one of our model's parameter names): a view
        where it is one, a copy of zeros for a row-parallel bias off rank 0 (added once)."""
        shard = self.shard
        for part, heads in _HEAD_ROWS.items():
            if part in name:
                kept = shard.q_heads if heads == "q" else shard.kv_heads
                return tensor[kept.start * head_dim : kept.stop * head_dim]
        if name.endswith("self_attn.o_proj.weight"):
            q = shard.q_heads
            return tensor[:, q.start * head_dim : q.stop * head_dim]  # [hidden, local H D]
        if name.endswith("self_attn.o_proj.bias"):
            return tensor if self.rank == 0 else torch.zeros_like(tensor)
        if name.endswith(_MLP_ROWS):
            return tensor[shard.intermediate.start : shard.intermediate.stop]
        if name.endswith("mlp.down_proj.weight"):
            return tensor[:, shard.intermediate.start : shard.intermediate.stop]
        if name in _VOCAB_ROWS:
            return tensor[shard.vocab.start : shard.vocab.stop]
        return tensor  # norms: every rank holds them whole

    def row_amax(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """The largest |w| of each output row `[N]` of parameter `name`, whose rows this rank
        holds `weight [N, K slice]` of: a row-parallel weight's rows are split over the ranks, so
        their maxima are reduced (a collective: every rank calls it for the same names in the same
        order), and each rank quantizes its slice with the whole row's scale, as TP-1 does."""
        amax = weight.detach().float().abs().amax(dim=1)  # [N]
        if name.endswith(_ROW_PARALLEL):
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
        return amax

    def share_tokens(self, tokens: list[int] | None, count: int, device: torch.device) -> list[int]:
        """Rank 0's `tokens` (its `count` samples of a step) on every rank: the others feed them in
        at the next step as rank 0 does (only rank 0 samples). On `device`: NCCL moves no host
        tensors."""
        values = tokens if self.rank == 0 else [0] * count
        shared = torch.tensor(values, dtype=torch.long, device=device)  # [count]
        dist.broadcast(shared, group=self.group, group_src=0)
        return shared.tolist()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial `x` in place: every rank then holds the whole sum, bit for bit
        the same. On the CPU through shared memory (the ranks are one node's: `tp_group.py` pins
        them there), else, or for a tensor too big for its slots, through torch.distributed."""
        if not self._attached:
            self._attach(x.device)
        fits = x.numel() * x.element_size() <= SHM_SLOT_BYTES and x.dtype in (
            torch.float32,
            torch.bfloat16,
        )
        if self.shared is None or not fits:
            dist.all_reduce(x, group=self.group)
            return x
        self.num_reduces += 1
        whole = x.contiguous()
        self._shm_all_reduce(
            whole, self.shared, self.pids, self.rank, self.num_reduces, SHM_TIMEOUT_S
        )
        if whole.data_ptr() != x.data_ptr():
            x.copy_(whole)
        return x

    def _attach(self, device: torch.device) -> None:
        """Map the shared-memory all-reduce's region on every rank (a collective: every rank's
        first all-reduce comes here), where every rank can: a CPU model and the kernels built."""
        self._attached = True
        module = kernels.load_kernels()
        able = module is not None and device.type == "cpu"
        votes = torch.tensor([int(able)], dtype=torch.long)
        dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=self.group)
        if not votes.item():
            return
        size = self.size
        nbytes = 64 * size + 2 * size * SHM_SLOT_BYTES
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        names = [f"{shm}/pdserve-tp-{uuid.uuid4().hex}" if self.rank == 0 else None]
        if self.rank == 0:
            with open(names[0], "wb") as f:
                f.truncate(nbytes)  # zeros: every flag down
        dist.broadcast_object_list(names, group=self.group, group_src=0)
        pids = [0] * size
        dist.all_gather_object(pids, os.getpid(), group=self.group)
        self.shared = torch.from_file(names[0], shared=True, size=nbytes, dtype=torch.uint8)
        self._shm_all_reduce = module.shm_all_reduce
        self.pids = torch.tensor(pids, dtype=torch.long)
        dist.barrier(group=self.group)
        if self.rank == 0:  # mapped by every rank: the name is no longer needed
            os.unlink(names[0])

    def embed(self, table: Any, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of `input_ids [N]` from this rank's rows, `table` (an nn.Embedding or a
        packed one of `[local vocab, hidden]`): each rank looks up the ids it holds, zeros for the
        others, and the sum is the lookup."""
        vocab = self.shard.vocab
        local = input_ids - vocab.start  # [N]
        held = (local >= 0) & (local < len(vocab))  # [N]
        x = table(local.clamp(0, len(vocab) - 1))  # [N, hidden]
        x.masked_fill_(~held[:, None], 0.0)  # [N, hidden]
        return self.all_reduce(x)

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """The whole vocabulary's logits `[M, vocab_size]` on rank 0 from every rank's columns
        `local [M, local vocab]`; None on the others."""
        if self.shared is not None and local.shape[0] * vocab_size * 4 <= SHM_SLOT_BYTES:
            # each rank's columns in place, zeros elsewhere: the sum is the gather, exactly
            whole = local.new_zeros(local.shape[0], vocab_size, dtype=torch.float32)  # [M, V]
            whole[:, self.shard.vocab.start : self.shard.vocab.stop] = local
            self.all_reduce(whole)
            return whole.to(local.dtype) if self.rank == 0 else None
        widths = [len(even_range(vocab_size, self.size, r)) for r in range(self.size)]
        # the ranks' pieces differ by at most one column: each padded to the widest (rank 0's)
        padded = F.pad(local, (0, widths[0] - local.shape[1])).contiguous()  # [M, widest]
        if self.rank != 0:
            dist.gather(padded, group=self.group, group_dst=0)
            return None
        pieces = [torch.empty_like(padded) for _ in widths]  # [M, widest] each
        dist.gather(padded, pieces, group=self.group, group_dst=0)
        # [M, vocab_size]
        return torch.cat([p[:, :n] for p, n in zip(pieces, widths, strict=True)], dim=1)
