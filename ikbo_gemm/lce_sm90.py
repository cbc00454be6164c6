"""The IKBO linear-compression kernel for Hopper (sm_90a): one persistent launch.

    out[b] = w_cand @ e_cand[b] + (w_user @ e_user)[idx[b]]

With FP8 operands (``LceConfig.dtype`` float8_e4m3fn; e K-major, [B, N, K]) each product is
scaled in fp32 first, ``sw[m] * se[b] * (w8 @ e8[b]^T)``, and the output is ``cfg.out_dtype``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import torch
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync
from cutlass.tensor_utils import LayoutEnum

from cute_kernels.arguments import GemmSmemLayouts, kernel_arguments
from cute_kernels.interop import cutlass_dtype
from cute_kernels.mainloop import pingpong_mainloop, promoting_mainloop
from cute_kernels.scheduler import strided_tiles
from cute_kernels.staged_stores import StagedStores
from cute_kernels.warp_specialized import (
    Barrier,
    PingPong,
    PipelineSpec,
    WARPGROUP,
    RegisterSplit,
    bar_sync,
    check_barriers,
    pipelines_init_arrive,
    pipelines_init_wait,
)

from .config import LceConfig, LceGeometry


@kernel_arguments
class LceOperands(NamedTuple):
    """The GEMMs' operands and the index (host -> kernel)."""

    w_cand: cute.Tensor  # [1, M, K_cand_pad]
    w_user: cute.Tensor  # [1, M, K_user_pad]
    e_cand: cute.Tensor  # [B, K_cand, N]; FP8: [B, N, K_cand_pad] (K-major)
    e_user: cute.Tensor  # [U, K_user, N]; FP8: [U, N, K_user_pad]
    idx: cute.Tensor  # [B]


@kernel_arguments
class LceEpilogue(NamedTuple):
    """Where the results go (host -> kernel): the output, the fp32 user tiles and their flags;
    FP8: the fp32 scales (one per row of w, one per batch entry of e)."""

    out: cute.Tensor  # [B, M, N]
    workspace: cute.Tensor  # [U_pad * column tiles * w tiles, tile_n * tile_w] fp32
    flags: cute.Tensor  # [U * w_tiles * n_tiles] int32, zeroed
    w_cand_scale: Optional[cute.Tensor] = None  # FP8: [M]
    w_user_scale: Optional[cute.Tensor] = None  # FP8: [M]
    e_cand_scale: Optional[cute.Tensor] = None  # FP8: [B]
    e_user_scale: Optional[cute.Tensor] = None  # FP8: [U]


@kernel_arguments
class LceLaunch(NamedTuple):
    """One launch's share of the tile walk and how it starts (host -> kernel)."""

    tile_begin: Int32  # cluster tiles [tile_begin, tile_end)
    tile_end: Int32
    grid_size: Int32  # CTAs, a multiple of the cluster size
    wait_prior: Int32  # 1: wait for the previous grid on the stream before starting; 0: at the end
    cooperative: Int32  # 1: every CTA resident at once, or the launch is refused (see LceSm90)


class PhaseLoads(NamedTuple):
    """One phase's TMA loads (kernel -> producer): e slices (A) and w chunks (B)."""

    a_atom: cute.CopyAtom
    a: cute.Tensor  # TMA view of e, (N, K, batch)
    b_atom: cute.CopyAtom  # a full 32-row w chunk (the whole tile without a cluster)
    b_last_atom: cute.CopyAtom  # the last chunk's w_last rows (b_atom again where it is a full one)
    b: cute.Tensor  # TMA view of w, (M, K, 1)


class LceStores(NamedTuple):
    """What the consumers' epilogues read and write (kernel -> consumers)."""

    out_atom: cute.CopyAtom  # a staged 64 x EPI_W sub-tile
    out_last_atom: cute.CopyAtom  # the last sub-tile's rows not yet stored (out_atom again where none)
    out: cute.Tensor  # TMA view of out^T, (N, M, batch)
    workspace: cute.Tensor  # user tiles, (4 values, chunk, thread, tile)
    idx: cute.Tensor
    flags: cute.Tensor
    w_cand_scale: Optional[cute.Tensor]  # FP8 only (LceEpilogue's)
    w_user_scale: Optional[cute.Tensor]
    e_cand_scale: Optional[cute.Tensor]
    e_user_scale: Optional[cute.Tensor]



class TileRange(NamedTuple):
    """The launch's cluster tiles and whether it waits for the previous grid first (kernel -> roles)."""

    begin: Int32
    end: Int32
    wait_prior: Int32


class LceBarrier(Barrier):
    """Named barrier ids (the class docstring of LceSm90 says who uses each)."""

    EPILOGUE = 1  # + consumer: the 128 threads of one consumer warpgroup
    MMA_ORDER = 3  # + consumer: the ping-pong turn of the main loops (PingPong), 256 threads


@dataclasses.dataclass(frozen=True)
class LceTile:
    """One CTA tile of the walk (device values)."""

    is_user: object  # a user-phase tile (its result goes to the workspace)
    w: Int32  # w-row tile
    n: Int32  # column tile of this CTA
    batch: Int32  # user (user phase) or candidate (candidate phase)
    k_blocks: Int32


@dataclasses.dataclass(frozen=True)
class UserTileSource:
    """Where a tile's epilogue-time user tile comes from."""

    index: Int32  # workspace tile / ready flag of the user tile
    poison: Float32  # added to every accumulator value: NaN for an out-of-range idx, else 0
    load: object  # whether to load it (candidate tiles with a valid idx)


