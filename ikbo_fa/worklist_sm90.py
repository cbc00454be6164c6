"""The KV-broadcast work list in one launch (sm_90a): class KvWorklistSm90.

Produces exactly what :func:`ikbo_fa.worklist.kv_worklist` produces (the
torch reference), except that the order of candidates within a user is not
fixed unless idx is grouped already: ``order`` [B], ``cand_start`` [U + 2],
``tile_start`` [U + 2] and ``grouped`` [1] (int32), with the out-of-range
indices in group U. Built with ``keys`` ("lengths" or "offsets"), it also orders
the groups longest first as :func:`ikbo_fa.worklist.kv_tile_order` does
(``perm`` [U + 1], and ``tile_start`` by position in it), the order within a
bucket left open.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory
import torch
from cutlass import Int32, Uint32, const_expr

from cute_kernels.compile import compile_kernel, kernel_cache
from cute_kernels.interop import cutlass_dtype, fake_stream, fake_tensor

from .config import TILE_M_CHOICES
from .fwd_args import FwdWorkList, WorkListScalars
from .worklist import TILE_ROWS

FULL_MASK = 0xFFFFFFFF


class KvWorklistSm90:
    """Counting sort of the candidates by user, in one CTA.

    One CTA of 1024 threads, no warp specialization; shared memory holds one
    int32 counter per group (U users + the out-of-range group), so U + 1 must
    not exceed ``CAPACITY``. Phases, separated by CTA barriers:
      1. zero the counters;
      2. histogram: each thread reads ``UNROLL`` indices at a stride of 1024
         (loads in flight together); lanes of a warp with the same group are
         matched (match.any) and their lowest lane adds the group's count with
         one shared-memory atomic; a thread that sees a group key below the one
         before it marks idx as not grouped (one shared flag);
      3. scan: each thread sums a contiguous run of groups (candidates, and
         tiles of ``tile_rows`` rows as in ``kv_worklist``); a CTA-wide exclusive scan of the two
         sums (warp shuffles, then one warp over the 32 warp totals) gives each
         run's offsets; the run is walked again writing cand_start /
         tile_start and resetting each counter to its group's first position;
      4. scatter: idx grouped already: ``order`` is 0, 1, ..., B - 1 (the stable
         order, which lets the attention kernel load a tile's query rows in one
         box). Otherwise, as in 2, the lowest lane claims consecutive slots for
         its peers with one atomic; the peers write their candidate indices to
         ``order`` in lane order. Warps claim in whatever order their atomics
         land, so the order within a user can change from run to run (the
         attention result does not depend on it).
      5. (``keys`` only) order the groups: each group's key count (kv_lengths as given,
         clamped by the op; or kv_offsets clamped as the attention kernel clamps them) in
         key blocks, bucketed (``key_bucket``); a histogram of the buckets, one warp's
         exclusive scan of it from the top bucket down, then each group claims its rank
         in its bucket with one shared-memory atomic and writes ``perm``; the tile scan of
         3 runs again over the groups in ``perm`` order, rewriting ``tile_start``; thread 0
         zeroes ``walk``, the attention kernel's tile counter (``dynamic_walk``).
    It first lets the attention kernel queued after it launch (programmatic
    dependent launch); that kernel waits for this grid before reading. It is
    itself launched so (its launch and phase 1 overlap the kernel before it) and
    waits for that kernel before it touches global memory.
    No pipelines, no named barriers.
    """

    NUM_THREADS = 1024
    UNROLL = 8
    # int32 counters: 224 KiB of the 227 KiB a CTA may use.
    CAPACITY = 57344
    BUCKETS = 128  # key_bucket is below 100 for any int32 key count

    def __init__(self, idx_dtype, keys=None, tile_rows: int = TILE_ROWS):
        if keys not in (None, "lengths", "offsets"):
            raise ValueError(f"KvWorklistSm90: keys must be None, 'lengths' or 'offsets', got {keys!r}")
        if tile_rows not in TILE_M_CHOICES:
            raise ValueError(f"KvWorklistSm90: tile_rows must be one of {TILE_M_CHOICES}, got {tile_rows!r}")
        self.idx_dtype = idx_dtype
        self.keys = keys
        self.tile_rows = tile_rows  # the attention tile's query rows (AttentionConfig.tile_m)

    @cute.jit
    def __call__(
        self,
        mIdx: cute.Tensor,  # [B] int32 or int64
        wl: FwdWorkList,  # written: cand (the order) [B], cand_start, tile_start [U + 2], grouped [1], perm, walk
        mRows: cute.Tensor | None,  # keys: kv_lengths [U] or kv_offsets [U + 1], int32
        scalars: WorkListScalars,
        stream,
    ):
        @cute.struct
        class SharedStorage:
            hist: cute.struct.Align[cute.struct.MemRange[Int32, self.CAPACITY], 16]
            scan: cute.struct.MemRange[Int32, 64]
            descents: cute.struct.MemRange[Int32, 1]
            buckets: cute.struct.MemRange[Int32, self.BUCKETS]

        self.shared_storage = SharedStorage
        self.kernel(mIdx, wl, mRows, scalars).launch(grid=[1, 1, 1], block=[self.NUM_THREADS, 1, 1], stream=stream,
                                                      use_pdl=True)

    @cute.kernel
    def kernel(self, mIdx: cute.Tensor, wl: FwdWorkList, mRows: cute.Tensor | None, scalars: WorkListScalars):
        mOrder, mCandStart, mTileStart, mGrouped, mPerm, mWalk = wl
        n_users, rows_per_cand, total_keys, max_keys = scalars
        # The attention kernel that follows is launched with programmatic dependent launch:
        # let it start its prologue now (it waits for this grid to finish before reading).
        cute.arch.griddepcontrol_launch_dependents()
        nt = self.NUM_THREADS
        tidx, _, _ = cute.arch.thread_idx()
        lane = cute.arch.lane_idx()
        warp = tidx // 32
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        sHist = storage.hist.get_tensor(cute.make_layout(self.CAPACITY))
        sScan = storage.scan.get_tensor(cute.make_layout(64))
        sDescents = storage.descents.get_tensor(cute.make_layout(1))
        n_cand = Int32(mIdx.shape[0])
        n_groups = n_users + 1

        for g in cutlass.range(tidx, n_groups, nt):
            sHist[g] = Int32(0)
        if tidx == 0:
            sDescents[0] = Int32(0)
        # Launched with programmatic dependent launch itself: the launch and the setup above
        # overlap the kernel before it on the stream, which may still write idx (or read the
        # arrays written below): no global memory is touched before this wait.
        cute.arch.griddepcontrol_wait()
        cute.arch.sync_threads()

        count_groups(mIdx, sHist, sDescents, n_cand, n_users, tidx, nt, self.UNROLL)
        cute.arch.sync_threads()

        lo, hi = scan_groups(sHist, mCandStart, mTileStart, n_groups, rows_per_cand, self.tile_rows, nt, sScan, tidx,
                             warp, lane)
        grouped = sDescents[0] == 0  # written before the barriers above, read after
        if tidx == 0:
            mGrouped[0] = Int32(1) if grouped else Int32(0)
        cute.arch.sync_threads()

        if grouped:
            for i in cutlass.range(tidx, n_cand, nt):
                mOrder[i] = i
        else:
            self.scatter(mIdx, mOrder, sHist, n_cand, n_users, tidx)
        if const_expr(self.keys is not None):
            sBuckets = storage.buckets.get_tensor(cute.make_layout(self.BUCKETS))
            if tidx == 0:
                mWalk[0] = Int32(0)
                mWalk[1] = Int32(0)
            cute.arch.sync_threads()
            self.order_groups(mCandStart, mTileStart, mPerm, mRows, sBuckets, sScan, n_users, rows_per_cand,
                              total_keys, max_keys, lo, hi, tidx, warp, lane)

    @cute.jit
    def group_bucket(self, mRows, g, n_users: Int32, total_keys: Int32, max_keys: Int32) -> Int32:
        """The key bucket of group g (the out-of-range group U has no keys), counted from the top
        (0: the longest histories)."""
        n = Int32(0)
        if g < n_users:
            if const_expr(self.keys == "lengths"):
                n = mRows[g]
            else:
                start = cutlass.min(cutlass.max(mRows[g], 0), total_keys)
                end = cutlass.min(cutlass.max(mRows[g + 1], start), total_keys)
                n = cutlass.min(end - start, max_keys)
        return Int32(self.BUCKETS - 1) - _key_bucket((cutlass.max(n, 0) + TILE_ROWS - 1) // TILE_ROWS)

    @cute.jit
    def order_groups(self, mCandStart, mTileStart, mPerm, mRows, sBuckets, sScan, n_users: Int32,
                     rows_per_cand: Int32, total_keys: Int32, max_keys: Int32, lo, hi, tidx, warp, lane):
        """Phase 5: perm (the groups by bucket, longest first) and tile_start by position in it."""
        nt = self.NUM_THREADS
        n_groups = n_users + 1
        for b in cutlass.range(tidx, self.BUCKETS, nt):
            sBuckets[b] = Int32(0)
        cute.arch.sync_threads()
        for g in cutlass.range(tidx, n_groups, nt):
            cute.arch.atomic_add(sBuckets.iterator + self.group_bucket(mRows, g, n_users, total_keys, max_keys),
                                 Int32(1))
        cute.arch.sync_threads()
        if warp == 0:  # exclusive scan of the bucket counts, BUCKETS // 32 per lane
            per = self.BUCKETS // 32
            run = Int32(0)
            for i in cutlass.range_constexpr(per):
                run += sBuckets[lane * per + i]
            off = _warp_inclusive_sum(run, lane) - run
            for i in cutlass.range_constexpr(per):
                c = sBuckets[lane * per + i]
                sBuckets[lane * per + i] = off
                off += c
        cute.arch.sync_threads()
        for g in cutlass.range(tidx, n_groups, nt):
            b = self.group_bucket(mRows, g, n_users, total_keys, max_keys)
            rank = cute.arch.atomic_add(sBuckets.iterator + b, Int32(1))
            mPerm[rank] = g
        cute.arch.sync_threads()
        # Tiles by position: the run [lo, hi) of positions of phase 3, now through perm.
        t_sum = Int32(0)
        for j in cutlass.range(lo, hi, 1):
            g = mPerm[j]
            t_sum += group_tiles(mCandStart[g + 1] - mCandStart[g], rows_per_cand, self.tile_rows)
        _, t_off = cta_exclusive_sums(Int32(0), t_sum, sScan, warp, lane)
        for j in cutlass.range(lo, hi, 1):
            g = mPerm[j]
            mTileStart[j] = t_off
            t_off += group_tiles(mCandStart[g + 1] - mCandStart[g], rows_per_cand, self.tile_rows)

    @cute.jit
    def scatter(self, mIdx, mOrder, sHist, n_cand: Int32, n_users: Int32, tidx):
        """Phase 4: each candidate to its slot in ``order``, as in ``count_groups`` the lowest
        lane of each key claiming its peers' slots with one atomic."""
        nt = self.NUM_THREADS
        step = nt * self.UNROLL
        below = cute.arch.lanemask_lt()
        for base in cutlass.range(0, n_cand, step):
            keys = cute.make_rmem_tensor((self.UNROLL,), Int32)
            for j in cutlass.range_constexpr(self.UNROLL):
                i = base + j * nt + tidx
                key = Int32(-1)  # lanes past the end: a group of their own, never counted
                if i < n_cand:
                    key = group_key(mIdx[i], n_users)
                keys[j] = key
            for j in cutlass.range_constexpr(self.UNROLL):
                key = keys[j]
                peers = cute.arch.match_sync(FULL_MASK, key)
                rank = Int32(cute.arch.popc(peers & below))
                first = Int32(0)
                if rank == 0 and key >= 0:
                    first = cute.arch.atomic_add(sHist.iterator + key, Int32(cute.arch.popc(peers)))
                low_bit = peers & (Uint32(0) - peers)
                leader_lane = Int32(cute.arch.popc(low_bit - Uint32(1)))
                first = cute.arch.shuffle_sync(first, leader_lane)
                if key >= 0:
                    mOrder[first + rank] = base + j * nt + tidx


