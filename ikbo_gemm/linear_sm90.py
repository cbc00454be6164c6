"""The IKBO linear kernel for Hopper (sm_90a): class LinearSm90, one class for both phases.

    user phase:      ws[u]  = x_user[u] @ w_user^T                          (fp32)
    candidate phase: out[b] = act(x_cand[b] @ w_cand^T + ws[idx[b]] + bias)  (rounded once)

With FP8 operands (``LinearConfig.dtype`` float8_e4m3fn) each product is scaled in fp32 first,
``sx[row] * sw[col] * (x8 @ w8^T)``, and the output is ``cfg.out_dtype``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional

import cutlass
import cutlass.cute as cute
import torch
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync
from cutlass.tensor_utils import LayoutEnum

from cute_kernels.accumulator import acc_mn_view
from cute_kernels.arguments import GemmSmemLayouts, kernel_arguments
from cute_kernels.cluster_reduce import ClusterReduce, ExchangeMemory
from cute_kernels.interop import cutlass_dtype
from cute_kernels.mainloop import pingpong_mainloop, promoting_mainloop
from cute_kernels.scheduler import strided_tiles
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

from .config import LinearConfig

_SQRT_HALF = math.sqrt(0.5)
_GELU_TANH_C = math.sqrt(2.0 / math.pi)


@kernel_arguments
class LinearOperands(NamedTuple):
    """The GEMM's operands and the index (host -> kernel)."""

    a: cute.Tensor  # [rows, K_pad]: x_cand (candidate phase) or x_user (user phase)
    b: cute.Tensor  # [N, K_pad]: w_cand or w_user
    idx: cute.Tensor  # [B] (user phase: unused)


@kernel_arguments
class LinearEpilogue(NamedTuple):
    """Where the results go and what the candidate epilogue adds (host -> kernel)."""

    out: cute.Tensor  # candidate phase: [B, N] in the output dtype; user phase: ws
    ws: cute.Tensor  # [n_splits, U_pad, N_pad] fp32 user results (the user phase writes them)
    bias: Optional[cute.Tensor]  # [N] (candidate phase with bias only; FP8: fp32)
    a_scale: Optional[cute.Tensor] = None  # FP8: [rows] fp32, a's row scales
    b_scale: Optional[cute.Tensor] = None  # FP8: [N] fp32, b's row scales (the result's columns)


@kernel_arguments
class LinearLaunch(NamedTuple):
    """The launch's scalars (host -> kernel)."""

    n_users: Int32  # U
    n_splits: Int32  # slices of the user phase's K: workspace slabs (1 with split_k)
    grid_size: Int32  # CTAs, a multiple of the cluster
    band_rows: Int32  # candidate phase on a banded walk (LinearConfig.banded): cluster row groups a band


class LinearLoads(NamedTuple):
    """The TMA loads (kernel -> producer)."""

    a_atom: cute.CopyAtom  # the A tile, or (cluster_n 2) this CTA's rows of it, multicast in a cluster
    a: cute.Tensor  # TMA view (rows, K, 1)
    b_atom: cute.CopyAtom  # this CTA's rows of the B tile, multicast in a cluster
    b: cute.Tensor  # TMA view (N, K, 1)


class LinearStores(NamedTuple):
    """What the consumers' epilogues read and write (kernel -> consumers)."""

    out_atom: Optional[cute.CopyAtom]  # a staged sub-tile (candidate phase)
    out: cute.Tensor  # TMA view of out (candidate phase), or ws (user phase: stored from registers)
    ws: cute.Tensor
    idx: cute.Tensor
    bias: Optional[cute.Tensor]
    n_users: Int32
    n_splits: Int32
    a_scale: Optional[cute.Tensor]  # FP8 only
    b_scale: Optional[cute.Tensor]



class LinearBarrier(Barrier):
    """Named barrier ids (the class docstring of LinearSm90 says who uses each)."""

    EPILOGUE = 1  # + consumer: the 128 threads of one consumer warpgroup
    MMA_ORDER = 3  # + consumer: the ping-pong turn of the main loops (PingPong), 256 threads


@dataclasses.dataclass(frozen=True)
class LinearTile:
    """One tile of the walk (device values)."""

    m: Int32  # row tile (candidates, or users in the user phase)
    n: Int32  # column tile (output features)
    split: Int32  # user phase: the workspace slab it writes (its slice of K, without split_k)
    k_begin: Int32  # first k-block (split_k: of this CTA's slice)
    k_count: Int32  # k-blocks (>= 1)


@dataclasses.dataclass(frozen=True)
class LinearWork:
    """The launch's tile space (device values): ``splits`` slices of K (user phase, workspace
    slabs), each of ``m_groups`` x ``n_groups`` cluster tiles, column group fastest. With split_k
    the CTAs of a cluster take the k-slices of one tile instead."""

    n_groups: Int32  # groups of cluster_n column tiles
    m_groups: Int32  # groups of cluster_m row tiles
    splits: Int32
    k_blocks: Int32
    k_per_split: Int32  # every slice has at least one k-block (the op picks the slice count so)
    band_rows: Int32  # LinearConfig.banded: cluster row groups a band of the walk (1: column tile fastest)

    def size(self):
        return self.splits * self.m_groups * self.n_groups


