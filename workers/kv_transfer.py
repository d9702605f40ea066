"""The KV transfer seam: how a prompt's KV rows leave a prefill worker's blocks and enter a decode
worker's, through one of Ray's transports.

The scheduler decides what moves where (`scheduler/cell/handoffs.py`); this module only moves
bytes. A prefill worker's `KVSender` copies the rows a step plan exports out of its blocks and puts
them with its transport; the `KVPiece`s it returns carry the references and the transport's name.
A decode worker's `KVReceiver` gets each piece with the transport it names and writes the rows
into the blocks of the request's table. Transports:

* `object_store`: Ray's shared-memory object store (numpy arrays, zero-copy on one node, pulled
  across nodes; `prefetch` pulls them ahead). Works everywhere; the default on CPU.
* `nixl` and `cuda_ipc`: Ray Direct Transport. The rows stay in the prefill worker's memory (GPU
  or host) and the decode worker reads them one-sidedly: NIXL over UCX, across nodes, GPU or CPU
  memory; CUDA IPC between two workers sharing one GPU.

A transfer that cannot complete (its owner died, its bytes were lost, it timed out) is reported
per request, never raised: the scheduler's `kv_transfer_failure` policy decides what follows.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from scheduler.messages import KVImport, KVPiece
from workers.kv_cache import PagedKVCache

log = logging.getLogger(__name__)

TRANSPORTS = ("object_store", "nixl", "cuda_ipc")
CHOICES = ("auto", *TRANSPORTS)
# a transfer still not done after this long is reported lost (its request is recomputed)
GET_TIMEOUT_S = 60.0


class TransferLost(Exception):
    """The bytes of a piece cannot be had: its owner died, the object was lost, or it timed out."""


class Transport(Protocol):
    """Puts a step's rows where a decode worker can get them, and gets them there."""

    name: str
    # one object for all the requests a step exported (cheap puts); else one per request, so a
    # reader fetches only its own rows
    batches: bool

    def put(self, rows: torch.Tensor) -> tuple[Any, str]:
        """A reference to `rows` and the name of the transport that carries it."""
        ...

    def get(self, refs: list[Any], timeout_s: float) -> list[torch.Tensor]:
        """The tensors behind `refs`, in order; raises TransferLost."""
        ...

    def prefetch(self, refs: list[Any]) -> None:
        """Bring the bytes nearer ahead of `get` (a no-op where `get` reads the source)."""
        ...


def _ray_lost_errors() -> tuple[type[BaseException], ...]:
    import ray

    return (
        ray.exceptions.ObjectLostError,
        ray.exceptions.OwnerDiedError,
        ray.exceptions.ObjectFetchTimedOutError,
        ray.exceptions.ObjectReconstructionFailedError,
        ray.exceptions.GetTimeoutError,
    )


class ObjectStoreTransport:
    """Ray's object store: the rows as a numpy array (bf16 as its raw 16-bit words), so another
    process on the node maps them without a copy or pickling."""

    name = "object_store"
    batches = True

    def put(self, rows: torch.Tensor) -> tuple[Any, str]:
        import ray

        if rows.dtype == torch.bfloat16:  # numpy has no bfloat16
            rows = rows.view(torch.int16)
        return ray.put(rows.cpu().numpy()), self.name

    def get(self, refs: list[Any], timeout_s: float) -> list[torch.Tensor]:
        import ray

        try:
            arrays = ray.get(refs, timeout=timeout_s)
        except _ray_lost_errors() as error:
            raise TransferLost(type(error).__name__) from error
        with warnings.catch_warnings():  # the shared buffer is read-only; it is only read
            warnings.simplefilter("ignore", UserWarning)
            return [torch.from_numpy(np.asarray(array)) for array in arrays]

    def prefetch(self, refs: list[Any]) -> None:
        import ray

        with contextlib.suppress(Exception):  # lost or late: the import finds out and says so
            ray.get(refs, timeout=GET_TIMEOUT_S)


class DirectTransport:
    """Ray Direct Transport (`ray.put(tensor, _tensor_transport=...)`): the rows stay in the
    prefill worker until the reader fetches them one-sidedly (NIXL, CUDA IPC).

    NIXL reads from a staging pool registered once (`staging_bytes` on the rows' device): a put
    copies the rows into it, and the pool's registration never changes while readers fetch (a
    registration per object races with reads of others). When the pool is full, a step's rows go
    through the object store instead, and their pieces say so.
    """

    batches = False

    def __init__(self, name: str, device: torch.device | None = None, staging_bytes: int = 0):
        self.name = name
        self.fallback = ObjectStoreTransport()
        self.staged = False
        if name == "nixl" and staging_bytes > 0 and device is not None:
            from ray.experimental.rdt import register_nixl_memory_pool

            register_nixl_memory_pool(staging_bytes, device)
            self.staged = True

    def put(self, rows: torch.Tensor) -> tuple[Any, str]:
        import ray

        try:
            return ray.put(rows.contiguous(), _tensor_transport=self.name), self.name
        except Exception as error:
            if type(error).__name__ != "NixlOutOfMemoryError":
                raise
            log.info("NIXL staging pool full: %d bytes go through the object store", rows.nbytes)
            return self.fallback.put(rows)

    def get(self, refs: list[Any], timeout_s: float) -> list[torch.Tensor]:
        import ray

        try:
            return list(ray.get(refs, timeout=timeout_s))
        except _ray_lost_errors() as error:
            raise TransferLost(type(error).__name__) from error
        except (ray.exceptions.RayDirectTransportError, RuntimeError, ValueError) as error:
            log.warning("%s transfer failed", self.name, exc_info=True)
            raise TransferLost(f"{type(error).__name__}: {error}") from error

    def prefetch(self, refs: list[Any]) -> None:
        """Nothing: the rows are read from the prefill worker's memory at import."""


