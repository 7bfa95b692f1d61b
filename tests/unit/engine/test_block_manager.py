"""Block manager: ref counts, prefix hits per tenant, LRU reuse, truncation."""

from __future__ import annotations

from pipeline.engine.block_manager import BlockManager
from pipeline.engine.params import EngineRequest
from pipeline.engine.sequence import Sequence


def seq(tokens: list[int], salt: str = "", seq_id: int = 0) -> Sequence:
    return Sequence.from_request(EngineRequest(tuple(tokens), max_tokens=100, salt=salt), seq_id=seq_id, arrival=0)


def computed(bm: BlockManager, s: Sequence) -> None:
    """Allocate and mark every token but the last as computed (as a finished prefill would)."""
    bm.allocate(s, len(s) - 1 - bm.cached_prefix_tokens(s))
    s.num_computed_tokens = len(s) - 1
    bm.commit(s)


def test_a_shared_prefix_reuses_full_blocks_only_within_a_tenant() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq(list(range(10)))
    computed(bm, a)
    assert bm.num_free_blocks == 16 - 3
    b = seq([*range(8), 99, 98])
    assert bm.cached_prefix_tokens(b) == 8
    bm.allocate(b, 2)
    assert b.block_table[:2] == a.block_table[:2] and b.num_computed_tokens == 8
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    assert bm.cached_prefix_tokens(seq(list(range(10)), salt="other-tenant")) == 0
    bm.deallocate(a)
    bm.deallocate(b)
    assert bm.num_free_blocks == 16 and all(blk.ref_count == 0 for blk in bm.blocks)


def test_freed_blocks_stay_cached_until_reused_least_recent_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq(list(range(9)))
    computed(bm, a)
    bm.deallocate(a)
    assert bm.cached_prefix_tokens(seq(list(range(9)))) == 8  # still there after release
    filler = seq([50 + i for i in range(5)], seq_id=1)
    bm.allocate(filler, 5)  # takes the two never-used... then the least recently freed blocks
    assert bm.cached_prefix_tokens(seq(list(range(9)))) == 8
    bm.deallocate(filler)
    big = seq([70 + i for i in range(16)], seq_id=2)
    bm.allocate(big, 16)
    assert bm.cached_prefix_tokens(seq(list(range(9)))) == 0  # evicted


def test_a_full_prompt_hit_still_leaves_one_token_to_compute() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(list(range(9)))
    computed(bm, a)
    assert bm.cached_prefix_tokens(seq(list(range(8)))) == 4  # 8 tokens: the second block is recomputed


def test_truncate_rolls_back_and_unregisters_the_partial_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(list(range(11)))
    computed(bm, a)  # 10 computed: blocks 0,1 full and registered, block 2 partial
    bm.truncate(a, 5)
    assert a.num_computed_tokens == 5 and len(a.block_table) == 2
    assert bm.cached_prefix_tokens(seq(list(range(11)))) == 4
    assert bm.num_free_blocks == 6


def test_truncate_into_a_shared_block_releases_it_for_recompute() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(list(range(9)))
    computed(bm, a)
    b = seq(list(range(9)), seq_id=1)
    computed(bm, b)
    assert b.block_table[:2] == a.block_table[:2]
    bm.truncate(b, 2)  # 6 computed: inside shared block 1
    assert b.num_computed_tokens == 4 and b.block_table == a.block_table[:1]
    assert bm.blocks[a.block_table[1]].ref_count == 1
