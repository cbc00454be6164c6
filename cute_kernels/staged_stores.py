"""A warpgroup's output staged through shared memory and TMA-stored, one barrier a sub-tile.

The warpgroup writes sub-tile j of its output into staging buffer j % buffers, fences it for the
async proxy and syncs; one warp then issues the bulk store that reads the buffer (one bulk async
group a store). Before each sub-tile's barrier that warp waits until at most
``pending_at_sync`` of its stores are still reading shared memory: the next sub-tile's buffer was
last read by the store buffers - 1 sub-tiles back, so once at most buffers - 2 newer ones remain,
it is free when the barrier passes. So one barrier a sub-tile, and buffers - 2 stores in flight
across it. The count j runs on across tiles (the walk's sub-tiles in order).
"""
from __future__ import annotations

import dataclasses

import cutlass.cute as cute


@dataclasses.dataclass(frozen=True)
class StagedStores:
    """``buffers`` staging buffers a warpgroup, used in turn (at least 2)."""

    buffers: int

    def __post_init__(self):
        if isinstance(self.buffers, bool) or not isinstance(self.buffers, int) or self.buffers < 2:
            raise ValueError(f"StagedStores: one barrier a sub-tile needs at least 2 buffers, got {self.buffers!r}")

    @property
    def pending_at_sync(self) -> int:
        """Stores that may still read shared memory when a sub-tile's barrier passes."""
        return self.buffers - 2

    def buffer(self, count, warpgroup=0):
        """Index of sub-tile ``count``'s buffer among all warpgroups' (``warpgroup``'s come after
        those of the warpgroups before it)."""
        return warpgroup * self.buffers + count % self.buffers

    @cute.jit
    def free_next(self, storing_warp) -> None:
        """Before the sub-tile's barrier: the storing warp waits until the next sub-tile's buffer is
        no longer read (at most ``pending_at_sync`` stores pending)."""
        if storing_warp:
            cute.arch.cp_async_bulk_wait_group(self.pending_at_sync, read=True)

    def replay(self, subtiles: int) -> None:
        """Host check of the rule: play ``subtiles`` sub-tiles in order, each store finishing as late
        as the waits allow; AssertionError where a sub-tile would write a buffer a store still reads."""
        reading = []  # buffers of the pending stores, oldest first
        for j in range(subtiles):
            assert j % self.buffers not in reading, f"sub-tile {j} overwrites a buffer being stored"
            n = self.pending_at_sync
            reading = reading[max(0, len(reading) - n):] if n else []
            assert (j + 1) % self.buffers not in reading, f"sub-tile {j + 1}'s buffer is read after the barrier"
            reading.append(j % self.buffers)