class LinearSm90:
    """Persistent warp-specialized GEMM (ping-pong, or both consumers on one tile), ``C = A @ B^T`` with both operands K-major,
    and one of two epilogues (``cfg.phase``):
      "user": C in fp32 into the workspace ws [U_pad, N_pad] (no rounding);
      "cand": C + ws[idx[row]] + bias, the activation, all in fp32, rounded once into out [B, N].

    The op runs the user phase, then the candidate phase, as two launches on one stream
    (programmatic dependent launch): the candidate grid starts once every CTA of the user grid
    has started, runs its main loops meanwhile, and waits for the user grid to finish
    (griddepcontrol.wait) only before its first epilogue reads ws. No CTA waits on a CTA of its
    own grid outside its cluster, so any residency (green contexts, MPS limits) is safe.

    Clusters, one of two kinds:
      ``cfg.cluster_m`` = 2: the CTAs of a cluster run neighbouring row tiles of the same column
        tile and share its B tile: each loads its half of the rows and multicasts it to both,
        halving the B traffic from L2. With ``cfg.cluster_n`` = 2 as well (candidate phase), a
        2 x 2 cluster: CTA r runs row tile 2 m + r % 2 of column tile 2 n + r // 2; the two CTAs
        of a column tile share its B tile as above, the two of a row tile share its A tile the
        same way (each loads tile_m / 2 of its rows), halving the A traffic from L2 too. A
        column tile past N loads zeros and stores nothing (the workspace is padded to whole
        column groups).
      ``cfg.split_k`` = s > 1: the s CTAs of a cluster run one tile, CTA r over the r-th slice of
        its k-blocks; their partial sums meet in shared memory (cute_kernels.cluster_reduce:
        epilogue sub-tile j belongs to CTA j % s, which adds the others' partial sums of it in
        rank order and runs its epilogue). For grids of few tiles: s times the CTAs, each with
        1/s of the K loop. Consumer 1 has no tiles then (a tile's exchange is one consumer's).

    Warp roles (384 threads, 1 CTA per SM):
      warpgroup 0, producer (setmaxnreg 24): warp 0 issues the TMA loads of each k-block: this
        CTA's share of the A tile (tile_m / cluster_n rows x 64) and of the B tile (tile_n /
        cluster_m rows x 64), each multicast to the CTAs sharing it; K tails and rows past the
        tensors load as zeros.
      warpgroups 1, 2, consumers (setmaxnreg 240): each runs whole tiles, alternating (tile t
        of this CTA's walk on consumer t % 2): the wgmma main loop, then its epilogue while
        the other consumer runs its main loop. With split_k consumer 0 runs every tile. With
        ``cfg.consumers_per_tile`` = 2 (a shared tile: 128 x 256, LINEAR_SHARED_TILE, or FP8's
        128 x 128 with promotion) both run every tile, consumer c its rows [64 c, 64 c + 64)
        (m64n256 wgmmas: each k-step reads the B tile once for 64 rows a consumer, where
        ping-pong 128 x 128 reads it twice),
        and the epilogues of both follow the main loop.

    Pipelines (PipelineTmaAsync; checked in ``__init__``):

        | pipeline | producer -> consumer | full / empty arrives | stages |
        | --- | --- | --- | --- |
        | ab | producer warp 0 -> the consumer warpgroups owning the tile | 1 / 4 x peers x consumers_per_tile | ab_stages |

      One ring shared by both consumers. Full: one elected producer thread with the stage's TMA
      bytes (the whole A and B tiles, their shares from the CTAs that multicast them). Empty:
      each warp of the tile's consumers (one; both on a shared tile) releases the stage in each
      of the ``peers`` = cluster_m + cluster_n - 1 CTAs whose loads land in it (itself, the
      other CTA of its column tile and that of its row tile). Ping-pong: each consumer skips
      the other consumer's k-blocks in its ring state.
      split_k adds the exchange's two mbarriers (``ClusterReduce``: full, 1 arrive + the bytes
      of the other CTAs' partial sums; free, split_k - 1 remote arrives).

    Named barriers (LinearBarrier):
      MMA_ORDER + c (256 threads; PingPong): consumer c waits on it before its main loop; the
        other consumer arrives on it once its last wgmma is issued (consumer 0 opens the first
        turn), so the consumers walk the ring in tile order. Not used with split_k or a
        shared tile.
      EPILOGUE + c (128 threads): consumer c around each staged sub-tile of its output
        (candidate phase): its warp 0 TMA-stores the sub-tile and reuses a staging buffer
        only once the bulk store that read it is done; with split_k also once per tile, after
        it has read the other CTAs' partial sums.

    Timelines. Producer warp 0, per tile: for each k-block, wait for a free stage, load A and B.
    Consumer c, per tile of its lane of the walk (shared tile: every tile, no turns): (candidate
    phase: load each of its rows' user index, and where the registers allow each of its
    columns' bias) -> wait for its MMA_ORDER turn -> main loop
    (wgmma one group in flight, stages released one behind) -> hand the turn over ->
    (split_k: send the sub-tiles other CTAs own, add the partial sums of its own) -> epilogue:
    user phase: fp32 stores of its fragment into ws; candidate phase: (first tile: wait for the
    user grid) per sub-tile of its rows x EPI_N: + ws row + bias,
    activation, round, stmatrix into its staging buffer, TMA store.

    Tile order: cluster tiles (cluster_m row tiles x cluster_n column tiles) numbered column group
    fastest (the tiles running together share their A rows in L2), or (``cfg.banded``, candidate
    phase) in bands of ``band_rows`` row groups (LinearLaunch, a run-time value), row group fastest
    within a band (the last band may hold fewer; 1 row group a band is the column-fastest order);
    walked by the persistent grid of clusters (cute_kernels.scheduler). The user phase may split
    K in ``n_splits`` slices (so that its few tiles fill the GPU and the candidate grid starts
    sooner): slice s writes workspace slab s, and the candidate epilogue adds the slabs in order
    (deterministic).

    Out-of-range indices: a candidate whose idx is outside [0, U) reads ws row 0 and adds NaN:
    its output row is NaN, no other row is affected.

    FP8 (``cfg.dtype`` float8_e4m3fn): the same kernel with 8-bit wgmma (instruction K 32, both
    operands K-major, as 8-bit wgmma requires and x, w are), k-blocks of 128 elements (128
    bytes, as the 16-bit ones: the same stages, 128-byte swizzle), and fp32 scales
    (LinearEpilogue: a's row and b's row scales, the result's rows and columns). Each phase
    multiplies its fp32 sums by their row's and column's scales in place, as soon as its main
    loop ends: the workspace holds scaled user results, and the candidate epilogue then adds
    the slabs, the bias and the activation exactly as the 16-bit one does, rounding once to
    ``cfg.out_dtype``. A thread loads each of its rows' and columns' scales once per tile.
    With ``cfg.promote`` each k-block's wgmmas sum from zero into one of two partial fragments
    in turn, and the consumer adds the retired one into its fp32 accumulator while the next
    k-block's wgmmas run (cute_kernels.mainloop.promoting_mainloop); the wgmmas drain once
    every 4 k-blocks, at different k-blocks in the two consumers of a shared tile. The 128 x
    128 candidate tile is then a shared tile (64 rows a consumer).

    Arguments (cute_kernels.arguments): the host passes LinearOperands, LinearEpilogue and
    LinearLaunch; the kernel hands the loads to the producer (LinearLoads) and the epilogue's
    tensors and scalars to the consumers (LinearStores; split_k: ExchangeMemory).
    """

    TILE_K = 64  # elements of a 16-bit k-block; FP8 k-blocks hold twice as many (the same bytes)
    EPI_N = 16  # output columns per staged epilogue sub-tile (one 4-matrix stmatrix wide)
    EPI_STAGES = (4, 3, 2)  # staging buffers a consumer: the most that cost no operand stage
    # The bias of a thread's columns is loaded before the main loop where its registers and the
    # accumulator's take at most this many (more spilled: 128 x 192, 64 x 256 with a K split).
    BIAS_AHEAD_REGISTERS = 160
    REGISTERS = RegisterSplit(producer=24, consumer=240)
    THREADS = REGISTERS.threads
    # Each named barrier's threads, and its ids (one per consumer warpgroup), as the docstring states.
    BARRIER_THREADS = {"EPILOGUE": WARPGROUP, "MMA_ORDER": 2 * WARPGROUP}
    BARRIER_SPANS = {"EPILOGUE": 2, "MMA_ORDER": 2}

    def __init__(self, cfg: LinearConfig):
        self.cfg = cfg
        self.dtype = cutlass_dtype(cfg.dtype)
        self.fp8 = cfg.dtype == torch.float8_e4m3fn
        self.out_dtype = cutlass_dtype(cfg.out_dtype or cfg.dtype)
        self.tile_k = self.TILE_K * 2 if self.fp8 else self.TILE_K
        self.idx_dtype = cutlass_dtype(cfg.idx_dtype)
        self.tile_m, self.tile_n = cfg.tile_m, cfg.tile_n
        self.tile_mnk = (cfg.tile_m, cfg.tile_n, self.tile_k)
        self.cluster = cfg.cluster_m  # CTAs sharing B tiles (multicast)
        self.cluster_n = cfg.cluster_n  # CTAs sharing A tiles (multicast)
        self.split = cfg.split_k  # CTAs sharing one tile's K loop
        self.launch_cluster = cfg.cluster
        self.b_rows = cfg.tile_n // cfg.cluster_m  # rows of the B tile each CTA of a cluster loads
        self.a_rows = cfg.tile_m // cfg.cluster_n  # ... of the A tile
        # CTAs whose loads land in this CTA's stages, itself included (those that release them).
        self.peers = cfg.cluster_m + cfg.cluster_n - 1
        # Rows of each tile a consumer computes: all of them (ping-pong), or its half of a tile
        # both consumers share (consumers_per_tile = 2; consumer c takes rows [64 c, 64 c + 64)).
        self.shared_tile = cfg.consumers_per_tile == 2
        self.consumer_rows = cfg.tile_m // cfg.consumers_per_tile
        self.epi_tile = (self.consumer_rows, self.EPI_N)
        # A thread's accumulator: consumer_rows x tile_n / 128 fp32 registers over tile_n / 4 columns.
        self.bias_ahead = cfg.has_bias and (self.consumer_rows * cfg.tile_n // 128 + cfg.tile_n // 4
                                            <= self.BIAS_AHEAD_REGISTERS)
        self.epi_subtiles = cfg.tile_n // self.EPI_N
        # The exchange of a K-split cluster: 2 accumulator rows per 64 tile rows a thread holds.
        self.reduce = ClusterReduce(self.split, self.epi_subtiles, 2 * cfg.tile_m // 64) if self.split > 1 else None
        elt = self.dtype.width // 8
        smem = cutlass.memory.get_smem_capacity_in_bytes("sm_90")
        self.stage_bytes = (cfg.tile_m + cfg.tile_n) * self.tile_k * elt
        # Staging buffers: epi_stages per consumer (the user phase stores from registers; it
        # keeps one unused buffer so that both phases share one shared-memory layout). Each
        # staged sub-tile waits for the bulk store epi_stages - 1 sub-tiles back to have read
        # its buffer: more buffers, fewer of those waits in a row, as long as they cost no
        # operand stage.
        red_bytes = self.reduce.tx_bytes if self.reduce else 0

        def ab_stages(epi_stages: int) -> int:
            # As many stages as fit beside the staging buffers, the exchange's receive buffer and
            # the barriers (1024 bytes: the operands are 1024-byte aligned).
            buffers = 2 * epi_stages if cfg.phase == "cand" else 1
            epi_bytes = buffers * self.consumer_rows * self.EPI_N * (self.out_dtype.width // 8)
            return min(8, (smem - epi_bytes - red_bytes - 1024) // self.stage_bytes)

        self.ab_stages = ab_stages(self.EPI_STAGES[-1])
        self.epi_stages = next(e for e in self.EPI_STAGES if ab_stages(e) == self.ab_stages)
        self.epi_buffers = 2 * self.epi_stages if cfg.phase == "cand" else 1
        if self.ab_stages < 2:
            raise ValueError(f"LinearSm90: a {cfg.tile_m} x {cfg.tile_n} tile leaves room for "
                             f"{self.ab_stages} pipeline stages; at least 2 are needed")
        self.ab = PipelineSpec("ab", "producer warp 0", "the consumer warpgroups owning the tile", self.ab_stages,
                               self.stage_bytes, 1, 4 * self.peers * cfg.consumers_per_tile).check(
            "LinearSm90", releasing_threads=WARPGROUP * cfg.consumers_per_tile, multicast_ctas=self.peers)
        self.ping_pong = PingPong(int(LinearBarrier.MMA_ORDER), self.BARRIER_THREADS["MMA_ORDER"])
        check_barriers("LinearSm90", LinearBarrier, self.BARRIER_SPANS)

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(self, operands: LinearOperands, epilogue: LinearEpilogue, launch: LinearLaunch, stream):
        # GEMM views (rows, K, 1) and (N, K, 1); C (rows, N).
        a, b, out = operands.a, operands.b, epilogue.out
        mA = cute.make_tensor(a.iterator, cute.append(a.layout, cute.make_layout(1)))
        mB = cute.make_tensor(b.iterator, cute.append(b.layout, cute.make_layout(1)))
        # One wgmma row of 64 per consumer on a shared tile (each consumer slices its own).
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.K, Float32,
            (self.cfg.consumers_per_tile, 1, 1), tiler_mn=(64, self.tile_n))
        a_smem = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, self.tile_mnk, self.dtype, self.ab_stages)
        b_smem = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, self.tile_mnk, self.dtype, self.ab_stages)
        load = cpasync.CopyBulkTensorTileG2SOp()
        if const_expr(self.cluster_n > 1):
            # This CTA's rows of the A tile, multicast to the CTAs of its row tile.
            a_part = (self.a_rows, self.tile_n, self.tile_k)
            a_part_smem = cute.select(sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, a_part, self.dtype, 1),
                                      mode=[0, 1])
            tma_a, tA = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SMulticastOp(), mA, a_part_smem,
                                                    (self.a_rows, self.tile_k))
        else:
            tma_a, tA = cpasync.make_tiled_tma_atom(load, mA, cute.select(a_smem, mode=[0, 1]),
                                                    (self.tile_m, self.tile_k))
        # This CTA's rows of the B tile (all of them without a cluster), multicast in a cluster.
        b_part = (self.tile_m, self.b_rows, self.tile_k)
        b_part_smem = cute.select(sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, b_part, self.dtype, 1),
                                  mode=[0, 1])
        b_load = cpasync.CopyBulkTensorTileG2SMulticastOp() if const_expr(self.cluster > 1) else load
        tma_b, tB = cpasync.make_tiled_tma_atom(b_load, mB, b_part_smem, (self.b_rows, self.tile_k))
        epi_smem = sm90_utils.make_smem_layout_epi(self.out_dtype, LayoutEnum.ROW_MAJOR, self.epi_tile,
                                                   self.epi_buffers)
        tma_out = None
        c_out = out  # user phase: ws, stored from registers
        if const_expr(self.cfg.phase == "cand"):
            # The TMA view of out: stores of staged sub-tiles.
            tma_out, c_out = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), out,
                                                         cute.select(epi_smem, mode=[0, 1]), self.epi_tile)

        self.shared_storage = self.storage_struct(cute.cosize(a_smem), cute.cosize(b_smem), cute.cosize(epi_smem))
        self.kernel(
            LinearLoads(tma_a, tA, tma_b, tB),
            LinearStores(tma_out, c_out, epilogue.ws, operands.idx, epilogue.bias, launch.n_users, launch.n_splits,
                         epilogue.a_scale, epilogue.b_scale),
            GemmSmemLayouts(tiled_mma, a_smem, b_smem, epi_smem),
            launch.band_rows,
        ).launch(
            grid=[launch.grid_size, 1, 1], block=[self.THREADS, 1, 1], cluster=[self.launch_cluster, 1, 1],
            min_blocks_per_mp=1, stream=stream, use_pdl=True)

    def storage_struct(self, a_words: int, b_words: int, epi_words: int):
        """The shared-memory layout: the ring's barriers and operand stages, the staging buffers
        and, with split_k, the exchange's barriers (full, free) and receive buffer."""
        Align, MemRange = cute.struct.Align, cute.struct.MemRange
        fields = {"ab_barriers": MemRange[cutlass.Int64, self.ab_stages * 2]}
        if self.split > 1:
            fields["reduce_barriers"] = MemRange[cutlass.Int64, 2]
        fields.update(sA=Align[MemRange[self.dtype, a_words], 1024], sB=Align[MemRange[self.dtype, b_words], 1024],
                      sC=Align[MemRange[self.out_dtype, epi_words], 1024])
        if self.split > 1:
            fields["sRed"] = Align[MemRange[Float32, self.reduce.words], 128]
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, loads: LinearLoads, stores: LinearStores, layouts: GemmSmemLayouts, band_rows: Int32):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cpasync.prefetch_descriptor(loads.a_atom)
            cpasync.prefetch_descriptor(loads.b_atom)
            if const_expr(self.cfg.phase == "cand"):
                cpasync.prefetch_descriptor(stores.out_atom)
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        ab_pipeline = self.ab.make(storage.ab_barriers.data_ptr(),
                                   cute.make_layout((1, self.cluster, self.cluster_n, 1)))
        red_full = red_free = None
        if const_expr(self.split > 1):
            red_full = storage.reduce_barriers.data_ptr()
            red_free = red_full + 1
            if warp_idx == 0:
                with cute.arch.elect_one():
                    self.reduce.init_barriers(red_full, red_free)
        pipelines_init_arrive(self.launch_cluster)
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        sA = storage.sA.get_tensor(layouts.a.outer, swizzle=layouts.a.inner)
        sB = storage.sB.get_tensor(layouts.b.outer, swizzle=layouts.b.inner)
        sC = storage.sC.get_tensor(layouts.epi.outer, swizzle=layouts.epi.inner)
        exchange = None
        if const_expr(self.split > 1):
            exchange = ExchangeMemory(storage.sRed.get_tensor(self.reduce.buffer_layout()), red_full, red_free)
        n_rows = cute.size(loads.a, mode=[0])
        n_cols = cute.size(loads.b, mode=[0])
        k_blocks = (cute.size(loads.a, mode=[1]) + self.tile_k - 1) // self.tile_k
        splits = stores.n_splits if const_expr(self.cfg.phase == "user") else Int32(1)
        k_parts = splits * self.split  # one of the two is 1
        work = LinearWork(
            n_groups=(n_cols + self.tile_n * self.cluster_n - 1) // (self.tile_n * self.cluster_n),
            m_groups=(n_rows + self.tile_m * self.cluster - 1) // (self.tile_m * self.cluster),
            splits=splits, k_blocks=k_blocks, k_per_split=(k_blocks + k_parts - 1) // k_parts,
            band_rows=band_rows,
        )
        pipelines_init_wait(self.launch_cluster)
        if const_expr(self.cfg.phase == "user"):
            # The inputs were written by the grids before this one (programmatic dependent
            # launch): wait for them, then let the candidate grid start on the free SMs.
            cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()

        if warp_idx < 4:
            self.REGISTERS.enter_producer()
            if warp_idx == 0:
                self.producer(ab_pipeline, sA, sB, loads, work, rank)
        else:
            self.REGISTERS.enter_consumer()
            consumer_idx = warp_idx // 4 - 1
            if const_expr(self.split > 1):
                if consumer_idx == 0:
                    self.consumer(0, ab_pipeline, layouts.tiled_mma, sA, sB, sC, exchange, stores, n_rows, n_cols,
                                  work, rank)
            else:
                self.consumer(consumer_idx, ab_pipeline, layouts.tiled_mma, sA, sB, sC, exchange, stores, n_rows,
                              n_cols, work, rank)
        if const_expr(self.split > 1):
            ClusterReduce.end()

    @cute.jit
    def decode(self, t: Int32, work: LinearWork, rank: Int32) -> LinearTile:
        """Cluster tile index -> this CTA's tile (split_k: its slice of the tile's k-blocks)."""
        per_split = work.m_groups * work.n_groups
        split = t // per_split
        r = t - split * per_split
        if const_expr(self.cfg.banded):
            band_tiles = work.band_rows * work.n_groups
            band = r // band_tiles
            in_band = r - band * band_tiles
            band_rows = cutlass.min(work.band_rows, work.m_groups - band * work.band_rows)
            n = in_band // band_rows
            m = (band * work.band_rows + in_band - n * band_rows) * self.cluster
        else:
            m = r // work.n_groups * self.cluster
            n = r % work.n_groups
        k_part = split
        if const_expr(self.split > 1):
            k_part = rank
        elif const_expr(self.cluster_n > 1):
            m = m + rank % self.cluster
            n = n * self.cluster_n + rank // self.cluster
        else:
            m = m + rank
        k_begin = k_part * work.k_per_split
        return LinearTile(m, n, split, k_begin, cutlass.min(work.k_per_split, work.k_blocks - k_begin))

    # ----------------------------------------------------------- producer
    @cute.jit
    def producer(self, ab_pipeline, sA, sB, loads: LinearLoads, work: LinearWork, rank: Int32):
        """Warp 0: per tile and k-block, wait for a free stage and load its A tile and this CTA's
        rows of its B tile (multicast to the cluster); with cluster_n 2, this CTA's rows of its A
        tile (multicast to the CTAs of its row tile) and of its B tile."""
        one = cute.make_layout(1)
        gA = cute.local_tile(loads.a, (self.tile_m, self.tile_k), (None, None, 0))
        tAsA, tAgA = cpasync.tma_partition(loads.a_atom, 0, one, cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
        cluster_layout = cute.make_layout((self.cluster, self.cluster_n, 1))
        b_rank = rank if const_expr(self.cluster > 1) else Int32(0)  # this CTA in the cluster
        coord = cluster_layout.get_flat_coord(b_rank)
        mcast = cute.make_layout_image_mask(cluster_layout, coord, mode=0)  # B: the CTAs of its column tile
        a_rank, a_mcast = None, None
        if const_expr(self.cluster_n > 1):
            b_rank, a_rank = rank % self.cluster, rank // self.cluster  # its shares: its row, its column
            a_mcast = cute.make_layout_image_mask(cluster_layout, coord, mode=1)  # A: the CTAs of its row tile
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
        walk = strided_tiles(Int32(0), cluster=self.launch_cluster)
        t = walk.first
        while t < work.size():
            tile = self.decode(t, work, rank)
            for i in cutlass.range(tile.k_count, unroll=1):
                k = tile.k_begin + i
                ab_pipeline.producer_acquire(state)
                bar = ab_pipeline.producer_get_barrier(state)
                if const_expr(self.cluster_n > 1):
                    self.load_share(loads.a_atom, loads.a, sA, self.tile_m, self.a_rows, tile.m, k, a_rank, state.index,
                                    bar, a_mcast, True)
                else:
                    cute.copy(loads.a_atom, tAgA[(None, tile.m, k)], tAsA[(None, state.index)], tma_bar_ptr=bar)
                self.load_share(loads.b_atom, loads.b, sB, self.tile_n, self.b_rows, tile.n, k, b_rank, state.index,
                                bar, mcast, self.cluster > 1)
                ab_pipeline.producer_commit(state)
                state.advance()
            t += walk.stride
        ab_pipeline.producer_tail(state)

    @cute.jit
    def load_share(self, atom, mX, sX, tile_rows: cutlass.Constexpr, share_rows: cutlass.Constexpr, tile, k, share,
                   stage, bar, mcast, multicast: cutlass.Constexpr):
        """Rows [share, share + 1) x share_rows of operand tile (tile, k) (``tile_rows`` rows, K-major)
        into the stage; ``multicast``: to the CTAs of ``mcast`` as well."""
        box = (share_rows, self.tile_k)
        r = share * share_rows
        g = cute.local_tile(cute.domain_offset((tile * tile_rows + r, 0, 0), mX), box, (0, k, 0))
        s = cute.local_tile(cute.domain_offset((r, 0, 0), sX), box, (0, 0, stage))
        tXs, tXg = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 2),
                                         cute.group_modes(g, 0, 2))
        if const_expr(multicast):
            cute.copy(atom, tXg, tXs, tma_bar_ptr=bar, mcast_mask=mcast)
        else:
            cute.copy(atom, tXg, tXs, tma_bar_ptr=bar)

    # ----------------------------------------------------------- consumers
    @cute.jit
    def consumer(self, consumer_idx: Int32, ab_pipeline, tiled_mma, sA, sB, sC, exchange: Optional[ExchangeMemory],
                 stores: LinearStores, n_rows: Int32, n_cols: Int32, work: LinearWork, rank: Int32):
        """Consumer warpgroups: alternate tiles of the CTA's walk; main loop, then epilogue (split_k:
        consumer 0 alone, the partial sums exchanged in between)."""
        tidx, _, _ = cute.arch.thread_idx()
        tidx = tidx % 128
        warp_in_wg = cute.arch.make_warp_uniform(cute.arch.warp_idx()) % 4
        # A shared tile's MMA spans both consumers: each takes the slice of its 64 rows.
        thr_mma = tiled_mma.get_slice(consumer_idx * WARPGROUP + tidx if const_expr(self.shared_tile) else tidx)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        # Promotion: two partial fragments of the accumulator's shape, one k-block each in turn.
        partials = None
        if const_expr(self.cfg.promote):
            partials = [cute.make_rmem_tensor_like(acc) for _ in range(2)]
        # (row, col) within the tile of each accumulator register.
        coords = acc_mn_view(thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n))))

        # Ping-pong: the consumers take the CTA's tiles in turn. A K split or a shared tile: each
        # consumer that runs takes every tile.
        turns = self.split == 1 and not self.shared_tile
        lanes = 2 if const_expr(turns) else 1
        ping_pong = self.ping_pong if const_expr(turns) else None
        walk = strided_tiles(Int32(0), cluster=self.launch_cluster, lanes=lanes,
                             lane=consumer_idx if const_expr(turns) else 0)
        t = walk.first
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
        if const_expr(turns):
            if consumer_idx == 0:
                self.ping_pong.open_first_turn()
            else:
                # Consumer 1 starts after consumer 0's first tile in the ring.
                if t - walk.clusters < work.size():
                    state.advance(self.decode(t - walk.clusters, work, rank).k_count)
        epi_count = Int32(0)
        tile_i = Int32(0)
        while t < work.size():
            tile = self.decode(t, work, rank)
            row_in = col_in = None
            if const_expr(self.cfg.phase == "cand"):
                # The epilogue's per-row users and per-column bias: inputs of the call, not of the
                # user grid, so loaded now, in flight while the main loop runs.
                row_in = self.row_users(coords, stores, tile, n_rows)
                col_in = self.column_bias(coords, stores, tile, n_cols)
            if const_expr(turns):
                self.ping_pong.wait(consumer_idx)
            if const_expr(self.cfg.promote):
                # A shared tile's consumers drain at different k-blocks (promoting_mainloop).
                stagger = consumer_idx == 1 if const_expr(self.shared_tile) else False
                state = promoting_mainloop(ab_pipeline, state, tiled_mma, acc, partials, tCrA, tCrB, tile.k_count,
                                           ping_pong, consumer_idx, stagger)
            else:
                state = pingpong_mainloop(ab_pipeline, state, tiled_mma, acc, tCrA, tCrB, tile.k_count, True,
                                          ping_pong, consumer_idx)
            if const_expr(self.split > 1):
                self.reduce.exchange(acc_mn_view(acc), exchange, rank, tile_i,
                                     t + walk.stride < work.size(), tidx, int(LinearBarrier.EPILOGUE))
            if const_expr(self.fp8):
                self.apply_scales(acc, coords, stores, tile, n_rows, n_cols)
            if const_expr(self.cfg.phase == "user"):
                self.store_user_tile(acc, coords, stores.out, tile, rank)
            else:
                self.store_output_tile(acc, coords, tiled_mma, sC, stores, tile, row_in, col_in, n_cols,
                                       epi_count, consumer_idx, warp_in_wg, tidx, rank)
                epi_count += self.epi_subtiles // self.split
            if const_expr(turns):
                # Skip the other consumer's next tile in the ring.
                if t + walk.clusters < work.size():
                    state.advance(self.decode(t + walk.clusters, work, rank).k_count)
            t += walk.stride
            tile_i += 1
        if const_expr(self.cfg.phase == "cand"):
            if warp_in_wg == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def apply_scales(self, acc, coords, stores: LinearStores, tile: LinearTile, n_rows: Int32, n_cols: Int32):
        """FP8: each fp32 sum times its row's scale (a's) and its column's (b's), each loaded once
        (rows and columns past a and b take the last one's: never stored)."""
        acc_mn = acc_mn_view(acc)
        rows, cols = cute.size(acc_mn, mode=[0]), cute.size(acc_mn, mode=[1])
        row_scales = [Float32(stores.a_scale[cutlass.min(tile.m * self.tile_m + coords[m, 0][0], n_rows - 1)])
                      for m in range(rows)]
        for c in cutlass.range_constexpr(cols):
            col_scale = Float32(stores.b_scale[cutlass.min(tile.n * self.tile_n + coords[0, c][1], n_cols - 1)])
            for m in cutlass.range_constexpr(rows):
                acc_mn[m, c] = acc_mn[m, c] * row_scales[m] * col_scale

    def owns(self, s: int, rank):
        """Whether this CTA runs the epilogue of sub-tile ``s`` (a compile-time index): always, but
        with split_k only the sub-tiles it owns (``ClusterReduce.owner``)."""
        return True if self.split == 1 else rank == self.reduce.owner(s)

    @cute.jit
    def store_user_tile(self, acc, coords, mWs, tile: LinearTile, rank: Int32):
        """fp32 user results straight into workspace slab ``tile.split`` (padded to whole tiles: no
        bounds to check)."""
        acc_mn = acc_mn_view(acc)
        row0 = tile.m * self.tile_m
        col0 = tile.n * self.tile_n
        per_sub = cute.size(acc_mn, mode=[1]) // self.epi_subtiles  # columns of a sub-tile
        for m in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
                if self.owns(c // per_sub, rank):
                    r, col = coords[m, c]
                    mWs[tile.split, row0 + r, col0 + col] = acc_mn[m, c]

    @cute.jit
    def row_users(self, coords, stores: LinearStores, tile: LinearTile, n_rows: Int32):
        """(users, poison) of the thread's accumulator rows: each row's user (rows past B read
        idx[B - 1]; they are never stored) and 0, or user 0 and NaN for an index out of range."""
        users = []
        poison = []
        row0 = tile.m * self.tile_m
        for m in cutlass.range_constexpr(cute.size(coords, mode=[0])):
            u_raw = stores.idx[cutlass.min(row0 + coords[m, 0][0], n_rows - 1)]
            valid = (u_raw >= 0) & (u_raw < stores.n_users)  # in idx's own width: an int64 must not wrap
            users.append(Int32(u_raw) if valid else Int32(0))
            poison.append(Float32(0.0) if valid else Float32(math.nan))
        return users, poison

    @cute.jit
    def column_bias(self, coords, stores: LinearStores, tile: LinearTile, n_cols: Int32):
        """The bias of each of the thread's accumulator columns in fp32 (columns past N read the
        last one: never stored); None without a bias, or where the registers are short
        (``bias_ahead``: the epilogue loads it)."""
        if const_expr(not self.bias_ahead):
            return None
        col0 = tile.n * self.tile_n
        return [Float32(stores.bias[cutlass.min(col0 + coords[0, c][1], n_cols - 1)])
                for c in range(cute.size(coords, mode=[1]))]

    @cute.jit
    def store_output_tile(self, acc, coords, tiled_mma, sC, stores: LinearStores, tile: LinearTile, row_in, col_in,
                          n_cols: Int32, epi_count: Int32, consumer_idx: Int32, warp_in_wg: Int32, tidx: Int32,
                          rank: Int32):
        """+ ws[idx[row]] (its slabs in order) + bias, activation, round once; staged (its rows) x EPI_N
        sub-tiles (split_k: those this CTA owns), TMA-stored (rows and columns past the output are
        clipped by the store). ``row_in``: ``row_users``; ``col_in``: ``column_bias``."""
        acc_mn = acc_mn_view(acc)
        rows = cute.size(acc_mn, mode=[0])
        col0 = tile.n * self.tile_n
        users, poison = row_in
        # The user grid's ws is complete (a no-op once it has finished).
        cute.arch.griddepcontrol_wait()

        # The user rows, slab by slab in a fixed order (the same bits whoever ran which slice).
        per_sub = cute.size(acc_mn, mode=[1]) // self.epi_subtiles  # columns of a sub-tile
        for sp in cutlass.range(stores.n_splits, unroll=1):
            for m in cutlass.range_constexpr(rows):
                for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
                    if self.owns(c // per_sub, rank):
                        acc_mn[m, c] = acc_mn[m, c] + stores.ws[sp, users[m], col0 + coords[m, c][1]]

        sub = cute.make_rmem_tensor(self.sub_mma(tiled_mma).get_slice(tidx).partition_shape_C(self.epi_tile), Float32)
        sub_mn = acc_mn_view(sub)
        r2s = cute.make_tiled_copy_S(
            sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.out_dtype, Float32),
            cute.make_tiled_copy_C_atom(cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4),
                                                            self.out_dtype),
                                        self.sub_mma(tiled_mma)),
        )
        thr_r2s = r2s.get_slice(tidx)
        tRS_sC = thr_r2s.partition_D(sC)
        gOut = cute.local_tile(stores.out, self.epi_tile, (None, None))
        for s in cutlass.range_constexpr(self.epi_subtiles):
            if self.owns(s, rank):
                for m in cutlass.range_constexpr(rows):
                    for c in cutlass.range_constexpr(per_sub):
                        v = acc_mn[m, s * per_sub + c] + poison[m]
                        if const_expr(self.bias_ahead):
                            v = v + col_in[s * per_sub + c]
                        elif const_expr(self.cfg.has_bias):
                            col = col0 + coords[m, s * per_sub + c][1]
                            v = v + Float32(stores.bias[cutlass.min(col, n_cols - 1)])
                        sub_mn[m, c] = self.activation(v)
                rOut = cute.make_rmem_tensor_like(sub, self.out_dtype)
                rOut.store(sub.load().to(self.out_dtype))
                # The sub-tile's turn among those this CTA stores (every sub-tile without split_k).
                buf = consumer_idx * self.epi_stages + (epi_count + s // self.split) % self.epi_stages
                cute.copy(r2s, r2s.retile(rOut), tRS_sC[(None, None, None, buf)])
                cute.arch.fence_proxy("async.shared", space="cta")
                self.epi_sync(consumer_idx)
                if warp_in_wg == 0:
                    # The consumer's rows of the tile: a shared tile's are its half.
                    m_sub = tile.m * self.cfg.consumers_per_tile + (consumer_idx if const_expr(self.shared_tile) else 0)
                    tS, tG = cpasync.tma_partition(stores.out_atom, 0, cute.make_layout(1),
                                                   cute.group_modes(sC[(None, None, buf)], 0, 2),
                                                   cute.group_modes(gOut[(None, None, m_sub,
                                                                          tile.n * self.epi_subtiles + s)], 0, 2))
                    cute.copy(stores.out_atom, tS, tG)
                    cute.arch.cp_async_bulk_commit_group()
                    cute.arch.cp_async_bulk_wait_group(self.epi_stages - 1, read=True)
                self.epi_sync(consumer_idx)

    def sub_mma(self, tiled_mma):
        """The tiled MMA of one epilogue sub-tile (the consumer's rows x EPI_N): its accumulator fragment is the
        full tile's fragment restricted to those columns, in the same register order."""
        return sm90_utils.make_trivial_tiled_mma(
            self.out_dtype, self.out_dtype, OperandMajorMode.K, OperandMajorMode.K, Float32, (1, 1, 1),
            tiler_mn=(64, self.EPI_N))

    @cute.jit
    def activation(self, x: Float32) -> Float32:
        """The configured activation, in fp32."""
        act = self.cfg.activation
        y = x
        if const_expr(act == "relu"):
            y = Float32(0.0) if x < Float32(0.0) else x  # NaN stays NaN (fmax would drop it), as torch.relu
        elif const_expr(act == "gelu"):
            y = Float32(0.5) * x * (Float32(1.0) + cute.math.erf(x * Float32(_SQRT_HALF)))
        elif const_expr(act == "gelu_tanh"):
            inner = Float32(_GELU_TANH_C) * (x + Float32(0.044715) * x * x * x)
            y = Float32(0.5) * x * (Float32(1.0) + cute.math.tanh(inner))
        elif const_expr(act == "silu"):
            y = x / (Float32(1.0) + cute.math.exp(-x))
        elif const_expr(act == "sigmoid"):
            y = Float32(1.0) / (Float32(1.0) + cute.math.exp(-x))
        return y

    def epi_sync(self, consumer_idx):
        """The 128 threads of consumer ``consumer_idx`` (its epilogue's staging buffers)."""
        bar_sync(LinearBarrier.EPILOGUE + consumer_idx, self.BARRIER_THREADS["EPILOGUE"])
