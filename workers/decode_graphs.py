"""CUDA graphs of decode steps: one per batch-size bucket, captured at start-up and replayed with a
step's rows padded to their bucket."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from workers.kv_cache import PagedKVCache
from workers.model import BatchLayout, DecoderLM

log = logging.getLogger(__name__)

# the buckets past 8 step by 16 up to the largest, as vLLM's default capture sizes do
_SMALL_BUCKETS = (1, 2, 4, 8)
_BUCKET_STEP = 16


@dataclass(frozen=True)
class GraphOptions:
    """What sizes a worker's decode graphs: the most rows a decode step runs (the cell's slots) and
    the longest request (`max_model_len`), which fixes the width of the block tables. Graphs are
    captured on a GPU only; `cpu` runs the same padded steps eagerly on a CPU, which only the
    tests want (it checks the padding; it is slower than a plain step there)."""

    max_rows: int
    max_model_len: int
    cpu: bool = False


def graph_buckets(max_rows: int) -> list[int]:
    """The batch sizes graphs are captured for: 1, 2, 4, 8, then every 16 up to `max_rows`
    (`max_rows` itself the last)."""
    buckets = [b for b in _SMALL_BUCKETS if b < max_rows]
    buckets += range(_BUCKET_STEP, max_rows, _BUCKET_STEP)
    return sorted({*buckets, max_rows})


def graph_reserve_bytes(model: DecoderLM, max_rows: int) -> int:
    """An upper estimate of the memory the graphs' shared pool keeps: the activations of the
    largest bucket's step (fp32 logits, the MLP's gate/up and a few hidden-size tensors live at
    once), so the KV pool is sized with it counted."""
    spec = model.local_spec
    per_row = 2 * spec.intermediate_size + 8 * spec.hidden_size + 2 * spec.vocab_size
    return 4 * max_rows * per_row


class DecodeGraphs:
    """Static input buffers for `max_rows` decode rows, and on a GPU one captured graph per bucket
    of `graph_buckets`. `run` pads a step's rows to their bucket with rows that write only the
    cache's scratch block and are never sampled, copies the inputs in with one host-to-device
    copy, and replays the bucket's graph (`capture=False`: runs the same padded forward eagerly,
    which is how the CPU tests check the padding)."""

    def __init__(
        self,
        model: DecoderLM,
        cache: PagedKVCache,
        options: GraphOptions,
        capture: bool,
    ) -> None:
        if cache.scratch_block is None:
            raise ValueError("decode graphs need a KV cache with a scratch block")
        self.model = model
        self.cache = cache
        self.buckets = graph_buckets(options.max_rows)
        self.width = -(-options.max_model_len // cache.block_size)  # blocks of the longest row
        device = cache.k.device
        rows = self.buckets[-1]
        # the step's inputs in one int64 buffer, so one copy moves them: five fields of `rows`
        # (token id, position, block, offset, keys read), then the block tables `[rows, width]`;
        # each field a contiguous run, as the kernels take them
        size = (5 + self.width) * rows
        self._inputs = torch.zeros(size, dtype=torch.long, device=device)
        pinned = device.type == "cuda"
        self._staging = torch.zeros(size, dtype=torch.long, pin_memory=pinned)
        self._logits_indices = torch.arange(rows, device=device)  # [rows]
        self._outputs: dict[int, torch.Tensor] = {}  # bucket -> its graph's logits [bucket, V]
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_seconds = 0.0
        self._fill_padding(0, rows)
        self._inputs.copy_(self._staging)
        if capture:
            self._capture()

    def fits(self, num_rows: int, max_table: int) -> bool:
        """Whether a step of `num_rows` decode rows whose longest block table has `max_table`
        blocks can run here."""
        return num_rows <= self.buckets[-1] and max_table <= self.width

    def run(self, rows: list[tuple[list[int], int, int]]) -> torch.Tensor:
        """The logits `[B, vocab]` of decode `rows` of (block table, token id, position), their
        K/V written into the cache as an eager step writes them."""
        num_rows = len(rows)
        bucket = next(b for b in self.buckets if b >= num_rows)
        block_size = self.cache.block_size
        fields, tables = self._views(self._staging)
        fields[:, :num_rows] = torch.tensor(
            [
                [token for _, token, _ in rows],
                [position for _, _, position in rows],
                [table[position // block_size] for table, _, position in rows],
                [position % block_size for _, _, position in rows],
                [position + 1 for _, _, position in rows],
            ],
            dtype=torch.long,
        )  # [5, B]
        tables[:num_rows] = torch.tensor(
            [table + [0] * (self.width - len(table)) for table, _, _ in rows], dtype=torch.long
        )  # [B, width]
        self._fill_padding(num_rows, bucket)
        # one copy of the step's inputs (a few hundred KiB at most); from pinned memory it does
        # not wait for the device. The staging buffer is rewritten only by the next step, after
        # this step's sampled ids came back (a sync that orders it after this copy).
        self._inputs.copy_(self._staging, non_blocking=True)
        graph = self._graphs.get(bucket)
        if graph is not None:
            graph.replay()
            return self._outputs[bucket][:num_rows]
        return self._forward(bucket)[:num_rows]

    def _views(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`flat`'s five fields `[5, rows]` and block tables `[rows, width]`."""
        rows = self.buckets[-1]
        return flat[: 5 * rows].view(5, rows), flat[5 * rows :].view(rows, self.width)

    def _fill_padding(self, start: int, end: int) -> None:
        """Staging rows start..end-1 as padding: token 0 at position 0 of the scratch block."""
        scratch = self.cache.scratch_block
        fields, tables = self._views(self._staging)
        fields[:, start:end] = torch.tensor([0, 0, scratch, 0, 1])[:, None]  # it reads its own key
        tables[start:end] = 0
        tables[start:end, 0] = scratch

    def _layout(self, bucket: int) -> tuple[torch.Tensor, BatchLayout]:
        """Views of the static inputs as a decode-only batch of `bucket` rows."""
        fields, tables = self._views(self._inputs)
        ids, positions, blocks, offsets, lengths = fields[:, :bucket]  # [bucket] each
        device = ids.device
        empty = torch.zeros(0, dtype=torch.long)
        layout = BatchLayout(
            positions=positions,
            blocks=blocks,
            offsets=offsets,
            num_decode=bucket,
            decode_tables=tables[:bucket],
            decode_lengths=lengths,
            prefill=[],
            prefill_tables=torch.zeros(0, 0, dtype=torch.long, device=device),
            prefill_starts=empty,
            prefill_firsts=empty,
            prefill_counts=empty,
        )
        return ids, layout

    def _forward(self, bucket: int) -> torch.Tensor:
        input_ids, layout = self._layout(bucket)
        logits = self.model(input_ids, layout, self.cache, self._logits_indices[:bucket])
        assert logits is not None  # graphs run on workers that are not tensor-parallel
        return logits  # [bucket, vocab]

    def _capture(self) -> None:
        """A graph per bucket, the largest first, all in one memory pool (a step runs one at a
        time), each after one eager warm-up run on a side stream as CUDA graphs require."""
        start = time.perf_counter()
        pool = None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(self.buckets[-1])
        torch.cuda.current_stream().wait_stream(stream)
        for bucket in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            self._forward(bucket)  # warm-up: lazy initialisations happen outside the capture
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[bucket] = self._forward(bucket)
            pool = graph.pool()
            self._graphs[bucket] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        log.info(
            "CUDA graphs: %d decode graphs (up to %d rows, tables of %d blocks) captured in "
            "%.1f s; --enforce-eager turns them off",
            len(self._graphs),
            self.buckets[-1],
            self.width,
            self.capture_seconds,
        )
