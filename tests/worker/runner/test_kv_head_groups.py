"""KV blocks regrouped between tensor-parallel sizes: every head lands on the ranks that hold it
(split where the ranks divide the heads, replicated where they outnumber them), and back again."""

from __future__ import annotations

import numpy as np
import pytest

from spillway.worker.runner.kv_head_groups import can_regroup, rank_heads, regroup

INNER = (2, 2, 4)  # layers, sides, block_size
HEAD_DIM, ITEMSIZE = 3, 2


def test_rank_heads_follow_the_models_sharding():
    assert [rank_heads(4, 2, r) for r in range(2)] == [range(0, 2), range(2, 4)]
    assert [rank_heads(2, 4, r) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert [rank_heads(1, 3, r) for r in range(3)] == [range(0, 1)] * 3  # a latent head on every rank


def shape(num_kv_heads: int, ranks: int) -> tuple[int, ...]:
    heads = len(rank_heads(num_kv_heads, ranks, 0))
    return (*INNER, heads, HEAD_DIM) if ranks == 1 else (ranks, *INNER, heads, HEAD_DIM)


def blocks_of(whole: np.ndarray, num_kv_heads: int, ranks: int) -> np.ndarray:
    """Blocks `[n, layers, sides, block, K, head bytes]` as `ranks` ranks lay them out."""
    shares = [whole[..., rank_heads(num_kv_heads, ranks, r).start:rank_heads(num_kv_heads, ranks, r).stop, :]
              for r in range(ranks)]
    return np.stack(shares, axis=1).reshape(-1)


@pytest.mark.parametrize("num_kv_heads, source, target", [(4, 1, 2), (4, 2, 1), (4, 2, 4), (2, 4, 1), (2, 1, 4),
                                                          (1, 2, 1), (1, 1, 3), (2, 2, 4)])
def test_blocks_regroup_to_what_the_target_ranks_hold(num_kv_heads, source, target):
    whole = np.random.default_rng(0).integers(0, 256, (3, *INNER, num_kv_heads, HEAD_DIM * ITEMSIZE), dtype=np.uint8)
    assert can_regroup(shape(num_kv_heads, source), shape(num_kv_heads, target), num_kv_heads)
    got = regroup(blocks_of(whole, num_kv_heads, source).tobytes(), 3, shape(num_kv_heads, source),
                  shape(num_kv_heads, target), num_kv_heads, ITEMSIZE)
    assert np.array_equal(got, blocks_of(whole, num_kv_heads, target))


def test_blocks_of_another_shape_or_head_split_do_not_regroup():
    assert not can_regroup((2, *INNER, 2, HEAD_DIM), (*INNER, 4, HEAD_DIM + 1), 4)  # another head_dim
    assert not can_regroup((2, *INNER, 1, HEAD_DIM), (*INNER, 4, HEAD_DIM), 4)  # not the sharding of 4 heads
    assert not can_regroup((2, 3, *INNER, 2, HEAD_DIM), (*INNER, 4, HEAD_DIM), 4)  # not a block's shape
