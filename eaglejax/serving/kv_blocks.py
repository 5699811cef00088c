"""The host half of the serving engine's paged KV cache: which pool blocks each slot holds.

A paged engine (`Engine(kv_tokens=...)`) keeps the target's KV rows in one pool of blocks of
`BLOCK` positions (`models.kv_cache`, paged), and an EAGLE head's in a pool of as many blocks
read through the same tables (a block id holds the same positions in both), so a request
holds only the blocks its prompt and reply so far fill, not a whole slot of `capacity`
positions. The host gives a slot blocks before each compiled call for the positions that
call may write (and a round's drafting may read back), takes them back when the
request ends, is cancelled or is preempted, and hands the tables to the device when they
changed (a free slot's entries point at no block: its rows' writes are dropped). In a
multi-process run (`serving.lockstep`) every process keeps its own copy, the same one: each
makes the same calls in the same order.

Blocks are reference-counted: a full block may be in several slots' tables at once (a
shared prompt prefix, `serving.prefix_cache`) and kept by the prefix cache after they end;
it returns to the free list when nothing refers to it. When blocks run short, `reclaim`
(the prefix cache's eviction) is asked for the ones only it keeps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


class BlockTables:
    """Block tables of `slots` rows of `width` entries over a pool of `blocks` blocks of
    `block_size` positions."""

    def __init__(self, slots: int, blocks: int, block_size: int, width: int):
        self.blocks, self.block_size, self.width = blocks, block_size, width
        self.tables = np.full((slots, width), blocks, np.int32)
        self.held = np.zeros(slots, np.int64)  # blocks each slot holds (its first entries)
        self.refs = np.zeros(blocks, np.int64)  # slots' tables and the prefix cache
        self._free = list(range(blocks))[::-1]  # the lowest block handed out first
        self.changed = True  # the device's copy is stale
        # Blocks only the prefix cache keeps, and how to free n of them (least recently used).
        self.reclaimable: Callable[[], int] = lambda: 0
        self.reclaim: Callable[[int], None] = lambda n: None

    @property
    def free(self) -> int:
        """Blocks that could be handed out now: unused, or kept only by the prefix cache."""
        return len(self._free) + self.reclaimable()

    @property
    def used(self) -> int:
        """Blocks some slot's table holds."""
        return self.blocks - len(self._free) - self.reclaimable()

    def needed(self, positions: int) -> int:
        """Blocks covering `positions` positions of a row (at most the table's width)."""
        return min(-(-positions // self.block_size), self.width)

    def shortfall(self, slot: int, positions: int) -> int:
        """Blocks `slot` lacks to cover `positions` positions."""
        return max(0, self.needed(positions) - int(self.held[slot]))

    def grow(self, slot: int, positions: int) -> bool:
        """Give `slot` the blocks it lacks for `positions` positions; False (nothing given)
        when too few are free."""
        lacking = self.shortfall(slot, positions)
        if lacking > self.free:
            return False
        if lacking > len(self._free):
            self.reclaim(lacking - len(self._free))
        start = int(self.held[slot])
        for entry in range(start, start + lacking):
            block = self._free.pop()
            self.tables[slot, entry] = block
            self.refs[block] = 1
        self.held[slot] += lacking
        self.changed = self.changed or lacking > 0
        return True

    def share(self, slot: int, blocks: Sequence[int]) -> None:
        """Make `blocks` (held elsewhere: full, never written again) the first entries of
        `slot`, which holds none."""
        if self.held[slot]:
            raise ValueError(f"slot {slot} already holds {self.held[slot]} blocks")
        self.tables[slot, :len(blocks)] = blocks
        self.held[slot] = len(blocks)
        for block in blocks:
            self.keep(block)
        self.changed = self.changed or len(blocks) > 0

    def keep(self, block: int) -> None:
        """One more reference to `block`."""
        self.refs[block] += 1

    def drop(self, block: int) -> None:
        """One reference less to `block`; freed at none."""
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self._free.append(block)

    def release(self, slot: int) -> None:
        """Drop every block of `slot`."""
        held = int(self.held[slot])
        for block in self.tables[slot, :held][::-1].tolist():
            self.drop(block)
        self.tables[slot] = self.blocks
        self.held[slot] = 0
        self.changed = self.changed or held > 0