def make_transport(
    name: str, device: torch.device | None = None, staging_bytes: int = 0
) -> Transport:
    """A transport by name; a sender's NIXL one stages its puts in `staging_bytes` on
    `device`."""
    if name == "object_store":
        return ObjectStoreTransport()
    if name in ("nixl", "cuda_ipc"):
        return DirectTransport(name, device, staging_bytes)
    raise ValueError(f"unknown KV transport {name!r}: choose one of {', '.join(CHOICES)}")


# ---- what a worker can use, and what a prefill worker uses with its decode peers


def usable_transports(device: torch.device, requested: str) -> dict[str, str]:
    """Whether this process can use each transport `requested` may pick (name -> "" when it can,
    else the reason). Only those are tried: starting a NIXL agent costs time and threads."""
    reasons = {"object_store": ""}
    reasons["cuda_ipc"] = "" if device.type == "cuda" else f"the worker's device is {device.type}"
    if requested == "nixl" or (requested == "auto" and device.type == "cuda"):
        reasons["nixl"] = _nixl_problem()
    return reasons


def _nixl_problem() -> str:
    """Why this process cannot use NIXL ("" if it can); starts its agent, so puts are warm."""
    try:
        import nixl._api  # noqa: F401
    except ImportError as error:
        return f"NIXL is not installed ({error}); pip install --no-deps nixl nixl-cu12"
    try:
        from ray.experimental.rdt.util import get_tensor_transport_manager

        get_tensor_transport_manager("NIXL").get_nixl_agent()
    except Exception as error:  # the agent's backends fail in many ways; all mean "not here"
        return f"the NIXL agent did not start: {type(error).__name__}: {error}"
    return ""


def choose_transport(requested: str, own: dict[str, Any], peers: list[dict[str, Any]]) -> str:
    """The transport a prefill worker (`own`: what its `ready()` reported) uses for the KV it sends
    to any of its decode `peers` (theirs). `auto`: CUDA IPC when every peer shares its GPU, else
    NIXL when the KV is on a GPU and both sides have it, else the object store. An explicit choice
    that some pair cannot use raises ValueError naming the pair and the reason, and so does a peer
    whose cache holds another dtype than this worker's (`kv_cache_dtype`, or the model's): its
    blocks cannot take these rows."""
    if requested not in CHOICES:
        raise ValueError(f"unknown KV transport {requested!r}: choose one of {', '.join(CHOICES)}")
    ours = own.get("kv_cache", {}).get("dtype")
    for peer in peers:
        theirs = peer.get("kv_cache", {}).get("dtype")
        if theirs != ours:
            raise ValueError(
                f"decode worker {peer.get('index')} keeps its KV cache in {theirs}, prefill "
                f"worker {own.get('index')} in {ours}: the workers of a cell must share one "
                "kv_cache_dtype and dtype"
            )

    def why_not(name: str, peer: dict[str, Any]) -> str:
        for side, place in (("prefill", own), ("decode", peer)):
            reason = place.get("transports", {}).get(name, "not reported")
            if reason:
                return f"{side} worker {place.get('index')}: {reason}"
        if name == "cuda_ipc" and not _same_gpu(own, peer):
            return (
                f"decode worker {peer.get('index')} is not on prefill worker "
                f"{own.get('index')}'s GPU (CUDA IPC needs both on one GPU)"
            )
        return ""

    if requested == "auto":
        on_gpu = str(own.get("device", "cpu")).startswith("cuda")
        for name in ("cuda_ipc", "nixl") if on_gpu else ():
            if peers and not any(why_not(name, peer) for peer in peers):
                return name
        return "object_store"
    for peer in peers:
        if reason := why_not(requested, peer):
            raise ValueError(f"kv_transport {requested} cannot be used: {reason}")
    return requested


def _same_gpu(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        a.get("node_id") == b.get("node_id")
        and bool(a.get("gpu_ids"))
        and a.get("gpu_ids") == b.get("gpu_ids")
    )


# ---- the two halves


