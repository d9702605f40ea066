"""The block tables of one worker's requests: growing them as tokens are computed, sharing
blocks (cached prefixes, n > 1 forks), naming the full ones, giving them back."""

from __future__ import annotations

from scheduler.block_pool import BlockPool, block_names, common_blocks
from scheduler.request import Request


class BlockTables:
    """Each request's `block_table` over one worker's `BlockPool`. With `prefix_caching`, a full
    block whose tokens are known is named by its hash chain (`name_full_blocks`) and a new request
    starts from the named blocks its prompt begins with (`match_prefix`)."""

    def __init__(self, pool: BlockPool, prefix_caching: bool) -> None:
        self.pool = pool
        self.prefix_caching = prefix_caching
        # blocks kept free at admission so that running requests can grow (vLLM's 1%)
        self.watermark = pool.num_blocks // 100
        self.num_named: dict[str, int] = {}  # per running request: its leading blocks named

    def to_admit(self, request: Request, prefill_chunk: int, alone: bool) -> int:
        """Free blocks a waiting request needs to be admitted: those of its first chunk (or of the
        KV it imports), and the watermark unless it would run `alone` (nothing else can grow then,
        and a request as long as the pool must still run). Cached blocks it would match are not
        counted: admitting it may need fewer."""
        first = request.num_computed or min(request.num_uncomputed, prefill_chunk)
        return self.pool.blocks_for(first) + (0 if alone else self.watermark)

    def grow(self, request: Request, num_tokens: int) -> bool:
        """Extend a request's table to hold positions 0..num_tokens-1; False (nothing taken) if the
        pool is short."""
        missing = self.pool.blocks_for(num_tokens) - len(request.block_table)
        if missing <= 0:
            return True
        blocks = self.pool.allocate(missing)
        if blocks is None:
            return False
        request.block_table += blocks
        return True

    def shrink(self, request: Request, num_tokens: int) -> None:
        """Give back the blocks past those that hold positions 0..num_tokens-1 (rejected drafts':
        never named, for their tokens were never known)."""
        keep = self.pool.blocks_for(num_tokens)
        if len(request.block_table) > keep:
            self.pool.free_blocks(request.block_table[keep:])
            del request.block_table[keep:]

    def fit(self, request: Request, length: int) -> int:
        """The longest prompt chunk of at most `length` tokens whose blocks can be had now."""
        room = len(request.block_table) * self.pool.block_size - request.num_computed
        room += self.pool.num_free * self.pool.block_size
        length = min(length, room)
        if length > 0:
            self.grow(request, request.num_computed + length)
        return max(length, 0)

    def free(self, request: Request) -> None:
        self.pool.free_blocks(request.block_table)
        request.block_table = []
        self.num_named.pop(request.req_id, None)

    def share_prompt(self, sibling: Request, request: Request) -> list[tuple[int, int]]:
        """n > 1: a choice points its table at its sibling's full prompt blocks and copies the last,
        partly filled one, then computes only the last prompt token (which samples its first
        token). Returns the block copy to make before the forward, if any."""
        request.num_computed = len(request.prompt_ids) - 1
        full = request.num_computed // self.pool.block_size
        request.block_table = sibling.block_table[:full]
        self.pool.share(request.block_table)
        if request.num_computed % self.pool.block_size == 0:
            return []
        copy = self.pool.allocate(1)
        if copy is None:  # no block for the copy: compute the partial block instead
            request.num_computed = full * self.pool.block_size
            return []
        request.block_table += copy
        return [(sibling.block_table[full], copy[0])]

    def match_prefix(self, request: Request) -> None:
        """Point a new request's table at the named blocks its prompt starts with. Only blocks
        entirely before its last token: that one must run to sample, and a block in the cache is
        never written again."""
        names = block_names(request, self.pool.block_size)
        usable = (request.num_tokens - 1) // self.pool.block_size
        request.block_table = self.pool.match(names[:usable])
        request.num_computed = len(request.block_table) * self.pool.block_size
        self.num_named[request.req_id] = len(request.block_table)
        self.pool.queried_tokens += request.num_tokens
        self.pool.hit_tokens += request.num_computed
        # a request readmitted after preemption keeps its first count
        if request.num_cached is None:
            request.num_cached = request.num_computed

    def held_blocks(self, names: list[bytes], num_tokens: int) -> list[int]:
        """The cached blocks among the first `num_tokens` positions of a prompt computed on
        another worker (`names`: its full blocks' names), taken: its import skips them."""
        if not self.prefix_caching:
            return []
        return self.pool.match(names[: num_tokens // self.pool.block_size])

    def match_held(self, request: Request, num_tokens: int) -> int:
        """A handed-off request starts its table with its `held_blocks`: returns the positions
        held here."""
        names = block_names(request, self.pool.block_size)
        request.block_table = self.held_blocks(names, num_tokens)
        self.num_named[request.req_id] = len(request.block_table)
        return len(request.block_table) * self.pool.block_size

    def name_full_blocks(self, request: Request) -> None:
        """Name the full blocks of a running request whose tokens are all known (planned counts as
        computed: this worker runs its steps in order)."""
        done = self.num_named.get(request.req_id, 0)
        full = min(request.num_computed, request.num_tokens) // self.pool.block_size
        if full <= done:
            return
        names = block_names(request, self.pool.block_size)
        for i in range(done, full):
            self.pool.name(request.block_table[i], names[i])
        self.num_named[request.req_id] = full

    def should_wait(self, request: Request, running: list[Request]) -> bool:
        """A new request whose leading blocks a running request here is still computing (and the
        pool lacks) waits for them rather than computing them a second time alongside."""
        if request.num_computed or request.wants_prompt_logprobs:
            return False
        names = block_names(request, self.pool.block_size)
        pooled = self.pool.cached_tokens(names) // self.pool.block_size
        for other in running:
            shared = common_blocks(names, block_names(other, self.pool.block_size))
            if shared > pooled and other.num_computed < shared * self.pool.block_size:
                return True
        return False