@cute.jit
def count_groups(mIdx, sHist, sFlag, n_cand: Int32, n_users: Int32, tidx, nt: int, unroll: int) -> None:
    """Phase 2: every index's group counted in ``sHist`` (``count_key``), and ``sFlag[0]`` set
    where a key falls below its predecessor's (idx not grouped). Each thread loads ``unroll``
    indices at a stride of ``nt`` (the CTA's threads) before it counts them, so the loads are in
    flight together."""
    below = cute.arch.lanemask_lt()
    for base in cutlass.range(0, n_cand, nt * unroll):
        keys = cute.make_rmem_tensor((unroll,), Int32)
        for j in cutlass.range_constexpr(unroll):
            i = base + j * nt + tidx
            key = Int32(-1)  # lanes past the end: a group of their own, never counted
            if i < n_cand:
                key = group_key(mIdx[i], n_users)
                if i > 0:
                    if key < group_key(mIdx[i - 1], n_users):
                        sFlag[0] = Int32(1)
            keys[j] = key
        for j in cutlass.range_constexpr(unroll):
            count_key(sHist, keys[j], below)


@cute.jit
def group_key(v, n_users: Int32) -> Int32:
    """A candidate's group: its user, or U for an index out of range."""
    key = n_users
    if v >= 0 and v < n_users:
        key = Int32(v)
    return key


