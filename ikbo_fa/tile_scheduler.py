"""The attention forward kernel's tile scheduler: tile number -> the work of that tile.

A launch's tiles are numbered 0 .. total - 1 and a persistent grid walks them (CTA c, or
cluster c of split pairs, takes c, c + G, c + 2 G, ...: ``cute_kernels.scheduler.strided_tiles``;
with ``dynamic_walk`` CTA c takes c, then G plus what a counter in global memory hands it each
time its producer starts on a tile: ``cute_kernels.scheduler.TileCounter``).
``AttentionTileScheduler.tile_info(t, g, sched)`` maps a tile number to its ``TileInfo``: the
head, the K/V row and key range, the query rows (KV broadcast: ``tile_m`` (128 or 192)
consecutive rows of a user's run of grouped candidates; Q broadcast: one candidate's chunk), the
split and the head of out it writes. The order, per configuration (``AttentionConfig``):

- head slowest, then group, then tile within the group (users in order: CTAs running together
  share a user's K/V through L2);
- ``ordered`` (KV broadcast with kv_lengths or jagged K/V, ``longest_first``): the groups in the work list's
  ``perm`` order (longest first), heads fastest, and the walk turned back every other round
  (round r of G hands CTA c position r G + c, or r G + n - 1 - c on odd rounds of n positions);
- ``split_kv``: every tile ``n_splits`` times, split slowest; ``split_pair``: both CTAs of a
  cluster take the same tile, CTA r split r;
- ``tail_split``: the first W of the T tiles whole, then the other T - W tiles ``n_splits``
  times each, split slowest, so the last round's few tiles spread over the grid instead of
  leaving most of it idle. W is G * floor(T / G) (the tiles of the grid's full rounds) moved
  back to the first tile of its group: a user's tiles are all whole or all split, so the order
  of candidates within a user (open where idx is not grouped) never moves a row from one to the
  other, and a call gives the same bits every run;
- ``dynamic_walk`` (ordered tiles handed out by a counter, not strided): the groups in ``perm``
  order, then tile within the group, then split, heads fastest, with no turning back: a row's
  pieces next to each other, the longest rows' first.

``tile_info_host`` is its twin on the host (Python ints, torch tensors): the same mapping, step
for step, for the test emulation and for checking the walk on the CPU. The order itself is
``position`` (and its twin ``position_host``): a new tile order is a scheduler class with these
two methods (``CounterTileScheduler``: the dynamic walk's), picked by ``tile_scheduler(cfg)``,
not an edit of the kernel.
"""
from __future__ import annotations

import bisect
import dataclasses

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from cute_kernels.scheduler import warp_search

