"""Prefix caching for the serving engine: the target's KV rows of earlier prompts and replies,
kept in blocks on the device, so a request whose prompt starts with them prefills only the
rest (a chat's later turns, a shared system prompt).

Blocks (`decoding.prefix_pool`) hold 32 consecutive positions of one sequence, all layers'
keys and values. A block is content-addressed: its key hashes its tokens and its whole prefix
(the key of the block before it), so a key found holds the rows a prefill of that prefix
computes (up to the float rounding of a different prefill split). The engine copies a hit's
blocks into the request's slot and prefills the rest after them (`slots.fill_cached`), and
after each prefill and at each request's end saves the slot's new full blocks. Blocks are
evicted least recently used; the copy in a slot owns its rows, so no block is counted per
request.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from eaglejax.config import ModelConfig
from eaglejax.decoding.buckets import bucket
from eaglejax.decoding.prefix_pool import BLOCK, empty_pool, save_blocks
from eaglejax.models import kv_cache

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
    """The host's index of a `PrefixPool` of `blocks` blocks (module docstring)."""

    def __init__(self, config: ModelConfig, blocks: int, dtype: jnp.dtype, capacity: int):
        if blocks < 1:
            raise ValueError(f"a prefix cache holds at least one block, got {blocks}")
        if capacity % BLOCK:
            raise ValueError(f"slot capacity {capacity} is not a multiple of {BLOCK}")
        self.pool = empty_pool(config, blocks, dtype)
        self.blocks, self.capacity = blocks, capacity
        self.index: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # LRU first
        self.free = list(range(blocks))[::-1]
        self.hit_tokens = 0  # prompt tokens found cached, over all requests
        self.prompt_tokens = 0  # prompt tokens of all requests looked up

    def match(self, prompt: Sequence[int], minimum: int = 0) -> list[int]:
        """Pool blocks holding the longest cached prefix of `prompt` that leaves at least one
        token to prefill, in order (marked recently used); none where it is shorter than
        `minimum` tokens."""
        keys = block_keys(np.asarray(prompt)[:len(prompt) - 1])
        found = list(itertools.takewhile(lambda block: block is not None,
                                         map(self.index.get, keys)))
        self.prompt_tokens += len(prompt)
        if BLOCK * len(found) < max(minimum, 1):
            return []
        for key in keys[:len(found)]:
            self.index.move_to_end(key)
        self.hit_tokens += BLOCK * len(found)
        return found

    def save(self, cache: kv_cache.KVCache, slot: int, tokens: Sequence[int]) -> None:
        """Keep the full blocks of `tokens` (whose rows `slot` of `cache` holds) that are
        not kept yet, evicting the least recently used blocks of other prefixes."""
        sources, targets, mine = [], [], set()
        for i, key in enumerate(block_keys(np.asarray(tokens))):
            if key in self.index:
                self.index.move_to_end(key)
                mine.add(self.index[key])
                continue
            block = self._allocate(mine)
            if block is None:  # the pool holds less than this sequence
                break
            self.index[key] = block
            mine.add(block)
            sources.append(i)
            targets.append(block)
        if not sources:
            return
        pad = _width(len(sources), self.capacity // BLOCK) - len(sources)
        self.pool = save_blocks(self.pool, cache, jnp.int32(slot),
                                jnp.asarray(sources + [0] * pad, jnp.int32),
                                jnp.asarray(targets + [self.blocks] * pad, jnp.int32))

    def warmup(self, cache: kv_cache.KVCache) -> None:
        """Compile `save`'s programs (one per width `_width` gives) writing nothing."""
        most = self.capacity // BLOCK
        for width in sorted({_width(n, most) for n in range(1, most + 1)}):
            nowhere = jnp.full((width,), self.blocks, jnp.int32)
            self.pool = save_blocks(self.pool, cache, jnp.int32(0), jnp.zeros_like(nowhere),
                                    nowhere)

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