class LceSm90:
    """Persistent warp-specialized ping-pong GEMM with the IKBO broadcast epilogue.

    Each product is computed transposed, ``out[b]^T = e[b]^T @ w^T`` (wgmma A =
    a ``tile_n``-column slice of e[b], one or two 64-row wgmma atoms; B =
    ``tile_w`` rows of w), so the operand that every batch shares (w) is
    multicast by TMA to the CTAs of a cluster: ``cluster_n`` neighbouring
    column slices of ``cluster_b`` neighbouring batches:
        user phase:      ws[u]  = w_user @ e_user[u]         (fp32 workspace)
        candidate phase: out[b] = w_cand @ e_cand[b] + ws[idx[b]], added in fp32, rounded once

    Tiles. A CTA tile is ``tile_n`` output columns x ``tile_w`` output rows of one batch;
    a cluster tile is cluster_n x cluster_b CTA tiles (rank r: column slice
    r % cluster_n, batch r // cluster_n of the cluster tile). Cluster tiles
    are numbered user phase first ([0, T_user)), then candidate phase; within a
    phase w-row tile fastest, then the column group, then the batch, so the
    cluster tiles reading the same e[b] run at the same time (L2 reuse). Cluster
    c of G takes cluster tiles c, c+G, ... (cute_kernels.scheduler), alternating
    between its two consumer warpgroups. Every user tile precedes every
    candidate tile in each walk, so the ready-flag waits cannot deadlock while
    every cluster of the grid is resident: a grid that runs both phases is
    launched cooperative (``cooperative`` 1), which guarantees that or refuses
    the launch (a green context or an MPS limit with fewer SMs than the grid).

    Warp roles (384 threads, 1 CTA per SM):
      warpgroup 0, producer (setmaxnreg 24): warp 0 issues the TMA loads of each
        k-block: its own e slice, and its 32-row chunks of the w tile (chunks
        rank, rank + cluster, ...), each multicast to every CTA of the cluster.
        Where 32 does not divide tile_w, the last chunk is the tile's remaining
        rows, loaded with a TMA atom of its own height.
      warpgroups 1, 2, consumers (setmaxnreg 240): wgmma main loop on their tile,
        then its epilogue while the other consumer runs its main loop.

    Pipelines (PipelineTmaAsync; checked in ``__init__``):

        | pipeline | producer -> consumer | full / empty arrives | stages |
        | --- | --- | --- | --- |
        | ab | producer warp 0 -> the consumer warpgroup owning the tile | 1 / 4 x cluster | ab_stages |

      One ring shared by both phases and both consumers. Full: one elected producer thread
      with the stage's TMA bytes (this CTA's e slice + the whole w tile, multicast to it by the
      cluster's CTAs). Empty: each of the owning consumer's 4 warps releases the stage in every
      CTA of the cluster (their w chunks land in it). Each consumer skips the other consumer's
      k-blocks in its ring state.

    Named barriers (LceBarrier):
      MMA_ORDER + c (256 threads; PingPong): consumer c waits on it before its main loop; the
        other consumer arrives on it after issuing its last wgmma (consumer 0 arrives once on
        its own at the start), so the consumers walk the ring in tile order.
      EPILOGUE + c (128 threads, per-consumer staging buffers):
        one barrier a staged 64 x 32 sub-tile (epi_stages buffers a consumer;
        cute_kernels.staged_stores): after the sub-tile's stmatrix, warp 0 waits until the bulk store that last
        read the next sub-tile's buffer is done reading, all sync, then warp 0
        TMA-stores the sub-tile. A tile_w that
        32 does not divide ends on a sub-tile that overlaps the one before it (the
        4-matrix stmatrix stages 32 rows); only its new rows are stored, with a TMA
        atom of their height.
      user-tile ready flags (global int32 per user CTA tile, zeroed by the op):
        a user epilogue stores its fp32 tile, fences, syncs its warpgroup, then
        one thread sets the flag with st.release.gpu. A candidate tile's main loop
        adds onto its user tile, loaded into the accumulator while the other
        consumer's main loop runs: thread 0 spins on ld.acquire.gpu of the flag
        before the previous tile's epilogue, whose first warpgroup barrier orders
        every thread's loads after it, and each staged sub-tile frees accumulator
        registers that the loads then fill (after a user tile: once stored).

    Timelines. Producer warp 0, per cluster tile: for each k-block, wait for a free stage,
    load its e slice and its w chunks (multicast). Consumer c, per tile of its lane of the walk:
    load the next tile's idx (read after the main loop: its latency hidden) -> add the poison
    to the accumulator (it holds the user tile already) -> wait for its MMA_ORDER turn -> main
    loop (wgmma one group in flight, stages released one behind) -> hand the turn over -> user
    tile: store it to the workspace, set its flag; candidate tile: staged TMA-store epilogue,
    loading the next tile's user tile into the freed registers.

    Launch: programmatic dependent launch. With ``wait_prior`` 1 the CTAs set up
    their barriers while the previous grid on the stream finishes, then wait for it
    (griddepcontrol.wait). Every CTA then lets a dependent grid start
    (griddepcontrol.launch_dependents): the op launches a second grid this way to run
    the first candidates on SMs that this grid's clusters leave idle. That grid has
    ``wait_prior`` 0: it spins on the ready flags of user tiles this grid computes,
    and waits for this grid only before it exits, so what follows on the stream
    still runs after both.

    Candidates whose idx is outside [0, U) never read past the workspace: their
    output is NaN.

    FP8 (``cfg.dtype`` float8_e4m3fn): the same kernel with 8-bit wgmma (instruction K 32), which
    reads both operands K-major: e is taken as [B, N, K] (the A tile's TMA box and shared-memory
    layout K-major), k-blocks of 128 elements (128 bytes, as the 16-bit ones: the same stages and
    128-byte swizzle), and the fp32 scales of LceEpilogue (one per row of w, one per batch entry of
    e). A product's scale differs between the user and the candidate term, so the candidate main
    loop starts from zero instead of from the user tile: the user epilogue stores its tile already
    scaled, ``sw_u[m] * se_u[u] * sum``, and the candidate epilogue computes ``sw_c[m] * se_c[b] *
    sum + ws[idx[b]]`` per staged sub-tile, then rounds once to ``cfg.out_dtype``. The user tile
    reaches it through shared memory: each consumer thread copies its own fragment of the next
    sub-tiles' user values with cp.async (16 bytes, L1 bypassed) into USER_BUFFERS buffers of its
    consumer, the first ones before its main loop (the flag was waited for, as above, before the
    previous tile's epilogue), each later one as soon as a sub-tile has read its buffer, so the
    L2 reads overlap the main loop and the sub-tiles before. A thread reads back only what it
    copied: cp.async.wait_group orders it, no barrier. Each row's scale (its w row's times the
    batch entry's) is loaded before the main loop, one row a thread, and staged in shared memory
    after it, so no sub-tile waits on a global load. Starting the main loop from the user tile
    divided by the candidate scale (the 16-bit overlap) would make a zero or tiny scale inf or
    NaN, and would add the user term into the 8-bit wgmma's narrow accumulation. With
    ``cfg.promote`` (64 x 128 tiles) each k-block's wgmmas sum from zero into one of two partial
    fragments in turn, added into the fp32 accumulator once done
    (cute_kernels.mainloop.promoting_mainloop; the wgmmas drain once every 4 k-blocks).

    Arguments (cute_kernels.arguments): the host passes LceOperands, LceEpilogue and LceLaunch;
    the kernel hands each phase's loads to the producer (PhaseLoads) and the epilogue's tensors
    to the consumers (LceStores), with the launch's tile range (TileRange).
    """

    ATOM_N = 64  # output columns of one wgmma (its M side)
    TILE_K = 64  # elements of a 16-bit k-block; FP8 k-blocks hold 128 (the same bytes, LceConfig.tile_k)
    EPI_W = 32  # output rows per staged epilogue sub-tile
    EPI_STAGES = 2  # staging buffers per consumer (16-bit operands)
    EPI_STAGES_FP8 = 4  # ... FP8: its shorter main loop leaves the stores less time
    USER_BUFFERS = 2  # FP8: shared-memory buffers of a consumer for its tile's user sub-tiles (cp.async)
    REGISTERS = RegisterSplit(producer=24, consumer=240)
    THREADS = REGISTERS.threads
    # Each named barrier's threads, and its ids (one per consumer warpgroup), as the docstring states.
    BARRIER_THREADS = {"EPILOGUE": WARPGROUP, "MMA_ORDER": 2 * WARPGROUP}
    BARRIER_SPANS = {"EPILOGUE": 2, "MMA_ORDER": 2}
    TILE_OWNER_THREADS = 128  # the one consumer warpgroup that runs a tile and releases its stages

    def __init__(self, cfg: LceConfig):
        self.cfg = cfg
        self.dtype = cutlass_dtype(cfg.dtype)
        self.fp8 = cfg.dtype == torch.float8_e4m3fn
        self.out_dtype = cutlass_dtype(cfg.out_dtype or cfg.dtype)
        self.tile_k = cfg.tile_k
        self.idx_dtype = cutlass_dtype(cfg.idx_dtype)
        self.tile_w = tile_w = cfg.tile_w
        self.tile_n = tile_n = cfg.tile_n
        self.cluster_n = cfg.cluster_n
        self.cluster_b = cfg.cluster_b
        self.cluster = cluster = cfg.cluster
        dtype = self.dtype
        self.tile_mnk = (tile_n, tile_w, self.tile_k)  # GEMM view: M = out columns, N = out rows
        # A cluster loads each w tile in 32-row chunks (the last one holds the remaining
        # w_last rows), CTA r taking chunks r, r + cluster, ..., each multicast.
        self.w_chunk = tile_w if cluster == 1 else 32
        self.w_chunks = -(-tile_w // self.w_chunk)
        self.w_last = tile_w - (self.w_chunks - 1) * self.w_chunk
        self.chunks_per_cta = -(-self.w_chunks // cluster)
        self.w_last_atom = self.w_last != self.w_chunk  # the last chunk needs a TMA atom of its own
        self.epi_tile = (self.ATOM_N, self.EPI_W)
        self.subs_per_atom = -(-tile_w // self.EPI_W)
        self.epi_subtiles = tile_n // self.ATOM_N * self.subs_per_atom

        # Epilogue sub-tile s stages rows epi_rows[s] + [0, EPI_W) of atom s // subs_per_atom
        # from accumulator values epi_acc[s] + [0, ATOM_N * EPI_W / 128); after it the 4-value
        # chunks epi_freed[s] are read by no later sub-tile (they take the next user tile).
        last_row = tile_w - self.EPI_W  # the last sub-tile may overlap the one before
        self.per_sub = per_sub = self.ATOM_N * self.EPI_W // 128  # accumulator values of a sub-tile
        self.epi_rows = [min(s % self.subs_per_atom * self.EPI_W, last_row) for s in range(self.epi_subtiles)]
        # The rows of sub-tile s that the one before it (same atom) already stored.
        self.epi_skip = [
            max(0, self.epi_rows[s - 1] + self.EPI_W - self.epi_rows[s]) if s % self.subs_per_atom else 0
            for s in range(self.epi_subtiles)
        ]
        self.epi_acc = [s // self.subs_per_atom * tile_w // 2 + self.epi_rows[s] // 2 for s in range(self.epi_subtiles)]
        last_use = {i: s for s in range(self.epi_subtiles) for i in range(self.epi_acc[s], self.epi_acc[s] + per_sub)}
        self.epi_freed = [
            [c for c in range(tile_n * tile_w // 512) if max(last_use[4 * c + v] for v in range(4)) == s]
            for s in range(self.epi_subtiles)
        ]
        self.out_last_atom = any(self.epi_skip)  # the last sub-tiles store with a TMA atom of their own

        smem = cutlass.memory.get_smem_capacity_in_bytes("sm_90")
        self.stage_bytes = (tile_n + tile_w) * self.tile_k * dtype.width // 8
        self.epi_stages = self.EPI_STAGES_FP8 if self.fp8 else self.EPI_STAGES
        self.staged = StagedStores(self.epi_stages)  # each consumer's staging buffers, one barrier a sub-tile
        epi_bytes = 2 * self.epi_stages * self.ATOM_N * self.EPI_W * self.out_dtype.width // 8
        # FP8: each consumer's user-tile buffers (one sub-tile's fp32 values each) and row scales.
        self.user_floats = 2 * self.USER_BUFFERS * per_sub * 128 if self.fp8 else 0
        self.scale_floats = 2 * tile_w if self.fp8 else 0
        # As many stages as fit beside the staging, user and scale buffers and the barriers (1024
        # bytes: the operands are 1024-byte aligned); 128 x 152 tiles take 6 (16-bit, filling the
        # 227 KB exactly) or 4 (FP8: 7 k-blocks a tile).
        self.ab_stages = min(12, (smem - epi_bytes - 4 * (self.user_floats + self.scale_floats) - 1024)
                             // self.stage_bytes)
        self.ab = PipelineSpec("ab", "producer warp 0", "the consumer warpgroup owning the tile", self.ab_stages,
                               self.stage_bytes, 1, 4 * cluster).check(
            "LceSm90", releasing_threads=self.TILE_OWNER_THREADS, multicast_ctas=cluster)
        self.ping_pong = PingPong(int(LceBarrier.MMA_ORDER), self.BARRIER_THREADS["MMA_ORDER"])
        check_barriers("LceSm90", LceBarrier, self.BARRIER_SPANS)

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(self, operands: LceOperands, epilogue: LceEpilogue, launch: LceLaunch, stream):
        # GEMM views: A = e^T (N, K, batch) N-major, B = w^T (M, K, 1) K-major,
        # C = out^T (N, M, batch) N-major. The workspace holds each user tile in
        # accumulator-fragment order: (4 values, chunk, thread, tile), so a
        # consumer thread moves its fragment with coalesced 16-byte accesses. The
        # tile stride is the tensor's own 64-bit one: the workspace can pass 2^31 floats.
        e_cand, e_user, w_cand, w_user = operands.e_cand, operands.e_user, operands.w_cand, operands.w_user
        workspace = epilogue.workspace
        e_modes = [1, 2, 0] if const_expr(self.fp8) else [2, 1, 0]  # FP8 e: [B, N, K], K-major
        a_cand = cute.make_tensor(e_cand.iterator, cute.select(e_cand.layout, mode=e_modes))
        a_user = cute.make_tensor(e_user.iterator, cute.select(e_user.layout, mode=e_modes))
        b_cand = cute.make_tensor(w_cand.iterator, cute.select(w_cand.layout, mode=[1, 2, 0]))
        b_user = cute.make_tensor(w_user.iterator, cute.select(w_user.layout, mode=[1, 2, 0]))
        c_out = cute.make_tensor(epilogue.out.iterator, cute.select(epilogue.out.layout, mode=[2, 1, 0]))
        tile_elems = self.tile_n * self.tile_w
        c_ws = cute.make_tensor(
            workspace.iterator,
            cute.make_layout(
                (4, tile_elems // 512, 128, workspace.shape[0]),
                stride=(1, 512, 4, workspace.stride[0]),
            ),
        )

        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            cute.nvgpu.OperandMajorMode.K if const_expr(self.fp8) else cute.nvgpu.OperandMajorMode.MN,
            cute.nvgpu.OperandMajorMode.K,
            Float32,
            (1, 1, 1),
            tiler_mn=(self.ATOM_N, self.tile_w),
        )
        a_major = LayoutEnum.ROW_MAJOR if const_expr(self.fp8) else LayoutEnum.COL_MAJOR
        a_smem = sm90_utils.make_smem_layout_a(a_major, self.tile_mnk, self.dtype, self.ab_stages)
        b_smem = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, self.tile_mnk, self.dtype, self.ab_stages)
        epi_smem = sm90_utils.make_smem_layout_epi(self.out_dtype, LayoutEnum.COL_MAJOR, self.epi_tile,
                                                   2 * self.epi_stages)

        a_one = cute.select(a_smem, mode=[0, 1])
        a_box = (self.tile_n, self.tile_k)
        a_load = cpasync.CopyBulkTensorTileG2SOp()
        b_load = cpasync.CopyBulkTensorTileG2SMulticastOp() if const_expr(self.cluster > 1) else a_load
        tma_a_cand, ta_cand = cpasync.make_tiled_tma_atom(a_load, a_cand, a_one, a_box)
        tma_a_user, ta_user = cpasync.make_tiled_tma_atom(a_load, a_user, a_one, a_box)
        # w chunks: a full chunk's atom and the last chunk's (w_last rows), per phase. Where the
        # last chunk is a full one, the kernel gets the full chunk's atom twice and uses the first.
        b_atoms = []
        heights = (self.w_chunk, self.w_last) if self.w_last_atom else (self.w_chunk,)
        for b in (b_user, b_cand):
            for rows in heights:
                tile = (self.tile_n, rows, self.tile_k)
                chunk = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tile, self.dtype, 1)
                chunk = cute.select(chunk, mode=[0, 1])
                b_atoms.append(cpasync.make_tiled_tma_atom(b_load, b, chunk, (rows, self.tile_k)))
            if const_expr(not self.w_last_atom):
                b_atoms.append(b_atoms[-1])
        (tma_b_user, tb_user), (tma_b_user_last, _), (tma_b_cand, tb_cand), (tma_b_cand_last, _) = b_atoms
        # Output sub-tiles: a full one's atom and the last one's (only the rows not yet stored;
        # the full one's again where every sub-tile is stored whole).
        store = cpasync.CopyBulkTensorTileS2GOp()
        tma_out, t_out = cpasync.make_tiled_tma_atom(store, c_out, cute.select(epi_smem, mode=[0, 1]), self.epi_tile)
        tma_out_last = tma_out
        if const_expr(self.out_last_atom):
            last_box = (self.ATOM_N, self.EPI_W - self.epi_skip[self.subs_per_atom - 1])
            last_smem = sm90_utils.make_smem_layout_epi(self.out_dtype, LayoutEnum.COL_MAJOR, last_box, 1)
            tma_out_last, _ = cpasync.make_tiled_tma_atom(store, c_out, cute.select(last_smem, mode=[0, 1]), last_box)

        @cute.struct
        class SharedStorage:
            ab_barriers: cute.struct.MemRange[cutlass.Int64, self.ab_stages * 2]
            sA: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(a_smem)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(b_smem)], 1024]
            sC: cute.struct.Align[cute.struct.MemRange[self.out_dtype, cute.cosize(epi_smem)], 1024]

        @cute.struct
        class SharedStorageFp8:  # ... and the consumers' user-tile buffers and row scales
            ab_barriers: cute.struct.MemRange[cutlass.Int64, self.ab_stages * 2]
            sA: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(a_smem)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(b_smem)], 1024]
            sC: cute.struct.Align[cute.struct.MemRange[self.out_dtype, cute.cosize(epi_smem)], 1024]
            sU: cute.struct.Align[cute.struct.MemRange[Float32, max(1, self.user_floats)], 128]
            sS: cute.struct.Align[cute.struct.MemRange[Float32, max(1, self.scale_floats)], 16]

        self.shared_storage = SharedStorageFp8 if const_expr(self.fp8) else SharedStorage

        self.kernel(
            PhaseLoads(tma_a_user, ta_user, tma_b_user, tma_b_user_last, tb_user),
            PhaseLoads(tma_a_cand, ta_cand, tma_b_cand, tma_b_cand_last, tb_cand),
            LceStores(tma_out, tma_out_last, t_out, c_ws, operands.idx, epilogue.flags, epilogue.w_cand_scale,
                      epilogue.w_user_scale, epilogue.e_cand_scale, epilogue.e_user_scale),
            GemmSmemLayouts(tiled_mma, a_smem, b_smem, epi_smem),
            TileRange(launch.tile_begin, launch.tile_end, launch.wait_prior),
        ).launch(
            grid=[launch.grid_size, 1, 1],
            block=[self.THREADS, 1, 1],
            cluster=[self.cluster, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
            use_pdl=True,
            cooperative=launch.cooperative,
        )

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, user: PhaseLoads, cand: PhaseLoads, stores: LceStores, layouts: GemmSmemLayouts,
               tiles: TileRange):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            atoms = [user.a_atom, user.b_atom, cand.a_atom, cand.b_atom, stores.out_atom]
            if const_expr(self.w_last_atom):
                atoms += [user.b_last_atom, cand.b_last_atom]
            if const_expr(self.out_last_atom):
                atoms.append(stores.out_last_atom)
            for atom in atoms:
                cpasync.prefetch_descriptor(atom)

        cluster_layout = cute.make_layout((self.cluster, 1, 1))
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        ab_pipeline = self.ab.make(storage.ab_barriers.data_ptr(), cute.make_layout((1, self.cluster, 1, 1)))
        pipelines_init_arrive(self.cluster)
        sA = storage.sA.get_tensor(layouts.a.outer, swizzle=layouts.a.inner)
        sB = storage.sB.get_tensor(layouts.b.outer, swizzle=layouts.b.inner)
        sC = storage.sC.get_tensor(layouts.epi.outer, swizzle=layouts.epi.inner)
        sU, sS = None, None
        if const_expr(self.fp8):
            # (4 values, chunk, thread, buffer, consumer): each thread's 16-byte slots side by side.
            per_sub = self.per_sub
            sU = storage.sU.get_tensor(cute.make_layout(
                (4, per_sub // 4, 128, self.USER_BUFFERS, 2),
                stride=(1, 512, 4, per_sub * 128, per_sub * 128 * self.USER_BUFFERS)))
            # (row, consumer): the scale of each row of the consumer's tile.
            sS = storage.sS.get_tensor(cute.make_layout((self.tile_w, 2)))
        geom = self.geometry(user, cand, stores)
        pipelines_init_wait(self.cluster)
        # Launched with programmatic dependent launch: the setup above overlaps the previous
        # grid on the stream; no global memory is touched before this wait.
        if tiles.wait_prior != 0:
            cute.arch.griddepcontrol_wait()
        # Every CTA of this grid is resident: a dependent grid may start on the SMs left free.
        cute.arch.griddepcontrol_launch_dependents()

        warpgroup_idx = warp_idx // 4
        if warpgroup_idx == 0:
            self.REGISTERS.enter_producer()
            if warp_idx == 0:
                self.producer(ab_pipeline, sA, sB, geom, cluster_layout, rank, user, cand, tiles)
        else:
            self.REGISTERS.enter_consumer()
            self.consumer(warpgroup_idx - 1, rank, ab_pipeline, layouts.tiled_mma, sA, sB, sC, sU, sS, geom,
                          stores, tiles)

    def geometry(self, user: PhaseLoads, cand: PhaseLoads, stores: LceStores) -> LceGeometry:
        """The launch's tiling, from the (GEMM-view) tensors' shapes."""
        out = stores.out
        return LceGeometry.of(
            self, M=cute.size(out, mode=[1]), N=cute.size(out, mode=[0]), U=cute.size(user.a, mode=[2]),
            B=cute.size(out, mode=[2]), K_user=cute.size(user.b, mode=[1]), K_cand=cute.size(cand.b, mode=[1]),
            ceil_div=cute.ceil_div,
        )

    @cute.jit
    def decode(self, t: Int32, rank: Int32, geom: LceGeometry) -> LceTile:
        """Cluster tile index -> this CTA's tile."""
        is_user = t < geom.user_tiles
        local = t
        k_blocks = geom.k_blocks_user
        if not is_user:
            local = t - geom.user_tiles
            k_blocks = geom.k_blocks_cand
        w = local % geom.w_tiles
        n = (local // geom.w_tiles) % geom.groups * self.cluster_n + rank % self.cluster_n
        batch = local // (geom.w_tiles * geom.groups) * self.cluster_b + rank // self.cluster_n
        return LceTile(is_user, w, n, batch, k_blocks)

    @cute.jit
    def k_blocks_of(self, t: Int32, geom: LceGeometry) -> Int32:
        k_blocks = geom.k_blocks_cand
        if t < geom.user_tiles:
            k_blocks = geom.k_blocks_user
        return k_blocks

    # ----------------------------------------------------------- producer
    @cute.jit
    def producer(self, ab_pipeline, sA, sB, geom, cluster_layout, rank, user: PhaseLoads, cand: PhaseLoads,
                 tiles: TileRange):
        a_box = (self.tile_n, self.tile_k)
        sA_ = cute.group_modes(sA, 0, 2)
        one = cute.make_layout(1)
        # A: this CTA's own e slice. B: this CTA's share of the w rows, multicast (load_w).
        tAsA, tAgA_user = cpasync.tma_partition(
            user.a_atom, 0, one, sA_, cute.group_modes(cute.local_tile(user.a, a_box, (None, None, None)), 0, 2)
        )
        _, tAgA_cand = cpasync.tma_partition(
            cand.a_atom, 0, one, sA_, cute.group_modes(cute.local_tile(cand.a, a_box, (None, None, None)), 0, 2)
        )

        mcast = cute.make_layout_image_mask(cluster_layout, cluster_layout.get_flat_coord(rank), mode=0)

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
        tile_end = tiles.end
        walk = strided_tiles(tiles.begin, cluster=self.cluster)
        t = walk.first
        while t < tile_end:
            tile = self.decode(t, rank, geom)
            for k in cutlass.range(tile.k_blocks, unroll=1):
                ab_pipeline.producer_acquire(state)
                bar = ab_pipeline.producer_get_barrier(state)
                if tile.is_user:
                    cute.copy(user.a_atom, tAgA_user[(None, tile.n, k, tile.batch)], tAsA[(None, state.index)],
                              tma_bar_ptr=bar)
                    self.load_w(user, sB, tile.w, k, rank, state.index, bar, mcast)
                else:
                    cute.copy(cand.a_atom, tAgA_cand[(None, tile.n, k, tile.batch)], tAsA[(None, state.index)],
                              tma_bar_ptr=bar)
                    self.load_w(cand, sB, tile.w, k, rank, state.index, bar, mcast)
                ab_pipeline.producer_commit(state)
                state.advance()
            t += walk.stride
        ab_pipeline.producer_tail(state)

    @cute.jit
    def load_w(self, loads: PhaseLoads, sB, w, k, rank, stage, bar, mcast):
        """This CTA's chunks of w tile (w, k): chunk j = rank + i * cluster, rows
        [32 j, 32 j + 32) of the tile, the last one only its w_last rows."""
        for i in cutlass.range_constexpr(self.chunks_per_cta):
            j = rank + i * self.cluster
            if j < self.w_chunks - 1:
                self.load_w_chunk(loads.b_atom, self.w_chunk, loads.b, sB, w, j * self.w_chunk, k, stage, bar, mcast)
            if j == self.w_chunks - 1:
                last = loads.b_last_atom if const_expr(self.w_last_atom) else loads.b_atom
                self.load_w_chunk(last, self.w_last, loads.b, sB, w, j * self.w_chunk, k, stage, bar, mcast)

    @cute.jit
    def load_w_chunk(self, atom, rows: cutlass.Constexpr, mB, sB, w, r, k, stage, bar, mcast):
        """Rows [r, r + rows) of w tile (w, k) into the stage, multicast in a cluster."""
        box = (rows, self.tile_k)
        g = cute.local_tile(cute.domain_offset((w * self.tile_w + r, 0, 0), mB), box, (0, k, 0))
        s = cute.local_tile(cute.domain_offset((r, 0, 0), sB), box, (0, 0, stage))
        tBs, tBg = cpasync.tma_partition(
            atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 2), cute.group_modes(g, 0, 2)
        )
        if const_expr(self.cluster > 1):
            cute.copy(atom, tBg, tBs, tma_bar_ptr=bar, mcast_mask=mcast)
        else:
            cute.copy(atom, tBg, tBs, tma_bar_ptr=bar)

    # ----------------------------------------------------------- consumers
    @cute.jit
    def consumer(self, consumer_idx: Int32, rank: Int32, ab_pipeline, tiled_mma, sA, sB, sC, sU, sS, geom,
                 stores: LceStores, tiles: TileRange):
        tidx, _, _ = cute.arch.thread_idx()
        tidx = tidx % 128
        warp_in_wg = cute.arch.make_warp_uniform(cute.arch.warp_idx()) % 4
        thr_mma = tiled_mma.get_slice(tidx)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.tile_n, self.tile_w)), Float32)
        # Promotion: two partial fragments of the accumulator's shape, one k-block each in turn.
        partials = [cute.make_rmem_tensor_like(acc) for _ in range(2)] if const_expr(self.cfg.promote) else None

        # Register -> shared staging of the output (transposing stmatrix), per-consumer buffers.
        r2s = cute.make_tiled_copy_S(
            sm90_utils.get_smem_store_op(LayoutEnum.COL_MAJOR, self.out_dtype, Float32),
            cute.make_tiled_copy_C_atom(
                cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(True, 4), self.out_dtype), tiled_mma
            ),
        )
        thr_r2s = r2s.get_slice(tidx)
        tRS_sC = thr_r2s.partition_D(sC)
        rD_shape = cute.shape(thr_r2s.partition_S(sC))[:3]
        tRS_rD = cute.make_rmem_tensor(rD_shape, Float32)
        tRS_rOut = cute.make_rmem_tensor(rD_shape, self.out_dtype)
        # FP8: each accumulator value's (output column, output row) within the tile (its scales).
        coords = thr_mma.partition_C(cute.make_identity_tensor((self.tile_n, self.tile_w))) if const_expr(
            self.fp8) else None
        # FP8: this consumer's user-tile buffers, this thread's slots ((4, chunk, buffer)).
        my_sU = sU[(None, None, tidx, None, consumer_idx)] if const_expr(self.fp8) else None
        my_sS = sS[(None, consumer_idx)] if const_expr(self.fp8) else None

        tile_end = tiles.end
        walk = strided_tiles(tiles.begin, cluster=self.cluster, lanes=2, lane=consumer_idx)
        t, stride, grid = walk.first, walk.stride, walk.clusters
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
        if consumer_idx == 0:
            self.ping_pong.open_first_turn()
        else:
            # Consumer 1 starts after consumer 0's first tile in the ring.
            first0 = t - grid
            if first0 < tile_end:
                state.advance(self.k_blocks_of(first0, geom))

        epi_count = Int32(0)
        # The first tile's user tile; later ones are loaded during the previous tile's epilogue.
        first = self.decode(t, rank, geom)
        u_first = self.load_idx(stores, first, t < tile_end, geom)
        src = self.user_tile_source(stores, first, t < tile_end, geom, tidx, u_first)
        # Carried through the walk as plain values (the DSL carries no objects through loops).
        ws_tile, poison, do_load = src.index, src.poison, src.load
        self.load_user_tile(acc, stores.workspace, ws_tile, do_load, consumer_idx, tidx)
        while t < tile_end:
            tile = self.decode(t, rank, geom)
            own = UserTileSource(ws_tile, poison, do_load)  # FP8: the epilogue adds it
            # The next tile's idx, loaded while the main loop runs (the wait for its user tile follows it).
            t_next = t + stride
            tile_next = self.decode(t_next, rank, geom)
            u_next = self.load_idx(stores, tile_next, t_next < tile_end, geom)
            zero_init = tile.is_user
            row_scales = None
            if const_expr(self.fp8):
                zero_init = True  # the sum is scaled before the user tile is added (in the epilogue)
                row_scales = self.load_row_scales(stores, tile, tidx)
                for s in cutlass.range_constexpr(min(self.USER_BUFFERS, self.epi_subtiles)):
                    self.prefetch_user_subtile(my_sU, stores.workspace, own, s, tidx)
            else:
                # A bad index adds NaN; this also waits for the user-tile loads.
                for i in cutlass.range(cute.size(acc), unroll_full=True):
                    acc[i] = acc[i] + poison
            self.ping_pong.wait(consumer_idx)
            if const_expr(self.cfg.promote):
                state = promoting_mainloop(ab_pipeline, state, tiled_mma, acc, partials, tCrA, tCrB, tile.k_blocks,
                                           self.ping_pong, consumer_idx, False)
            else:
                state = pingpong_mainloop(ab_pipeline, state, tiled_mma, acc, tCrA, tCrB, tile.k_blocks, zero_init,
                                          self.ping_pong, consumer_idx)
            if const_expr(self.fp8):
                self.stage_row_scales(my_sS, row_scales, consumer_idx, tidx)
            if tile.is_user:
                if const_expr(self.fp8):
                    self.scale_tile(acc, coords, my_sS)
                self.store_user_tile(acc, stores, tile, geom, consumer_idx, tidx)
            # Thread 0 waits for the next tile's user tile (after a user tile is stored: it may
            # be that one); a warpgroup barrier then orders every thread's loads after the wait.
            src = self.user_tile_source(stores, tile_next, t_next < tile_end, geom, tidx, u_next)
            ws_tile, poison, do_load = src.index, src.poison, src.load
            if tile.is_user:
                self.load_user_tile(acc, stores.workspace, ws_tile, do_load, consumer_idx, tidx)
            else:
                # The epilogue's first barrier orders the loads; each sub-tile frees registers for them.
                self.store_output_tile(
                    acc, tRS_rD, tRS_rOut, tRS_sC, r2s, sC, stores,
                    tile, epi_count, consumer_idx, warp_in_wg, ws_tile, do_load, tidx, coords, own, my_sU, my_sS,
                )
                epi_count += self.epi_subtiles
            # Skip the other consumer's next tile in the ring.
            t_other = t + grid
            if t_other < tile_end:
                state.advance(self.k_blocks_of(t_other, geom))
            t = t_next
        if warp_in_wg == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        # A grid that did not wait at its start (wait_prior 0) ends only after the previous
        # grid, so what follows on the stream sees both.
        cute.arch.griddepcontrol_wait()

    @cute.jit
    def fragment_view(self, acc, mWs, tile, tidx):
        """(this thread's slot of a workspace tile, acc), both as (4, chunk)."""
        return (
            mWs[(None, None, tidx, tile)],
            cute.make_tensor(acc.iterator, cute.make_layout((4, cute.size(acc) // 4))),
        )

    @cute.jit
    def store_user_tile(self, acc, stores: LceStores, tile: LceTile, geom: LceGeometry, consumer_idx, tidx):
        """fp32 user tile -> workspace, then release its ready flag."""
        index = geom.user_tile_index(tile.batch, tile.w, tile.n)
        ws, frag = self.fragment_view(acc, stores.workspace, index, tidx)
        cute.autovec_copy(frag, ws)
        cute.arch.fence_acq_rel_gpu()
        self.epi_sync(consumer_idx)
        if tidx == 0:
            cute.arch.store(stores.flags.iterator + index, Int32(1), sem="release", scope="gpu")

    @cute.jit
    def reads_idx(self, tile: LceTile, exists, geom: LceGeometry):
        """Whether ``tile`` is a candidate tile of a batch entry of e (a cluster tile can reach
        cluster_b - 1 batches past B)."""
        return exists & (not tile.is_user) & (tile.batch < geom.n_cands)

    @cute.jit
    def load_idx(self, stores: LceStores, tile: LceTile, exists, geom: LceGeometry):
        """idx[b] of a candidate tile, in idx's own width (0 where ``reads_idx`` is false)."""
        u_raw = self.idx_dtype(0)
        if self.reads_idx(tile, exists, geom):
            u_raw = stores.idx[tile.batch]
        return u_raw

    @cute.jit
    def user_tile_source(self, stores: LceStores, tile: LceTile, exists, geom: LceGeometry, tidx,
                         u_raw) -> UserTileSource:
        """The user tile that ``tile`` adds (``u_raw``: its ``load_idx``): a candidate tile adds
        ws[idx[b]] once that user tile's flag is set (thread 0 waits for it here; the caller's
        warpgroup barrier then orders every thread's loads after the flag). A bad index reads
        nothing and adds NaN; user tiles and past-the-end tiles load nothing."""
        u = Int32(0)
        valid = tile.is_user | (not exists)
        if self.reads_idx(tile, exists, geom):
            # Compared in its own width: an int64 index must not wrap into range.
            valid = (u_raw >= 0) & (u_raw < geom.n_users)
            if valid:
                u = Int32(u_raw)
        poison = Float32(0.0)
        if not valid:
            poison = Float32(math.nan)
        index = geom.user_tile_index(u, tile.w, tile.n)
        do_load = valid & exists & (not tile.is_user)
        if do_load & (tidx == 0):
            while cute.arch.load(stores.flags.iterator + index, Int32, sem="acquire", scope="gpu") == 0:
                pass
        return UserTileSource(index, poison, do_load)

    @cute.jit
    def load_user_tile(self, acc, mWs, tile, do_load, consumer_idx, tidx):
        """With ``do_load``, the whole of user tile ``tile`` into acc, after a warpgroup barrier
        (which orders the loads after thread 0's wait for its flag)."""
        self.epi_sync(consumer_idx)
        if const_expr(not self.fp8):  # FP8: the epilogue reads it
            if do_load:
                self.load_user_chunks(acc, mWs, tile, tidx, list(range(cute.size(acc) // 4)))

    @cute.jit
    def load_row_scales(self, stores: LceStores, tile: LceTile, tidx) -> list:
        """FP8: (w row scale, batch entry scale) of the tile's rows tidx, tidx + 128, ... (those
        below tile_w), of the tile's phase; rows past w and batches past e take the last one's
        (their values are never stored). Loaded before the main loop, multiplied and staged in
        shared memory after it (a product taken here would wait for the loads)."""
        w_scale, e_scale = stores.w_cand_scale, stores.e_cand_scale
        if tile.is_user:
            w_scale, e_scale = stores.w_user_scale, stores.e_user_scale
        se = Float32(e_scale[cutlass.min(tile.batch, cute.size(e_scale) - 1)])
        scales = []
        for j in cutlass.range_constexpr(-(-self.tile_w // 128)):
            r = tidx + 128 * j
            sw = Float32(0.0)
            if r < self.tile_w:
                sw = Float32(w_scale[cutlass.min(tile.w * self.tile_w + r, cute.size(w_scale) - 1)])
            scales.append((sw, se))
        return scales

    @cute.jit
    def stage_row_scales(self, my_sS, scales: list, consumer_idx, tidx):
        """FP8: each row's scale, its w row's times its batch entry's (``load_row_scales``) ->
        the consumer's row scales, then a warpgroup barrier (the previous tile's readers passed
        the last barrier of its epilogue)."""
        for j in cutlass.range_constexpr(len(scales)):
            r = tidx + 128 * j
            if r < self.tile_w:
                my_sS[r] = scales[j][0] * scales[j][1]
        self.epi_sync(consumer_idx)

    @cute.jit
    def scale_tile(self, acc, coords, my_sS):
        """FP8, user tile: each fp32 sum times its row's scale before the workspace store."""
        for i in cutlass.range_constexpr(cute.size(acc)):
            acc[i] = acc[i] * my_sS[coords[i][1]]

    @cute.jit
    def load_user_chunks(self, acc, mWs, tile, tidx, chunks):
        """acc chunks (4 values each, the workspace's 16-byte fragment order) from user tile ``tile``."""
        ws, frag = self.fragment_view(acc, mWs, tile, tidx)
        for k in cutlass.range_constexpr(len(chunks)):
            cute.autovec_copy(ws[(None, chunks[k])], frag[(None, chunks[k])])

    @cute.jit
    def prefetch_user_subtile(self, my_sU, mWs, own: UserTileSource, s: int, tidx):
        """FP8: this thread's user values of epilogue sub-tile ``s`` -> its buffer s % USER_BUFFERS
        (cp.async, one commit group per sub-tile, empty where the tile loads no user tile)."""
        if own.load:
            ws = mWs[(None, None, tidx, own.index)]
            atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), Float32,
                                       num_bits_per_copy=128)
            for c in cutlass.range_constexpr(self.per_sub // 4):
                cute.copy(atom, ws[(None, self.epi_acc[s] // 4 + c)], my_sU[(None, c, s % self.USER_BUFFERS)])
        cute.arch.cp_async_commit_group()

    @cute.jit
    def store_output_tile(
        self, acc, tRS_rD, tRS_rOut, tRS_sC, r2s, sC, stores: LceStores,
        tile: LceTile, epi_count, consumer_idx, warp_in_wg, next_tile, do_load, tidx, coords, own: UserTileSource,
        my_sU, my_sS,
    ):
        """Round once, stage 64 x EPI_W sub-tiles in shared memory, TMA-store them. With
        ``do_load`` the accumulator chunks a sub-tile frees take the next tile's user tile.
        FP8: each value is the scaled sum plus ``own``, this tile's user tile (and poison), read
        from the buffers ``prefetch_user_subtile`` fills."""
        gOut = cute.local_tile(stores.out, (self.tile_n, self.tile_w), (tile.n, tile.w, tile.batch))
        per_sub = cute.size(tRS_rD)
        user = None
        if const_expr(self.fp8):
            user = cute.make_rmem_tensor(cute.make_layout((4, per_sub // 4)), Float32)
        # acc holds each atom's fragment whole (tile_w / 2 values), its rows (the wgmma N
        # side) outermost, 4 values per 8 rows.
        for s in cutlass.range_constexpr(self.epi_subtiles):
            h, row = s // self.subs_per_atom, self.epi_rows[s]
            if const_expr(self.fp8):
                for v in cutlass.range_constexpr(per_sub):
                    i = self.epi_acc[s] + v
                    tRS_rD[v] = acc[i] * my_sS[coords[i][1]] + own.poison
                cute.arch.cp_async_wait_group(self.user_groups_pending(s))
                if own.load:
                    cute.autovec_copy(my_sU[(None, None, s % self.USER_BUFFERS)], user)
                    for v in cutlass.range_constexpr(per_sub):
                        tRS_rD[v] = tRS_rD[v] + user[v]
                if const_expr(s + self.USER_BUFFERS < self.epi_subtiles):  # its buffer is read: refill it
                    self.prefetch_user_subtile(my_sU, stores.workspace, own, s + self.USER_BUFFERS, tidx)
            else:
                for v in cutlass.range_constexpr(per_sub):
                    tRS_rD[v] = acc[self.epi_acc[s] + v]
            tRS_rOut.store(tRS_rD.load().to(self.out_dtype))
            buf = self.staged.buffer(epi_count + s, consumer_idx)
            cute.copy(r2s, tRS_rOut, tRS_sC[(None, None, None, buf)])
            cute.arch.fence_proxy("async.shared", space="cta")
            self.staged.free_next(warp_in_wg == 0)
            self.epi_sync(consumer_idx)
            if const_expr(not self.fp8):  # FP8: each tile's epilogue reads its own user tile
                if do_load:
                    self.load_user_chunks(acc, stores.workspace, next_tile, tidx, self.epi_freed[s])
            if warp_in_wg == 0:
                # Rows [row + skip, row + EPI_W) of the atom's 64 columns h: those no earlier
                # sub-tile stored (the full sub-tile's atom, or the last one's).
                skip = self.epi_skip[s]
                atom = stores.out_atom if const_expr(skip == 0) else stores.out_last_atom
                box = (self.ATOM_N, self.EPI_W - skip)
                g = cute.local_tile(cute.domain_offset((0, row + skip), gOut), box, (h, 0))
                staged = cute.local_tile(cute.domain_offset((0, skip, 0), sC), box, (0, 0, buf))
                tS, tG = cpasync.tma_partition(
                    atom, 0, cute.make_layout(1), cute.group_modes(staged, 0, 2), cute.group_modes(g, 0, 2)
                )
                cute.copy(atom, tS, tG)
                cute.arch.cp_async_bulk_commit_group()

    def user_groups_pending(self, s: int) -> int:
        """FP8: the cp.async groups that may still be pending when sub-tile ``s`` reads its user
        values: USER_BUFFERS groups are issued before the main loop and one more after each sub-tile
        that leaves one to issue, so sub-tile s's group is done once at most (issued) - (s + 1) are."""
        return min(self.USER_BUFFERS + s, self.epi_subtiles) - s - 1

    def epi_sync(self, consumer_idx):
        """The 128 threads of consumer ``consumer_idx`` (its epilogue's staging buffers)."""
        bar_sync(LceBarrier.EPILOGUE + consumer_idx, self.BARRIER_THREADS["EPILOGUE"])
