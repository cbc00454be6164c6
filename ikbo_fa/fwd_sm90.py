"""IKBO flash attention forward for Hopper (sm_90a): class IkboAttentionFwdSm90."""
from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup

from cute_kernels.compile import compile_kernel
from cute_kernels.interop import fake_stream, fake_tensor

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)
# After a tile's first block the main loop exponentiates each block against the running row
# max as it stands (log2 units, scale applied), without the block's own max, and rescales
# only when a P may exceed 2^STALE_MAX. A move of the max past REDO_MAX (P could overflow,
# or its rescale factor underflow) marks the warp's rows for an exact recompute at the end
# of the tile (``exact_rows``).
STALE_MAX = 8.0
REDO_MAX = 120.0


@dataclasses.dataclass(frozen=True)
class FwdConfig:
    """Everything that changes the generated code (the compile key)."""

    dtype: str  # "bf16" | "fp16"
    head_dim: int  # 64 | 128
    s_q: int  # query rows per candidate (any >= 1)
    direction: str  # "kv": K/V looked up by idx; "q": Q looked up by idx
    has_kv_lengths: bool
    return_lse: bool
    # Issue S of block j before P V of block j-1, the two consumer warpgroups taking turns
    # (False: one block at a time, no turns; a diagnostic path).
    overlap: bool = True


def row_packing(s_q: int):
    """Rows of the 128-row CTA tile given to each candidate.

    Returns (slot_rows R, slots per consumer warpgroup, 128-row chunks per candidate).
    S_q <= 64: candidates share a warpgroup's 64 rows in slots of R = next power of two >= S_q
    (at least 8) rows; S_q > 64: a candidate spans 64-row slots over ceil(S_q / 128) tiles.
    """
    if s_q <= 64:
        r = max(8, 1 << (s_q - 1).bit_length())
        return r, 64 // r, 1
    return 64, 1, (s_q + 127) // 128


_META = 8  # Int32 fields of tile_info, as handed from the producer to the consumers


class _Bar:
    """Named barrier ids (0 is __syncthreads); the class docstring says who uses each."""

    EPILOGUE_WG0 = 1  # + consumer warpgroup index
    V_TAIL = 3  # both consumer warpgroups, after zeroing a V tail
    SCHED_WG0 = 4  # + consumer warpgroup index: that warpgroup's turn to issue its GEMMs