class KVSender:
    """A prefill worker's half: each step's exported rows out of its blocks, put with its
    transport. A piece holds every KV head: a tensor-parallel worker's `rows` gathers them from
    its ranks (`workers/tp_group.py`)."""

    def __init__(
        self,
        cache: PagedKVCache,
        transport: Transport,
        rows: Callable[[list[tuple[list[int], int, int]]], torch.Tensor] | None = None,
    ) -> None:
        self.cache = cache
        self.transport = transport
        # (block table, first, end) spans -> `[layers, 2, every KV head, tokens, width]`
        self.rows = rows or cache.export_spans

    def export(self, exports: list[tuple[str, list[int], int, int]]) -> list[KVPiece]:
        """A piece per (request, block table, first, end) span; the spans of a step share one
        object where the transport batches."""
        groups = [exports] if self.transport.batches else [[span] for span in exports]
        pieces = []
        for group in groups:
            start = time.perf_counter()
            rows = self.rows([(table, first, end) for _, table, first, end in group])
            ref, carrier = self.transport.put(rows)
            per_token = rows.nbytes // max(1, rows.shape[3])
            export_s = time.perf_counter() - start
            offset = 0
            for req_id, _, first, end in group:
                num_tokens = end - first
                pieces.append(
                    KVPiece(
                        req_id,
                        first,
                        num_tokens,
                        ref,
                        per_token * num_tokens,
                        export_s,
                        offset,
                        carrier,
                    )
                )
                offset += num_tokens
        return pieces


@dataclass
class TransferCounts:
    """What one transport moved into a worker during a call: bytes fetched, seconds spent
    fetching, transfers lost."""

    bytes: int = 0
    seconds: float = 0.0
    failures: int = 0


@dataclass
class ImportReport:
    failed: list[str] = field(default_factory=list)  # requests whose KV could not be had
    import_s: dict[str, float] = field(default_factory=dict)  # final imports: seconds each
    transfers: dict[str, TransferCounts] = field(default_factory=dict)  # per transport


class KVReceiver:
    """A decode worker's half: gets the pieces of each import with their transport and writes
    their rows into the request's blocks. A rank of a tensor-parallel worker writes the rows of its
    own `kv_heads` only (a piece holds every head)."""

    def __init__(
        self,
        cache: PagedKVCache,
        transports: dict[str, Transport] | None = None,
        timeout_s: float = GET_TIMEOUT_S,
        kv_heads: range | None = None,
    ) -> None:
        self.cache = cache
        self.kv_heads = kv_heads
        self.transports = transports or {name: make_transport(name) for name in TRANSPORTS}
        self.timeout_s = timeout_s
        self.fetcher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-prefetch")

    def prefetch(self, pieces: list[KVPiece]) -> None:
        """Pull pieces of prompts still prefilling on another node towards this one, in the
        background; returns at once."""
        by_transport: dict[str, list[Any]] = {}
        for piece in pieces:
            by_transport.setdefault(piece.transport, []).append(piece.ref)
        for name, refs in by_transport.items():
            self.fetcher.submit(self.transports[name].prefetch, refs)

    def import_all(self, imports: list[KVImport]) -> ImportReport:
        """Each import's pieces past what it already imported and past what the worker holds, into
        its blocks; an import whose bytes cannot be had is reported in `failed` and changes no
        block of its request beyond those of pieces already written."""
        report = ImportReport()
        fetched: dict[Any, torch.Tensor] = {}  # a step's pieces may share one object: fetch once
        for item in imports:
            start = time.perf_counter()
            todo = [
                piece
                for piece in item.handoff.pieces[item.handoff.imported :]
                if piece.start + piece.num_tokens > item.held
            ]
            try:
                tensors = self._fetch(todo, fetched, report)
            except TransferLost as error:
                log.warning("KV of %s lost: %s", item.handoff.req_id, error)
                report.failed.append(item.handoff.req_id)
                continue
            for piece, rows in zip(todo, tensors, strict=True):
                position = max(piece.start, item.held)  # the positions before `held` are here
                first = piece.offset + position - piece.start
                rows = rows[:, :, :, first : piece.offset + piece.num_tokens]
                if self.kv_heads is not None:  # [layers, 2, its KV heads, tokens, width]
                    rows = rows[:, :, self.kv_heads.start : self.kv_heads.stop]
                self.cache.import_rows(item.block_table, rows, position)
            if item.final:
                report.import_s[item.handoff.req_id] = time.perf_counter() - start
        return report

    def _fetch(
        self, pieces: list[KVPiece], fetched: dict[Any, torch.Tensor], report: ImportReport
    ) -> list[torch.Tensor]:
        missing: dict[str, dict[Any, KVPiece]] = {}
        for piece in pieces:
            if _key(piece.ref) not in fetched:
                missing.setdefault(piece.transport, {})[_key(piece.ref)] = piece
        for name, by_ref in missing.items():
            counts = report.transfers.setdefault(name, TransferCounts())
            start = time.perf_counter()
            try:
                refs = [piece.ref for piece in by_ref.values()]
                tensors = self.transports[name].get(refs, self.timeout_s)
            except TransferLost:
                counts.failures += 1
                raise
            finally:
                counts.seconds += time.perf_counter() - start
            for key, tensor in zip(by_ref, tensors, strict=True):
                fetched[key] = tensor
                counts.bytes += tensor.nbytes
        return [fetched[_key(piece.ref)] for piece in pieces]


def _key(ref: Any) -> Any:
    """What identifies an object across the copies of its reference that pickling makes."""
    return ref.binary() if hasattr(ref, "binary") else id(ref)
