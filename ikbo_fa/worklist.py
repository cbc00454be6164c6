"""Device-side work list for KV broadcast: candidates grouped by user, and the
first tile of every user. ``kv_worklist`` is the PyTorch definition (a handful
of asynchronous torch ops, no host synchronization, CUDA-graph capturable);
the op builds the same arrays in one launch with ``worklist_sm90`` when the
users fit its shared memory, and falls back to ``kv_worklist`` otherwise.

Outputs (all int32 on idx's device):
  order       [B]      candidate indices grouped by user (here stable: idx order within a
                       user; the one-launch kernel leaves the order within a user open)
  cand_start  [U + 2]  first position in ``order`` of each group; group U holds the
                       candidates whose index is out of range (written as NaN)
  tile_start  [U + 2]  first tile (per head) of each group; tile_start[U + 1] is the
                       tile count per head, read by the kernel from device memory
"""
from __future__ import annotations

import torch


def kv_worklist(idx: torch.Tensor, num_users: int, cands_per_tile: int, chunks_per_cand: int):
    """Group candidates by user; -> (order, cand_start, tile_start)."""
    # Out-of-range indices (-1 and U after the clamp) both land in group U.
    key = torch.remainder(idx.clamp(-1, num_users), num_users + 1).to(torch.int32)
    sorted_key, order = torch.sort(key, stable=True)
    # The group ids are built per call, not cached: a tensor first made during CUDA-graph
    # capture holds its values only once the graph has been replayed.
    group_ids = torch.arange(num_users + 2, dtype=torch.int32, device=idx.device)
    cand_start = torch.searchsorted(sorted_key, group_ids, out_int32=True)
    counts = cand_start[1:] - cand_start[:-1]
    tiles = (counts + (cands_per_tile - 1)).div_(cands_per_tile, rounding_mode="floor")
    if chunks_per_cand > 1:
        tiles = counts * chunks_per_cand
    tile_start = torch.zeros(num_users + 2, dtype=torch.int32, device=idx.device)
    tile_start[1:] = torch.cumsum(tiles, dim=0, dtype=torch.int32)
    return order.to(torch.int32), cand_start, tile_start


def max_tiles_per_head(batch: int, num_users: int, cands_per_tile: int, chunks_per_cand: int) -> int:
    """Host-side upper bound of tile_start[U + 1] (sizes the persistent grid without a sync)."""
    if chunks_per_cand > 1:
        return batch * chunks_per_cand
    # Each non-empty group adds at most one partly filled tile.
    return -(-batch // cands_per_tile) + min(batch, num_users + 1)
