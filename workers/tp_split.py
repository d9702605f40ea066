"""Which heads, MLP columns and vocabulary rows each rank of a tensor-parallel worker holds: plain
integers, no torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankShard:
    """One rank's part of a model, as ranges of the full model's indices.

    Query heads go by KV group: a rank holds whole groups with their KV heads, or, where there are
    fewer KV heads than ranks, one KV head (a copy, shared with the other ranks of its group) and
    part of its group's query heads."""

    rank: int
    tp_size: int
    q_heads: range  # the query heads it holds
    kv_heads: range  # the KV heads it holds: its KV pool's heads
    intermediate: range  # its columns of gate/up (rows of down's input)
    vocab: range  # its rows of the embedding and of the LM head


def even_range(total: int, parts: int, index: int) -> range:
    """Part `index` of `total` items cut into `parts` contiguous pieces as even as they go: the
    first `total % parts` pieces hold one more."""
    size, extra = divmod(total, parts)
    start = index * size + min(index, extra)
    return range(start, start + size + (index < extra))


def head_split(num_heads: int, num_kv_heads: int, tp_size: int, rank: int) -> tuple[range, range]:
    """The query heads and the KV heads rank `rank` of `tp_size` holds. Raises ValueError where the
    heads cannot be split so that every rank holds at least one query head with its KV head."""
    _check_rank(tp_size, rank)
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not share {num_kv_heads} KV heads evenly")
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp_size:
        kv = even_range(num_kv_heads, tp_size, rank)
        return range(kv.start * group, kv.stop * group), kv
    # fewer KV heads than ranks: each KV head is copied to the ranks that share its group
    kv_head = rank * num_kv_heads // tp_size
    sharing = [r for r in range(tp_size) if r * num_kv_heads // tp_size == kv_head]
    if len(sharing) > group:
        raise ValueError(
            f"tensor parallel size {tp_size} is too wide for {num_heads} query heads on "
            f"{num_kv_heads} KV heads: {len(sharing)} ranks would share a group of {group} heads"
        )
    part = even_range(group, len(sharing), sharing.index(rank))
    first = kv_head * group
    return range(first + part.start, first + part.stop), range(kv_head, kv_head + 1)


def rank_shard(
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    vocab_size: int,
    tp_size: int,
    rank: int,
) -> RankShard:
    """Rank `rank`'s part of a model of these sizes at tensor parallel size `tp_size`."""
    q_heads, kv_heads = head_split(num_heads, num_kv_heads, tp_size, rank)
    if intermediate_size < tp_size or vocab_size < tp_size:
        raise ValueError(f"tensor parallel size {tp_size} is wider than the model's MLP or vocab")
    return RankShard(
        rank=rank,
        tp_size=tp_size,
        q_heads=q_heads,
        kv_heads=kv_heads,
        intermediate=even_range(intermediate_size, tp_size, rank),
        vocab=even_range(vocab_size, tp_size, rank),
    )


def _check_rank(tp_size: int, rank: int) -> None:
    if tp_size < 1:
        raise ValueError(f"tensor parallel size must be at least 1, not {tp_size}")
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} is not one of the {tp_size} ranks")
