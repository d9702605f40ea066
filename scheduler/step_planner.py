"""Decode-first, token-budgeted, chunked-prefill scheduling policy over one worker's KV blocks."""

from __future__ import annotations

import bisect
import itertools
import time
from collections import OrderedDict
from collections.abc import Iterable

from scheduler.block_pool import BLOCK_SIZE, BlockPool
from scheduler.block_tables import BlockTables
from scheduler.messages import Samples
from scheduler.plan import Chunk, StepPlan, StepUpdate, WaitingEntry
from scheduler.request import FinishReason, LoraRef, Request, RequestStatus, TokenLogprob
from scheduler.speculation import PROPOSED, NgramIndex, SpeculativeConfig
from scheduler.worker_copy import WorkerCopy


class StepPlanner:
    """Plans steps for one worker's KV blocks and consumes the tokens the worker sampled.

    Each `plan()`: admit waiting requests (most urgent priority, then oldest) while one of the
    `num_slots` slots (vLLM's max_num_seqs) and the blocks of their first chunk are free; give every
    decoding request one token (a new block each `block_size` tokens; when none is left, the least
    urgent request is preempted and recomputed later); spend what is left of `token_budget` on
    chunks of at most `prefill_chunk` tokens for requests still computing their prompt
    (`_prefill_order`). `update()` takes the sampled tokens, applies stop conditions and returns the
    finished requests (their slots and blocks are free).

    With `prefix_caching`, every full block whose tokens are known is named by its hash chain as
    soon as it is planned: a new request whose prompt starts with named blocks points its table at
    them instead of computing them (prompt blocks and generated ones alike).

    With `speculative`, a decoding request whose last token is known carries draft tokens in its
    decode chunk (n-gram proposals, or placeholders the worker's draft model fills in) while fewer
    than `disable_by_batch_size` requests decode: the worker verifies them in the step and
    `update()` takes the accepted run, then gives back the positions (and blocks) of rejected
    drafts. A request with a token in flight is not planned again until its result is in, so its
    next chunk can speculate."""

    def __init__(
        self,
        num_slots: int,
        capacity: int,
        token_budget: int = 256,
        prefill_chunk: int = 128,
        max_waiting: int | None = None,
        max_preemptions: int = 2,
        decodes: bool = True,
        num_blocks: int | None = None,
        block_size: int = BLOCK_SIZE,
        prefix_caching: bool = False,
        speculative: SpeculativeConfig | None = None,
        max_loras: int | None = None,
    ) -> None:
        limits = {
            "num_slots": (num_slots, 1),
            "capacity": (capacity, 1),
            "token_budget": (token_budget, 1),
            "prefill_chunk": (prefill_chunk, 1),
            "max_waiting": (max_waiting or 0, 0),
            "max_preemptions": (max_preemptions, 0),
        }
        for name, (value, least) in limits.items():
            if value < least:
                raise ValueError(f"{name} must be >= {least}, got {value}")
        self.max_preemptions = max_preemptions
        # False on a prefill worker: a prompt that sampled its first token leaves
        self.decodes = decodes
        self.num_preemptions = 0  # preemptions so far
        self.num_recomputed_tokens = 0  # cached tokens those preemptions threw away
        self.peak_running = 0  # the most requests running at once (reset with the counters)
        self.num_slots = num_slots
        self.capacity = capacity
        self.token_budget = token_budget
        self.prefill_chunk = prefill_chunk
        self.max_waiting = max_waiting
        self.free_slots: list[int] = list(range(num_slots))
        # prompts prefilling elsewhere -> the slot and the blocks their KV is imported into
        self.reserved: dict[str, tuple[int, list[int]]] = {}
        # handed-off prompts: their leading positions this worker held already (cached blocks), so
        # their import skips them
        self.held: dict[str, int] = {}
        # handed-off requests whose import no step result has confirmed yet: until then their
        # blocks are not named (cached) and forks do not share them, for the import may fail
        self.importing: set[str] = set()
        # reservations given back for want of blocks since the caller last took them
        # (`take_dropped_reservations`): what was imported into them is void
        self.dropped_reservations: list[str] = []
        self.waiting: list[WaitingEntry] = []  # sorted by admission key
        self.running: list[Request] = []  # most urgent, then oldest (re-sorted by every plan)
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        # what the worker holds per request: each chunk sends only what it lacks
        self.worker_copy = WorkerCopy()
        self._order = itertools.count()
        if num_blocks is None:  # room for every slot's whole context, as a slot cache has
            num_blocks = num_slots * -(-capacity // block_size)
        if num_blocks * block_size < capacity:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {block_size} tokens "
                f"({num_blocks * block_size} tokens): fewer than one request of max_model_len "
                f"{capacity} needs; give it more memory or lower max_model_len"
            )
        self.blocks = BlockPool(num_blocks, block_size)
        self.prefix_caching = prefix_caching
        self.tables = BlockTables(self.blocks, prefix_caching)
        self.speculative = speculative
        self.max_loras = max_loras  # LoRA adapters running at once, at most
        # the adapters the worker holds, least recently used first, as it keeps them (its plans
        # name them in this order): what routing prefers a worker for
        self.adapters: OrderedDict[LoraRef, None] = OrderedDict()
        self.num_adapter_loads = 0  # adapters the worker read for a step (not held then)
        self.ngrams: dict[str, NgramIndex] = {}  # per speculating request: its n-gram index
        self.draft_lens: dict[str, int] = {}  # per request: the drafts its next chunk may carry
        self.spec_stats = SpecStats(speculative.num_speculative_tokens if speculative else 0)

    # ---- admission
    def check(self, request: Request) -> None:
        """Raise ValueError if the request can never run here; nothing is changed."""
        if request.req_id in self.requests:
            raise ValueError(f"request id {request.req_id!r} is already in use")
        self.check_fits(request, self.capacity)

    @staticmethod
    def check_batch(requests: list[Request], capacity: int) -> None:
        """Raise ValueError for the first request of a batch that can never run (an id used twice in
        it, or too long for a slot), before any of them is submitted."""
        seen: set[str] = set()
        for request in requests:
            if request.req_id in seen:
                raise ValueError(f"request id {request.req_id!r} is already in use")
            seen.add(request.req_id)
            StepPlanner.check_fits(request, capacity)

    @staticmethod
    def check_fits(request: Request, capacity: int) -> None:
        """Raise ValueError if the request has run to its end already (its state would be taken
        for progress: submit a new Request), or, with both numbers, if prompt + max_tokens exceed
        a slot's capacity."""
        if request.status is RequestStatus.FINISHED:
            raise ValueError(
                f"request {request.req_id!r} has already run (finished: "
                f"{request.finish_reason.value if request.finish_reason else 'unknown'}); "
                "submit a new Request"
            )
        needed = len(request.prompt_ids) + request.max_tokens
        if needed > capacity:
            raise ValueError(
                f"request {request.req_id!r}: prompt ({len(request.prompt_ids)} tokens) plus "
                "max_tokens "
                f"({request.max_tokens}) is {needed}, over the context limit of {capacity} tokens"
            )

    def submit(self, request: Request) -> None:
        """Queue a request. Raises ValueError for a request that cannot run or a full queue."""
        self.check(request)
        if self.max_waiting is not None and len(self.waiting) >= self.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests)")
        request.status = RequestStatus.WAITING
        self.requests[request.req_id] = request
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        entry = WaitingEntry(request.priority, request.arrival_s, next(self._order), request)
        bisect.insort(self.waiting, entry, key=lambda e: (e.priority, e.arrival_s, e.order))

    # ---- planning
    def plan(self, max_admit: int | None = None) -> StepPlan:
        """Admit what fits, at most `max_admit` requests (preempting for more urgent ones), then
        plan one step (see the class docstring)."""
        preempted: list[str] = []
        copies: list[tuple[int, int]] = []
        index = 0
        admit = len(self.waiting) if max_admit is None else max_admit
        blocked = False  # a request found no room: only those with a reserved slot pass it
        while index < len(self.waiting) and admit > 0:
            request = self.waiting[index].request
            if request.req_id in preempted or blocked and request.req_id not in self.reserved:
                # preempted by this plan for a more urgent one: not back before the next (a step in
                # flight may still carry a chunk of the slot it had); or behind one that waits
                index += 1
                continue
            sibling = self._fork_source(request)
            if (
                sibling is not None
                and (
                    sibling.slot is None
                    or sibling.num_computed < len(request.prompt_ids) - 1
                    or sibling.req_id in self.importing
                )
                or sibling is None
                and self.prefix_caching
                and self.tables.should_wait(request, self.running)
            ):
                # its prefix is being computed here: copying it soon beats computing it again
                index += 1
                continue
            if not self._adapter_fits(request):  # its adapter waits for one running to end
                index += 1
                continue
            reserved = self.reserved.get(request.req_id)
            room = True
            while reserved is None and not (
                self.free_slots
                and self.tables.to_admit(request, self.prefill_chunk, not self.running)
                <= self.blocks.num_free
            ):
                victim = self.victim(request)
                if victim is None and self._drop_a_reservation():
                    continue
                room = victim is not None
                if not room:
                    break
                self._preempt(victim)
                preempted.append(victim.req_id)
            if not room:
                # a handed-off request behind it may hold the slot it lacks (reserved while its
                # prompt was prefilled, before this one arrived): it still goes in
                blocked = True
                index += 1
                continue
            self.waiting.pop(index)
            admit -= 1
            if request.scheduled_s is None:
                request.scheduled_s = time.perf_counter()
            if reserved is None:
                request.slot = self.free_slots.pop(0)
            else:
                request.slot, request.block_table = self.reserved.pop(request.req_id)
            request.status = RequestStatus.RUNNING
            request.num_admissions += 1
            self.running.append(request)
            if request.num_computed:  # its KV is imported by the step that runs its first chunk
                self.importing.add(request.req_id)
            if sibling is not None and sibling.slot is not None:
                copies += self.tables.share_prompt(sibling, request)
            elif (
                self.prefix_caching
                and not request.num_computed
                and not request.wants_prompt_logprobs
            ):
                self.tables.match_prefix(request)
            elif self.prefix_caching and reserved is None:  # a handoff: import what is not here
                self.held[request.req_id] = self.tables.match_held(request, request.num_computed)
            # a handed-off prompt: blocks for the KV it imports
            self.tables.grow(request, request.num_computed)
        # prompt chunks: most urgent, then oldest
        self.running.sort(key=lambda r: (r.priority, r.arrival_s))
        self.peak_running = max(self.peak_running, len(self.running))

        budget = self.token_budget
        decode: list[Chunk] = []
        speculate = self._speculating()
        for request in list(self.running):
            if (
                budget
                and self.decodes
                and request.status is RequestStatus.RUNNING
                and request.is_decoding
                and request.num_outputs_planned < request.max_tokens
                and not (speculate and request.num_pending)  # its result first, then drafts
            ):
                draft = self._draft(request, budget) if speculate else []
                if draft and not self.tables.grow(request, request.num_computed + 1 + len(draft)):
                    draft = []  # drafts never preempt: without room the chunk decodes alone
                if not self._grow_or_preempt(request, request.num_computed + 1, preempted):
                    continue
                chunk = self._chunk(request, 1)
                if draft:
                    chunk.token_ids += draft
                    chunk.draft = tuple(draft)
                    if draft[0] == PROPOSED:  # what the draft model has yet to see, it reads first
                        start = request.num_drafted
                        chunk.draft_context = tuple(request.token_ids(start, chunk.start_pos))
                decode.append(chunk)
                budget -= chunk.num_tokens
        prefill: list[Chunk] = []
        for request in self._prefill_order():
            if not budget:
                break
            # a prefill worker computes whatever is uncomputed (a recompute's last known token too),
            # but never a token still being sampled: that request leaves with its handoff
            waits = request.is_decoding if self.decodes else request.num_pending > 0
            running = request.status is RequestStatus.RUNNING  # (not preempted in this plan)
            if running and not waits and request.num_uncomputed > 0:
                wanted = min(request.num_uncomputed, self.prefill_chunk, budget)
                length = self.tables.fit(request, wanted)
                while not length and self._drop_a_reservation():
                    length = self.tables.fit(request, wanted)
                # every running prompt holds blocks and none can grow: the least urgent other one
                # gives its blocks back (and is recomputed later), or nothing would ever run. Not
                # while another has a token in flight: that step may finish it and free its
                # blocks, and preempting it would throw its work away (two requests could take
                # turns at that forever)
                while (
                    not length
                    and not decode
                    and not prefill
                    and len(self.running) > 1
                    and not any(r.num_pending for r in self.running if r is not request)
                ):
                    victim = max(
                        (r for r in self.running if r is not request),
                        key=lambda r: (r.priority, r.arrival_s),
                    )
                    self._preempt(victim)
                    preempted.append(victim.req_id)
                    length = self.tables.fit(request, wanted)
                if length:
                    prefill.append(self._chunk(request, length))
                    budget -= length
        for chunk in decode + prefill:
            if chunk.lora is not None:
                self._use_adapter(chunk.lora)
        exports = []
        # planned is as good as computed: the next plan may follow at once
        for chunk in decode + prefill:
            request = self.requests[chunk.req_id]
            request.num_computed += chunk.num_tokens
            request.num_pending += chunk.sample
            # blocks matched in the cache or shared with a sibling go out with the first piece
            if not self.decodes:
                exports.append(
                    (
                        chunk.req_id,
                        list(request.block_table),
                        request.num_exported,
                        request.num_computed,
                    )
                )
                request.num_exported = request.num_computed
        if self.prefix_caching:
            for request in self.running:
                if request.req_id not in self.importing:
                    self.tables.name_full_blocks(request)
        # an empty plan is not sent
        forgotten = self.worker_copy.take_forgotten() if decode or prefill else []
        return StepPlan(
            decode=decode,
            prefill=prefill,
            preempted=preempted,
            forget=forgotten,
            copies=copies,
            exports=exports,
        )

    def _use_adapter(self, lora: LoraRef) -> None:
        if lora not in self.adapters:
            self.num_adapter_loads += 1
        self.adapters[lora] = None
        self.adapters.move_to_end(lora)
        while self.max_loras is not None and len(self.adapters) > self.max_loras:
            self.adapters.popitem(last=False)

    def holds(self, lora: LoraRef) -> bool:
        """Whether the worker holds a LoRA adapter, or will for a request queued here."""
        return lora in self.adapters or any(r.lora == lora for r in self.requests.values())

    def _adapter_fits(self, request: Request) -> bool:
        """`max_loras`: a request of a LoRA adapter no running request uses is admitted only while
        fewer than `max_loras` adapters run (a worker holds that many at once)."""
        if request.lora is None or self.max_loras is None:
            return True
        running = {r.lora for r in self.running if r.lora is not None}
        return request.lora in running or len(running) < self.max_loras

    def _speculating(self) -> bool:
        """Whether this plan's decode chunks carry drafts: speculation is on and the batch small."""
        config = self.speculative
        if config is None or not self.decodes:
            return False
        limit = config.disable_by_batch_size
        return limit is None or len(self.running) < limit

    def _draft(self, request: Request, budget: int) -> list[int]:
        """The drafts of a decoding request whose last token is known: at most its draft length,
        the budget left after its own token, the outputs max_tokens leaves after the one sampled,
        and the positions its context has left. The n-gram proposal, or as many PROPOSED tokens
        for the worker's draft model to fill in."""
        config = self.speculative
        assert config is not None
        known = request.num_tokens
        if request.num_pending or request.num_computed != known - 1:
            return []
        k = min(
            self.draft_lens.get(request.req_id, config.num_speculative_tokens),
            budget - 1,
            request.max_tokens - request.num_outputs_planned - 1,
            self.capacity - known,
        )
        if k <= 0:
            return []
        if config.drafts_with_model:
            return [PROPOSED] * k
        index = self.ngrams.get(request.req_id)
        if index is None or len(index.tokens) > known:
            index = NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max)
            self.ngrams[request.req_id] = index
        index.extend(request.token_ids(len(index.tokens), known))
        return index.propose(k)

    def _prefill_order(self) -> list[Request]:
        """Running requests in the order their prompts get chunks: most urgent, then oldest, but of
        each priority only the oldest prompt needing more than one chunk goes ahead of shorter ones
        (one long one at most, not all)."""
        long = {id(r): r for r in self.running if r.num_uncomputed > self.prefill_chunk}
        # the oldest long prompt of each priority
        first = {r.priority: r for r in reversed(long.values())}
        return sorted(
            self.running, key=lambda r: (r.priority, id(r) in long and first[r.priority] is not r)
        )

    def _fork_source(self, request: Request) -> Request | None:
        """n > 1: the sibling here with the same prompt, whose prompt KV this request
        (with an empty cache) copies instead of computing it; it waits while the sibling's prompt is
        not computed."""
        if (
            request.fork_of is None
            or request.num_computed
            or len(request.prompt_ids) < 2
            or request.wants_prompt_logprobs
        ):  # echo: its own prompt positions must be computed
            return None
        sibling = self.requests.get(request.fork_of)
        return sibling if sibling is not None and sibling.prompt_ids == request.prompt_ids else None

    def reserve(self, req_id: str, num_tokens: int, names: list[bytes] | None = None) -> bool:
        """Keep a slot and the blocks of `num_tokens` positions for a prompt prefilling on another
        worker (its KV is imported into them piece by piece, and it takes them when it is handed off
        here), if more slots are free than requests wait and the blocks leave the watermark. The
        prompt's leading blocks this worker has cached (`names`: its full blocks' names) are taken
        as they are: their positions are `held` and not imported."""
        if req_id in self.reserved or len(self.free_slots) <= len(self.waiting):
            return req_id in self.reserved
        # the prompt's positions: all but the first output token's
        matched = self.tables.held_blocks(names or [], num_tokens - 1)
        needed = self.blocks.blocks_for(num_tokens) - len(matched)
        if needed + self.tables.watermark > self.blocks.num_free:
            self.blocks.free_blocks(matched)
            return False
        blocks = self.blocks.allocate(needed)
        assert blocks is not None
        self.reserved[req_id] = (self.free_slots.pop(), matched + blocks)
        self.held[req_id] = len(matched) * self.blocks.block_size
        return True

    def unreserve(self, req_id: str) -> None:
        if (reserved := self.reserved.pop(req_id, None)) is not None:
            slot, blocks = reserved
            bisect.insort(self.free_slots, slot)
            self.blocks.free_blocks(blocks)
            self.held.pop(req_id, None)

    def _chunk(self, request: Request, length: int) -> Chunk:
        assert request.slot is not None, f"{request.req_id} is running without a slot"
        start = request.num_computed
        sample = start + length == request.num_tokens + request.num_pending
        params, history = self.worker_copy.send(request, sample)
        num_prompt = len(request.prompt_ids)
        targets: tuple[int, ...] = ()
        if request.wants_prompt_logprobs:
            targets = tuple(request.prompt_ids[start + 1 : min(start + length + 1, num_prompt)])
        return Chunk(
            req_id=request.req_id,
            block_table=list(request.block_table),
            token_ids=request.token_ids(start, start + length),
            start_pos=start,
            sample=sample,
            output_index=request.num_outputs_planned,
            sampling=params,
            history=history,
            prompt_targets=targets,
            admission=request.num_admissions,
            lora=request.lora,
        )

    # ---- making room when blocks run short: a reservation given back first, then the least
    # urgent running request preempted (and recomputed later by the one recompute path)
    def can_preempt_for_waiting(self) -> bool:
        """A waiting request could preempt a running one: the most urgent one can whenever any
        can."""
        return bool(self.waiting) and self.victim(self.waiting[0].request) is not None

    def victim(self, candidate: Request) -> Request | None:
        """The running request to preempt for `candidate`: strictly less urgent, preempted fewer
        than `max_preemptions` times (so a stream of urgent requests cannot starve it), the least
        urgent of those, then the one with the most work left."""
        preemptible = [
            r
            for r in self.running
            if r.priority > candidate.priority and r.num_preemptions < self.max_preemptions
        ]
        if not preemptible:
            return None
        return max(
            preemptible,
            key=lambda r: (r.priority, r.max_tokens - r.num_outputs_planned + r.num_uncomputed),
        )

    def _grow_or_preempt(self, request: Request, num_tokens: int, preempted: list[str]) -> bool:
        """`tables.grow`, preempting the least urgent running requests while the pool is short;
        False if `request` itself was the least urgent (it is preempted then)."""
        while not self.tables.grow(request, num_tokens):
            if self._drop_a_reservation():
                continue
            victim = max(self.running, key=lambda r: (r.priority, r.arrival_s))
            self._preempt(victim)
            preempted.append(victim.req_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        """Free its slot and blocks now; it waits again and, readmitted, recomputes prompt + output
        so far (what of it is still cached, it finds there)."""
        self._free_slot(request)
        self.num_preemptions += 1
        self.num_recomputed_tokens += request.num_computed
        request.reset_cache()
        request.num_preemptions += 1
        # what the worker sampled for it in flight is void: resend
        self.worker_copy.forget(request.req_id)
        self._enqueue(request)

    def _drop_a_reservation(self) -> bool:
        """Give back the latest reservation of a prompt still prefilling elsewhere (it imports
        its KV whole when it is handed off): a running request that cannot grow, or a waiting one
        that can preempt none, goes before a prompt that may not arrive for a while (or, with the
        prefill pool waiting on this worker's queue, ever). A prompt handed off already keeps its
        own: it goes in next. False if there is none to give back."""
        req_id = next((r for r in reversed(self.reserved) if r not in self.requests), None)
        if req_id is None:
            return False
        self.unreserve(req_id)
        self.dropped_reservations.append(req_id)
        return True

    def take_dropped_reservations(self) -> list[str]:
        dropped, self.dropped_reservations = self.dropped_reservations, []
        return dropped

    # ---- results
    def update(
        self,
        plan: StepPlan,
        sampled: dict[str, int],
        logprobs: dict[str, TokenLogprob] | None = None,
        prompt_logprobs: dict[str, list[TokenLogprob]] | None = None,
        more: dict[str, list[int]] | None = None,
        more_logprobs: dict[str, list[TokenLogprob]] | None = None,
    ) -> StepUpdate:
        """Record a planned step's results: the tokens taken and the requests that finished in it.
        `sampled` maps req_id to the token sampled for each chunk with `sample=True`; `logprobs` to
        its log-probs, for requests that asked; `prompt_logprobs` to those of the chunk's
        `prompt_targets`; `more` to the tokens after the first that a chunk with drafts accepted
        (its drafts that matched, then one more), `more_logprobs` to theirs. Chunks of requests
        that left meanwhile (finished, aborted or preempted while the step ran, even if they have a
        slot here again) are ignored; so is the token a later step in flight samples for a request
        that finished in this one, and whatever follows a stop inside an accepted run."""
        finished: list[Request] = []
        accepted: dict[str, list[int]] = {}
        now = time.perf_counter()
        for chunk in plan.chunks:
            request = self.requests.get(chunk.req_id)
            if (
                request is None
                or request.status is not RequestStatus.RUNNING
                or chunk.admission != request.num_admissions
            ):
                continue
            if (
                chunk.start_pos + chunk.num_tokens > request.num_computed
                or chunk.output_index != len(request.output_ids)
                and chunk.sample
            ):
                raise RuntimeError(
                    f"{chunk.req_id}: a result for positions {chunk.start_pos}+{chunk.num_tokens}, "
                    f"output {chunk.output_index}, that was never planned"
                )
            if (
                chunk.prompt_targets
                and prompt_logprobs
                and chunk.req_id in prompt_logprobs
                and len(request.prompt_logprobs) >= chunk.start_pos
            ):
                # index i: prompt token i + 1; a recompute's repeats are dropped
                known = request.prompt_logprobs
                known += prompt_logprobs[chunk.req_id][len(known) - chunk.start_pos :]
            if not chunk.sample:
                continue
            tokens = [sampled[chunk.req_id]] + (more or {}).get(chunk.req_id, [])
            token_logprobs = []
            if logprobs and chunk.req_id in logprobs:
                token_logprobs = [logprobs[chunk.req_id]] + (more_logprobs or {}).get(
                    chunk.req_id, []
                )
            request.num_pending -= 1
            if chunk.draft:  # its KV holds the accepted drafts; the rejected ones' is void
                self._verified(request, chunk, len(tokens) - 1)
            taken = accepted[chunk.req_id] = []
            for i, token in enumerate(tokens):
                taken.append(token)
                if i < len(token_logprobs):
                    request.logprobs.append(token_logprobs[i])
                request.output_ids.append(token)
                # a block planned before this token was known is full now
                if self.prefix_caching and request.req_id not in self.importing:
                    self.tables.name_full_blocks(request)
                request.token_times_s.append(now)
                if request.first_token_s is None:
                    request.first_token_s = now
                if token in request.stop_token_ids:
                    self.finish(request.req_id, FinishReason.STOP)
                elif len(request.output_ids) >= request.max_tokens:
                    self.finish(request.req_id, FinishReason.LENGTH)
                if request.finished:
                    finished.append(request)
                    break
        return StepUpdate(accepted, finished)

    def take(self, plan: StepPlan, samples: Samples) -> StepUpdate:
        """`update` with what a worker's step gave back, whole."""
        return self.update(
            plan,
            samples.tokens,
            samples.logprobs,
            samples.prompt_logprobs,
            samples.more,
            samples.more_logprobs,
        )

    def _verified(self, request: Request, chunk: Chunk, num_accepted: int) -> None:
        """A chunk's drafts were verified, `num_accepted` of them taken: count them, set the next
        draft length (halved when none was taken, one more when all were, up to k), and give back
        the positions of the rejected ones (their KV is past the request's length: the next tokens
        write over it) and the blocks only they were in."""
        config = self.speculative
        assert config is not None
        self.spec_stats.add(len(chunk.draft), num_accepted)
        k = len(chunk.draft)
        if num_accepted == 0:  # proposals failing: fewer drafts (down to 1) for this request
            k = max(1, k // 2)
        elif num_accepted == k:  # all right: one more, up to num_speculative_tokens
            k = min(k + 1, config.num_speculative_tokens)
        self.draft_lens[request.req_id] = k
        request.num_computed = chunk.start_pos + 1 + num_accepted
        if chunk.draft[0] == PROPOSED:
            # the draft model read the chunk's token and its drafts but the last: the accepted of
            # those are the request's
            request.num_drafted = chunk.start_pos + 1 + min(num_accepted, len(chunk.draft) - 1)
        self.tables.shrink(request, request.num_computed + 1)

    def finish(self, req_id: str, reason: FinishReason, error: str | None = None) -> Request | None:
        """End a request in any state and return its slot; None if it is unknown or already
        ended."""
        if (request := self.detach(req_id)) is not None:
            request.mark_finished(reason, error)
        return request

    def detach(self, req_id: str) -> Request | None:
        """Take a request off this step planner without finishing it (its slot, reserved or not, is
        free at once); the caller moves it on (a finished prompt with its KV, a lost cache to be
        recomputed). None if not here."""
        self.unreserve(req_id)
        request = self.requests.pop(req_id, None)
        if request is None:
            return None
        self.worker_copy.forget(req_id)
        self.ngrams.pop(req_id, None)
        self.draft_lens.pop(req_id, None)
        if request.status is RequestStatus.WAITING:
            self.waiting = [e for e in self.waiting if e.request is not request]
        else:
            self._free_slot(request)
        request.slot = None
        request.status = RequestStatus.WAITING
        return request

    def confirm_import(self, req_id: str) -> None:
        """A step imported a handed-off request's KV whole: its blocks may be cached and shared."""
        self.importing.discard(req_id)

    def _free_slot(self, request: Request) -> None:
        self.importing.discard(request.req_id)
        self.running.remove(request)
        assert request.slot is not None, f"{request.req_id} is running without a slot"
        bisect.insort(self.free_slots, request.slot)
        self.tables.free(request)
        self.held.pop(request.req_id, None)

    def abort(self, req_id: str) -> Request | None:
        """Cancel a request in any state; its slot is free at once."""
        return self.finish(req_id, FinishReason.ABORT)

    # ---- introspection
    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def waiting_requests(self) -> Iterable[Request]:
        return (e.request for e in self.waiting)


class SpecStats:
    """Speculative decoding's counts on one worker, as vLLM names them: chunks that carried
    drafts, draft tokens, the accepted ones, and accepted ones by position in their draft."""

    def __init__(self, k: int) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * k

    def add(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def as_dict(self) -> dict[str, object]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_rate": self.num_accepted_tokens / max(self.num_draft_tokens, 1),
        }

    @staticmethod
    def summed(stats: list[SpecStats]) -> dict[str, object]:
        """Several workers' counts as one (`as_dict`'s form)."""
        total = SpecStats(max((len(s.accepted_per_position) for s in stats), default=0))
        for s in stats:
            total.num_drafts += s.num_drafts
            total.num_draft_tokens += s.num_draft_tokens
            total.num_accepted_tokens += s.num_accepted_tokens
            for i, n in enumerate(s.accepted_per_position):
                total.accepted_per_position[i] += n
        return total.as_dict()


class QueueFullError(ValueError):
    """The waiting queue is at `max_waiting`; the caller should retry later (HTTP 429)."""
