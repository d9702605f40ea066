"""Speculative decoding's draft model on a worker: a small model of the served model's vocabulary,
with its own paged KV over the same block tables, proposing each speculating request's drafts."""

from __future__ import annotations

import logging
from typing import Any

import torch

from scheduler.plan import Chunk
from scheduler.speculation import SpeculativeConfig
from workers.kv_cache import PagedKVCache
from workers.model import BatchLayout, DecoderLM

log = logging.getLogger(__name__)


class Drafter:
    """The draft model and a KV cache of its own with the served model's blocks: block b of a
    request's table holds the draft model's KV of the same positions as the served model's block b.
    The planner allots a chunk's blocks for its drafts, so the draft model writes only where the
    request may; which positions it holds KV for, the planner tracks (`Request.num_drafted`).

    Its drafts are its greedy choices. A draft is a proposal the served model's own sample must
    equal to be taken (`ModelRunner._verify`), so every output, greedy or seeded, is the token
    decoding without drafts gives; a better draft model is only taken more often."""

    def __init__(self, model: DecoderLM, num_blocks: int, block_size: int) -> None:
        self.model = model.eval()
        weight = model.model.embed_tokens.weight
        self.device = weight.device
        spec = model.spec
        self.cache = PagedKVCache.for_model(model, num_blocks, block_size)
        self.num_forwards = 0  # draft-model forwards run, for profiling
        log.info(
            "draft model: %d layers, %.1f MiB of KV in %d blocks",
            spec.num_layers,
            self.cache.total_bytes / 2**20,
            num_blocks,
        )

    @staticmethod
    def bytes_per_token(model: DecoderLM) -> int:
        """The draft model's KV bytes for one position (its cache has the served model's blocks)."""
        spec = model.spec
        dtype = model.model.embed_tokens.weight.dtype
        return PagedKVCache.bytes_per_token(
            spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype
        )

    @torch.inference_mode()
    def propose(self, chunks: list[tuple[Chunk, int]]) -> list[list[int]]:
        """The drafts of each (chunk, its first token): as many as the chunk's PROPOSED tokens.
        The first forward reads what the draft model has not seen of each request (the chunk's
        `draft_context`, then its token) and proposes each request's first draft; each further
        forward feeds the drafts just proposed, one per request still wanting more."""
        rows = [
            (c.block_table, [*c.draft_context, token], c.start_pos - len(c.draft_context))
            for c, token in chunks
        ]
        # rows of one token go in as decode rows, the rest as prompt chunks
        order = sorted(range(len(rows)), key=lambda i: len(rows[i][1]) > 1)
        num_decode = sum(len(rows[i][1]) == 1 for i in order)
        last = self._greedy([rows[i] for i in order], num_decode)
        drafts: list[list[int]] = [[] for _ in chunks]
        for i, token in zip(order, last, strict=True):
            drafts[i].append(token)
        wanted = [len(c.draft) for c, _ in chunks]
        for step in range(1, max(wanted)):
            more = [i for i, k in enumerate(wanted) if k > step]
            feed = [
                (chunks[i][0].block_table, [drafts[i][-1]], chunks[i][0].start_pos + step)
                for i in more
            ]
            for i, token in zip(more, self._greedy(feed, len(feed)), strict=True):
                drafts[i].append(token)
        return drafts

    def _greedy(self, rows: list[tuple[list[int], list[int], int]], num_decode: int) -> list[int]:
        """One forward of the rows through the draft model: each row's greedy next token."""
        input_ids, layout = BatchLayout.pack(rows, num_decode, self.cache.block_size, self.device)
        ends = torch.tensor([len(r[1]) for r in rows], device=self.device).cumsum(0) - 1
        logits = self.model(input_ids, layout, self.cache, ends)
        self.num_forwards += 1
        return logits.argmax(dim=-1).tolist()


def load_draft_model(
    speculative: SpeculativeConfig | None, served: DecoderLM, dtype: str, device: str
) -> DecoderLM | None:
    """The draft model `speculative` names, loaded as the served model is (its dtype and device,
    with the draft's own `quantization`); None without one. ValueError if its vocabulary is not
    the served model's."""
    if speculative is None or not speculative.drafts_with_model:
        return None
    from workers.loader import load_model

    assert speculative.model is not None
    draft = load_model(speculative.model, dtype, device, speculative.quantization).model
    check_vocabulary(draft, served, speculative.model)
    return draft


def draft_kv_bytes_per_token(speculative: SpeculativeConfig | None, dtype: str, device: str) -> int:
    """The bytes a position of the draft model's KV takes (0 without one), from its config alone:
    what the workers' pools are sized with."""
    if speculative is None or not speculative.drafts_with_model:
        return 0
    from workers.loader import kv_bytes_per_token, load_tokenizer

    assert speculative.model is not None
    return kv_bytes_per_token(load_tokenizer(speculative.model), dtype, device)


def check_vocabulary(draft: Any, served: Any, name: str) -> None:
    """A draft's token ids must mean the served model's: the same vocabulary size (the tokenizer's
    ids are the embedding's rows)."""
    if draft.spec.vocab_size != served.spec.vocab_size:
        raise ValueError(
            f"draft model {name} has a vocabulary of {draft.spec.vocab_size} tokens, the served "
            f"model {served.spec.vocab_size}: a draft model must share the served model's "
            "tokenizer"
        )