@cute.jit
def count_key(sHist, key: Int32, below) -> None:
    """Add one to counter ``key`` (>= 0; a negative key counts nothing) for every lane of the
    warp: the lanes with the same key are matched and the lowest adds their number, one
    shared-memory atomic per key (``below``: this lane's lanemask_lt). Every lane calls it."""
    peers = cute.arch.match_sync(FULL_MASK, key)
    if Int32(cute.arch.popc(peers & below)) == 0 and key >= 0:
        cute.arch.atomic_add(sHist.iterator + key, Int32(cute.arch.popc(peers)))


@cute.jit
def scan_groups(sCount, mCandStart, mTileStart, n_groups: Int32, rows_per_cand: Int32, tile_rows: int, nt: int, sScan,
                tidx, warp, lane):
    """Phase 3: each group's first candidate and first tile from its count (``sCount``, shared
    memory): every thread takes a contiguous run of groups, a CTA-wide exclusive scan gives each
    run's offsets, and the run is walked again writing ``mCandStart`` and ``mTileStart``
    (n_groups + 1 entries) and leaving each group's first candidate in ``sCount``. Every thread
    of the CTA (``nt``) calls it. Returns the thread's run [lo, hi)."""
    per = (n_groups + nt - 1) // nt
    lo = cutlass.min(tidx * per, n_groups)
    hi = cutlass.min(lo + per, n_groups)
    c_sum = Int32(0)
    t_sum = Int32(0)
    for g in cutlass.range(lo, hi, 1):
        c = sCount[g]
        c_sum += c
        t_sum += group_tiles(c, rows_per_cand, tile_rows)
    c_off, t_off = cta_exclusive_sums(c_sum, t_sum, sScan, warp, lane)
    for g in cutlass.range(lo, hi, 1):
        c = sCount[g]
        mCandStart[g] = c_off
        mTileStart[g] = t_off
        sCount[g] = c_off
        c_off += c
        t_off += group_tiles(c, rows_per_cand, tile_rows)
    if tidx == nt - 1:
        mCandStart[n_groups] = c_off
        mTileStart[n_groups] = t_off
    return lo, hi


