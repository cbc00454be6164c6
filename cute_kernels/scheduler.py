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
"""
from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int32


def strided_tiles(begin: Int32, cluster: int = 1, lanes: int = 1, lane=0):
    """First tile and stride of this cluster's walk, or of consumer ``lane`` out
    of ``lanes`` consumers that take the cluster's tiles in turn (ping-pong).

    Returns ``(first, stride, clusters)``; the walk is ``first, first + stride,
    ...`` while below the range end, and ``clusters`` is the grid in clusters.
    """
    bid, _, _ = cute.arch.block_idx()
    grid, _, _ = cute.arch.grid_dim()
    clusters = Int32(grid) // cluster
    first = begin + Int32(bid) // cluster + lane * clusters
    return first, clusters * lanes, clusters
