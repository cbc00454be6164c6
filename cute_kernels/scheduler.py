"""Persistent static tile scheduling (device side).

A persistent grid of ``G`` clusters walks the tile range ``[begin, end)``:
cluster ``c`` takes tiles ``begin + c``, ``begin + c + G``, ... in order (the
CTAs of a cluster work on the same tile, each on its part). Consecutive tile
indices run on neighbouring clusters at the same time, so a kernel numbers its
tiles to put tiles that share operands next to each other (L2 reuse).

The grid size is a run-time value: the op launches no more clusters than can be
resident at once and no more than there are tiles, so a problem with fewer
tiles than SMs still processes every tile, and the device is never queried
while tracing.

``TileCounter`` hands tiles out at run time instead: CTA ``c`` takes tile ``c`` first, then
``G`` plus what a counter in global memory returns, each time it asks. Tiles of unequal work,
numbered longest first, then go each to the first CTA free to take it.

``warp_search`` finds a tile's group among the groups' first tiles with every lane of a warp.
"""
from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32


class TileWalk(NamedTuple):
    """One walk over the tile range: ``first, first + stride, ...`` while below the range end."""

    first: Int32
    stride: Int32
    clusters: Int32  # the grid, in clusters


def strided_tiles(begin: Int32, cluster: int = 1, lanes: int = 1, lane=0) -> TileWalk:
    """This cluster's walk, or that of consumer ``lane`` out of ``lanes`` consumers that take
    the cluster's tiles in turn (ping-pong)."""
    bid, _, _ = cute.arch.block_idx()
    grid, _, _ = cute.arch.grid_dim()
    clusters = Int32(grid) // cluster
    first = begin + Int32(bid) // cluster + lane * clusters
    return TileWalk(first, clusters * lanes, clusters)


class TileCounter(NamedTuple):
    """Tiles handed out by an atomic counter: ``words`` [2] int32 in global memory, zero at launch
    (the tiles handed out past the grid's first G, and the CTAs done). The last CTA to finish
    zeroes both again, so one buffer serves launches in stream order, never two at once."""

    words: cute.Tensor

    @cute.jit
    def first(self) -> Int32:
        bid, _, _ = cute.arch.block_idx()
        return Int32(bid)

    @cute.jit
    def next(self) -> Int32:
        """The calling CTA's next tile (every lane of the calling warp calls it and gets it; lane 0
        asks the counter)."""
        grid, _, _ = cute.arch.grid_dim()
        t = Int32(0)
        if cute.arch.lane_idx() == 0:
            t = cute.arch.atomic_add(self.words.iterator, Int32(1))
        return cute.arch.shuffle_sync(t, 0) + Int32(grid)

    @cute.jit
    def finish(self):
        """Once per CTA, by the warp that called ``next``, after its last call: the last CTA resets
        the counter (every CTA has taken its last tile by then)."""
        grid, _, _ = cute.arch.grid_dim()
        if cute.arch.lane_idx() == 0:
            done = cute.arch.atomic_add(self.words.iterator + 1, Int32(1))
            if done == Int32(grid) - 1:
                self.words[0] = Int32(0)
                self.words[1] = Int32(0)


@cute.jit
def warp_search(starts: cute.Tensor, value: Int32, lo: Int32, hi: Int32) -> Int32:
    """The last position i in [lo, hi) with ``starts[i] <= value``, by all 32 lanes of a warp
    together (every lane calls it; every lane gets the answer). ``starts`` is non-decreasing over
    [lo, hi) and ``starts[lo] <= value``.

    Each round the lanes read SEARCH_WIDTH evenly spaced entries of the range at once (lane l the
    SEARCH_LOADS entries l * SEARCH_LOADS, ...), and ballots narrow it SEARCH_WIDTH-fold:
    ceil(log_SEARCH_WIDTH(hi - lo)) rounds of loads in flight together, where a binary search
    waits on ceil(log2(hi - lo)) loads in a row (the first tile of a persistent CTA waits on
    them): one round up to SEARCH_WIDTH groups."""
    lane = cute.arch.lane_idx()
    while hi - lo > 1:
        step = (hi - lo + SEARCH_WIDTH - 1) // SEARCH_WIDTH
        seen = Int32(0)
        for e in cutlass.range_constexpr(SEARCH_LOADS):
            j = lo + (Int32(lane) * SEARCH_LOADS + e) * step
            below = cutlass.Boolean(False)
            if j < hi:
                below = starts[j] <= value
            # The entries <= value are a prefix of the SEARCH_WIDTH read (lane 0's first is starts[lo]).
            seen += cute.arch.popc(cute.arch.vote_ballot_sync(below))
        lo = lo + (seen - 1) * step
        hi = cutlass.min(lo + step, hi)
    return lo


SEARCH_LOADS = 2  # entries a lane reads a round of warp_search (the producer warp holds 24 registers)
SEARCH_WIDTH = 32 * SEARCH_LOADS