@cute.jit
def group_tiles(count: Int32, rows_per_cand: Int32, tile_rows: int) -> Int32:
    """Tiles of a group: its candidates' query rows, one run cut into tiles of ``tile_rows`` rows
    (compile time)."""
    return (count * rows_per_cand + tile_rows - 1) // tile_rows


@cute.jit
def _key_bucket(blocks: Int32) -> Int32:
    """ikbo_fa.worklist.key_bucket: the count below 16, then four buckets per power of two."""
    b = blocks
    if blocks >= 16:
        msb = Int32(31) - Int32(cute.arch.clz(blocks))
        b = Int32(16 + (msb - 4) * 4 + ((blocks >> (msb - 2)) & 3))
    return b


@cute.jit
def cta_exclusive_sums(a: Int32, b: Int32, sScan, warp, lane):
    """Exclusive CTA-wide prefix sums of two values per thread (thread order), through sScan
    (64 words); every thread must call it (it has CTA barriers)."""
    a_inc = _warp_inclusive_sum(a, lane)
    b_inc = _warp_inclusive_sum(b, lane)
    if lane == 31:
        sScan[warp] = a_inc
        sScan[32 + warp] = b_inc
    cute.arch.sync_threads()
    if warp == 0:
        x = sScan[lane]
        y = sScan[32 + lane]
        x_inc = _warp_inclusive_sum(x, lane)
        y_inc = _warp_inclusive_sum(y, lane)
        sScan[lane] = x_inc - x
        sScan[32 + lane] = y_inc - y
    cute.arch.sync_threads()
    return sScan[warp] + a_inc - a, sScan[32 + warp] + b_inc - b


