"""The block index of one worker's prefix cache: which token blocks its pool holds, and which to
evict.

The worker only copies rows (a slot's block into the pool after a step, a pool block into a slot
before one); every decision is made here, so the scheduler knows exactly what each worker has
cached.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable

from scheduler.request import Request

BLOCK_SIZE = 16  # tokens per cached block


def chain_hashes(tokens: list[int], num_blocks: int, known: list[bytes]) -> list[bytes]:
    """The names of the first `num_blocks` full blocks of `tokens`: block i's name hashes its tokens
    and the name of block i-1, so equal names mean equal prefixes. Extends and returns `known` (a
    prefix of the answer computed before)."""
    while len(known) < num_blocks:
        i = len(known)
        digest = hashlib.blake2b(known[-1] if known else b"", digest_size=16)
        digest.update(
            b",".join(str(t).encode() for t in tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
        )
        known.append(digest.digest())
    return known


def block_names(request: Request) -> list[bytes]:
    """The names of every full block of a request's known tokens (kept on the request)."""
    num_blocks = request.num_tokens // BLOCK_SIZE
    if len(request.block_names) < num_blocks:
        chain_hashes(request.token_ids(0, num_blocks * BLOCK_SIZE), num_blocks, request.block_names)
    return request.block_names[:num_blocks]


def common_blocks(a: list[bytes], b: list[bytes]) -> int:
    """Leading blocks two requests share."""
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


def routing_cost(request: Request, cache: PrefixCache | None, held: Iterable[Request]) -> int:
    """The routing score of a worker for a new prompt, in tokens (lower is better): the uncomputed
    tokens of the requests the worker holds, plus twice the prompt's tokens not cached there. Queued
    work plus the uncached tokens once is what the prompt waits for before its first token; the
    uncached tokens again are the work it adds for every request after it (so a prefix is not
    computed twice to save a little queueing). Cached counts the worker's pool and the prompts it
    holds (what they share with this one is computed by them, and cached, before this one runs)."""
    names, held = block_names(request), list(held)
    shared = max((common_blocks(names, block_names(r)) for r in held), default=0) * BLOCK_SIZE
    pooled = cache.cached_tokens(names) if cache is not None else 0
    uncached = request.num_tokens - min(max(pooled, shared), request.num_tokens - 1)
    return sum(r.num_uncomputed for r in held) + 2 * uncached


def combined_stats(caches: Iterable[dict[str, float]]) -> dict[str, float]:
    """Several workers' cache stats as one line: prompt tokens looked up and served from a pool, the
    hit rate."""
    caches = list(caches)
    queried = sum(c["queried_tokens"] for c in caches)
    hit = sum(c["hit_tokens"] for c in caches)
    return (
        {
            "prefix_queried_tokens": queried,
            "prefix_hit_tokens": hit,
            "prefix_hit_rate": hit / max(queried, 1),
            "prefix_evictions": sum(c["evictions"] for c in caches),
        }
        if caches
        else {}
    )


