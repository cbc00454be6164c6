"""Device-side work list for KV broadcast: candidates grouped by user, and the
first tile of every user. ``kv_worklist`` is the PyTorch definition (a handful
of asynchronous torch ops, no host synchronization, CUDA-graph capturable);
the op builds the same arrays in one launch with ``worklist_sm90`` when the
users fit its shared memory, and falls back to ``kv_worklist`` otherwise.

The query rows of a user's candidates form one run of ``count * rows_per_cand``
rows, cut into tiles of ``tile_rows`` (``TILE_ROWS``, or the attention configuration's
``tile_m``); only the last tile of a user has empty rows.

Outputs (all int32 on idx's device):
  order       [B]      candidate indices grouped by user (here stable: idx order within a
                       user; the one-launch kernel is stable too when idx is grouped already,
                       and otherwise leaves the order within a user open)
  cand_start  [U + 2]  first position in ``order`` of each group; group U holds the
                       candidates whose index is out of range (written as NaN)
  tile_start  [U + 2]  first tile (per head) of each group; tile_start[U + 1] is the
                       tile count per head, read by the kernel from device memory
  grouped     [1]      1 where idx is grouped already (its user keys never decrease, the
                       out-of-range ones counting as U): ``order`` is then 0, 1, ..., B - 1
                       and a tile's query rows are consecutive rows of q

Where the users' histories differ in length (kv_lengths, or jagged kv_offsets), the tiles run
longest first, so that the persistent grid's last round holds the short ones
(``kv_tile_order``): then
  perm        [U + 3]  the groups by decreasing key-count bucket (``key_bucket``; the
                       out-of-range group U has no keys); the one-launch kernel leaves the
                       order within a bucket open. Two more words follow the U + 1 groups:
                       the attention kernel's tile counter (``walk``, zero between calls;
                       ``AttentionConfig.dynamic_walk``)
  tile_start  [U + 2]  indexed by position in ``perm``: the first tile of group perm[j]
                       is tile_start[j]; tile_start[U + 1] is still the tile count per head
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Optional

import torch

from .config import TILE_M_CHOICES

TILE_ROWS = 128  # query rows of one attention tile (AttentionConfig.tile_m: also 192) and keys of a key block
WALK_WORDS = 2  # the tile counter after perm's groups (cute_kernels.scheduler.TileCounter)


@dataclasses.dataclass(frozen=True)
class WorkList:
    """The arrays above for one idx, built once by :func:`ikbo_fa.work_list` and passed to every
    KV-broadcast ``attention(..., work_list=)`` call on that idx (layers, head groups, behaviour
    sequences), which then launches no grouping of its own.

    It holds the grouping of idx's values when it was built: a call checks that its batch, U,
    S_q, device and tile order (``perm``: built with kv_lengths or kv_offsets where the call has
    them) match, and that idx itself was not written in place since (where torch counts its
    versions: not for inference tensors); with validation on, that it groups idx as idx holds
    now (a synchronizing check). With ``perm``, its last two words are the attention kernel's tile
    counter (``walk``): the calls that share the work list must run one after another on a stream,
    not on two streams at once. ``tile_rows``: the query rows of the tiles it counts, which the
    calls then run (192 only for D 64 calls)."""

    order: torch.Tensor
    cand_start: torch.Tensor
    tile_start: torch.Tensor
    grouped: torch.Tensor
    perm: Optional[torch.Tensor]  # the groups longest first, then the tile counter; None: in user order
    rows_per_cand: int  # S_q
    # Query rows of the tiles tile_start counts: 128, or 192 for D 64 calls (work_list's head_dim)
    tile_rows: int = TILE_ROWS
    # The idx it was built from and that tensor's version then (None: not tracked).
    source: Optional[weakref.ref] = dataclasses.field(default=None, repr=False, compare=False)
    version: Optional[int] = dataclasses.field(default=None, repr=False, compare=False)
    # The attention kernel's tile counter: perm's last two words (None without perm); a view made
    # once, not per call.
    walk: Optional[torch.Tensor] = dataclasses.field(init=False, default=None, repr=False, compare=False)

    def __post_init__(self):
        # Every WorkList is one the kernel can read: the calls check only that it fits them.
        if not isinstance(self.rows_per_cand, int) or isinstance(self.rows_per_cand, bool) or self.rows_per_cand < 1:
            raise ValueError(f"WorkList.rows_per_cand must be an int >= 1, got {self.rows_per_cand!r}")
        if self.tile_rows not in TILE_M_CHOICES or isinstance(self.tile_rows, bool):
            raise ValueError(f"WorkList.tile_rows must be one of {TILE_M_CHOICES}, got {self.tile_rows!r}")
        arrays = {"order": self.order, "cand_start": self.cand_start, "tile_start": self.tile_start,
                  "grouped": self.grouped, **({} if self.perm is None else {"perm": self.perm})}
        for name, t in arrays.items():
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1 or not t.is_contiguous():
                raise TypeError(f"WorkList.{name} must be a contiguous int32 vector, got "
                                f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
            if t.device != self.order.device:
                raise ValueError(f"WorkList.{name} is on {t.device}, its order on {self.order.device}")
        groups = self.cand_start.shape[0] - 1  # U + 1
        want = {"cand_start": groups + 1, "tile_start": groups + 1, "grouped": 1, "perm": groups + WALK_WORDS}
        for name, n in want.items():
            if name in arrays and (groups < 1 or arrays[name].shape[0] != n):
                raise ValueError(f"WorkList.{name} has {arrays[name].shape[0]} entries; a work list of "
                                 f"U + 1 = {groups} groups has {n}")
        if self.perm is not None:
            object.__setattr__(self, "walk", self.perm[groups:])

    @property
    def batch(self) -> int:
        return self.order.shape[0]

    @property
    def num_users(self) -> int:
        return self.cand_start.shape[0] - 2

    def tensors(self) -> list:
        """Its arrays (``perm`` last, where it has one)."""
        return [self.order, self.cand_start, self.tile_start, self.grouped, *([] if self.perm is None else [self.perm])]

    def __repr__(self) -> str:
        return (f"WorkList(batch={self.batch}, num_users={self.num_users}, rows_per_cand={self.rows_per_cand}, "
                f"tile_rows={self.tile_rows}, longest_first={self.perm is not None}, device={self.order.device})")


def kv_worklist(idx: torch.Tensor, num_users: int, rows_per_cand: int, tile_rows: int = TILE_ROWS):
    """Group candidates by user; -> (order, cand_start, tile_start, grouped)."""
    # Out-of-range indices (-1 and U after the clamp) both land in group U.
    key = torch.remainder(idx.clamp(-1, num_users), num_users + 1).to(torch.int32)
    sorted_key, order = torch.sort(key, stable=True)
    # The group ids are built per call, not cached: a tensor first made during CUDA-graph
    # capture holds its values only once the graph has been replayed.
    group_ids = torch.arange(num_users + 2, dtype=torch.int32, device=idx.device)
    cand_start = torch.searchsorted(sorted_key, group_ids, out_int32=True)
    tiles = group_tiles(cand_start, rows_per_cand, tile_rows)
    tile_start = torch.zeros(num_users + 2, dtype=torch.int32, device=idx.device)
    tile_start[1:] = torch.cumsum(tiles, dim=0, dtype=torch.int32)
    grouped = (key[1:] >= key[:-1]).all().to(torch.int32).reshape(1)
    return order.to(torch.int32), cand_start, tile_start, grouped


def group_tiles(cand_start: torch.Tensor, rows_per_cand: int, tile_rows: int = TILE_ROWS) -> torch.Tensor:
    """Tiles of each group (int64, in group order): its candidates' query rows, from ``cand_start``,
    one run cut into tiles of ``tile_rows`` rows."""
    counts = (cand_start[1:] - cand_start[:-1]).long()
    return (counts * rows_per_cand + (tile_rows - 1)).div_(tile_rows, rounding_mode="floor")


def key_bucket(blocks: torch.Tensor) -> torch.Tensor:
    """A non-decreasing bucket of a key-block count (int tensor, >= 0): the count itself below
    16, then four buckets per power of two (so at most 99 for counts below 2**25)."""
    b = blocks.long()
    # The exponent of frexp is exact (a floating log2 is not on every device: log2(64) < 6).
    msb = torch.frexp(b.clamp(min=1).double()).exponent.long() - 1
    quarter = (b >> (msb - 2).clamp(min=0)) & 3
    return torch.where(b < 16, b, 16 + (msb - 4) * 4 + quarter)


def kv_tile_order(cand_start: torch.Tensor, keys: torch.Tensor, rows_per_cand: int, tile_rows: int = TILE_ROWS):
    """The groups longest first -> (perm [U + 1], tile_start [U + 2] by position), int32, from
    the work list's ``cand_start`` and each user's key count ``keys`` [U] (as the attention
    kernel counts them, in blocks of 128 keys); here stable within a bucket."""
    blocks = torch.zeros(keys.shape[0] + 1, dtype=torch.int64, device=keys.device)
    blocks[:-1] = (keys.long().clamp(min=0) + (TILE_ROWS - 1)).div(TILE_ROWS, rounding_mode="floor")
    perm = torch.sort(key_bucket(blocks), descending=True, stable=True).indices
    tiles = group_tiles(cand_start, rows_per_cand, tile_rows)
    tile_start = torch.zeros(keys.shape[0] + 2, dtype=torch.int32, device=keys.device)
    tile_start[1:] = torch.cumsum(tiles[perm], dim=0, dtype=torch.int32)
    return perm.to(torch.int32), tile_start


def max_tiles_per_head(batch: int, num_users: int, rows_per_cand: int, tile_rows: int = TILE_ROWS) -> int:
    """Host-side upper bound of tile_start[U + 1] (sizes the persistent grid without a sync)."""
    # Each non-empty group adds at most one partly filled tile.
    return -(-batch * rows_per_cand // tile_rows) + min(batch, num_users + 1)
