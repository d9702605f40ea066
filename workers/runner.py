"""Executes step plans on a model and its slot cache: one flat forward per step, then sampling."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time

import torch

from scheduler.plan import Chunk, StepPlan
from scheduler.request import PENDING
from workers.kernels import load_kernels
from workers.kv_cache import SlotKVCache
from workers.model import BatchLayout, DecoderLM
from workers.sampling import sample

log = logging.getLogger(__name__)


class ModelRunner:
    """Owns a model and a slot KV cache sized `num_slots × capacity`, and runs plans on them."""

    def __init__(self, model: DecoderLM, num_slots: int, capacity: int) -> None:
        self.model = model.eval()
        weight = model.model.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        spec = model.spec
        self.cache = SlotKVCache(spec.num_layers, num_slots, spec.num_kv_heads, capacity, spec.head_dim,
                                 dtype=self.dtype, device=self.device)
        per_token = SlotKVCache.bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim, self.dtype)
        if self.device.type == "cpu":
            load_kernels()  # build the decode-attention kernel (once per machine) now, not inside a step
        self.last_forward_s = 0.0  # seconds inside the model in the last execute(), for profiling
        self.last_sampled: dict[str, int] = {}  # what the last execute() sampled: fed in for PENDING tokens
        log.info("KV cache: %d slots x %d tokens, %d bytes per token, %.1f MiB in all",
                 num_slots, capacity, per_token, self.cache.total_bytes / 2**20)

    def execute(self, plan: StepPlan) -> dict[str, int]:
        """Run every chunk of the plan in one forward; return the sampled token of each sampling chunk.

        A PENDING token is the one this runner sampled for that request in its previous execute() (the
        scheduler planned this step before it knew it). A chunk whose PENDING token this runner never
        sampled (its request's cache was lost here) is dropped: no result comes back for it.
        """
        decode = [c for c in map(self._feed, plan.decode) if c is not None]
        chunks = decode + [c for c in map(self._feed, plan.prefill) if c is not None]
        if not chunks:
            self.last_sampled = {}
            return {}
        input_ids, layout = BatchLayout.pack([(c.slot, c.token_ids, c.start_pos) for c in chunks], len(decode),
                                             self.device)
        ends = list(itertools.accumulate(c.num_tokens for c in chunks))  # flat index after each chunk
        logits_indices = [end - 1 for c, end in zip(chunks, ends, strict=True) if c.sample]
        forward_start = time.perf_counter()
        logits = self.model(input_ids, layout, self.cache,
                            torch.tensor(logits_indices, dtype=torch.long, device=self.device))  # [M, vocab]
        self.last_forward_s = time.perf_counter() - forward_start
        sampling_chunks = [c for c in chunks if c.sample]
        tokens = sample(logits, [c.sampling for c in sampling_chunks], [c.output_index for c in sampling_chunks])
        self.last_sampled = {c.req_id: t for c, t in zip(sampling_chunks, tokens, strict=True)}
        return self.last_sampled

    def _feed(self, chunk: Chunk) -> Chunk | None:
        if PENDING not in chunk.token_ids:
            return chunk
        if chunk.req_id not in self.last_sampled:
            return None
        token = self.last_sampled[chunk.req_id]
        return dataclasses.replace(chunk, token_ids=[token if t == PENDING else t for t in chunk.token_ids])