from .config import AttentionConfig, row_packing


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The tile space of one launch (device values, read-only in every role)."""

    total_tiles: Int32
    tiles_per_head: Int32
    n_q_batch: Int32
    n_kv_batch: Int32
    n_heads: Int32
    n_kv_heads: Int32
    kv_len: Int32  # keys per K/V row (jagged: total_L, the rows of the packed K/V)
    max_keys: Int32  # jagged: the longest history a row may have (the op's max_kv_len)
    q_flat: cutlass.Boolean  # q and out hold a user's query rows at one stride (checked by the op)
    n_splits: Int32  # split_kv: CTAs per (tile, head), each over split_keys of the row's keys
    split_keys: Int32  # split_kv, split_pair: keys per split, a multiple of 128 (the key block wherever keys are split)
    rank: Int32  # split_pair: this CTA's split (its rank in the cluster); 0 otherwise
    # tail_split: the tiles that run whole, the first ones up to the grid's last full round
    # (AttentionTileScheduler.whole_tiles); 0 otherwise
    whole_tiles: Int32 = 0

    def group(self):
        """Query heads per K/V head."""
        return self.n_heads // self.n_kv_heads


@dataclasses.dataclass(frozen=True)
class TileInfo:
    """What the producer looked up for one tile; written to shared memory with the tile's Q
    (``store``) and read back by the consumers (``load``), so they never search the work list.

    KV broadcast: the tile is rows ``row0 : row0 + tile_m`` of its user's run of query rows
    (candidate ``order[first + i]`` holds rows i * S_q : (i + 1) * S_q of the run)."""

    head: Int32
    kv_coord: Int32  # K/V batch row (a user, or a candidate for Q broadcast); jagged: its offsets entry
    first: Int32  # KV: work-list position of the user's first candidate; Q: the candidate
    n_valid: Int32  # KV: rows of the tile that hold a query row (1 to tile_m)
    chunk: Int32  # Q: 128-row chunk of the candidate (S_q > 64)
    q_coord: Int32  # KV: row of q (as [B * S_q] rows) of the tile's first row; Q: query batch row
    row0: Int32  # KV: the tile's first row in its user's run
    flat: cutlass.Boolean  # KV: the tile's rows are consecutive rows of q and out (idx grouped)
    invalid: cutlass.Boolean  # out-of-range index: the tile writes NaN
    n_keys: Int32  # split_kv: the keys of this split
    kv_base: Int32  # jagged: the row's first key in the packed K/V; split_kv: plus the split's first
    out_head: Int32  # the head of out / lse it writes (split_kv: split * H + head of the workspace)
    # whole_rows_out: 1 on split 0 of a row whose keys fit one split (or whose index is out of
    # range): the tile writes out and lse directly (out_head is the head); 0 on its other splits.
    whole: Int32 = 0

    FIELDS = 13  # Int32 words in shared memory
    KV_BASE = 10  # the word of kv_base
    WHOLE = 12  # the word of whole, read by the consumers once the main loop is done
    END = -1  # dynamic_walk: a head word of END in a Q stage says the CTA's tiles are done

    @staticmethod
    def store_end(sMeta, stage: Int32):
        sMeta[0, stage] = Int32(TileInfo.END)

    @staticmethod
    def is_tile(sMeta, stage: Int32):
        """Whether the Q stage holds a tile (not the END mark)."""
        return sMeta[0, stage] != Int32(TileInfo.END)

    @cute.jit
    def store(self, sMeta, stage: Int32):
        words = (self.head, self.kv_coord, self.first, self.n_valid, self.chunk, self.q_coord, self.row0,
                 Int32(1) if self.flat else Int32(0), Int32(1) if self.invalid else Int32(0), self.n_keys,
                 self.kv_base, self.out_head, self.whole)
        for i in cutlass.range_constexpr(TileInfo.FIELDS):
            sMeta[i, stage] = words[i]

    @staticmethod
    def load(sMeta, stage: Int32, dense: bool, split: bool = False) -> "TileInfo":
        """The fields the consumers keep through the main loop: those of the configuration (the
        others are constants, registers the consumers, at their limit, keep free); kv_base is
        read from shared memory where it is needed (``KV_BASE``)."""
        m = [sMeta[i, stage] for i in range(TileInfo.WHOLE)]
        row0, flat = (m[6], m[7] != 0) if dense else (Int32(0), False)
        return TileInfo(m[0], m[1], m[2], m[3], m[4], m[5], row0, flat, m[8] != 0, m[9], Int32(0),
                        m[11] if split else m[0])


class AttentionTileScheduler:
    """Tile number -> TileInfo for one configuration (compile-time fields only)."""

    def __init__(self, cfg: AttentionConfig):
        self.tile_m = cfg.tile_m  # KV broadcast: query rows per tile (Q broadcast: 128)
        self.s_q = cfg.s_q
        self.dense = cfg.direction == "kv"  # KV broadcast: a user's query rows as one dense run
        self.chunks = 1 if self.dense else row_packing(cfg.s_q)[2]  # Q broadcast: 128-row chunks per candidate
        self.ordered = cfg.ordered
        self.split_kv = cfg.split_kv
        self.tail_split = cfg.tail_split
        self.whole_rows = cfg.whole_rows_out
        self.key_split = cfg.split_kv or cfg.split_pair
        self.cluster_size = 2 if cfg.split_pair else 1
        self.has_kv_lengths = cfg.has_kv_lengths
        self.jagged = cfg.jagged

    @cute.jit
    def position(self, t: Int32, sched: Schedule):
        """Tile t -> (split, head, tile of the head): the walk's order (the module docstring)."""
        split = sched.rank
        h = Int32(0)
        rem = Int32(0)
        if const_expr(self.ordered):
            grid, _, _ = cute.arch.grid_dim()
            G = Int32(grid) // self.cluster_size  # the walk's width, in clusters
            r = t // G
            c = t - r * G
            if r % 2 == 1:
                c = cutlass.min(G, sched.total_tiles - r * G) - 1 - c
            t = r * G + c
        if const_expr(self.tail_split):
            whole = sched.whole_tiles
            if t >= whole:
                tail = cutlass.max(sched.tiles_per_head * sched.n_heads - whole, 1)
                split = (t - whole) // tail
                t = t - split * tail
        elif const_expr(self.split_kv):
            per_split = sched.tiles_per_head * sched.n_heads
            split = t // per_split
            t = t - split * per_split
        if const_expr(self.ordered):
            rem = t // sched.n_heads
            h = t - rem * sched.n_heads
        else:
            h = t // sched.tiles_per_head
            rem = t - h * sched.tiles_per_head
        return split, h, rem

    @cute.jit
    def whole_tiles(self, tiles_per_head: Int32, n_heads: Int32, mTileStart, n_groups: Int32):
        """``tail_split``: how many tiles (of ``tiles_per_head`` over ``n_heads`` heads) run whole: those
        of the grid's full rounds, back to the first tile of the group (``mTileStart`` over
        ``n_groups`` groups) that the first split tile would fall in. Every warp that calls it
        searches (cute_kernels.scheduler.warp_search) and gets the answer."""
        grid, _, _ = cute.arch.grid_dim()
        tiles = tiles_per_head * n_heads
        whole = tiles - tiles % Int32(grid)
        h = whole // cutlass.max(tiles_per_head, 1)
        rem = whole - h * tiles_per_head
        if rem > 0:
            g = warp_search(mTileStart, rem, Int32(0), n_groups)
            whole = h * tiles_per_head + mTileStart[g]
        return whole

    def whole_tiles_host(self, tiles_per_head: int, n_heads: int, tile_start, grid: int) -> int:
        """``whole_tiles`` on the host (``tile_start``: the groups' first tiles, a sequence)."""
        tiles = tiles_per_head * n_heads
        whole = tiles - tiles % grid
        h, rem = divmod(whole, max(tiles_per_head, 1))
        if rem > 0:
            starts = [int(x) for x in tile_start]
            whole = h * tiles_per_head + starts[bisect.bisect_right(starts, rem) - 1]
        return whole

    def position_host(self, t: int, sched: Schedule, grid: int) -> tuple:
        """``position`` on the host (``grid``: the launch's CTA count, the walk's width)."""
        split = sched.rank
        if self.ordered:
            G = grid // self.cluster_size
            r, c = divmod(t, G)
            if r % 2 == 1:
                c = min(G, sched.total_tiles - r * G) - 1 - c
            t = r * G + c
        if self.tail_split:
            tiles = sched.tiles_per_head * sched.n_heads
            whole = sched.whole_tiles
            if t >= whole:
                split, rest = divmod(t - whole, max(tiles - whole, 1))
                t = whole + rest
        elif self.split_kv:
            split, t = divmod(t, sched.tiles_per_head * sched.n_heads)
        if self.ordered:
            rem, h = divmod(t, sched.n_heads)
        else:
            h, rem = divmod(t, sched.tiles_per_head)
        return split, h, rem

    @cute.jit
    def tile_info(self, t: Int32, g, sched: Schedule) -> TileInfo:
        """Tile t -> its TileInfo, on the device (KV broadcast: a search over the groups' first
        tiles by the whole warp, which calls it). ``g``: the work list's tensors (``cand``,
        ``cand_start``, ``tile_start``, ``perm``) and the rows' keys (``kv_lengths``,
        ``kv_offsets``), as ``fwd_args.GlobalTensors`` holds them."""
        mCand, mCandStart, mTileStart, mPerm = g.cand, g.cand_start, g.tile_start, g.perm
        mKvLen, mKvOffsets = g.kv_lengths, g.kv_offsets
        split, h, rem = self.position(t, sched)
        first = Int32(0)
        n_valid = Int32(self.tile_m)
        chunk = Int32(0)
        q_coord = Int32(0)
        row0 = Int32(0)
        kv_coord = Int32(0)
        invalid = False
        if const_expr(self.dense):
            # Group u with tile_start[u] <= rem < tile_start[u + 1]; group n_kv_batch
            # holds the candidates whose index is out of range.
            # All 32 lanes of the producer warp search at once (warp_search: one round of loads
            # for up to 64 groups, two up to 4,096, where a binary search waits on one load after
            # another).
            lo = warp_search(mTileStart, rem, Int32(0), sched.n_kv_batch + 1)
            # The group's query rows are one run; this is its tile j. ordered: position lo of
            # tile_start holds group perm[lo].
            g = lo
            if const_expr(self.ordered):
                g = mPerm[lo]
            first = mCandStart[g]
            row0 = (rem - mTileStart[lo]) * self.tile_m
            n_valid = cutlass.min((mCandStart[g + 1] - first) * self.s_q - row0, self.tile_m)
            q_coord = first * self.s_q + row0
            invalid = g == sched.n_kv_batch
            kv_coord = g
            if invalid:
                kv_coord = Int32(0)
        else:
            b = rem // self.chunks
            chunk = rem - b * self.chunks
            first = b
            kv_coord = b
            q_coord = mCand[b]
            invalid = q_coord < 0 or q_coord >= sched.n_q_batch
            if invalid:
                q_coord = Int32(0)
        n_keys, kv_base = self.row_keys(kv_coord, mKvLen, mKvOffsets, sched.kv_len, sched.max_keys)
        out_head = h
        whole = Int32(0)
        whole_tile = False  # tail_split: a tile of the whole rounds, all of its keys
        if const_expr(self.tail_split):
            whole_tile = t < sched.whole_tiles
        if const_expr(self.whole_rows):
            if whole_tile or (split == 0 and (invalid or n_keys <= sched.split_keys)):
                whole = Int32(1)
        if const_expr(self.key_split):
            if not whole_tile:
                start = split * sched.split_keys
                n_keys = cutlass.min(cutlass.max(n_keys - start, 0), sched.split_keys)
                kv_base = kv_base + start
        if const_expr(self.split_kv):
            if whole == 0:
                out_head = split * sched.n_heads + h
        if invalid:
            n_keys = Int32(0)
        return TileInfo(h, kv_coord, first, n_valid, chunk, q_coord, row0, sched.q_flat, invalid, n_keys, kv_base,
                        out_head, whole)

    @cute.jit
    def row_keys(self, row: Int32, mKvLen, mKvOffsets, kv_len: Int32, max_keys: Int32):
        """(keys, first key) of K/V row ``row``: ``kv_len`` and 0 over padded K/V; its kv_lengths
        entry; or its kv_offsets span, clamped into the packed K/V (offsets the op did not validate
        never lead outside it) and to ``max_keys``."""
        n_keys = kv_len
        kv_base = Int32(0)
        if const_expr(self.has_kv_lengths):
            n_keys = mKvLen[row]
        if const_expr(self.jagged):
            kv_base = cutlass.min(cutlass.max(mKvOffsets[row], 0), kv_len)
            end = cutlass.min(cutlass.max(mKvOffsets[row + 1], kv_base), kv_len)
            n_keys = cutlass.min(end - kv_base, max_keys)
        return n_keys, kv_base

    def tile_info_host(self, t: int, g, sched: Schedule, grid: int) -> TileInfo:
        """``tile_info`` on the host: ``g``'s fields are torch tensors (or None), ``sched``'s
        Python ints, ``grid`` the launch's CTA count (the walk's width)."""
        item = lambda x, i: int(x[i])  # noqa: E731
        split, h, rem = self.position_host(t, sched, grid)
        first, n_valid, chunk, q_coord, row0, kv_coord, invalid = 0, self.tile_m, 0, 0, 0, 0, False
        if self.dense:
            starts = g.tile_start[:sched.n_kv_batch + 1].tolist()
            lo = bisect.bisect_right(starts, rem) - 1  # warp_search
            grp = item(g.perm, lo) if self.ordered else lo
            first = item(g.cand_start, grp)
            row0 = (rem - starts[lo]) * self.tile_m
            n_valid = min((item(g.cand_start, grp + 1) - first) * self.s_q - row0, self.tile_m)
            q_coord = first * self.s_q + row0
            invalid = grp == sched.n_kv_batch
            kv_coord = 0 if invalid else grp
        else:
            b, chunk = divmod(rem, self.chunks)
            first = kv_coord = b
            q_coord = item(g.cand, b)
            invalid = not 0 <= q_coord < sched.n_q_batch
            if invalid:
                q_coord = 0
        n_keys, kv_base = sched.kv_len, 0
        if self.has_kv_lengths:
            n_keys = item(g.kv_lengths, kv_coord)
        if self.jagged:
            kv_base = min(max(item(g.kv_offsets, kv_coord), 0), sched.kv_len)
            end = min(max(item(g.kv_offsets, kv_coord + 1), kv_base), sched.kv_len)
            n_keys = min(end - kv_base, sched.max_keys)
        out_head = h
        whole_tile = self.tail_split and t < sched.whole_tiles
        whole = int(self.whole_rows and (whole_tile or (split == 0 and (invalid or n_keys <= sched.split_keys))))
        if self.key_split and not whole_tile:
            start = split * sched.split_keys
            n_keys = min(max(n_keys - start, 0), sched.split_keys)
            kv_base += start
        if self.split_kv and not whole:
            out_head = split * sched.n_heads + h
        if invalid:
            n_keys = 0
        return TileInfo(h, kv_coord, first, n_valid, chunk, q_coord, row0, sched.q_flat, invalid, n_keys, kv_base,
                        out_head, whole)


class CounterTileScheduler(AttentionTileScheduler):
    """``dynamic_walk``: ordered tiles handed out by a counter (``cute_kernels.scheduler.TileCounter``),
    numbered group (longest first), tile within the group, split, head: a row's pieces next to
    each other, with no turning back (a CTA that frees up takes the next one, whatever its round)."""

    @cute.jit
    def position(self, t: Int32, sched: Schedule):
        per_tile = sched.n_heads * (sched.n_splits if const_expr(self.split_kv) else 1)
        rem = t // per_tile
        x = t - rem * per_tile
        split = x // sched.n_heads
        return split, x - split * sched.n_heads, rem

    def position_host(self, t: int, sched: Schedule, grid: int) -> tuple:
        rem, x = divmod(t, sched.n_heads * (sched.n_splits if self.split_kv else 1))
        split, h = divmod(x, sched.n_heads)
        return split, h, rem


def tile_scheduler(cfg: AttentionConfig) -> AttentionTileScheduler:
    """The scheduler of configuration ``cfg``: tiles from a counter (``dynamic_walk``) or strided."""
    return (CounterTileScheduler if cfg.dynamic_walk else AttentionTileScheduler)(cfg)