class PrefixCache:
    """`num_blocks` pool blocks of BLOCK_SIZE tokens, named by their hash chain, evicted least
    recently used.

    Blocks used by the plan being made (matched or saved) are never evicted for it: with a worker's
    steps run in order, a block read by one step and overwritten by a later one is always read
    first.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        # name -> pool block, least recently used first
        self.blocks: OrderedDict[bytes, int] = OrderedDict()
        self.free = list(range(num_blocks))
        self.pinned: set[bytes] = set()  # used by the plan being made
        self.queried_tokens = 0  # prompt tokens looked up at admission
        self.hit_tokens = 0  # of which served from the pool
        self.evictions = 0
        # per running request: its leading blocks that are in the pool
        self.saved: dict[str, int] = {}

    # ---- per request
    def admit(self, request: Request, slot: int) -> list[tuple[int, int, int]]:
        """A request with an empty cache row takes a slot: load its longest cached prefix into the
        slot and mark those tokens computed (all but the last token at most: one must run to
        sample). Returns the loads, (pool block, slot, first position)."""
        tokens = request.token_ids(0, request.num_tokens)
        blocks = self.match(block_names(request))
        request.num_computed = min(len(blocks) * BLOCK_SIZE, len(tokens) - 1)
        # a request readmitted after preemption keeps its first count
        if request.num_cached is None:
            request.num_cached = request.num_computed
        self.queried_tokens += len(tokens)
        self.hit_tokens += request.num_computed
        self.saved[request.req_id] = len(blocks)
        return [(block, slot, i * BLOCK_SIZE) for i, block in enumerate(blocks)]

    def save(self, running: Iterable[Request]) -> list[tuple[int, int, int]]:
        """After planning a step: every block of a running request that this step completes (or an
        earlier one did) and whose tokens are all known goes into the pool. Returns the saves,
        (slot, first position, pool block), to run after the step's forward."""
        saves = []
        for request in running:
            done = self.saved.get(request.req_id, 0)
            full = min(request.num_computed, request.num_tokens) // BLOCK_SIZE
            if full <= done or request.slot is None:
                continue
            names = chain_hashes(request.token_ids(0, full * BLOCK_SIZE), full, request.block_names)
            for i in range(done, full):
                block = self.allocate(names[i])
                if block is not None:
                    saves.append((request.slot, i * BLOCK_SIZE, block))
            self.saved[request.req_id] = full
        self.pinned.clear()
        return saves

    def should_wait(self, request: Request, running: Iterable[Request]) -> bool:
        """A request with an empty row whose leading blocks a running request here is still
        computing (and the pool lacks) waits for them rather than computing them a second time
        alongside."""
        if request.num_computed or request.wants_prompt_logprobs:
            return False
        names = block_names(request)
        pooled = self.cached_tokens(names) // BLOCK_SIZE
        for other in running:
            shared = common_blocks(names, block_names(other)) if names else 0
            if shared > pooled and other.num_computed < shared * BLOCK_SIZE:
                return True
        return False

    def forget(self, req_id: str) -> None:
        """Its cache row is gone (it left, or was preempted: readmitted, it matches the pool
        again)."""
        self.saved.pop(req_id, None)

    # ---- blocks
    def match(self, names: list[bytes]) -> list[int]:
        """Pool blocks of the longest cached prefix of `names` (marked used)."""
        found = []
        for name in names:
            block = self.blocks.get(name)
            if block is None:
                break
            self.blocks.move_to_end(name)
            self.pinned.add(name)
            found.append(block)
        return found

    def cached_tokens(self, names: list[bytes]) -> int:
        """Tokens of the longest cached prefix of `names`, without touching anything (for
        routing)."""
        count = 0
        for name in names:
            if name not in self.blocks:
                break
            count += 1
        return count * BLOCK_SIZE

    def allocate(self, name: bytes) -> int | None:
        """A pool block for a new block `name` (the least recently used one evicted if the pool is
        full); None if it is cached already or every block is in use by this plan."""
        if name in self.blocks:
            self.blocks.move_to_end(name)
            self.pinned.add(name)
            return None
        if not self.free:
            victim = next((n for n in self.blocks if n not in self.pinned), None)
            if victim is None:
                return None
            self.free.append(self.blocks.pop(victim))
            self.evictions += 1
        block = self.free.pop()
        self.blocks[name] = block
        self.pinned.add(name)
        return block

    def reset_counters(self) -> None:
        self.queried_tokens = self.hit_tokens = self.evictions = 0

    def clear(self) -> None:
        """The worker's pool is gone (it restarted): nothing is cached."""
        self.blocks.clear()
        self.free = list(range(self.num_blocks))
        self.pinned.clear()

    def stats(self) -> dict[str, float]:
        return {
            "blocks": self.num_blocks,
            "blocks_used": len(self.blocks),
            "queried_tokens": self.queried_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_rate": self.hit_tokens / max(self.queried_tokens, 1),
            "evictions": self.evictions,
        }
