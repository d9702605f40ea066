"""Bench workloads: random-token prompts (shared prefixes, chat replays) or a JSONL file, output
lengths, Poisson arrivals, urgency."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from scheduler.outputs import Completion
from scheduler.request import LoraRef, Request, SamplingParams


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    arrival_s: list[float]  # offsets from the start (all 0: everything at once)
    urgent: list[bool]  # urgent requests get priority 0, the others 1 (when priorities are on)
    # interference: the steady decoding streams (the others: long prompts)
    steady: tuple[bool, ...] = ()
    long_start_s: float = 0.0  # interference: when the long prompts' Poisson arrivals begin
    # the request each one starts after (its end, not an arrival time)
    after: tuple[int | None, ...] = ()
    # chat: each request continues the turn it starts after; its prompt begins with that turn's
    # prompt and a stand-in reply of that turn's output length, which `next_turns` replaces with
    # the model's reply when that turn ends
    conversation: bool = False
    # per request, the `model` it asks for: a LoRA adapter's name, or None (the served model)
    models: tuple[str | None, ...] = ()

    def at_rate(self, rate: float, seed: int) -> Workload:
        """Poisson arrivals at `rate` (all at once when 0); in an interference workload only the
        long prompts arrive so, from `long_start_s`, and the steady streams all start at 0."""
        if not self.steady:
            return replace(self, arrival_s=poisson_arrivals(len(self.prompts), rate, seed))
        later = iter(poisson_arrivals(self.steady.count(False), rate, seed))
        return replace(
            self, arrival_s=[0.0 if s else self.long_start_s + next(later) for s in self.steady]
        )

    def copy_prompts(self) -> Workload:
        """The same workload with prompt lists of its own (a chat's next turns are written into
        them as the turns before end)."""
        return replace(self, prompts=[list(p) for p in self.prompts])

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    def priorities(self, on: bool) -> list[int]:
        return [0 if (urgent or not on) else 1 for urgent in self.urgent]


def parse_range(text: str) -> tuple[int, int]:
    """'N' or 'MIN:MAX' with 1 <= MIN <= MAX."""
    parts = [int(p) for p in text.split(":")]
    low, high = (parts[0], parts[0]) if len(parts) == 1 else (parts[0], parts[1])
    if len(parts) > 2 or not 1 <= low <= high:
        raise ValueError(f"bad length range {text!r}: use N or MIN:MAX with 1 <= MIN <= MAX")
    return low, high


def parse_list(text: str | None, kind: type, name: str) -> list[Any]:
    """A comma list of numbers ('1,2,4'); a bad item names the flag."""
    try:
        return [kind(x) for x in (text or "").split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{name}: expected a comma list of numbers, got {text!r}") from None


def poisson_arrivals(num_requests: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets of a Poisson process at `rate` requests/s (all 0 when rate is 0)."""
    if rate < 0:
        raise ValueError(f"rate must be >= 0, got {rate}")
    rng = random.Random(f"arrivals-{seed}")
    arrivals = []
    t = 0.0
    for _ in range(num_requests):
        arrivals.append(t)
        t += rng.expovariate(rate) if rate > 0 else 0.0
    return arrivals