class IkboAttentionFwdSm90:
    """Persistent, warp-specialized IKBO attention forward.

    Warp roles (384 threads, one CTA per SM, grid = min(#SMs, tiles)):
      warpgroup 0 (producer, setmaxnreg 24): warp 0 walks the tile list and
        issues every TMA load: per tile the Q slots, then K/V blocks last to
        first, K one block ahead of V; warps 1-3 idle.
      warpgroups 1, 2 (consumers, setmaxnreg 240): 64 query rows each of the
        128-row tile; S = Q K^T and O += P V on WGMMA (P from registers),
        online softmax in exp2 on fp32 row max/sum. With ``overlap`` the S of
        block j is issued before the P V of block j-1 and the softmax of j runs
        while that P V is in flight; the two warpgroups take turns issuing
        their GEMMs (named barriers 4, 5 below), and after a tile's first block the
        softmax runs against the running max as it stands (rescaling P and O only when a
        P may exceed 2^STALE_MAX). A row whose max moved by more than REDO_MAX (log2
        units) is recomputed exactly on the CUDA cores after the main loop. Both decisions are
        taken per row: a row's result never depends on the other rows of its warp (with
        S_q <= 8, another candidate's).
        Epilogue: O / row_sum into the warpgroup's 64 rows of sO (stmatrix), one TMA
        store per stored slot.

    Scale: ``scale_log2`` must be > 0. Masked keys are -inf before scaling and each
    row's running max is taken over the raw scores; the op maps a scale <= 0 onto
    this (ikbo_fa.attention).

    Launch: programmatic dependent launch, so the CTAs start and set up their
    barriers while the kernel before them (the work list) finishes; every thread
    waits for that grid (griddepcontrol.wait) before touching global memory.

    Pipelines (mbarriers; producer arrive count 1 = one elected lane of warp 0
    with the transaction bytes; consumer arrive count 8 = lane 0 of each
    consumer warp on release):
      Q: ``q_stages`` = 2 stages (the CTA's i-th tile in stage i % 2, so the
         next tile's Q loads while this one runs), bytes = every slot of the 128-row tile;
         released by both consumer warpgroups after the tile's main loop. Each stage
         also carries the tile's info (tile_info: head, user, candidates, key count),
         written to shared memory by the producer between its wait for the free stage
         and its arrive, so the consumers never search the work list themselves.
      K, V: ``stages`` stages each, one shared state; K released after S of a
         block, V after its P V.
    Named barriers (id: thread count; who arrives / syncs):
      1 + wg (wg = consumer warpgroup 0 or 1): 128; warpgroup wg syncs twice
         per tile around its sO writes in the epilogue.
      3: 256; both consumer warpgroups sync once per tile after zeroing a V
         tail (kv_lengths only), before the first P V of the tile.
      4 + wg (``overlap`` only), the GEMM turn of warpgroup wg: 256. Warpgroup
         wg syncs on 4 + wg right before issuing S = Q K^T and P V of a
         main-loop iteration and, once both are issued, arrives (bar.arrive,
         128) on 4 + (1 - wg), handing the turn to the other warpgroup; once,
         before its first tile, warpgroup 0 arrives on its own barrier 4 so it
         takes the first turn. Both warpgroups run the same tiles with the
         same block count, so per tile each does n_blocks - 1 sync/arrive
         pairs and the turns strictly alternate 0, 1, 0, 1, ...: barrier 4
         completes with (warpgroup 0 sync k, warpgroup 1 arrive k - 1 or the
         initial arrive), barrier 5 with (warpgroup 1 sync k, warpgroup 0
         arrive k). The first S of a tile and its last P V are issued outside
         the turns. One arrive is left pending at exit (harmless).
      The softmax of one warpgroup thus runs while the other's GEMMs occupy
      the tensor cores (a ping-pong schedule).
    Before rewriting its sO rows a warpgroup waits (bulk wait_group.read) for
    its previous TMA stores.

    Tiles and order: a tile is (head, group, tile-in-group). KV broadcast:
    groups are users plus a last group of candidates whose index is out of
    range (written as NaN); a user's candidates, grouped on the device
    (worklist.py), fill the slots of its tiles so each K/V block in shared
    memory serves all of them; a user's last tile may have empty slots (they
    load a copy of a valid Q and are never stored). Q broadcast: a group is
    one candidate (Q at idx[b], K/V at b). Tiles run head-slowest, then user,
    then tile within the user, strided by the persistent grid, so CTAs running
    together share a user's K/V through L2.
    """

    def __init__(self, cfg: FwdConfig):
        self.cfg = cfg
        self.dtype = cutlass.BFloat16 if cfg.dtype == "bf16" else cutlass.Float16
        self.head_dim = cfg.head_dim
        self.s_q = cfg.s_q
        self.tile_m = 128
        self.tile_n = 128
        self.stages = 2
        # Two Q stages: the next tile's Q loads while this tile runs (its latency was
        # exposed between tiles with one stage).
        self.q_stages = 2
        self.slot_rows, self.slots_per_wg, self.chunks = row_packing(cfg.s_q)
        self.slots = 2 * self.slots_per_wg
        if cfg.direction == "kv" and cfg.s_q <= 64:
            self.cands_per_tile = self.slots
        else:
            self.cands_per_tile = 1
        self.num_threads = 384
        self.producer_regs = 24
        self.consumer_regs = 240
        self.consumer_warps = 8
        assert self.producer_regs * 128 + self.consumer_regs * 256 <= 65536
        elt = 2
        smem = (1024 + (self.q_stages + 1) * self.tile_m * self.head_dim * elt
                + 2 * self.stages * self.tile_n * self.head_dim * elt)
        assert smem <= 227 * 1024, smem  # barriers (padded to 1024) + sQ stages + sO + sK + sV

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [Bq, S_q, H, D]
        mK: cute.Tensor,  # [Bkv, L, H_kv, D]
        mV: cute.Tensor,  # [Bkv, L, H_kv, D]
        mO: cute.Tensor,  # [B, S_q, H, D]
        mLSE: cute.Tensor | None,  # [B, H, S_q] fp32
        mCand: cute.Tensor,  # kv: candidates grouped by user [B]; q: idx [B] (int32)
        mCandStart: cute.Tensor | None,  # kv: [U + 2] first candidate of each group
        mTileStart: cute.Tensor | None,  # kv: [U + 2] first tile of each group
        mKvLen: cute.Tensor | None,  # [Bkv] int32, clamped to [0, L]
        scale_log2: Float32,
        scale: Float32,
        n_ctas: Int32,
        stream,
    ):
        d, r = self.head_dim, self.slot_rows
        # (rows, D, head, batch) views: TMA boxes are (rows, D) at a (head, batch) coordinate.
        mQ, mO, mK, mV = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))
                          for t in (mQ, mO, mK, mV)]
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.K, Float32,
            atom_layout_mnk=(2, 1, 1), tiler_mn=(64, self.tile_n))
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.MN, Float32,
            atom_layout_mnk=(2, 1, 1), tiler_mn=(64, d), a_source=warpgroup.OperandSource.RMEM)

        # Q/O: K-major 128B-swizzle (rows x 64) panels of all 128 rows; a slot is r rows
        # of each panel, loaded/stored as one (r, 64) TMA box per panel.
        qo_atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(cutlass.tensor_utils.LayoutEnum.ROW_MAJOR, self.dtype, d),
            self.dtype)
        sO_layout = cute.tile_to_shape(qo_atom, (self.tile_m, d), order=(0, 1))
        sQ_layout = cute.tile_to_shape(qo_atom, (self.tile_m, d, self.q_stages), order=(0, 1, 2))
        slot_layout = cute.composition(sO_layout, cute.make_layout((r, d), stride=(1, self.tile_m)))
        kv_atom = qo_atom
        sK_layout = cute.tile_to_shape(kv_atom, (self.tile_n, d, self.stages), order=(0, 1, 2))
        sV_layout = sK_layout

        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mQ, slot_layout, (r, d))
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mK, cute.select(sK_layout, mode=[0, 1]), (self.tile_n, d), 1)
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mV, cute.select(sV_layout, mode=[0, 1]), (self.tile_n, d), 1)
        tma_atom_O, tma_O = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), mO, slot_layout, (r, d))
        # Transaction bytes per stage, counted from the boxes (cute.size_in_bytes would take
        # the cosize of the strided slot layout, which spans more than the slot).
        self.q_bytes = self.slots * r * d * (self.dtype.width // 8)
        self.kv_bytes = self.tile_n * d * (self.dtype.width // 8)

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, self.q_stages * 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            mbar_v: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            tile_meta: cute.struct.MemRange[Int32, self.q_stages * _META]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sO_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]

        self.shared_storage = SharedStorage

        self.kernel(
            tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V, tma_atom_O, tma_O,
            mLSE, mCand, mCandStart, mTileStart, mKvLen, mK, mV,
            mQ.shape[3], mK.shape[3], mQ.shape[2], mK.shape[2], mK.shape[0], mO.shape[3],
            scale_log2, scale,
            tiled_mma_qk, tiled_mma_pv, sQ_layout, sO_layout, slot_layout, sK_layout, sV_layout,
        ).launch(grid=[n_ctas, 1, 1], block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1,
                 use_pdl=True)

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(
        self,
        tma_atom_Q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_atom_K: cute.CopyAtom,
        mK: cute.Tensor,
        tma_atom_V: cute.CopyAtom,
        mV: cute.Tensor,
        tma_atom_O: cute.CopyAtom,
        mO: cute.Tensor,
        mLSE: cute.Tensor | None,
        mCand: cute.Tensor,
        mCandStart: cute.Tensor | None,
        mTileStart: cute.Tensor | None,
        mKvLen: cute.Tensor | None,
        mKg: cute.Tensor,  # (L, D, H_kv, batch) view of K in global memory, for exact_rows
        mVg: cute.Tensor,  # ... and of V
        n_q_batch: Int32,
        n_kv_batch: Int32,
        n_heads: Int32,
        n_kv_heads: Int32,
        kv_len: Int32,
        n_out: Int32,
        scale_log2: Float32,
        scale: Float32,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        sQ_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        slot_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == 0:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O):
                cpasync.prefetch_descriptor(atom)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.consumer_warps)
        pipe_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_q.data_ptr(), num_stages=self.q_stages, producer_group=producer,
            consumer_group=consumers, tx_count=self.q_bytes, defer_sync=True)
        pipe_k = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_k.data_ptr(), num_stages=self.stages, producer_group=producer,
            consumer_group=consumers, tx_count=self.kv_bytes, defer_sync=True)
        pipe_v = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_v.data_ptr(), num_stages=self.stages, producer_group=producer,
            consumer_group=consumers, tx_count=self.kv_bytes, defer_sync=True)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        # Launched with programmatic dependent launch: everything above overlaps the kernel
        # before this one on the stream (the work list); no global memory is touched above.
        cute.arch.griddepcontrol_wait()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        # The producer's tile_info for the tile in each Q stage, handed to the consumers with its Q.
        sMeta = storage.tile_meta.get_tensor(cute.make_layout((_META, self.q_stages)))
        # (D, n, stage) view of V: the MN-major B operand of O += P V.
        sVt = cute.composition(
            sV, cute.make_ordered_layout((self.head_dim, self.tile_n, self.stages), order=(1, 0, 2)))

        if const_expr(self.cfg.direction == "kv"):
            tiles_per_head = mTileStart[n_kv_batch + 1]
        else:
            tiles_per_head = n_out * self.chunks
        total_tiles = tiles_per_head * n_heads
        sched = (total_tiles, tiles_per_head, n_q_batch, n_kv_batch, n_heads, n_kv_heads, kv_len)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.load(tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mV, sQ, sK, sV, sMeta,
                          pipe_q, pipe_k, pipe_v, mCand, mCandStart, mTileStart, mKvLen, sched)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self.mma(tiled_mma_qk, tiled_mma_pv, tma_atom_O, mO, mLSE, sQ, sK, sV, sVt, sO, sMeta,
                     pipe_q, pipe_k, pipe_v, mCand, mCandStart, mTileStart, mKvLen, mKg, mVg, sched,
                     scale_log2, scale, tidx - 128)

    # ------------------------------------------------------------ work list
    @cute.jit
    def tile_info(self, t: Int32, mCand, mCandStart, mTileStart, mKvLen, sched):
        """Tile t -> (head, kv batch coord, first candidate position or candidate b,
        valid candidates, chunk, query batch coord, invalid flag, valid keys)."""
        total_tiles, tiles_per_head, n_q_batch, n_kv_batch, n_heads, n_kv_heads, kv_len = sched
        h = t // tiles_per_head
        rem = t - h * tiles_per_head
        first = Int32(0)
        n_valid = Int32(1)
        chunk = Int32(0)
        q_coord = Int32(0)
        kv_coord = Int32(0)
        invalid = False
        if const_expr(self.cfg.direction == "kv"):
            # Group u with tile_start[u] <= rem < tile_start[u + 1]; group n_kv_batch
            # holds the candidates whose index is out of range.
            lo = Int32(0)
            hi = n_kv_batch + 1
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if mTileStart[mid] <= rem:
                    lo = mid
                else:
                    hi = mid
            j = rem - mTileStart[lo]
            if const_expr(self.chunks == 1):
                first = mCandStart[lo] + j * self.cands_per_tile
                n_valid = cutlass.min(mCandStart[lo + 1] - first, self.cands_per_tile)
            else:
                first = mCandStart[lo] + j // self.chunks
                chunk = j - (j // self.chunks) * self.chunks
            invalid = lo == n_kv_batch
            kv_coord = lo
            if invalid:
                kv_coord = Int32(0)
            q_coord = mCand[first]
        else:
            b = rem // self.chunks
            chunk = rem - b * self.chunks
            first = b
            kv_coord = b
            q_coord = mCand[b]
            invalid = q_coord < 0 or q_coord >= n_q_batch
            if invalid:
                q_coord = Int32(0)
        n_keys = kv_len
        if const_expr(self.cfg.has_kv_lengths):
            n_keys = mKvLen[kv_coord]
        if invalid:
            n_keys = Int32(0)
        return h, kv_coord, first, n_valid, chunk, q_coord, invalid, n_keys

    @cute.jit
    def slot_info(self, s, first: Int32, n_valid: Int32, chunk: Int32, q_coord: Int32, mCand):
        """Slot s of a tile -> (stored?, query batch coord, output batch coord, row block)."""
        valid = True
        row_block = Int32(0)
        q_b = q_coord
        out_b = first
        if const_expr(self.s_q > 64):
            row_block = chunk * 2 + s
            valid = row_block * 64 < self.s_q
            if const_expr(self.cfg.direction == "kv"):
                out_b = q_coord
        elif const_expr(self.cfg.direction == "kv"):
            valid = s < n_valid
            pos = first
            if valid:
                pos = first + s
            q_b = mCand[pos]
            out_b = q_b
        else:
            valid = s == 0
        return valid, q_b, out_b, row_block

    # ------------------------------------------------------------- producer
    @cute.jit
    def load(self, tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mV, sQ, sK, sV, sMeta,
             pipe_q, pipe_k, pipe_v, mCand, mCandStart, mTileStart, mKvLen, sched):
        total_tiles, tiles_per_head, n_q_batch, n_kv_batch, n_heads, n_kv_heads, kv_len = sched
        group = n_heads // n_kv_heads
        d, r = self.head_dim, self.slot_rows
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        t = cute.arch.block_idx()[0]
        n_ctas = cute.arch.grid_dim()[0]
        while t < total_tiles:
            h, kv_coord, first, n_valid, chunk, q_coord, invalid, n_keys = self.tile_info(
                t, mCand, mCandStart, mTileStart, mKvLen, sched)
            h_kv = h // group
            gK = cute.local_tile(mK[None, None, h_kv, kv_coord], (self.tile_n, d), (None, 0))
            gV = cute.local_tile(mV[None, None, h_kv, kv_coord], (self.tile_n, d), (None, 0))
            tKsK, tKgK = cpasync.tma_partition(
                tma_atom_K, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
            tVsV, tVgV = cpasync.tma_partition(
                tma_atom_V, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))
            n_blocks = (n_keys + self.tile_n - 1) // self.tile_n
            # Q first: its other stage was released when the tile before the previous one
            # ended, so this does not wait and the load runs under the previous tile's
            # last blocks. The K stage below waits for the previous tile's K releases.
            # The stage's meta slot is free once its Q is: wait, write the tile's info, then arrive
            # (with the Q bytes to expect), so the consumers' Q wait also covers the info.
            pipeline.PipelineAsync.producer_acquire(pipe_q, q_state)
            meta = (h, kv_coord, first, n_valid, chunk, q_coord, Int32(1) if invalid else Int32(0), n_keys)
            for i in cutlass.range_constexpr(_META):
                sMeta[i, q_state.index] = meta[i]
            pipe_q.producer_acquire(q_state, try_acquire_token=True)
            for s in cutlass.range_constexpr(self.slots):
                valid, q_b, out_b, row_block = self.slot_info(s, first, n_valid, chunk, q_coord, mCand)
                gQ = cute.local_tile(mQ[None, None, h, q_b], (r, d), (row_block, 0))
                sQ_s = cute.local_tile(sQ[None, None, q_state.index], (r, d), (s, 0))
                tQsQ, tQgQ = cpasync.tma_partition(
                    tma_atom_Q, 0, cute.make_layout(1), cute.group_modes(sQ_s, 0, 2), cute.group_modes(gQ, 0, 2))
                cute.copy(tma_atom_Q, tQgQ, tQsQ, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
            q_state.advance()
            # Blocks last to first (the consumers' order); block j's K and V share a stage.
            # K runs one block ahead of V (K(j-1) is issued before V(j)): the consumers
            # need S of block j-1 together with P V of block j, and a K stage frees up
            # earlier than a V stage, so the K load no longer waits behind a V release.
            if n_blocks > 0:
                pipe_k.producer_acquire(kv_state)
                cute.copy(tma_atom_K, tKgK[None, n_blocks - 1], tKsK[None, kv_state.index],
                          tma_bar_ptr=pipe_k.producer_get_barrier(kv_state))
            for i in cutlass.range(n_blocks - 1, unroll=1):
                blk = n_blocks - 2 - i
                prev = kv_state.clone()  # block blk + 1, whose V is still to load
                kv_state.advance()
                pipe_k.producer_acquire(kv_state)
                cute.copy(tma_atom_K, tKgK[None, blk], tKsK[None, kv_state.index],
                          tma_bar_ptr=pipe_k.producer_get_barrier(kv_state))
                pipe_v.producer_acquire(prev)
                cute.copy(tma_atom_V, tVgV[None, blk + 1], tVsV[None, prev.index],
                          tma_bar_ptr=pipe_v.producer_get_barrier(prev))
            if n_blocks > 0:
                pipe_v.producer_acquire(kv_state)
                cute.copy(tma_atom_V, tVgV[None, 0], tVsV[None, kv_state.index],
                          tma_bar_ptr=pipe_v.producer_get_barrier(kv_state))
                kv_state.advance()
            t += n_ctas

    # ------------------------------------------------------------ consumers
    @cute.jit
    def mma(self, tiled_mma_qk, tiled_mma_pv, tma_atom_O, mO, mLSE, sQ, sK, sV, sVt, sO, sMeta,
            pipe_q, pipe_k, pipe_v, mCand, mCandStart, mTileStart, mKvLen, mKg, mVg, sched,
            scale_log2: Float32, scale: Float32, tidx: Int32):
        total_tiles, tiles_per_head, n_q_batch, n_kv_batch, n_heads, n_kv_heads, kv_len = sched
        d, r, n = self.head_dim, self.slot_rows, self.tile_n
        wg = cute.arch.make_warp_uniform(tidx // 128)
        warp_in_wg = cute.arch.make_warp_uniform((tidx // 32) % 4)
        wg_mma_qk = tiled_mma_qk.get_slice(wg * 128)
        wg_mma_pv = tiled_mma_pv.get_slice(wg * 128)
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        thr_mma_pv = tiled_mma_pv.get_slice(tidx)
        tSrQ = wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(sQ))
        tSrK = wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(sK))
        tOrV = wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(sVt))
        tOrP = wg_mma_pv.make_fragment_A(wg_mma_pv.partition_shape_A((self.tile_m, n)))
        acc_O = cute.make_rmem_tensor(wg_mma_pv.partition_shape_C((self.tile_m, d)), Float32)
        acc_S_mn = _acc_mn_view(cute.make_rmem_tensor(wg_mma_qk.partition_shape_C((self.tile_m, n)), Float32))
        acc_O_mn = _acc_mn_view(acc_O)
        # Column of each score register, row of each output register.
        # Columns as thread 0's (compile-time) plus this thread's offset: no column registers.
        tScS_mn = _acc_mn_view(tiled_mma_qk.get_slice(0).partition_C(cute.make_identity_tensor((self.tile_m, n))))
        col_offset = _acc_mn_view(thr_mma_qk.partition_C(cute.make_identity_tensor((self.tile_m, n))))[0, 0][1]
        n_rows = cute.size(acc_S_mn, mode=[0])
        row_max = cute.make_rmem_tensor((n_rows,), Float32)
        row_sum = cute.make_rmem_tensor((n_rows,), Float32)

        ctx = SimpleNamespace(
            tiled_mma_qk=tiled_mma_qk, tiled_mma_pv=tiled_mma_pv, tSrQ=tSrQ, tSrK=tSrK, tOrV=tOrV, tOrP=tOrP,
            acc_O=acc_O, acc_O_mn=acc_O_mn, tScS_mn=tScS_mn, col_offset=col_offset,
            row_max=row_max, row_sum=row_sum, corr=cute.make_rmem_tensor((n_rows,), Float32),
            pipe_k=pipe_k, pipe_v=pipe_v, sV=sV, wg=wg,
            # Per row: the largest move of its running max in one rescale of this tile (log2 units).
            jump=cute.make_rmem_tensor((n_rows,), Float32), sQ=sQ, mKg=mKg, mVg=mVg,
            tOcO_mn=_acc_mn_view(thr_mma_pv.partition_C(cute.make_identity_tensor((self.tile_m, d)))))

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        if const_expr(self.cfg.overlap):
            # Warpgroup 0 takes the first GEMM turn.
            if wg == 0:
                cute.arch.barrier_arrive(barrier_id=_Bar.SCHED_WG0, number_of_threads=256)
        t = cute.arch.block_idx()[0]
        n_ctas = cute.arch.grid_dim()[0]
        while t < total_tiles:
            # The producer looked the tile up (a binary search over dependent loads, off the
            # consumers' path); its info arrives with the tile's Q and stays in registers for
            # the epilogue.
            pipe_q.consumer_wait(q_state)
            m = [sMeta[i, q_state.index] for i in range(_META)]
            info = (m[0], m[1], m[2], m[3], m[4], m[5], m[6] != 0, m[7])
            n_keys = info[7]
            n_blocks = (n_keys + n - 1) // n
            acc_O.fill(0.0)
            row_max.fill(-Float32.inf)
            row_sum.fill(0.0)
            ctx.jump.fill(0.0)
            if n_blocks > 0:
                # Blocks run last to first: only the first one processed needs the key mask.
                n_cols = n_keys - (n_blocks - 1) * n
                if const_expr(self.cfg.overlap):
                    kv_state = self.mainloop_overlapped(ctx, kv_state, q_state.index, n_blocks, n_cols,
                                                        scale_log2, tidx)
                else:
                    kv_state = self.mainloop_serial(ctx, kv_state, q_state.index, n_blocks, n_cols,
                                                    scale_log2, tidx)
            if const_expr(self.cfg.overlap):
                redo = False
                for m in cutlass.range_constexpr(n_rows):
                    redo = redo | (ctx.jump[m] > Float32(REDO_MAX))
                if cute.arch.vote_any_sync(redo):
                    self.exact_rows(ctx, q_state.index, n_keys, info[0] // (n_heads // n_kv_heads), info[1],
                                    scale_log2, tidx)
            pipe_q.consumer_release(q_state)
            q_state.advance()
            self.epilogue(acc_O, acc_O_mn, row_max, row_sum, info, tiled_mma_pv, tidx, tma_atom_O, mO, mLSE, sO,
                          mCand, scale_log2, wg, warp_in_wg)
            t += n_ctas
        if warp_in_wg == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def mainloop_serial(self, ctx, kv_state, q_stage: Int32, n_blocks: Int32, n_cols: Int32, scale_log2: Float32,
                        tidx: Int32):
        """Per block: S = Q K^T, wait, softmax, O += P V, wait (the first block is masked)."""
        self.first_block(ctx, kv_state, q_stage, n_cols, scale_log2, tidx)
        kv_state = self.pv_block(ctx, kv_state)
        for i in cutlass.range(n_blocks - 1, unroll=1):
            ctx.pipe_k.consumer_wait(kv_state)
            acc_S = self.gemm_qk(ctx, q_stage, kv_state.index)
            warpgroup.wait_group(0)
            ctx.pipe_k.consumer_release(kv_state)
            self.online_softmax(ctx, acc_S, scale_log2)
            self.rescale_o(ctx, ctx.corr)
            self.convert_p(ctx, acc_S)
            kv_state = self.pv_block(ctx, kv_state)
        return kv_state

    @cute.jit
    def mainloop_overlapped(self, ctx, kv_state, q_stage: Int32, n_blocks: Int32, n_cols: Int32,
                            scale_log2: Float32, tidx: Int32):
        """S of block j is issued before P V of block j-1; the softmax of j runs while P V
        of j-1 is on the tensor cores. The end of the softmax is the path to this
        warpgroup's next GEMM turn, so after the tile's first block it exponentiates against
        the running max as it stands (``softmax_stale_max``) and O is rescaled only in the
        rare block where a P may exceed 2^STALE_MAX (``stale_max_grew``)."""
        self.first_block(ctx, kv_state, q_stage, n_cols, scale_log2, tidx)
        for i in cutlass.range(n_blocks - 1, unroll=1):
            v_state = kv_state.clone()
            kv_state.advance()
            ctx.pipe_k.consumer_wait(kv_state)
            # This warpgroup's turn: the other one is between its GEMM issues and its softmax.
            cute.arch.barrier(barrier_id=_Bar.SCHED_WG0 + ctx.wg, number_of_threads=256)
            acc_S = self.gemm_qk(ctx, q_stage, kv_state.index)
            ctx.pipe_v.consumer_wait(v_state)
            self.gemm_pv(ctx, v_state.index)
            cute.arch.barrier_arrive(barrier_id=_Bar.SCHED_WG0 + 1 - ctx.wg, number_of_threads=256)
            warpgroup.wait_group(1)
            ctx.pipe_k.consumer_release(kv_state)
            grew = self.softmax_stale_max(ctx, acc_S, scale_log2)
            warpgroup.wait_group(0)
            ctx.pipe_v.consumer_release(v_state)
            self.convert_p(ctx, acc_S)
            if grew:
                self.stale_max_grew(ctx, acc_S, scale_log2)
                self.convert_p(ctx, acc_S)
        return self.pv_block(ctx, kv_state)

    @cute.jit
    def first_block(self, ctx, kv_state, q_stage: Int32, n_cols: Int32, scale_log2: Float32, tidx: Int32):
        """S of the tile's first block (its last keys), masked past ``n_cols``, softmax, P in registers;
        with kv_lengths, the V rows past ``n_cols`` are zeroed too."""
        ctx.pipe_k.consumer_wait(kv_state)
        acc_S = self.gemm_qk(ctx, q_stage, kv_state.index)
        warpgroup.wait_group(0)
        ctx.pipe_k.consumer_release(kv_state)
        self.mask_keys(ctx, acc_S, n_cols)
        self.online_softmax(ctx, acc_S, scale_log2, first=True)
        if const_expr(self.cfg.overlap):
            # A row with no finite score in this block (every valid key -inf: an inf in K or an
            # overflowed q.k) has no running max for softmax_stale_max to exponentiate against:
            # recompute it exactly at the end of the tile.
            for m in cutlass.range_constexpr(cute.size(ctx.row_max, mode=[0])):
                ctx.jump[m] = Float32.inf if ctx.row_max[m] == -Float32.inf else ctx.jump[m]
        self.convert_p(ctx, acc_S)
        if const_expr(self.cfg.has_kv_lengths):
            ctx.pipe_v.consumer_wait(kv_state)
            self.zero_v_tail(ctx, kv_state.index, n_cols, tidx)

    @cute.jit
    def pv_block(self, ctx, kv_state):
        """O += P V of the block in ``kv_state``, waited for; its V stage released; the state advanced."""
        ctx.pipe_v.consumer_wait(kv_state)
        self.gemm_pv(ctx, kv_state.index)
        warpgroup.wait_group(0)
        ctx.pipe_v.consumer_release(kv_state)
        kv_state.advance()
        return kv_state

    @cute.jit
    def gemm_qk(self, ctx, q_stage: Int32, stage: Int32):
        # A fresh accumulator per block: the previous scores are dead once converted to P.
        acc_S = cute.make_rmem_tensor(ctx.tiled_mma_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        _gemm(ctx.tiled_mma_qk, acc_S, ctx.tSrQ[None, None, None, q_stage], ctx.tSrK[None, None, None, stage],
              zero_init=True)
        return acc_S

    @cute.jit
    def gemm_pv(self, ctx, stage: Int32):
        # acc_O starts at 0 for every tile, so P V always accumulates.
        _gemm(ctx.tiled_mma_pv, ctx.acc_O, ctx.tOrP, ctx.tOrV[None, None, None, stage], zero_init=False)

    @cute.jit
    def mask_keys(self, ctx, acc_S, n_cols: Int32):
        """Scores of keys at or past the valid length (TMA zero fill or kv_lengths) -> -inf."""
        acc_S_mn = _acc_mn_view(acc_S)
        limit = n_cols - ctx.col_offset
        # Selects, not branches: a branch per element makes the compiler carry every score
        # through each one (about a thousand extra instructions per tile).
        for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
            keep = ctx.tScS_mn[0, c][1] < limit
            for m in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
                acc_S_mn[m, c] = acc_S_mn[m, c] if keep else -Float32.inf

    @cute.jit
    def online_softmax(self, ctx, acc_S, scale_log2: Float32, first: bool = False):
        """S -> unnormalized P = exp2(S * scale_log2 - max * scale_log2) in place; updates the
        running row max and (per-thread partial) row sum, and ``ctx.corr``, the factor O must be
        scaled by before this block's P V. ``first``: the tile's first block (nothing to rescale;
        exp2(-inf * scale) would be NaN for scale 0)."""
        acc_S_mn, row_max, row_sum, corr = _acc_mn_view(acc_S), ctx.row_max, ctx.row_sum, ctx.corr
        n_cols = cute.size(acc_S_mn, mode=[1])
        assert n_cols % 4 == 0
        for m in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
            # Four independent max / sum chains per row (a single chain is latency bound).
            mx = [acc_S_mn[m, i] for i in range(4)]
            for c in cutlass.range_constexpr(4, n_cols, 4):
                for i in cutlass.range_constexpr(4):
                    mx[i] = cute.arch.fmax(mx[i], acc_S_mn[m, c + i])
            blk_max = cute.arch.fmax(cute.arch.fmax(mx[0], mx[1]), cute.arch.fmax(mx[2], mx[3]))
            blk_max = cute.arch.fmax(blk_max, cute.arch.shuffle_sync_bfly(blk_max, offset=1))
            blk_max = cute.arch.fmax(blk_max, cute.arch.shuffle_sync_bfly(blk_max, offset=2))
            new_max = cute.arch.fmax(row_max[m], blk_max)
            # A row with no unmasked score yet keeps max -inf: offset 0, so exp2 gives 0, not NaN.
            max_scaled = new_max * scale_log2 if new_max != -Float32.inf else Float32(0.0)
            if const_expr(first):
                corr[m] = Float32(1.0)
            else:
                corr[m] = cute.math.exp2(row_max[m] * scale_log2 - max_scaled, fastmath=True)
            row_max[m] = new_max
            blk_sum = _exp2_row(acc_S_mn, m, scale_log2, max_scaled)
            if const_expr(first):
                row_sum[m] = blk_sum
            else:
                row_sum[m] = row_sum[m] * corr[m] + blk_sum

    @cute.jit
    def softmax_stale_max(self, ctx, acc_S, scale_log2: Float32):
        """S -> P = exp2(S * scale_log2 - running max * scale_log2) in place, the row sums
        updated, without this block's max: the exponentials start at once. Returns whether
        in some row of this warp P may exceed 2^STALE_MAX (``stale_max_grew`` then rescales)."""
        acc_S_mn, row_max, row_sum = _acc_mn_view(acc_S), ctx.row_max, ctx.row_sum
        grew = False
        for m in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
            # After the first block the running max is finite (it holds a valid key).
            blk_sum = _exp2_row(acc_S_mn, m, scale_log2, row_max[m] * scale_log2)
            # No P exceeds this thread's sum of them, so a sum within 2^STALE_MAX bounds them
            # all without a max (an inf P makes the sum inf).
            grew = grew | (blk_sum > Float32(2.0 ** STALE_MAX))
            row_sum[m] = row_sum[m] + blk_sum
        return cute.arch.vote_any_sync(grew)

    @cute.jit
    def stale_max_grew(self, ctx, acc_S, scale_log2: Float32):
        """The rare step after ``softmax_stale_max`` when a P may exceed 2^STALE_MAX: the
        running max moves up by log2 of the row's largest P, and P, the row sums and O (its
        P V of the blocks before, waited for) are rescaled to it. The largest move is kept in
        ``ctx.jump``: past REDO_MAX (P may have overflowed), ``exact_rows`` recomputes the
        warp's rows at the end of the tile."""
        acc_S_mn, row_max, row_sum = _acc_mn_view(acc_S), ctx.row_max, ctx.row_sum
        n_cols = cute.size(acc_S_mn, mode=[1])
        for m in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
            p_max = acc_S_mn[m, 0]
            for c in cutlass.range_constexpr(1, n_cols):
                p_max = cute.arch.fmax(p_max, acc_S_mn[m, c])
            p_max = cute.arch.fmax(p_max, cute.arch.shuffle_sync_bfly(p_max, offset=1))
            p_max = cute.arch.fmax(p_max, cute.arch.shuffle_sync_bfly(p_max, offset=2))
            # Only a row that itself crossed 2^STALE_MAX moves: the warp-wide vote that brought us
            # here must not change other rows (with S_q <= 8 they belong to another candidate).
            # The sums are softmax_stale_max's, to the bit (same chains over the same P).
            part = _sum_row(acc_S_mn, m)
            part = cute.arch.fmax(part, cute.arch.shuffle_sync_bfly(part, offset=1))
            part = cute.arch.fmax(part, cute.arch.shuffle_sync_bfly(part, offset=2))
            jump = cute.arch.fmax(cute.math.log2(p_max, fastmath=True), Float32(0.0))
            jump = jump if part > Float32(2.0 ** STALE_MAX) else Float32(0.0)
            ctx.jump[m] = cute.arch.fmax(ctx.jump[m], jump)
            new_max = row_max[m] + jump / scale_log2 if jump > Float32(0.0) else row_max[m]
            # Through new_max * scale_log2, the offset later blocks exponentiate against, so the
            # rescaled P and the later P share one offset to the last bit.
            f = cute.math.exp2(row_max[m] * scale_log2 - new_max * scale_log2, fastmath=True)
            for c in cutlass.range_constexpr(n_cols):
                acc_S_mn[m, c] = acc_S_mn[m, c] * f
            row_sum[m] = row_sum[m] * f
            row_max[m] = new_max
            for c in cutlass.range_constexpr(cute.size(ctx.acc_O_mn, mode=[1])):
                ctx.acc_O_mn[m, c] = ctx.acc_O_mn[m, c] * f

    @cute.jit
    def exact_rows(self, ctx, q_stage: Int32, n_keys: Int32, h_kv: Int32, kv_coord: Int32,
                   scale_log2: Float32, tidx: Int32):
        """This thread's rows of O, their max and sum, recomputed on the CUDA cores in fp32
        over all ``n_keys`` keys (Q from shared memory, K and V from global memory). Runs
        after the tile's main loop in a warp where some row's running max moved by more than
        REDO_MAX in one rescale (scores far outside the usual range); only those rows are
        recomputed, the others keep their values. The four lanes sharing a row split each dot
        product."""
        acc_O_mn, row_max, row_sum, tOcO = ctx.acc_O_mn, ctx.row_max, ctx.row_sum, ctx.tOcO_mn
        n_rows = cute.size(acc_O_mn, mode=[0])
        n_cols = cute.size(acc_O_mn, mode=[1])
        quarter = self.head_dim // 4
        lane = tidx % 4
        # Only the rows whose own max moved past REDO_MAX (uniform over the four lanes of a row);
        # the other rows of the warp keep their results (with S_q <= 8: another candidate's).
        redo = [ctx.jump[m] > Float32(REDO_MAX) for m in range(n_rows)]
        for m in cutlass.range_constexpr(n_rows):
            row_max[m] = -Float32.inf if redo[m] else row_max[m]
            row_sum[m] = Float32(0.0) if redo[m] else row_sum[m]
            for c in cutlass.range_constexpr(n_cols):
                acc_O_mn[m, c] = Float32(0.0) if redo[m] else acc_O_mn[m, c]
        for key in cutlass.range(n_keys, unroll=1):
            s = [Float32(0.0)] * n_rows
            for j in cutlass.range_constexpr(quarter):
                kk = Float32(ctx.mKg[key, lane * quarter + j, h_kv, kv_coord])
                for m in cutlass.range_constexpr(n_rows):
                    s[m] = s[m] + Float32(ctx.sQ[tOcO[m, 0][0], lane * quarter + j, q_stage]) * kk
            v = [Float32(ctx.mVg[key, tOcO[0, c][1], h_kv, kv_coord]) for c in range(n_cols)]
            for m in cutlass.range_constexpr(n_rows):
                s[m] = s[m] + cute.arch.shuffle_sync_bfly(s[m], offset=1)
                s[m] = s[m] + cute.arch.shuffle_sync_bfly(s[m], offset=2)
                new_max = cute.arch.fmax(row_max[m], s[m])
                # No finite score yet (new_max -inf): nothing to rescale, and this key weighs 0.
                none = new_max == -Float32.inf
                f = Float32(1.0) if none else cute.math.exp2((row_max[m] - new_max) * scale_log2, fastmath=True)
                p = Float32(0.0) if none else cute.math.exp2((s[m] - new_max) * scale_log2, fastmath=True)
                row_sum[m] = row_sum[m] * f + p if redo[m] else row_sum[m]
                row_max[m] = new_max if redo[m] else row_max[m]
                for c in cutlass.range_constexpr(n_cols):
                    acc_O_mn[m, c] = acc_O_mn[m, c] * f + p * v[c] if redo[m] else acc_O_mn[m, c]
        # The epilogue adds the row sum over the four lanes of a row: a recomputed row's sum is whole
        # in every lane.
        for m in cutlass.range_constexpr(n_rows):
            row_sum[m] = Float32(0.0) if redo[m] and lane != 0 else row_sum[m]

    @cute.jit
    def rescale_o(self, ctx, corr):
        for m in cutlass.range_constexpr(cute.size(ctx.acc_O_mn, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(ctx.acc_O_mn, mode=[1])):
                ctx.acc_O_mn[m, c] = ctx.acc_O_mn[m, c] * corr[m]

    @cute.jit
    def convert_p(self, ctx, acc_S):
        ctx.tOrP.store(_acc_as_frag_a(acc_S).load().to(self.dtype))

    @cute.jit
    def zero_v_tail(self, ctx, stage: Int32, n_cols: Int32, tidx: Int32):
        """Zero V rows at or past the valid length in this stage, so padding that is not
        finite (keys kept out of the softmax by kv_lengths) cannot turn 0 * V into NaN.
        Both consumer warpgroups take part and meet at a barrier before P V reads V."""
        if const_expr(self.cfg.has_kv_lengths):
            if n_cols < self.tile_n:
                sV_s = ctx.sV[None, None, stage]
                n_elem = (self.tile_n - n_cols) * self.head_dim
                for i in cutlass.range(tidx, n_elem, 256, unroll=1):
                    sV_s[n_cols + i // self.head_dim, i % self.head_dim] = self.dtype(0.0)
                cute.arch.fence_view_async_shared()
                cute.arch.barrier(barrier_id=_Bar.V_TAIL, number_of_threads=256)

    @cute.jit
    def epilogue(self, acc_O, acc_O_mn, row_max, row_sum, info, tiled_mma_pv, tidx: Int32, tma_atom_O, mO, mLSE, sO,
                 mCand, scale_log2: Float32, wg: Int32, warp_in_wg: Int32):
        """O / row_sum (and the lse) to sO, then one TMA store per stored slot of this warpgroup.
        No keys: O = 0, lse = -inf. Out-of-range index: NaN."""
        d, r = self.head_dim, self.slot_rows
        h, kv_coord, first, n_valid, chunk, q_coord, invalid, n_keys = info
        n_rows = cute.size(acc_O_mn, mode=[0])
        lse = cute.make_rmem_tensor((n_rows,), Float32)
        for m in cutlass.range_constexpr(n_rows):
            total = row_sum[m]
            total = total + cute.arch.shuffle_sync_bfly(total, offset=1)
            total = total + cute.arch.shuffle_sync_bfly(total, offset=2)
            has_keys = total != 0.0
            inv = cute.arch.rcp_approx(total) if has_keys else Float32(0.0)
            lse_m = (row_max[m] * scale_log2 + cute.math.log2(total, fastmath=True)) * LN_2 if has_keys \
                else -Float32.inf
            inv = Float32.nan if invalid else inv
            lse[m] = Float32.nan if invalid else lse_m
            for c in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[1])):
                acc_O_mn[m, c] = acc_O_mn[m, c] * inv
        rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))

        bar = _Bar.EPILOGUE_WG0 + wg
        # This warpgroup's previous TMA stores must have read sO before it is rewritten.
        if warp_in_wg == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.barrier(barrier_id=bar, number_of_threads=128)
        store_atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                         self.dtype)
        thr_copy_O = cute.make_tiled_copy_C(store_atom, tiled_mma_pv).get_slice(tidx)
        cute.copy(store_atom, thr_copy_O.retile(rO), thr_copy_O.partition_D(sO))

        if const_expr(self.cfg.return_lse):
            tOcO_mn = _acc_mn_view(tiled_mma_pv.get_slice(tidx).partition_C(
                cute.make_identity_tensor((self.tile_m, d))))
            if tOcO_mn[0, 0][1] == 0:
                for m in cutlass.range_constexpr(n_rows):
                    row = tOcO_mn[m, 0][0]
                    s = row // r
                    valid, q_b, out_b, row_block = self.slot_info(s, first, n_valid, chunk, q_coord, mCand)
                    q_row = row_block * r + (row - s * r)
                    if valid and q_row < self.s_q:
                        mLSE[out_b, h, q_row] = lse[m]

        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=bar, number_of_threads=128)
        if warp_in_wg == 0:
            for i in cutlass.range_constexpr(self.slots_per_wg):
                s = wg * self.slots_per_wg + i
                valid, q_b, out_b, row_block = self.slot_info(s, first, n_valid, chunk, q_coord, mCand)
                if valid:
                    gO = cute.local_tile(mO[None, None, h, out_b], (r, d), (row_block, 0))
                    sO_s = cute.local_tile(sO, (r, d), (s, 0))
                    tOsO_s, tOgO = cpasync.tma_partition(
                        tma_atom_O, 0, cute.make_layout(1), cute.group_modes(sO_s, 0, 2), cute.group_modes(gO, 0, 2))
                    cute.copy(tma_atom_O, tOsO_s, tOgO)
            cute.arch.cp_async_bulk_commit_group()


