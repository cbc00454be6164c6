"""The KV-broadcast work list in one launch (sm_90a): class KvWorklistSm90.

Produces exactly what :func:`ikbo_fa.worklist.kv_worklist` produces (the
torch reference), except that the order of candidates within a user is not
fixed unless idx is grouped already: ``order`` [B], ``cand_start`` [U + 2],
``tile_start`` [U + 2] and ``grouped`` [1] (int32), with the out-of-range
indices in group U.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory
import torch
from cutlass import Int32, Uint32, const_expr

from cute_kernels.compile import compile_kernel, kernel_cache
from cute_kernels.interop import cutlass_dtype, fake_stream, fake_tensor

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
         tiles as in ``kv_worklist``); a CTA-wide exclusive scan of the two
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
    It first lets the attention kernel queued after it launch (programmatic
    dependent launch); that kernel waits for this grid before reading.
    No pipelines, no named barriers.
    """

    NUM_THREADS = 1024
    UNROLL = 8
    # int32 counters: 224 KiB of the 227 KiB a CTA may use.
    CAPACITY = 57344

    def __init__(self, idx_dtype):
        self.idx_dtype = idx_dtype

    @cute.jit
    def __call__(
        self,
        mIdx: cute.Tensor,  # [B] int32 or int64
        mOrder: cute.Tensor,  # [B] int32
        mCandStart: cute.Tensor,  # [U + 2] int32
        mTileStart: cute.Tensor,  # [U + 2] int32
        mGrouped: cute.Tensor,  # [1] int32
        n_users: Int32,
        rows_per_cand: Int32,
        stream,
    ):
        @cute.struct
        class SharedStorage:
            hist: cute.struct.Align[cute.struct.MemRange[Int32, self.CAPACITY], 16]
            scan: cute.struct.MemRange[Int32, 64]
            descents: cute.struct.MemRange[Int32, 1]

        self.shared_storage = SharedStorage
        self.kernel(mIdx, mOrder, mCandStart, mTileStart, mGrouped, n_users, rows_per_cand).launch(
            grid=[1, 1, 1], block=[self.NUM_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mIdx: cute.Tensor, mOrder: cute.Tensor, mCandStart: cute.Tensor, mTileStart: cute.Tensor,
               mGrouped: cute.Tensor, n_users: Int32, rows_per_cand: Int32):
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
        cute.arch.sync_threads()

        self.sweep(mIdx, mOrder, sHist, sDescents, n_cand, n_users, tidx, lane, scatter=False)
        cute.arch.sync_threads()

        # Contiguous run of groups per thread.
        per = (n_groups + nt - 1) // nt
        lo = cutlass.min(tidx * per, n_groups)
        hi = cutlass.min(lo + per, n_groups)
        c_sum = Int32(0)
        t_sum = Int32(0)
        for g in cutlass.range(lo, hi, 1):
            c = sHist[g]
            c_sum += c
            t_sum += _tiles(c, rows_per_cand)
        c_inc = _warp_inclusive_sum(c_sum, lane)
        t_inc = _warp_inclusive_sum(t_sum, lane)
        if lane == 31:
            sScan[warp] = c_inc
            sScan[32 + warp] = t_inc
        cute.arch.sync_threads()
        if warp == 0:
            a = sScan[lane]
            b = sScan[32 + lane]
            a_inc = _warp_inclusive_sum(a, lane)
            b_inc = _warp_inclusive_sum(b, lane)
            sScan[lane] = a_inc - a
            sScan[32 + lane] = b_inc - b
        cute.arch.sync_threads()
        c_off = sScan[warp] + c_inc - c_sum
        t_off = sScan[32 + warp] + t_inc - t_sum
        for g in cutlass.range(lo, hi, 1):
            c = sHist[g]
            mCandStart[g] = c_off
            mTileStart[g] = t_off
            sHist[g] = c_off
            c_off += c
            t_off += _tiles(c, rows_per_cand)
        if tidx == nt - 1:
            mCandStart[n_groups] = c_off
            mTileStart[n_groups] = t_off
        grouped = sDescents[0] == 0  # written before the barriers above, read after
        if tidx == 0:
            mGrouped[0] = Int32(1) if grouped else Int32(0)
        cute.arch.sync_threads()

        if grouped:
            for i in cutlass.range(tidx, n_cand, nt):
                mOrder[i] = i
        else:
            self.sweep(mIdx, mOrder, sHist, sDescents, n_cand, n_users, tidx, lane, scatter=True)

    @cute.jit
    def sweep(self, mIdx, mOrder, sHist, sDescents, n_cand: Int32, n_users: Int32, tidx, lane,
              scatter: cutlass.Constexpr):
        """Histogram (scatter=False; it also flags a key below its predecessor's) or scatter pass
        over all indices."""
        nt = self.NUM_THREADS
        step = nt * self.UNROLL
        below = cute.arch.lanemask_lt()
        for base in cutlass.range(0, n_cand, step):
            keys = cute.make_rmem_tensor((self.UNROLL,), Int32)
            for j in cutlass.range_constexpr(self.UNROLL):
                i = base + j * nt + tidx
                key = Int32(-1)  # lanes past the end: a group of their own, never counted
                if i < n_cand:
                    key = _group_key(mIdx[i], n_users)
                    if const_expr(not scatter):
                        if i > 0:
                            if key < _group_key(mIdx[i - 1], n_users):
                                sDescents[0] = Int32(1)
                keys[j] = key
            for j in cutlass.range_constexpr(self.UNROLL):
                key = keys[j]
                peers = cute.arch.match_sync(FULL_MASK, key)
                rank = Int32(cute.arch.popc(peers & below))
                leader = rank == 0
                if const_expr(not scatter):
                    if leader and key >= 0:
                        cute.arch.atomic_add(sHist.iterator + key, Int32(cute.arch.popc(peers)))
                else:
                    first = Int32(0)
                    if leader and key >= 0:
                        first = cute.arch.atomic_add(sHist.iterator + key, Int32(cute.arch.popc(peers)))
                    low_bit = peers & (Uint32(0) - peers)
                    leader_lane = Int32(cute.arch.popc(low_bit - Uint32(1)))
                    first = cute.arch.shuffle_sync(first, leader_lane)
                    if key >= 0:
                        mOrder[first + rank] = base + j * nt + tidx


@cute.jit
def _group_key(v, n_users: Int32) -> Int32:
    """A candidate's group: its user, or U for an index out of range."""
    key = n_users
    if v >= 0 and v < n_users:
        key = Int32(v)
    return key


@cute.jit
def _tiles(count: Int32, rows_per_cand: Int32) -> Int32:
    """Tiles of a group: its candidates' query rows, one run cut into TILE_ROWS-row tiles."""
    return (count * rows_per_cand + TILE_ROWS - 1) // TILE_ROWS


@cute.jit
def _warp_inclusive_sum(v: Int32, lane) -> Int32:
    for k in cutlass.range_constexpr(5):
        up = cute.arch.shuffle_sync_up(v, offset=1 << k, mask_and_clamp=0)
        if lane >= (1 << k):
            v += up
    return v


def compile_worklist(idx_dtype, keep_ptx: bool = False, ptxas_report: bool = False):
    """Compile the work-list kernel for int32 or int64 (torch dtype) indices, sm_90a."""
    dt = cutlass_dtype(idx_dtype)
    args = (
        fake_tensor(dt, (None,), align=idx_dtype.itemsize),
        fake_tensor(Int32, (None,), align=4),
        fake_tensor(Int32, (None,), align=4),
        fake_tensor(Int32, (None,), align=4),
        fake_tensor(Int32, (1,), align=4),
        Int32(1),
        Int32(1),
        fake_stream(),
    )
    return compile_kernel(KvWorklistSm90(dt), *args, keep_ptx=keep_ptx, ptxas_report=ptxas_report)


def fits(num_users: int) -> bool:
    """Whether U users (+ the out-of-range group) fit the kernel's shared-memory counters."""
    return num_users + 1 <= KvWorklistSm90.CAPACITY


def worklist_kernel(idx_dtype):
    """The compiled kernel for ``idx_dtype`` (torch.int32 or torch.int64), compiled at first use.

    Call: ``fn(idx, order, cand_start, tile_start, grouped, num_users, rows_per_cand)`` with
    contiguous int32 outputs of B, U + 2, U + 2 and 1 entries, on the current stream.
    """
    return kernel_cache.get(
        ("ikbo_fa.worklist_sm90", idx_dtype), lambda: compile_worklist(idx_dtype), package="ikbo_fa"
    )


def kv_worklist_sm90(idx, num_users: int, rows_per_cand: int):
    """One-launch equivalent of :func:`ikbo_fa.worklist.kv_worklist` (idx contiguous, on an sm_90 GPU);
    -> (order, cand_start, tile_start, grouped) views of one int32 buffer."""
    if not fits(num_users):
        raise ValueError(f"{num_users} users exceed the work-list kernel's {KvWorklistSm90.CAPACITY - 1}")
    b = idx.shape[0]
    buf = torch.empty(b + 2 * (num_users + 2) + 1, dtype=torch.int32, device=idx.device)
    order, cand_start, tile_start, grouped = buf.split([b, num_users + 2, num_users + 2, 1])
    worklist_kernel(idx.dtype).fn(idx, order, cand_start, tile_start, grouped, num_users, rows_per_cand)
    return order, cand_start, tile_start, grouped