def make_workload(
    num_requests: int,
    prompt_len: str,
    output_len: str,
    vocab_size: int,
    seed: int,
    rate: float = 0.0,
    urgent_fraction: float = 0.0,
) -> Workload:
    """Random-token prompts and output lengths drawn uniformly from the ranges, Poisson arrivals at
    `rate` requests/s (0: all at once) and a random `urgent_fraction` of urgent requests,
    reproducibly. The prompts and lengths depend only on the seed, not on the rate."""
    rng = random.Random(seed)
    (p_lo, p_hi) = parse_range(prompt_len)
    (o_lo, o_hi) = parse_range(output_len)
    # keep clear of the special tokens at the start of most vocabularies
    low_id = min(100, vocab_size // 4)
    prompts = [
        [rng.randrange(low_id, vocab_size) for _ in range(rng.randint(p_lo, p_hi))]
        for _ in range(num_requests)
    ]
    output_lens = [rng.randint(o_lo, o_hi) for _ in range(num_requests)]
    urgent = [rng.random() < urgent_fraction for _ in range(num_requests)]
    return Workload(prompts, output_lens, poisson_arrivals(num_requests, rate, seed), urgent)


def shifting_workload(
    num_requests: int, prompt_len: str, output_len: str, vocab_size: int, seed: int
) -> Workload:
    """A mix that moves: the first third prompt-heavy (prompts from the upper half of
    `prompt_len`, outputs from the lower half of `output_len`), the second output-heavy (the
    other halves), the last prompt-heavy again; in that order, so arrivals at a rate follow the
    phases."""
    rng = random.Random(seed)
    p_lo, p_hi = parse_range(prompt_len)
    o_lo, o_hi = parse_range(output_len)
    p_mid = (p_lo + p_hi) // 2
    o_mid = (o_lo + o_hi) // 2
    low_id = min(100, vocab_size // 4)
    prompts, output_lens = [], []
    for i in range(num_requests):
        output_heavy = num_requests // 3 <= i < 2 * num_requests // 3
        prompt = rng.randint(p_lo, p_mid) if output_heavy else rng.randint(p_mid, p_hi)
        output = rng.randint(o_mid, o_hi) if output_heavy else rng.randint(o_lo, o_mid)
        prompts.append([rng.randrange(low_id, vocab_size) for _ in range(prompt)])
        output_lens.append(output)
    return Workload(prompts, output_lens, [0.0] * num_requests, [False] * num_requests)


def shared_prefix_workload(
    num_requests: int,
    groups: int,
    prefix_len: int,
    suffix_len: str,
    output_len: str,
    vocab_size: int,
    seed: int,
    urgent_fraction: float = 0.0,
) -> Workload:
    """`groups` system prompts of `prefix_len` random tokens; each request is one of them (drawn at
    random) followed by its own random suffix, lengths from the ranges, reproducibly."""
    if groups < 1 or prefix_len < 0:
        raise ValueError(
            f"--groups must be >= 1 and --prefix-len >= 0, got {groups} and {prefix_len}"
        )
    rng = random.Random(f"shared-{seed}")
    low_id = min(100, vocab_size // 4)
    prefixes = [
        [rng.randrange(low_id, vocab_size) for _ in range(prefix_len)] for _ in range(groups)
    ]
    suffixes = make_workload(
        num_requests, suffix_len, output_len, vocab_size, seed, urgent_fraction=urgent_fraction
    )
    prompts = [prefixes[rng.randrange(groups)] + suffix for suffix in suffixes.prompts]
    return replace(suffixes, prompts=prompts)


def chat_workload(
    conversations: int, turns: int, turn_len: str, output_len: str, vocab_size: int, seed: int
) -> Workload:
    """A multi-turn chat: turn k of a conversation is sent when turn k-1 ends, its prompt turn
    k-1's prompt, the reply the model gave and a new user message of `turn_len` tokens, so every
    prompt holds the conversation so far, as a chat client sends it. The conversations' first
    turns arrive at the workload's arrival times. Until a turn ends its reply is a stand-in (random
    tokens of its output length), which `next_turns` replaces."""
    if conversations < 1 or turns < 1:
        raise ValueError(f"--groups and --turns must be >= 1, got {conversations} and {turns}")
    rng = random.Random(f"chat-{seed}")
    base = make_workload(conversations * turns, turn_len, output_len, vocab_size, seed)
    low_id = min(100, vocab_size // 4)
    history: list[list[int]] = [[] for _ in range(conversations)]
    prompts = []
    for i, message in enumerate(base.prompts):
        c = i % conversations
        if history[c]:  # the reply to the turn before, as long as that turn's output
            reply_len = base.output_lens[i - conversations]
            history[c] = history[c] + [rng.randrange(low_id, vocab_size) for _ in range(reply_len)]
        history[c] = history[c] + message
        prompts.append(list(history[c]))
    after = tuple(i - conversations if i >= conversations else None for i in range(len(prompts)))
    return replace(base, prompts=prompts, after=after, conversation=True)


def next_turns(
    work: Workload, then: Callable[[Completion], None] = lambda done: None
) -> Callable[[Completion], None]:
    """What a driver calls when a request ends (`on_finish`, called before the requests that
    follow it are sent): for a chat (`conversation`), it rewrites each next turn's prompt in place
    as the ended turn's prompt, the token ids the model replied and the next turn's own message;
    then it calls `then`. The prompts are lists the requests share (`engine_requests`, the HTTP
    client's bodies), so give each run its own copies (`Workload.copy_prompts`)."""
    messages: dict[int, list[int]] = {}
    followers: dict[int, list[int]] = {}
    for i, j in enumerate(work.after):
        if work.conversation and j is not None:
            messages[i] = work.prompts[i][len(work.prompts[j]) + work.output_lens[j] :]
            followers.setdefault(j, []).append(i)

    def on_finish(done: Completion) -> None:
        j = int(done.req_id)
        for i in followers.get(j, []):
            work.prompts[i][:] = work.prompts[j] + list(done.token_ids) + messages[i]
        then(done)

    return on_finish


def interference_workload(
    steady: int,
    steady_prompt_len: str,
    steady_output_len: str,
    num_long: int,
    prompt_len: str,
    output_len: str,
    vocab_size: int,
    seed: int,
    long_start_s: float,
    generations: int = 1,
) -> Workload:
    """`steady` decoding streams (short prompts, long outputs) that all start at once, and
    `num_long` long prompts (short outputs) arriving from `long_start_s` on: what disaggregation is
    for.

    With `generations` > 1 the streams are a steady population: each is followed, when it ends, by a
    new one (request `i + steady` starts after request `i`), up to `generations` in all, for as long
    as long prompts are still to come or running (`ArrivalSchedule` drops the rest). Outputs drawn
    from a range then spread the streams' context lengths, so the decode step stays the same size
    instead of growing with every stream's context at once."""
    if generations < 1:
        raise ValueError(f"generations must be >= 1, got {generations}")
    count = steady * generations
    streams = make_workload(count, steady_prompt_len, steady_output_len, vocab_size, seed)
    prompts = make_workload(num_long, prompt_len, output_len, vocab_size, seed + 1)
    after = tuple([None] * steady + list(range(count - steady)) + [None] * num_long)
    return Workload(
        streams.prompts + prompts.prompts,
        streams.output_lens + prompts.output_lens,
        [0.0] * (count + num_long),
        [False] * (count + num_long),
        tuple([True] * count + [False] * num_long),
        long_start_s,
        after,
    )


def load_workload(
    path: str,
    tokenizer: Any,
    num_requests: int,
    output_len: str,
    seed: int,
    urgent_fraction: float = 0.0,
) -> Workload:
    """Prompts from a JSONL file, one object per line with `prompt` (text), `messages` (chat) or
    `prompt_token_ids`, and optionally `max_tokens` (else drawn from `output_len`). The first
    `num_requests` lines are used (all if 0)."""
    from deploy.prompts import encode_prompt

    rng = random.Random(seed)
    o_lo, o_hi = parse_range(output_len)
    prompts = []
    output_lens = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            if num_requests and len(prompts) == num_requests:
                break
            try:
                item = json.loads(line)
                fields = {
                    k: item[k] for k in ("prompt", "messages", "prompt_token_ids") if k in item
                }
                prompts.append(encode_prompt(tokenizer, **fields))
                output_lens.append(int(item.get("max_tokens") or rng.randint(o_lo, o_hi)))
            except (ValueError, TypeError, AttributeError) as e:
                raise ValueError(f"{path}:{number}: {e}") from None
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    urgent = [rng.random() < urgent_fraction for _ in prompts]
    return Workload(prompts, output_lens, [0.0] * len(prompts), urgent)


# what a grounded request asks of its passage: answers that copy from their prompt
GROUNDED_TASKS = (
    "Repeat the following text exactly as it is written.",
    "Quote the first paragraph of the following text word for word.",
    "Copy the following text, keeping every line and every example as it is.",
    "Summarize the following text, quoting its key sentences exactly.",
)


def grounded_workload(
    num_requests: int, tokenizer: Any, passage_len: str, output_len: str, seed: int
) -> Workload:
    """Input-grounded chats: each asks the model to repeat, quote or summarize with quotes a
    passage of English prose (of `passage_len` tokens, from the Python documentation's topics,
    which ship with CPython), so answers copy from their prompts, as summarize-and-quote, code
    edits and extraction do: the workload speculative decoding's n-gram proposals are for."""
    from pydoc_data.topics import topics

    from deploy.prompts import encode_prompt

    rng = random.Random(f"grounded-{seed}")
    p_lo, p_hi = parse_range(passage_len)
    o_lo, o_hi = parse_range(output_len)
    texts = [topics[name] for name in sorted(topics)]
    prompts, output_lens = [], []
    for _ in range(num_requests):
        words = rng.choice(texts).split(" ")
        want = rng.randint(p_lo, p_hi)
        first = rng.randrange(max(1, len(words) - want))
        passage = " ".join(words[first:])
        ids = tokenizer(passage, add_special_tokens=False)["input_ids"][:want]
        passage = tokenizer.decode(ids)
        task = rng.choice(GROUNDED_TASKS)
        prompts.append(
            encode_prompt(tokenizer, messages=[{"role": "user", "content": f"{task}\n\n{passage}"}])
        )
        output_lens.append(rng.randint(o_lo, o_hi))
    return Workload(prompts, output_lens, [0.0] * num_requests, [False] * num_requests)


def engine_requests(
    work: Workload, priorities: bool, loras: dict[str, LoraRef] | None = None
) -> list[Request]:
    """The workload as greedy requests "0", "1", ... that make exactly their output lengths, each
    with the LoRA adapter (of `loras`) its `models` entry names."""
    models = work.models or (None,) * len(work.prompts)
    return [
        Request(
            req_id=str(i),
            prompt_ids=p,
            max_tokens=n,
            sampling=SamplingParams(),
            priority=prio,
            lora=None if model is None else (loras or {})[model],
        )
        for i, (p, n, prio, model) in enumerate(
            zip(work.prompts, work.output_lens, work.priorities(priorities), models, strict=True)
        )
    ]


def spread_models(work: Workload, names: list[str]) -> Workload:
    """Each request asks for the served model or one of the adapters `names`, in turn (a chat's
    later turns for their first turn's): requests spread evenly over them."""
    choices: list[str | None] = [None, *names]
    models: list[str | None] = []
    first_turns = 0
    for i in range(len(work.prompts)):
        before = work.after[i] if work.after else None
        if before is not None:
            models.append(models[before])
        else:
            models.append(choices[first_turns % len(choices)])
            first_turns += 1
    return replace(work, models=tuple(models))


def warmup_request(work: Workload) -> Request:
    """A request run before the clock starts, as long as the workload's longest prompt: first calls
    into torch, fresh worker processes and the first large buffers (a long prompt's attention, its
    KV handoff in the object store) are slower than every later one, and a server in steady state
    has paid for them."""
    longest = max(work.prompts, key=len)
    # reversed: shares no prefix
    return Request(req_id="warmup", prompt_ids=longest[::-1], max_tokens=2)
