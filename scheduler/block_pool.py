"""One worker's KV blocks as plain accounting: which block holds what, who uses it, which to evict.

A worker's KV is one pool of fixed-size blocks; a request holds a block table (the blocks of its
positions 0, B, 2B, ... in order). A full block whose tokens are known is named by the hash chain of
its tokens (`chain_hashes`), so a new request whose prefix is named points its table at the same
blocks (refcount + 1) instead of computing them: the prefix cache is the pool itself. A block no
request uses stays named (cached) until a block is needed and it is the least recently used. Every
decision is made here, so the scheduler knows exactly what each worker holds; the worker only reads
and writes the blocks it is told.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable

from scheduler.request import Request

BLOCK_SIZE = 16  # tokens per block unless configured (`--block-size`)


def chain_hashes(
    tokens: list[int],
    num_blocks: int,
    known: list[bytes],
    block_size: int = BLOCK_SIZE,
    salt: bytes = b"",
) -> list[bytes]:
    """The names of the first `num_blocks` full blocks of `tokens`: block i's name hashes its tokens
    and the name of block i-1 (block 0's, `salt`: a LoRA adapter's), so equal names mean equal
    prefixes computed by the same weights. Extends and returns `known` (a prefix of the answer
    computed before)."""
    while len(known) < num_blocks:
        i = len(known)
        digest = hashlib.blake2b(known[-1] if known else salt, digest_size=16)
        block = tokens[i * block_size : (i + 1) * block_size]
        digest.update(b",".join(str(t).encode() for t in block))
        known.append(digest.digest())
    return known


def block_names(request: Request, block_size: int = BLOCK_SIZE) -> list[bytes]:
    """The names of every full block of a request's known tokens (kept on the request, per block
    size: the ingress names blocks of its own size to choose a cell)."""
    num_blocks = request.num_tokens // block_size
    known = request.block_names.setdefault(block_size, [])
    if len(known) < num_blocks:
        tokens = request.token_ids(0, num_blocks * block_size)
        salt = b"" if request.lora is None else request.lora.salt
        chain_hashes(tokens, num_blocks, known, block_size, salt)
    return known[:num_blocks]


def common_blocks(a: list[bytes], b: list[bytes]) -> int:
    """Leading blocks two requests share."""
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


def routing_cost(request: Request, pool: BlockPool | None, held: Iterable[Request]) -> int:
    """The routing score of a worker for a new prompt, in tokens (lower is better): the
    uncomputed tokens of the requests the worker holds, plus twice the prompt's tokens not cached
    there. Queued work plus the uncached tokens once is what the prompt waits for before its first
    token; the uncached tokens again are the work it adds for every request after it (so a prefix
    is not computed twice to save a little queueing). Cached counts the worker's pool and the
    prompts it holds (what they share with this one is computed by them, and cached, before this
    one runs). A pool of None caches nothing."""
    block_size = pool.block_size if pool is not None else BLOCK_SIZE
    names = block_names(request, block_size)
    held = list(held)
    shared_blocks = max((common_blocks(names, block_names(r, block_size)) for r in held), default=0)
    shared = shared_blocks * block_size
    pooled = pool.cached_tokens(names) if pool is not None else 0
    uncached = request.num_tokens - min(max(pooled, shared), request.num_tokens - 1)
    return sum(r.num_uncomputed for r in held) + 2 * uncached


def combined_stats(caches: Iterable[dict[str, float]]) -> dict[str, float]:
    """Several workers' pool stats as one line: their blocks, the most in use at once (and that as
    a share of all); and where prompts were looked up (prefix caching on), the prompt tokens looked
    up and found cached, the hit rate, evictions."""
    caches = list(caches)
    if not caches:
        return {}
    blocks = sum(c["blocks"] for c in caches)
    peak = sum(c["peak_blocks_used"] for c in caches)
    line = {"kv_blocks": blocks, "kv_peak_blocks_used": peak, "kv_peak_usage": peak / blocks}
    queried = sum(c["queried_tokens"] for c in caches)
    if queried:
        hit = sum(c["hit_tokens"] for c in caches)
        line |= {
            "prefix_queried_tokens": queried,
            "prefix_hit_tokens": hit,
            "prefix_hit_rate": hit / queried,
            "prefix_evictions": sum(c["evictions"] for c in caches),
        }
    return line


class BlockPool:
    """`num_blocks` blocks of `block_size` tokens: reference counts, names, and the free ones.

    A block is in use (refcount > 0: in the tables of that many requests), cached (refcount 0 but
    named: a later request may match it) or free. New blocks come from the free ones first, then
    from the cached ones, least recently used first (`evictions` counts those).
    """

    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"a block pool needs num_blocks and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.refs = [0] * num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # popped from the end: 0 first
        self.names: dict[bytes, int] = {}  # name -> block
        self.name_of: dict[int, bytes] = {}  # block -> name
        self.cached: OrderedDict[int, None] = OrderedDict()  # unused named blocks, LRU first
        self.queried_tokens = 0  # prompt tokens looked up at admission
        self.hit_tokens = 0  # of which found cached
        self.evictions = 0
        self.peak_used = 0  # the most blocks in use at once since the counters were reset

    @property
    def num_free(self) -> int:
        """Blocks a request could take now (free, or cached and unused)."""
        return len(self.free) + len(self.cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` positions."""
        return -(-num_tokens // self.block_size)

    # ---- taking and giving back
    def allocate(self, count: int) -> list[int] | None:
        """`count` blocks for new KV (refcount 1, unnamed), or None (nothing taken) if fewer are
        free."""
        if count > self.num_free:
            return None
        blocks = []
        for _ in range(count):
            if self.free:
                block = self.free.pop()
            else:
                block, _ = self.cached.popitem(last=False)
                del self.names[self.name_of.pop(block)]
                self.evictions += 1
            self.refs[block] = 1
            blocks.append(block)
        self.peak_used = max(self.peak_used, self.num_used)
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """One more table points at each of `blocks` (a fork reading its sibling's prompt)."""
        for block in blocks:
            self._take(block)

    def free_blocks(self, blocks: Iterable[int]) -> None:
        """A table lets go of `blocks`: unused ones stay cached if named, else become free."""
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] < 0:
                raise RuntimeError(f"block {block} released more often than taken")
            if self.refs[block] == 0:
                if block in self.name_of:
                    self.cached[block] = None
                else:
                    self.free.append(block)

    def _take(self, block: int) -> None:
        if self.refs[block] == 0:
            self.cached.pop(block)
            self.peak_used = max(self.peak_used, self.num_used)
        self.refs[block] += 1

    # ---- names (the prefix cache)
    def match(self, names: list[bytes]) -> list[int]:
        """The blocks of the longest cached prefix of `names`, each taken (refcount + 1)."""
        found = []
        for name in names:
            block = self.names.get(name)
            if block is None:
                break
            self._take(block)
            found.append(block)
        return found

    def cached_tokens(self, names: list[bytes]) -> int:
        """Tokens of the longest cached prefix of `names`, without taking anything (routing)."""
        count = 0
        for name in names:
            if name not in self.names:
                break
            count += 1
        return count * self.block_size

    def name(self, block: int, name: bytes) -> None:
        """A block in use now holds the full block `name`. If another block has that name already
        (the same tokens computed twice at once), the first keeps it and this one stays unnamed."""
        if name not in self.names and block not in self.name_of:
            self.names[name] = block
            self.name_of[block] = name

    def clear(self) -> None:
        """The worker's KV is gone (it restarted): nothing is cached. Blocks still held (reserved
        for KV that is imported again) stay held."""
        self.free += list(self.cached)
        self.cached.clear()
        self.names.clear()
        self.name_of.clear()

    # ---- figures
    def reset_counters(self) -> None:
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.evictions = 0
        self.peak_used = self.num_used

    def stats(self) -> dict[str, float]:
        return {
            "blocks": self.num_blocks,
            "block_size": self.block_size,
            "blocks_used": self.num_used,
            "blocks_cached": len(self.names),
            "usage": self.num_used / self.num_blocks,
            "peak_blocks_used": self.peak_used,
            "queried_tokens": self.queried_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_rate": self.hit_tokens / max(self.queried_tokens, 1),
            "evictions": self.evictions,
        }
