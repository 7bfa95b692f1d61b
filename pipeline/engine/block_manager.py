"""Fixed-size KV blocks with reference counts and a hash-chained prefix cache (no torch).

A block is `block_size` consecutive token slots of one sequence's KV. When a block is full and its KV
computed, it is registered under a hash covering (parent block's hash, tenant salt, its tokens), so
a later sequence with the same salt and the same tokens up to that point shares it instead of
computing it again. Blocks whose reference count falls to zero go to the free list in release
order and keep their hash: they can still be hit until they are reused, oldest first (LRU).

    cached_prefix_tokens(seq)   how many leading tokens the cache would supply (a pure lookup)
    can_allocate(seq, n)        whether n more tokens (after any cache hits) fit in free blocks
    allocate(seq, n)            take the cache hits (first admission only) and the blocks n more tokens need
    may_append(seq)             allocate(seq, 1): room for the next decode token
    commit(seq)                 register the blocks that the last step filled
    truncate(seq, n)            roll back the last n computed tokens (speculative decoding)
    deallocate(seq)             release every block of the sequence
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from pipeline.engine.sequence import Sequence

__all__ = ["Block", "BlockManager"]

_NO_HASH = b""


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes = _NO_HASH  # set while registered in the prefix cache
    num_hashed_tokens: int = 0  # tokens of its sequence up to and including this block, when hashed


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # LRU order
        self._by_hash: dict[bytes, int] = {}
        self.hit_blocks = 0  # blocks served from the prefix cache since start (a counter for tests and metrics)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @staticmethod
    def block_hash(parent: bytes, salt: str, token_ids: list[int]) -> bytes:
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(salt.encode())
        digest.update(b"\x00")
        digest.update(b"".join(t.to_bytes(4, "little") for t in token_ids))
        return digest.digest()

    def cached_prefix_tokens(self, seq: Sequence) -> int:
        """Leading tokens whose KV the cache holds for this sequence (0 once it holds blocks)."""
        return len(self._prefix_hits(seq)) * self.block_size if not seq.block_table else 0

    def can_allocate(self, seq: Sequence, num_new_tokens: int, *, use_cache: bool = True) -> bool:
        hits = self._prefix_hits(seq) if use_cache and not seq.block_table else []
        computed = seq.num_computed_tokens + len(hits) * self.block_size
        fresh = self.blocks_for(computed + num_new_tokens) - len(seq.block_table) - len(hits)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)  # hits that sit in the free list
        return max(fresh, 0) + revived <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int, *, use_cache: bool = True) -> None:
        """Give `seq` room for `num_new_tokens` past its computed ones; check `can_allocate` first.
        `use_cache=False` skips the prefix-cache lookup (for KV written from elsewhere)."""
        if use_cache and not seq.block_table and seq.num_computed_tokens == 0:
            hits = self._prefix_hits(seq)
            for block_id in hits:
                self._take(block_id)
            seq.block_table.extend(hits)
            seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
            self.hit_blocks += len(hits)
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if needed > len(self._free):
            raise RuntimeError(f"allocate without room: {needed} blocks needed, {len(self._free)} free")
        for _ in range(needed):
            block_id, _ = self._free.popitem(last=False)  # least recently freed first
            self._forget(block_id)
            self._take(block_id)
            seq.block_table.append(block_id)

    def can_append(self, seq: Sequence) -> bool:
        return self.can_allocate(seq, 1)

    def may_append(self, seq: Sequence) -> None:
        self.allocate(seq, 1)

    def commit(self, seq: Sequence) -> None:
        """Register every full, computed block of `seq` that has no hash yet (call after each step)."""
        full = min(seq.num_computed_tokens, len(seq.token_ids)) // self.block_size
        parent = _NO_HASH
        for index in range(full):
            block = self.blocks[seq.block_table[index]]
            end = (index + 1) * self.block_size
            if block.hash and block.num_hashed_tokens == end:
                parent = block.hash
                continue
            digest = self.block_hash(parent, seq.salt, seq.token_ids[end - self.block_size : end])
            if digest not in self._by_hash:  # a twin computed concurrently keeps the first registration
                self._forget(block.block_id)
                block.hash, block.num_hashed_tokens = digest, end
                self._by_hash[digest] = block.block_id
            parent = digest

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Forget the KV of the last `num_tokens` computed tokens; `seq.token_ids` is the caller's to cut.

        The block that becomes partial loses its cache registration; if another sequence shares it, it
        is released instead and its kept tokens are recomputed by the next step."""
        if not 0 <= num_tokens <= seq.num_computed_tokens:
            raise ValueError(f"cannot roll back {num_tokens} of {seq.num_computed_tokens} computed tokens")
        seq.num_computed_tokens -= num_tokens
        keep = self.blocks_for(seq.num_computed_tokens)
        partial = seq.num_computed_tokens % self.block_size
        if partial and self.blocks[seq.block_table[keep - 1]].ref_count > 1:
            keep -= 1
            seq.num_computed_tokens -= partial
        elif partial:
            self._forget(seq.block_table[keep - 1])
        for block_id in reversed(seq.block_table[keep:]):
            self._release(block_id)
        del seq.block_table[keep:]

    def deallocate(self, seq: Sequence) -> None:
        """Release every block of `seq` (last block first, so a prefix outlives its tail in the LRU)."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table.clear()
        seq.num_computed_tokens = 0  # num_cached_tokens stays: what the last admission got from the cache

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks for the leading full blocks of `seq`, leaving at least one token to compute."""
        hits: list[int] = []
        parent = _NO_HASH
        for index in range((len(seq.token_ids) - 1) // self.block_size):
            end = (index + 1) * self.block_size
            parent = self.block_hash(parent, seq.salt, seq.token_ids[end - self.block_size : end])
            block_id = self._by_hash.get(parent)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self._free.pop(block_id, None)
        block.ref_count += 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"block {block_id} released more often than taken")
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None

    def _forget(self, block_id: int) -> None:
        """Drop the block's cache registration (its content is about to change)."""
        block = self.blocks[block_id]
        if block.hash and self._by_hash.get(block.hash) == block_id:
            del self._by_hash[block.hash]
        block.hash, block.num_hashed_tokens = _NO_HASH, 0
