"""Prefix caching for the serving engine: the target's KV rows of earlier prompts and replies,
kept in blocks on the device, so a request whose prompt starts with them prefills only the
rest (a chat's later turns, a shared system prompt).

Blocks (`decoding.prefix_pool`) hold 32 consecutive positions of one sequence, all layers'
keys and values. A block is content-addressed: its key hashes its tokens and its whole prefix
(the key of the block before it), so a key found holds the rows a prefill of that prefix
computes (up to the float rounding of a different prefill split). The engine copies a hit's
blocks into the request's slot and prefills the rest after them (`slots.fill_cached`; the
hit's last position again, whose EAGLE-head row reads the token after it), and after each
prefill and at each request's end saves the slot's new full blocks, with an EAGLE head's rows
of them where the row kept its head. Blocks are evicted least recently used; the copy in a
slot owns its rows, so no block is counted per request.

In a paged engine (`serving.kv_blocks`) nothing is copied: the index keeps blocks of the
engine's own pool (one reference each; an EAGLE head's rows of a block are the same block
of the head's pool, kept where the row that wrote them ran its head), a request's full
blocks join it where they are, and a hit puts the cached blocks themselves in the request's
block table (shared, never written again) and prefills the rest into blocks of its own,
in place (its last block copied into one of its own, since its last position is prefilled
again: the head's row there reads the token after it). Blocks only the index keeps are evicted,
least recently used, when the pool runs short or past the cache's size.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from eaglejax.decoding.buckets import bucket
from eaglejax.decoding.prefix_pool import BLOCK, PrefixPool, empty_pool, save_blocks
from eaglejax.models import kv_cache
from eaglejax.serving.kv_blocks import BlockTables

def block_keys(tokens: np.ndarray) -> list[bytes]:
    """The key of each full block of `tokens` (its ids and its whole prefix's)."""
    keys, key = [], b""
    ids = np.asarray(tokens, np.int64)
    for start in range(0, len(ids) - BLOCK + 1, BLOCK):
        key = hashlib.blake2b(key + ids[start:start + BLOCK].tobytes(), digest_size=16).digest()
        keys.append(key)
    return keys


PREFIX_CACHE_TOKENS = 4096  # positions a serving engine's prefix cache keeps by default


class PrefixCache:
    """The host's index of a `PrefixPool` of `blocks` blocks for caches like `cache` (module
    docstring); with `head_cache`, the draft head's rows of the same blocks are kept too, so
    that a hit can prefill the head too (where a block's were saved): in a second pool, or
    with `tables` (a paged engine's) in the head's own pool. With `tables`, the index keeps
    at most `blocks` blocks of the engine's pool (`pool` and `head_pool` are None)."""

    def __init__(self, cache: kv_cache.KVCache, blocks: int,
                 head_cache: kv_cache.KVCache | None = None,
                 tables: BlockTables | None = None):
        if blocks < 1:
            raise ValueError(f"a prefix cache holds at least one block, got {blocks}")
        if cache.capacity % BLOCK:
            raise ValueError(f"slot capacity {cache.capacity} is not a multiple of {BLOCK}")
        self.tables = tables
        self.pool = None if tables is not None else empty_pool(cache, blocks)
        self.keeps_heads = head_cache is not None
        self.head_pool = None if head_cache is None or tables is not None else empty_pool(
            head_cache, blocks)
        if tables is not None:
            tables.reclaimable, tables.reclaim = self.reclaimable, self.reclaim
        self.blocks, self.capacity = blocks, cache.capacity
        self.index: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # LRU first
        self.with_head: set[int] = set()  # blocks whose head rows the head pool holds
        self.free = list(range(blocks))[::-1]
        self.hit_tokens = 0  # prompt tokens copied from the cache, over all requests
        self.prompt_tokens = 0  # prompt tokens of all requests looked up

    def match(self, prompt: Sequence[int], minimum: int = 0, head: bool = False) -> list[int]:
        """Pool blocks holding the longest cached prefix of `prompt` that leaves at least one
        token to prefill, in order (marked recently used); with `head`, of blocks whose head
        rows are kept too; none where it is shorter than `minimum` tokens."""
        keys = block_keys(np.asarray(prompt)[:len(prompt) - 1])
        found = list(itertools.takewhile(
            lambda block: block is not None and (not head or block in self.with_head),
            map(self.index.get, keys)))
        self.prompt_tokens += len(prompt)
        if BLOCK * len(found) < max(minimum, 1):
            return []
        for key in keys[:len(found)]:
            self.index.move_to_end(key)
        self.hit_tokens += BLOCK * len(found) - 1  # the last found is prefilled again
        return found

    def save(self, cache: kv_cache.KVCache, slot: int, tokens: Sequence[int],
             head_cache: kv_cache.KVCache | None = None) -> None:
        """Keep the full blocks of `tokens` (whose rows `slot` of `cache`, and of
        `head_cache` when given, holds) that are not kept yet, evicting the least recently
        used blocks of other prefixes; with `head_cache`, also the head rows of kept blocks
        that lack them (paged: of the slot's own blocks, marked as holding them)."""
        new, heads, mine = [], [], set()  # (index in tokens, pool block) to write
        for i, key in enumerate(block_keys(np.asarray(tokens))):
            block = self.index.get(key)
            if block is not None:
                self.index.move_to_end(key)
            elif self.tables is not None:  # paged: the slot's own block joins the index
                block = int(self.tables.tables[slot, i])
                self.index[key] = block
                self.tables.keep(block)
                while len(self.index) > self.blocks:
                    self._evict(next(iter(self.index)))
            else:
                block = self._allocate(mine)
                if block is None:  # the pool holds less than this sequence
                    break
                self.index[key] = block
                self.with_head.discard(block)
                new.append((i, block))
            mine.add(block)
            own = self.tables is None or self.tables.tables[slot, i] == block
            if head_cache is not None and block not in self.with_head and own:
                self.with_head.add(block)
                heads.append((i, block))
        self.pool = self._copy(self.pool, cache, slot, new)
        if self.head_pool is not None:
            self.head_pool = self._copy(self.head_pool, head_cache, slot, heads)

    def warmup(self, cache: kv_cache.KVCache, head_cache: kv_cache.KVCache | None = None
               ) -> None:
        """Compile `save`'s programs (one per width `_width` gives) writing nothing."""
        most = self.capacity // BLOCK
        for width in sorted({_width(n, most) for n in range(1, most + 1)}):
            nowhere = [(0, self.blocks)] * width
            if self.pool is not None:
                self.pool = self._copy(self.pool, cache, 0, nowhere)
            if self.head_pool is not None:
                self.head_pool = self._copy(self.head_pool, head_cache, 0, nowhere)

    def _copy(self, pool: PrefixPool, cache: kv_cache.KVCache, slot: int,
              blocks: list[tuple[int, int]]) -> PrefixPool:
        """`pool` with blocks (index in the slot's rows, pool block; a pool block past the
        pool: not written) copied from `slot` of `cache`."""
        if not blocks:
            return pool
        blocks = blocks + [(0, self.blocks)] * (
            _width(len(blocks), self.capacity // BLOCK) - len(blocks))
        sources, targets = zip(*blocks)
        return save_blocks(pool, cache, jnp.int32(slot), jnp.asarray(sources, jnp.int32),
                           jnp.asarray(targets, jnp.int32))

    def reclaimable(self) -> int:
        """Paged: blocks only the index keeps."""
        return sum(int(self.tables.refs[block] == 1) for block in self.index.values())

    def reclaim(self, count: int) -> None:
        """Paged: free `count` blocks only the index keeps, least recently used first."""
        unused = [key for key, block in self.index.items() if self.tables.refs[block] == 1]
        for key in unused[:count]:
            self._evict(key)

    def _evict(self, key: bytes) -> None:
        """Paged: forget `key`, dropping the index's reference to its block."""
        block = self.index.pop(key)
        self.with_head.discard(block)
        self.tables.drop(block)

    def _allocate(self, keep: set[int]) -> int | None:
        if self.free:
            return self.free.pop()
        for key, block in self.index.items():  # least recently used first
            if block not in keep:
                del self.index[key]
                return block
        return None


def _width(blocks: int, most: int) -> int:
    """Blocks one `save_blocks` call copies for `blocks` new ones (a power of two, at most
    `most`): few programs, none copying much more than it needs."""
    return min(bucket(blocks, 1), most)
