"""The split of heads, MLP columns and vocabulary rows between tensor-parallel ranks."""

import subprocess
import sys

import pytest

from workers.tp_split import even_range, head_split, rank_shard


def test_embedded_model_at_tp2_splits_its_three_kv_groups_two_and_one():
    # SmolLM2-135M: 9 query heads on 3 KV heads, intermediate 1536, vocab 49152
    first = rank_shard(9, 3, 1536, 49152, 2, 0)
    second = rank_shard(9, 3, 1536, 49152, 2, 1)
    assert (first.q_heads, first.kv_heads) == (range(0, 6), range(0, 2))
    assert (second.q_heads, second.kv_heads) == (range(6, 9), range(2, 3))
    assert (first.intermediate, second.intermediate) == (range(0, 768), range(768, 1536))
    assert (first.vocab, second.vocab) == (range(0, 24576), range(24576, 49152))


def test_fewer_kv_heads_than_ranks_copies_the_kv_head_and_splits_its_queries():
    assert head_split(4, 1, 2, 0) == (range(0, 2), range(0, 1))
    assert head_split(4, 1, 2, 1) == (range(2, 4), range(0, 1))
    # an odd group: 4 and 3 query heads on the one KV head
    assert head_split(7, 1, 2, 0) == (range(0, 4), range(0, 1))
    assert head_split(7, 1, 2, 1) == (range(4, 7), range(0, 1))
    # 2 KV heads on 3 ranks: the first head's group on two ranks, the second's on one
    assert [head_split(8, 2, 3, r) for r in range(3)] == [
        (range(0, 2), range(0, 1)),
        (range(2, 4), range(0, 1)),
        (range(4, 8), range(1, 2)),
    ]


# (query heads, KV heads, tp): whole groups per rank, uneven groups, copied KV heads
SPLITS = [(9, 3, 2), (9, 3, 3), (4, 2, 2), (8, 8, 3), (12, 4, 3), (7, 1, 2), (32, 8, 4), (8, 2, 3)]


@pytest.mark.parametrize(("heads", "kv_heads", "tp"), SPLITS)
def test_every_query_head_is_on_one_rank_with_its_kv_head(heads, kv_heads, tp):
    group = heads // kv_heads
    seen = []
    for rank in range(tp):
        q, kv = head_split(heads, kv_heads, tp, rank)
        assert len(q) >= 1
        assert len(q) % len(kv) == 0  # each local KV head serves the same number of queries
        assert {h // group for h in q} == set(kv)
        seen += q
    assert seen == list(range(heads))


def test_even_range_cuts_into_contiguous_pieces_first_ones_larger():
    assert [even_range(10, 3, i) for i in range(3)] == [range(0, 4), range(4, 7), range(7, 10)]


def test_splits_that_cannot_be_made_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="too wide"):
        head_split(2, 1, 3, 0)
    with pytest.raises(ValueError, match="rank 2"):
        head_split(4, 2, 2, 2)
    with pytest.raises(ValueError, match="evenly"):
        head_split(9, 2, 2, 0)


def test_the_split_imports_no_torch():
    code = "import sys, workers.tp_split; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
