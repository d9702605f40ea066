"""Executes step plans on a model and its paged KV cache: one flat forward per step, then
sampling."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Any, Protocol

import torch

from scheduler.block_pool import BLOCK_SIZE
from scheduler.messages import Samples
from scheduler.plan import Chunk, StepPlan
from scheduler.request import PENDING
from scheduler.speculation import PROPOSED
from workers.decode_graphs import DecodeGraphs, GraphOptions, graph_reserve_bytes
from workers.drafter import Drafter
from workers.kernels import load_kernels
from workers.kv_cache import PagedKVCache, check_fits
from workers.lora import ResidentLoras
from workers.model import BatchLayout, DecoderLM
from workers.quantized import weight_bytes
from workers.request_state import RequestStates
from workers.sampling import sample, token_logprobs

log = logging.getLogger(__name__)


class Followers(Protocol):
    """Ranks 1..N-1 of a tensor-parallel worker, as rank 0 drives them (`workers/tp_group.py`)."""

    def execute(self, plan: StepPlan) -> Any:
        """Start running `plan` on every follower; returns what `wait` takes."""

    def wait(self, running: Any) -> None:
        """Wait until the followers have run the plan; raises a follower's failure."""


class ModelRunner:
    """Owns a model and a paged KV cache of `num_blocks` blocks of `block_size` tokens (in the
    model's dtype, or 8-bit as `kv_cache_dtype` says), and runs plans on them; with a `drafter`,
    its draft model proposes the drafts the plans leave to it; with `loras`, chunks run with the
    LoRA adapters they name.

    On rank 0 of a tensor-parallel worker, `followers` (`workers/tp_group.py`) are ranks 1..N-1:
    every plan goes to them too, each runs it on its shard, and rank 0 alone samples and answers.

    With `graphs`, decode-only steps run through `DecodeGraphs` (`workers/decode_graphs.py`): CUDA
    graphs on a GPU; on a CPU the same padded step runs eagerly (what tests check the padding
    with). Not on a tensor-parallel worker, whose ranks run steps together: those stay eager.
    """

    def __init__(
        self,
        model: DecoderLM,
        num_blocks: int,
        block_size: int = BLOCK_SIZE,
        tokenizer: Any = None,
        kv_cache_dtype: str = "auto",
        drafter: Drafter | None = None,
        loras: ResidentLoras | None = None,
        followers: Followers | None = None,
        graphs: GraphOptions | None = None,
    ) -> None:
        if model.tp is not None and (drafter is not None or loras is not None):
            raise ValueError(
                "a draft model and LoRA adapters are not served tensor-parallel yet: use "
                "--tensor-parallel-size 1"
            )
        self.model = model.eval()
        self.followers = followers
        self.drafter = drafter  # proposes the drafts of chunks that carry PROPOSED tokens
        self.loras = loras  # the LoRA adapters it holds, and reads when a chunk names another
        weight = model.model.embed_tokens.weight
        self.device = weight.device
        self.dtype = weight.dtype
        spec = model.spec
        local = model.local_spec  # a tensor-parallel rank's KV pool holds its own KV heads
        per_token = PagedKVCache.bytes_per_token(
            local.num_layers, local.num_kv_heads, local.head_dim, self.dtype, kv_cache_dtype
        )
        # build the CPU kernels (once per machine) now, not inside a step; their matmul packs a copy
        # of every float matrix on first use (counted here as every 2-D parameter: the embedding
        # too, when it is not the head); packed quantized weights (`--quantization`) are served as
        # they lie, no copy, and are already resident, so the memory free counts them
        kernels = load_kernels() if self.device.type == "cpu" else None
        packed = (
            0
            if kernels is None
            else sum(p.numel() * p.element_size() for p in model.parameters() if p.dim() == 2)
        )
        if graphs is not None and self.device.type != "cuda" and not graphs.cpu:
            graphs = None
        if graphs is not None and model.tp is not None:
            log.info("CUDA graphs: off on a tensor-parallel worker; its steps run eagerly")
            graphs = None
        capture = graphs is not None and self.device.type == "cuda"
        # the graphs' memory pool, counted before the KV pool takes the device's memory
        reserve = graph_reserve_bytes(model, graphs.max_rows) if capture and graphs else 0
        check_fits(num_blocks, block_size, per_token, self.device, packed + reserve)
        self.cache = PagedKVCache.for_model(
            model, num_blocks, block_size, kv_cache_dtype, scratch_block=graphs is not None
        )
        self.graphs = (
            None if graphs is None else DecodeGraphs(model, self.cache, graphs, capture=capture)
        )
        # seconds inside the model (and the draft model) in the last execute(), for profiling
        self.last_forward_s = 0.0
        # what the last execute() sampled: fed in for PENDING tokens
        self.last_sampled: dict[str, int] = {}
        grammars = (
            None if tokenizer is None else lambda: _grammar_compiler(tokenizer, spec.vocab_size)
        )
        self.states = RequestStates(grammars)  # per request: what penalties count, its grammar
        log.info(
            "KV cache: %d blocks of %d tokens (%d tokens), %s, %d bytes per token, %.2f GiB",
            num_blocks,
            block_size,
            num_blocks * block_size,
            self.cache.dtype_name,
            per_token,
            self.cache.total_bytes / 2**30,
        )
        floats, quantized = weight_bytes(model)
        log.info(
            "weights: %.1f MiB float parameters, %.1f MiB packed quantized, %.1f MiB of kernel "
            "copies at the first forward",
            floats / 2**20,
            quantized / 2**20,
            packed / 2**20,
        )

    def execute(self, plan: StepPlan) -> Samples:
        """`_execute` the plan here and on the followers (ranks 1..N-1), if any."""
        if self.followers is None:
            return self._execute(plan)
        running = self.followers.execute(plan)
        samples = self._execute(plan)
        self.followers.wait(running)
        return samples

    def _execute(self, plan: StepPlan) -> Samples:
        """Run every chunk of the plan in one forward; return the sampled token of each sampling
        chunk and the log-probs chunks asked for.

        A PENDING token is the one this runner sampled for that request in its previous execute()
        (the scheduler planned this step before it knew it). A chunk whose PENDING token this runner
        never sampled (its request's cache was lost here) is dropped: no result comes back for it.
        """
        self.states.drop(plan.forget)
        self.states.remember(plan.chunks)
        for src, dst in plan.copies:
            self.cache.copy_block(src, dst)
        # one-token decode rows first; a decode chunk with drafts runs as a prompt chunk does (its
        # tokens attend to the request's blocks and to one another)
        decode = [
            (c, ids) for c in plan.decode if not c.draft and (ids := self._fed(c)) is not None
        ]
        draft_start = time.perf_counter()
        chunked = self._proposed([c for c in plan.decode if c.draft]) + plan.prefill
        draft_s = time.perf_counter() - draft_start
        fed = decode + [(c, ids) for c in chunked if (ids := self._fed(c)) is not None]
        if not fed:  # (a step that only imports KV, or whose chunks' caches were lost here)
            self.last_sampled = {}
            self.last_forward_s = 0.0
            return Samples()
        chunks = [c for c, _ in fed]
        # flat index of each chunk
        starts = list(itertools.accumulate((c.num_tokens for c in chunks), initial=0))
        sampling = [c for c in chunks if c.sample]
        echo = [(c, start) for c, start in zip(chunks, starts, strict=False) if c.prompt_targets]
        # a sampling chunk's last token samples; one with drafts samples at each of its tokens,
        # those rows after every chunk's own
        logits_indices = [
            start + c.num_tokens - 1 - len(c.draft)
            for c, start in zip(chunks, starts, strict=False)
            if c.sample
        ]
        drafted = [(c, start) for c, start in zip(chunks, starts, strict=False) if c.draft]
        for c, start in drafted:
            logits_indices += range(start + 1, start + c.num_tokens)
        for c, start in echo:  # target i is predicted by the chunk's token i
            logits_indices += range(start, start + len(c.prompt_targets))
        forward_start = time.perf_counter()
        if self._graphed(decode, chunks, logits_indices):
            assert self.graphs is not None
            rows = [(c.block_table, ids[0], c.start_pos) for c, ids in decode]
            logits = self.graphs.run(rows)  # [B, vocab]
        else:
            logits = self._forward(fed, len(decode), logits_indices)  # [M, vocab] or None
        self.last_forward_s = time.perf_counter() - forward_start + draft_s
        tp = self.model.tp
        if logits is None:  # a tensor-parallel rank other than 0: rank 0 samples
            tokens = tp.share_tokens(None, len(sampling), self.device) if sampling else []
            self.last_sampled = {c.req_id: t for c, t in zip(sampling, tokens, strict=True)}
            return Samples()
        samples = Samples()
        if sampling:
            samples.tokens = self._sample(logits[: len(sampling)], sampling, samples)
        row = len(sampling)
        for c, _ in drafted:
            rows = logits[row : row + len(c.draft)]
            row += len(c.draft)
            self._verify(c, rows, samples)
        for c, _ in echo:
            rows = logits[row : row + len(c.prompt_targets)]
            row += len(c.prompt_targets)
            num_top = self.states.params_of(c).prompt_logprobs or 0
            samples.prompt_logprobs[c.req_id] = token_logprobs(
                rows, list(c.prompt_targets), [num_top] * len(rows)
            )
        self.last_sampled = dict(samples.tokens)
        for req_id, more in samples.more.items():
            self.last_sampled[req_id] = more[-1]
        if tp is not None and sampling:  # each request's last token (past any drafts taken)
            last = [self.last_sampled[c.req_id] for c in sampling]
            tp.share_tokens(last, len(sampling), self.device)
        return samples

    def _forward(
        self, fed: list[tuple[Chunk, list[int]]], num_decode: int, logits_indices: list[int]
    ) -> torch.Tensor | None:
        """The eager step: `fed` chunks flattened into one batch, the logits at `logits_indices`
        (None on a tensor-parallel rank other than 0)."""
        input_ids, layout = BatchLayout.pack(
            [(c.block_table, ids, c.start_pos) for c, ids in fed],
            num_decode,
            self.cache.block_size,
            self.device,
        )
        chunks = [c for c, _ in fed]
        if any(c.lora for c in chunks):
            if self.loras is None:
                raise RuntimeError("a plan asks for a LoRA adapter; this worker serves none")
            layout.lora = self.loras.batch([c.lora for c in chunks], [c.num_tokens for c in chunks])
        return self.model(
            input_ids,
            layout,
            self.cache,
            # [M, vocab]
            torch.tensor(logits_indices, dtype=torch.long, device=self.device),
        )

    def _graphed(
        self,
        decode: list[tuple[Chunk, list[int]]],
        chunks: list[Chunk],
        logits_indices: list[int],
    ) -> bool:
        """Whether this step runs as a decode graph: only one-token decode rows, each sampling
        once (no drafts, no prompt log-probs), none with a LoRA adapter, within the graphs'
        rows and table width."""
        if self.graphs is None or len(chunks) != len(decode):
            return False
        if logits_indices != list(range(len(decode))) or any(c.lora for c in chunks):
            return False
        widest = max(len(c.block_table) for c in chunks)
        return self.graphs.fits(len(decode), widest)

    def _proposed(self, chunks: list[Chunk]) -> list[Chunk]:
        """The chunks with drafts, those whose drafts the draft model proposes filled in (copies:
        the plan stays as the scheduler made it)."""
        asked = [c for c in chunks if c.draft[0] == PROPOSED]
        if not asked:
            return chunks
        if self.drafter is None:
            raise RuntimeError("a plan asks for a draft model's drafts; this worker has none")
        drafts = self.drafter.propose([(c, c.token_ids[0]) for c in asked])
        filled = {
            c.req_id: dataclasses.replace(c, token_ids=[c.token_ids[0], *d], draft=tuple(d))
            for c, d in zip(asked, drafts, strict=True)
        }
        return [filled.get(c.req_id, c) for c in chunks]

    def _verify(self, chunk: Chunk, rows: torch.Tensor, samples: Samples) -> None:
        """A chunk's drafts against the model: while the token sampled at a position equals the
        next draft, the draft is taken and the next position samples (with the request's state
        past the tokens taken, and its seed at that output index), so the tokens are exactly those
        decoding one at a time would give. `rows [k, vocab]`: the logits after each draft."""
        params = self.states.params_of(chunk)
        state = self.states.get(chunk.req_id) if params.needs_history else None
        token = samples.tokens[chunk.req_id]
        more: list[int] = []
        logprobs = []
        for i, draft in enumerate(chunk.draft):
            if token != draft:
                break
            index = chunk.output_index + 1 + i
            (token,) = sample(rows[i : i + 1], [params], [index], [state])
            if state is not None:
                state.consume(token)
            more.append(token)
            if params.logprobs is not None:
                logprobs += token_logprobs(rows[i : i + 1], [token], [params.logprobs or 0])
        if more:
            samples.more[chunk.req_id] = more
            if logprobs:
                samples.more_logprobs[chunk.req_id] = logprobs

    def _sample(
        self, logits: torch.Tensor, chunks: list[Chunk], samples: Samples
    ) -> dict[str, int]:
        params = [self.states.params_of(c) for c in chunks]
        states = []
        for c, p in zip(chunks, params, strict=True):
            if c.history is not None:
                self.states.rebuild(c.req_id, p, c.history)
            state = self.states.get(c.req_id) if p.needs_history else None
            if p.needs_history and (state is None or state.num_outputs != c.output_index):
                raise RuntimeError(
                    f"{c.req_id}: no sampling state for output {c.output_index} on this worker"
                )
            states.append(state)
        tokens = sample(logits, params, [c.output_index for c in chunks], states)
        for state, token in zip(states, tokens, strict=True):
            if state is not None:
                state.consume(token)
        asked = [i for i, p in enumerate(params) if p.logprobs is not None]
        if asked:
            lps = token_logprobs(
                logits[asked], [tokens[i] for i in asked], [params[i].logprobs or 0 for i in asked]
            )
            samples.logprobs = {chunks[i].req_id: lp for i, lp in zip(asked, lps, strict=True)}
        return {c.req_id: t for c, t in zip(chunks, tokens, strict=True)}

    def _fed(self, chunk: Chunk) -> list[int] | None:
        """The chunk's tokens with its PENDING one fed in; None if this runner never sampled it."""
        if PENDING not in chunk.token_ids:
            return chunk.token_ids
        token = self.last_sampled.get(chunk.req_id)
        if token is None:
            return None
        return [token if t == PENDING else t for t in chunk.token_ids]


def _grammar_compiler(tokenizer: Any, vocab_size: int) -> Any:
    # its library loads only when a request needs a grammar
    from workers.grammar import GrammarCompiler

    return GrammarCompiler(tokenizer, vocab_size)