@cute.jit
def _warp_inclusive_sum(v: Int32, lane) -> Int32:
    for k in cutlass.range_constexpr(5):
        up = cute.arch.shuffle_sync_up(v, offset=1 << k, mask_and_clamp=0)
        if lane >= (1 << k):
            v += up
    return v


def compile_worklist(idx_dtype, keys=None, keep_ptx: bool = False, ptxas_report: bool = False,
                     tile_rows: int = TILE_ROWS):
    """Compile the work-list kernel for int32 or int64 (torch dtype) indices, sm_90a; ``keys``
    ("lengths" / "offsets") adds the longest-first group order; ``tile_rows``: the attention
    tile's query rows."""
    dt = cutlass_dtype(idx_dtype)
    vec = lambda: fake_tensor(Int32, (None,), align=4)  # noqa: E731
    args = (
        fake_tensor(dt, (None,), align=idx_dtype.itemsize),
        FwdWorkList(vec(), vec(), vec(), fake_tensor(Int32, (1,), align=4), vec() if keys else None,
                    fake_tensor(Int32, (2,), align=4) if keys else None),
        vec() if keys else None,
        WorkListScalars(Int32(1), Int32(1), Int32(0), Int32(0)),
        fake_stream(),
    )
    return compile_kernel(KvWorklistSm90(dt, keys, tile_rows), *args, keep_ptx=keep_ptx, ptxas_report=ptxas_report)


def fits(num_users: int) -> bool:
    """Whether U users (+ the out-of-range group) fit the kernel's shared-memory counters."""
    return num_users + 1 <= KvWorklistSm90.CAPACITY


def worklist_kernel(idx_dtype, keys=None, tile_rows: int = TILE_ROWS):
    """The compiled kernel for ``idx_dtype`` (torch.int32 or torch.int64) and tiles of ``tile_rows``
    query rows, compiled at first use.

    Call: ``fn(idx, FwdWorkList(order, cand_start, tile_start, grouped, perm, walk), rows,
    WorkListScalars(num_users, rows_per_cand, total_keys, max_keys))`` with contiguous int32
    outputs of B, U + 2, U + 2, 1 and (``keys``) U + 1 and 2 entries, on the current stream;
    without ``keys`` perm, walk and rows are None (and the last two scalars ignored).
    """
    key = ("ikbo_fa.worklist_sm90", idx_dtype, keys) + (() if tile_rows == TILE_ROWS else (tile_rows,))
    return kernel_cache.get(key, lambda: compile_worklist(idx_dtype, keys, tile_rows=tile_rows), package="ikbo_fa")


def kv_worklist_sm90(idx, num_users: int, rows_per_cand: int, tile_rows: int = TILE_ROWS):
    """One-launch equivalent of :func:`ikbo_fa.worklist.kv_worklist` (idx contiguous, on an sm_90 GPU);
    -> (order, cand_start, tile_start, grouped) views of one int32 buffer."""
    if not fits(num_users):
        raise ValueError(f"{num_users} users exceed the work-list kernel's {KvWorklistSm90.CAPACITY - 1}")
    b = idx.shape[0]
    buf = torch.empty(b + 2 * (num_users + 2) + 1, dtype=torch.int32, device=idx.device)
    order, cand_start, tile_start, grouped = buf.split([b, num_users + 2, num_users + 2, 1])
    worklist_kernel(idx.dtype, None, tile_rows).fn(idx, FwdWorkList(order, cand_start, tile_start, grouped, None,
                                                                    None), None,
                                                   WorkListScalars(num_users, rows_per_cand, 0, 0))
    return order, cand_start, tile_start, grouped
