"""The host half of the serving engine's paged KV cache: which pool blocks each slot holds.

A paged engine (`Engine(kv_tokens=...)`) keeps the target's KV rows in one pool of blocks of
`BLOCK` positions (`models.kv_cache`, paged), so a request holds only the blocks its prompt
and reply so far fill, not a whole slot of `capacity` positions. The host gives a slot blocks
before each compiled call for the positions that call may write, takes them back when the
request ends, is cancelled or is preempted, and hands the tables to the device when they
changed (a free slot's entries point at no block: its rows' writes are dropped).
"""

from __future__ import annotations

import numpy as np


class BlockTables:
    """Block tables of `slots` rows of `width` entries over a pool of `blocks` blocks of
    `block_size` positions."""

    def __init__(self, slots: int, blocks: int, block_size: int, width: int):
        self.blocks, self.block_size, self.width = blocks, block_size, width
        self.tables = np.full((slots, width), blocks, np.int32)
        self.held = np.zeros(slots, np.int64)  # blocks each slot holds (its first entries)
        self._free = list(range(blocks))[::-1]  # the lowest block handed out first
        self.changed = True  # the device's copy is stale

    @property
    def free(self) -> int:
        """Blocks no slot holds."""
        return len(self._free)

    @property
    def used(self) -> int:
        return self.blocks - self.free

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
        if lacking > len(self._free):
            return False
        start = int(self.held[slot])
        for entry in range(start, start + lacking):
            self.tables[slot, entry] = self._free.pop()
        self.held[slot] += lacking
        self.changed = self.changed or lacking > 0
        return True

    def release(self, slot: int) -> None:
        """Take back every block of `slot`."""
        held = int(self.held[slot])
        self._free.extend(self.tables[slot, :held][::-1].tolist())
        self.tables[slot] = self.blocks
        self.held[slot] = 0
        self.changed = self.changed or held > 0