# ---------------------------------------------------------------- helpers
def _gemm(tiled_mma, acc, tA, tB, zero_init: bool):
    """Issue one warpgroup MMA over the K mode (asynchronous: caller waits)."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in range(cute.size(tA.shape[2])):
        cute.gemm(atom, acc, tA[None, None, k], tB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()


def _exp2_row(acc_S_mn, m: int, scale_log2: Float32, offset: Float32):
    """Row m of S -> exp2(S * scale_log2 - offset) in place; returns this thread's sum of the row
    (four independent chains: a single one is latency bound)."""
    n_cols = cute.size(acc_S_mn, mode=[1])
    sums = [Float32(0.0)] * 4
    for c in range(0, n_cols, 4):
        for i in range(4):
            p = cute.math.exp2(acc_S_mn[m, c + i] * scale_log2 - offset, fastmath=True)
            acc_S_mn[m, c + i] = p
            sums[i] = sums[i] + p
    return (sums[0] + sums[1]) + (sums[2] + sums[3])


def _sum_row(acc_S_mn, m: int):
    """This thread's sum of row m of P, in _exp2_row's order (the same bits)."""
    n_cols = cute.size(acc_S_mn, mode=[1])
    sums = [Float32(0.0)] * 4
    for c in range(0, n_cols, 4):
        for i in range(4):
            sums[i] = sums[i] + acc_S_mn[m, c + i]
    return (sums[0] + sums[1]) + (sums[2] + sums[3])


def _acc_mn_view(acc):
    """((2, 2, N/8), M, N) accumulator -> (rows, cols) view: ((2, M), (2, N/8, N))."""
    l = cute.make_layout(acc.layout.shape)
    shape = ((l.shape[0][1], l.shape[1]), (l.shape[0][0], l.shape[0][2], l.shape[2]))
    stride = ((l.stride[0][1], l.stride[1]), (l.stride[0][0], l.stride[0][2], l.stride[2]))
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, cute.make_layout(shape, stride=stride)))


def _acc_as_frag_a(acc):
    """fp32 accumulator of S viewed in the register layout of P V's A operand:
    ((2, 2, N/8), M, N) -> ((2, 2, 2), M, (N/16, N))."""
    l = cute.logical_divide(acc.layout, ((None, None, 2), None, None))
    frag = cute.make_layout(
        ((l.shape[0][0], l.shape[0][1], l.shape[0][2][0]), l.shape[1], (l.shape[0][2][1], l.shape[2])),
        stride=((l.stride[0][0], l.stride[0][1], l.stride[0][2][0]), l.stride[1], (l.stride[0][2][1], l.stride[2])),
    )
    return cute.make_tensor(acc.iterator, frag)


# ---------------------------------------------------------------- compile
def compile_fwd(cfg: FwdConfig, keep_ptx: bool = False, ptxas_report: bool = False):
    """Compile ``cfg`` for sm_90a from fake tensors (no GPU needed)."""
    dt = cutlass.BFloat16 if cfg.dtype == "bf16" else cutlass.Float16
    d = cfg.head_dim
    # Sizes B, H, L, ... are symbolic; strides are multiples of 8 elements (16 B).
    q = fake_tensor(dt, (None, cfg.s_q, None, d), divisibility=8)
    k = fake_tensor(dt, (None, None, None, d), divisibility=8)
    v = fake_tensor(dt, (None, None, None, d), divisibility=8)
    o = fake_tensor(dt, (None, cfg.s_q, None, d), divisibility=8)
    lse = fake_tensor(Float32, (None, None, cfg.s_q), align=4) if cfg.return_lse else None
    cand = fake_tensor(Int32, (None,), align=4)
    starts = fake_tensor(Int32, (None,), align=4) if cfg.direction == "kv" else None
    tiles = fake_tensor(Int32, (None,), align=4) if cfg.direction == "kv" else None
    kv_len = fake_tensor(Int32, (None,), align=4) if cfg.has_kv_lengths else None
    kernel = IkboAttentionFwdSm90(cfg)
    return compile_kernel(kernel, q, k, v, o, lse, cand, starts, tiles, kv_len,
                          Float32(1.0), Float32(1.0), Int32(1), fake_stream(),
                          keep_ptx=keep_ptx, ptxas_report=ptxas_report)
