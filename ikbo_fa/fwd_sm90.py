"""IKBO flash attention forward for Hopper (sm_90a): class IkboAttentionFwdSm90."""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup

from cute_kernels.accumulator import acc_as_frag_a, acc_mn_view, warpgroup_gemm
from cute_kernels.cluster_reduce import cluster_end, init_exchange, release_peers, store_remote
from cute_kernels.interop import cutlass_dtype
from cute_kernels.scheduler import TileCounter, strided_tiles
from cute_kernels.warp_specialized import (
    Barrier,
    PingPong,
    PipelineSpec,
    RegisterSplit,
    bar_sync,
    check_barriers,
    pipelines_init_arrive,
    pipelines_init_wait,
)

from .config import WHOLE_ROW, AttentionConfig, box_rows, row_packing
from .fwd_args import (
    FwdScalars,
    FwdTensors,
    FwdWorkList,
    GlobalTensors,
    OutTarget,
    ProblemDims,
    SmemLayouts,
    TiledMmas,
    TmaOperands,
)
from .softmax import LN_2, LOG2_E, OnlineSoftmax
from .tile_scheduler import Schedule, TileInfo, tile_scheduler


class FwdBarrier(Barrier):
    """Named barrier ids (the class docstring of IkboAttentionFwdSm90 says who uses each)."""

    EPILOGUE = 1  # + consumer warpgroup: its 128 threads around the sO writes
    GEMM_TURN = 4  # + consumer warpgroup: that warpgroup's turn to issue its GEMMs (PingPong)
    V_TAIL = 7  # every consumer warpgroup, after zeroing a V tail


@dataclasses.dataclass(frozen=True)
class ConsumerState:
    """A consumer thread's fragments, accumulators and softmax, shared by its main-loop steps."""

    tiled_mma_qk: object
    tiled_mma_pv: object
    tSrQ: object  # Q (A of S = Q K^T), per Q stage
    tSrK: object  # K (B), per K/V stage
    tOrV: object  # V (B of O += P V), per K/V stage
    tOrP: object  # P in registers (A of O += P V)
    acc_O: object
    acc_O_mn: object
    tScS_mn: object  # thread 0's score columns (compile time)
    col_offset: object  # this thread's column offset from thread 0's
    softmax: OnlineSoftmax
    tOcO_mn: object  # (row, col) of each O register
    pipe_k: object
    pipe_v: object
    sQ: object
    sV: object
    mKg: object  # (L, D, H_kv, batch) view of K in global memory, for the exact recompute
    mVg: object
    wg: Int32  # consumer warpgroup, 0 to tile_m / 64 - 1


class SharedTensors(NamedTuple):
    """The CTA's shared-memory tensors."""

    q: object  # Q stages (rows, D, stage)
    k: object  # K stages
    v: object  # V stages
    vt: object  # (D, n, stage) view of V: the MN-major B operand of O += P V
    o: object  # the output tile, staged for TMA stores
    meta: object  # TileInfo per Q stage


class Pipelines(NamedTuple):
    q: object
    k: object
    v: object


# Q slots whose lookups the producer (24 registers) keeps in flight together: at 8 or 16 they
# spilled (S_q 8, 16, 24, 40, ...: boxes of 8 or 16 rows).
Q_SLOTS_UNROLLED = 4


class IkboAttentionFwdSm90:
    """Persistent, warp-specialized IKBO attention forward.

    Warp roles (128 threads + 128 per 64 query rows of a tile (``tile_m``: 128 or 192); one CTA
    per SM, grid = min(#SMs, tiles); split pairs: clusters of 2, min(resident clusters, tiles) of
    them):
      warpgroup 0, producer (setmaxnreg 24): warp 0 walks the tile list (its 32 lanes find
        each tile's user together: warp_search) and issues every TMA load; warps 1-3 idle.
        Per tile: wait for a free Q stage, write the tile's TileInfo beside it, load the Q
        slots; then K/V blocks (``cfg.key_block`` keys: 128, or 192 at D 64 without a key
        split) last to first, K one block ahead of V. ``dynamic_walk``: once
        a tile's loads are issued, lane 0 takes the next tile from the work list's counter
        (TileCounter); a split with no key is written as its rows' lse alone (empty_piece);
        past the last tile, the END mark goes into the next Q stage (its full barrier arrived
        on with no bytes), and the last CTA to finish zeroes the counter.
      warpgroups 1 to tile_m / 64, consumers (setmaxnreg 240 for two, 160 for three): 64 query
        rows each of the tile.
        Per tile (``dynamic_walk``: until a Q stage holds the END mark): read the TileInfo,
        S = Q K^T and O += P V on wgmma (P from registers), the online softmax in exp2 on fp32
        row max / sum (ikbo_fa.softmax); with ``overlap`` the S of block j is issued before the
        P V of block j-1 and the softmax of j runs while that P V is in flight, the consumer
        warpgroups taking turns on the tensor cores in order (PingPong); rows whose max jumped are
        recomputed exactly; epilogue: O / row sum into the warpgroup's 64 rows of sO
        (stmatrix), one TMA store per stored slot (or one for all 64 rows); with boxes of at
        most 4 rows (``direct_rows``), rows that are not one such box go from registers
        straight to out instead.

    Pipelines (PipelineTmaAsync; checked in ``__init__``; the table is ``contract_table`` of
    ``self.pipelines``, which tests/test_attention_contracts_cpu.py holds it to):

        | pipeline | producer -> consumer | full / empty arrives | stages |
        | --- | --- | --- | --- |
        | Q | producer warp 0 -> both consumer warpgroups | 1 / 8 | 2 |
        | K | producer warp 0 -> both consumer warpgroups | 1 / 8 | 2 |
        | V | producer warp 0 -> both consumer warpgroups | 1 / 8 | 2 |

      and with 192-row tiles:

        | pipeline | producer -> consumer | full / empty arrives | stages |
        | --- | --- | --- | --- |
        | Q | producer warp 0 -> the 3 consumer warpgroups | 1 / 12 | 2 |
        | K | producer warp 0 -> the 3 consumer warpgroups | 1 / 12 | 2 |
        | V | producer warp 0 -> the 3 consumer warpgroups | 1 / 12 | 2 |

      Full: one elected producer thread with the stage's TMA bytes (Q: every slot of the
      tile). Empty: lane 0 of each consumer warp. Q stage i % 2 holds the
      CTA's i-th tile, and beside it the tile's TileInfo, so the next tile's Q loads while this
      one runs; it is released after the tile's main loop (the TileInfo slot with it). K and V
      share one stage index; K is released after S of its block, V after its P V.

    Named barriers (FwdBarrier; ``+ wg``: one id per consumer warpgroup, BARRIER_SPANS):
      EPILOGUE + wg (128 threads): warpgroup wg, twice per tile around its sO writes, and
        (``split_pair``) once in ``pair_receive``, when every thread has read the peer's rows.
      V_TAIL (every consumer thread): every consumer warpgroup, once per tile after zeroing a V
        tail (kv_lengths or jagged only), before the first P V of the tile.
      GEMM_TURN + wg (256, ``overlap`` only): the turn on the tensor cores. Warpgroup wg waits on
        it right before issuing S = Q K^T and P V of a main-loop iteration and, once both are
        issued, hands the turn to the next warpgroup (arrives on GEMM_TURN + (wg + 1) % n of n
        consumer warpgroups); warpgroup 0 takes the first turn. Every warpgroup runs the same
        tiles with the same block count, so the turns go strictly round 0, 1, (2,) 0, ...; the
        first S of a tile and its last P V are issued outside the turns. One arrive is left
        pending at exit (harmless).
    Before rewriting its sO rows a warpgroup waits (bulk wait_group.read) for its previous
    TMA stores.

    Split pairs (``split_pair``, a cluster of 2 CTAs on the same tiles, CTA r over split r of each
    row's keys): CTA r stores the rows of consumer warpgroup r. After its main loop the other
    warpgroup sends its normalized O (in the dtype) and its rows' lse by ``st.async`` into the
    peer's sO rows of that warpgroup (which the peer never stores) and its lse buffer; the owner
    rounds its own O to the dtype as well (so a row's result does not depend on which CTA owns
    it), merges the two in fp32 and runs the epilogue. Rows past a tile's (warpgroup 1's of a
    tile of at most 64 rows) are exchanged by neither. Barriers (one each per CTA):

        | barrier | arrives | completes when |
        | --- | --- | --- |
        | pair full | 1 (the owner, arming the bytes) + 128 x (D / 4 + 2) x 4 bytes | the peer's rows have landed |
        | pair free | 1 (the peer's owner, remotely) | the peer has read the previous exchange |

    The sender waits on free before every exchange but the first; the kernel ends with a
    cluster barrier, so no CTA exits while its peer may still arrive on or store into it.

    Timeline of a consumer warpgroup per tile (overlap): wait Q -> first block: S, mask,
    softmax, P -> for each later block: [turn: S(j), P V(j-1), hand over] softmax(j) against
    the stale max -> last P V -> exact rows (rare) -> release Q -> epilogue.

    Scale: ``scale_log2`` must be > 0. Masked keys are -inf before scaling and each row's
    running max is taken over the raw scores; the op maps a scale <= 0 onto this.

    Launch: programmatic dependent launch, so the CTAs start and set up their barriers while
    the kernel before them (the work list) finishes; every thread waits for that grid
    (griddepcontrol.wait) before touching the work list. Meanwhile (``prefetch``: KV broadcast)
    lanes of warp 0 prefetch into L2 the K/V blocks the first tiles read first (``prefetch_blocks``
    per CTA, a run-time argument; 0: none), as DRAM idles during the wait: each row's last
    blocks, from the shapes over padded K/V, from kv_lengths or kv_offsets (inputs of the call)
    over rows of their own lengths.
    Once its producer has issued its last load, a CTA lets the kernel queued after it launch
    (griddepcontrol.launch_dependents): the split merge's CTAs start on the SMs the tail frees.

    Tiles and order (the producer asks ``ikbo_fa.tile_scheduler``): a tile is (head, group,
    tile-in-group). KV broadcast: groups are users plus a last group of candidates whose index is out of range (written as NaN). A user's
    candidates, grouped on the device (worklist.py), put their query rows in one dense run
    (S_q rows each, any S_q), cut into tiles of ``tile_m`` rows, so each K/V block in shared memory serves
    all of them; a candidate may span two tiles, and only a user's last tile has rows past the
    run (they load a copy of a stored box and are never stored). A tile moves in slots of
    R = gcd(S_q, 64) rows (one TMA box each, looked up per slot); where idx is grouped already
    (the work list's ``grouped``) and q and out hold a user's rows at one stride, a tile's rows
    are consecutive rows of q and out and move as one 64-row box a warpgroup, a partly filled
    warpgroup's rows still by slots. Q broadcast: a group is one candidate (Q at idx[b], K/V at
    b), in slots of ``row_packing``. Jagged K/V (``jagged``): row r's keys start at
    kv_offsets[r] of one packed batch row; the keys past its end (the next row's) are masked
    and their V rows zeroed, as with kv_lengths. Tiles run head-slowest, then user, then tile
    within the user, strided by the persistent grid, so CTAs running together share a user's
    K/V through L2. Histories of their own lengths (kv_lengths or jagged, KV broadcast) that
    may be long (``ordered``: ``longest_first``) run longest first instead: the work list's
    ``perm`` holds the groups by decreasing key count and ``tile_start`` their tiles in that
    order; heads run fastest, and
    the walk turns back every other round (round r of the grid's G CTAs hands CTA c position
    r G + c, or r G + n - 1 - c on odd rounds of n positions), so the CTAs that took the
    longest tiles of one round take the shortest of the next; with ``dynamic_walk`` there are no
    rounds: each CTA takes its first tile by its index and every later one from the counter, in
    the order group, tile, split, head (a row's pieces together, longest rows first). Split-KV
    (``split_kv``, KV broadcast): every tile runs ``n_splits`` times (split slowest in the static
    walk), split i over keys
    i * split_keys : (i + 1) * split_keys of its row (K/V offset by kv_base, the keys past the
    row's end masked as above), writing its output and lse as head i * H + h of a workspace the
    op merges (``ikbo_fa.attention.merge_splits``). With ``whole_rows_out``, split 0 of a row
    whose keys fit one split (or whose index is out of range) writes out and lse directly
    (``whole_out``) and its split-0 lse word in the workspace as WHOLE_ROW, which the merge
    skips. With ``tail_split`` (padded K/V) only the tiles past the grid's full rounds (moved back
    to a user's first tile: ``AttentionTileScheduler.whole_tiles``, searched by every warp once the
    work list is in) split: the others run whole with all their keys and write out directly,
    marked as above.
    """

    KV_STAGES = 2
    # Two Q stages: the next tile's Q loads while this tile runs (its latency was exposed
    # between tiles with one stage).
    Q_STAGES = 2
    # By consumer warpgroups (tile_m / 64): three leave 160 registers a thread.
    REGISTERS = {2: RegisterSplit(producer=24, consumer=240),
                 3: RegisterSplit(producer=24, consumer=160, consumer_warpgroups=3)}
    # Named barriers offset by the consumer warpgroup (ids per barrier; the others take one).
    BARRIER_SPANS = {"EPILOGUE": 3, "GEMM_TURN": 3}
    WARPGROUP_THREADS = 128

    def __init__(self, cfg: AttentionConfig):
        self.cfg = cfg
        self.dtype = cutlass_dtype(cfg.dtype)
        self.head_dim = cfg.head_dim
        self.s_q = cfg.s_q
        self.tile_m, self.tile_n = cfg.tile_m, cfg.key_block
        # One consumer warpgroup per 64 query rows of the tile.
        self.consumer_wgs = self.tile_m // 64
        self.registers = self.REGISTERS[self.consumer_wgs]
        self.consumer_threads = self.consumer_wgs * self.WARPGROUP_THREADS
        # KV broadcast packs a user's query rows densely and moves them in boxes ("slots") of
        # box_rows rows; Q broadcast gives each candidate one tile (slots of row_packing).
        self.dense = cfg.direction == "kv"
        if self.dense:
            self.slot_rows, self.chunks = box_rows(cfg.s_q), 1
            self.slots_per_wg = 64 // self.slot_rows
        else:
            self.slot_rows, self.slots_per_wg, self.chunks = row_packing(cfg.s_q)
        self.slots = self.consumer_wgs * self.slots_per_wg
        # Q slots the producer loads together (load_q_slots): all where they are few (and for Q
        # broadcast, no lookup), up to 16 in groups of the most (at most Q_SLOTS_UNROLLED) that
        # divide them, one at a time beyond.
        if not self.dense or self.slots <= Q_SLOTS_UNROLLED:
            self.q_slot_group = self.slots
        elif self.slots <= 16:
            self.q_slot_group = max(p for p in range(1, Q_SLOTS_UNROLLED + 1) if self.slots % p == 0)
        else:
            self.q_slot_group = 1
        # Small boxes: a tile whose rows are consecutive rows of q (idx grouped) moves each
        # warpgroup's 64 rows in one box instead.
        self.flat_path = self.dense and self.slot_rows < 64
        # Boxes of 1, 2 or 4 rows (S_q odd, 2 mod 4, 4 mod 8): a warpgroup's rows that are not one
        # box of consecutive rows go from registers to out directly, a candidate lookup per row,
        # instead of 16 to 64 TMA stores, each after its own lookup.
        self.direct_rows = self.dense and self.slots_per_wg > 8
        self.tail_masked = cfg.has_kv_lengths or cfg.jagged  # keys past a row's end are read
        # Histories of different lengths (KV broadcast): the work list orders the groups longest
        # first, so that the walk's last rounds hold the short tiles.
        self.ordered = cfg.ordered
        # Ordered tiles from a counter (TileCounter), each to the first CTA free for it.
        self.dynamic = cfg.dynamic_walk
        self.scheduler = tile_scheduler(cfg)
        # KV broadcast: each row's first blocks (the last of each split) prefetched into L2 while
        # the work list runs: they follow from the shapes over padded K/V, from kv_lengths or
        # kv_offsets (not from the work list) over rows of their own lengths.
        self.prefetch = self.dense
        # Keys split over CTAs: split_kv (a workspace the op merges) or split_pair (the two CTAs
        # of a cluster merge them in distributed shared memory: pair_send / pair_receive).
        self.pair = cfg.split_pair
        self.cluster_size = 2 if self.pair else 1
        self.key_split = cfg.split_kv or cfg.split_pair
        self.num_threads = self.registers.threads
        self.ping_pong = PingPong(int(FwdBarrier.GEMM_TURN), warpgroups=self.consumer_wgs)
        check_barriers("IkboAttentionFwdSm90", FwdBarrier, self.BARRIER_SPANS)

        elt = self.dtype.width // 8
        d, r = self.head_dim, self.slot_rows
        # split_pair: per exchange each sending thread's O in the dtype, and its two rows' lse.
        self.pair_words = d // 4  # 32-bit words of a thread's 64 x D / 128 values, two a word
        self.pair_tx = self.WARPGROUP_THREADS * (self.pair_words + 2) * 4
        # Transaction bytes per stage, counted from the boxes (cute.size_in_bytes would take
        # the cosize of the strided slot layout, which spans more than the slot).
        q_bytes = self.slots * r * d * elt
        kv_bytes = self.tile_n * d * elt
        consumers = "both consumer warpgroups" if self.consumer_wgs == 2 else "the 3 consumer warpgroups"
        self.pipelines = {
            name: PipelineSpec(name, "producer warp 0", consumers, stages, tx, 1, 4 * self.consumer_wgs).check(
                "IkboAttentionFwdSm90", releasing_threads=self.consumer_threads)
            for name, stages, tx in (("Q", self.Q_STAGES, q_bytes), ("K", self.KV_STAGES, kv_bytes),
                                     ("V", self.KV_STAGES, kv_bytes))
        }
        # barriers, tile info and (split_pair) the lse exchange, padded to 1024; sQ stages, sO, sK, sV
        smem = ((2048 if self.pair else 1024) + (self.Q_STAGES + 1) * self.tile_m * d * elt
                + 2 * self.KV_STAGES * self.tile_n * d * elt)
        if smem > 227 * 1024:
            raise ValueError(f"IkboAttentionFwdSm90: {smem} bytes of shared memory exceed 227 KiB (D = {d})")

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(self, tensors: FwdTensors, wl: FwdWorkList, scalars: FwdScalars, n_ctas: Int32, stream):
        """Launch on ``stream`` over a grid of ``n_ctas`` CTAs (fwd_args says what each bundle holds)."""
        mQ, mK, mV, mO, mLSE = tensors.q, tensors.k, tensors.v, tensors.out, tensors.lse
        mKvLen, mKvOffsets = tensors.kv_lengths, tensors.kv_offsets
        d, r = self.head_dim, self.slot_rows
        n_out = mO.shape[0]
        mQf = self.flat_view(mQ) if const_expr(self.flat_path) else None
        mQ, mK, mV = [self.tma_view(t) for t in (mQ, mK, mV)]
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.K, Float32,
            atom_layout_mnk=(self.consumer_wgs, 1, 1), tiler_mn=(64, self.tile_n))
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.MN, Float32,
            atom_layout_mnk=(self.consumer_wgs, 1, 1), tiler_mn=(64, d), a_source=warpgroup.OperandSource.RMEM)

        # Q/O: K-major 128B-swizzle (rows x 64) panels of all tile_m rows; a slot is r rows
        # of each panel, loaded/stored as one (r, 64) TMA box per panel.
        qo_atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(cutlass.tensor_utils.LayoutEnum.ROW_MAJOR, self.dtype, d),
            self.dtype)
        sO_layout = cute.tile_to_shape(qo_atom, (self.tile_m, d), order=(0, 1))
        sQ_layout = cute.tile_to_shape(qo_atom, (self.tile_m, d, self.Q_STAGES), order=(0, 1, 2))
        slot_layout = cute.composition(sO_layout, cute.make_layout((r, d), stride=(1, self.tile_m)))
        sK_layout = cute.tile_to_shape(qo_atom, (self.tile_n, d, self.KV_STAGES), order=(0, 1, 2))
        sV_layout = sK_layout

        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mQ, slot_layout, (r, d))
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mK, cute.select(sK_layout, mode=[0, 1]), (self.tile_n, d), 1)
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mV, cute.select(sV_layout, mode=[0, 1]), (self.tile_n, d), 1)
        tma_atom_Qf = tma_Qf = half_layout = None
        if const_expr(self.flat_path):
            half_layout = cute.composition(sO_layout, cute.make_layout((64, d), stride=(1, self.tile_m)))
            tma_atom_Qf, tma_Qf = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), mQf, half_layout, (64, d))
        out = self.out_target(mO, mLSE, slot_layout, half_layout)
        whole_out = None
        if const_expr(self.cfg.whole_rows_out):
            whole_out = self.out_target(tensors.final_out, tensors.final_lse, slot_layout, half_layout)

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, self.Q_STAGES * 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, self.KV_STAGES * 2]
            mbar_v: cute.struct.MemRange[cutlass.Int64, self.KV_STAGES * 2]
            tile_meta: cute.struct.MemRange[Int32, self.Q_STAGES * TileInfo.FIELDS]
            pair_bars: cute.struct.MemRange[cutlass.Int64, 2]  # split_pair: full, free
            pair_lse: cute.struct.Align[cute.struct.MemRange[Float32, 256 if self.pair else 2], 16]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sO_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]

        self.shared_storage = SharedStorage

        self.kernel(
            TmaOperands(tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V, out.atom_o, out.o,
                        tma_atom_Qf, tma_Qf, out.atom_of, out.of),
            GlobalTensors(mLSE, wl.cand, wl.cand_start, wl.tile_start, mKvLen, wl.grouped, mKvOffsets, wl.perm,
                          wl.walk, mK, mV, out.rows),
            whole_out,
            ProblemDims(mQ.shape[3], mK.shape[3] if const_expr(not self.cfg.jagged) else mKvOffsets.shape[0] - 1,
                        mQ.shape[2], mK.shape[2], mK.shape[0], n_out),
            scalars,
            TiledMmas(tiled_mma_qk, tiled_mma_pv),
            SmemLayouts(sQ_layout, sO_layout, sK_layout, sV_layout),
        ).launch(grid=[n_ctas, 1, 1], block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1,
                 use_pdl=True, **({"cluster": [self.cluster_size, 1, 1]} if self.pair else {}))

    def flat_view(self, t):
        """(rows, D, head) view of q or out ([B, S_q, H, D]) as B * S_q rows, for the one-box path
        (used only where q_flat says the strides allow it)."""
        return cute.make_tensor(t.iterator, cute.make_layout(
            (t.shape[0] * self.s_q, t.shape[3], t.shape[2]),
            stride=(t.stride[0] if const_expr(self.s_q == 1) else t.stride[1], t.stride[3], t.stride[2])))

    def tma_view(self, t):
        """(rows, D, head, batch) view of a [batch, rows, head, D] tensor: TMA boxes are (rows, D)
        at a (head, batch) coordinate."""
        return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))

    def out_target(self, mO, mLSE, slot_layout, half_layout) -> OutTarget:
        """out [B, S_q, H, D] and its lse as the epilogue stores them: TMA atoms of slots and (the
        one-box path) of 64-row boxes, and direct_rows' view."""
        d = self.head_dim
        store = cpasync.CopyBulkTensorTileS2GOp()
        atom_of = of = None
        if const_expr(self.flat_path):
            atom_of, of = cpasync.make_tiled_tma_atom(store, self.flat_view(mO), half_layout, (64, d))
        view = self.tma_view(mO)
        atom_o, o = cpasync.make_tiled_tma_atom(store, view, slot_layout, (self.slot_rows, d))
        return OutTarget(atom_o, o, atom_of, of, view if const_expr(self.direct_rows) else None, mLSE)

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(
        self,
        tma: TmaOperands,
        g: GlobalTensors,
        whole_out: OutTarget | None,
        dims: ProblemDims,
        scalars: FwdScalars,
        mmas: TiledMmas,
        layouts: SmemLayouts,
    ):
        """The CTA: shared memory and pipelines, the tile walk's Schedule, then the warp roles
        (producer warp 0; the consumer warpgroups), each given the bundles it reads."""
        n_kv_batch = dims.n_kv_batch
        n_splits = scalars.n_splits
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == 0:
            for atom in (tma.atom_q, tma.atom_k, tma.atom_v, tma.atom_o):
                cpasync.prefetch_descriptor(atom)
            if const_expr(self.flat_path):
                for atom in (tma.atom_qf, tma.atom_of):
                    cpasync.prefetch_descriptor(atom)
            if const_expr(self.cfg.whole_rows_out):
                cpasync.prefetch_descriptor(whole_out.atom_o)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        sK = storage.sK.get_tensor(layouts.k.outer, swizzle=layouts.k.inner)
        sV = storage.sV.get_tensor(layouts.v.outer, swizzle=layouts.v.inner)
        if const_expr(self.prefetch):
            if warp_idx == 0:
                self.prefetch_first_blocks(tma, sK, sV, dims, scalars, g)
        pipe_q = self.pipelines["Q"].make(storage.mbar_q.data_ptr())
        pipe_k = self.pipelines["K"].make(storage.mbar_k.data_ptr())
        pipe_v = self.pipelines["V"].make(storage.mbar_v.data_ptr())
        pair_bars = storage.pair_bars.data_ptr()
        rank = Int32(0)
        if const_expr(self.pair):
            if warp_idx == 0:
                with cute.arch.elect_one():
                    init_exchange(pair_bars, pair_bars + 1, self.cluster_size)  # full, free
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        pipelines_init_arrive(self.cluster_size)
        pipelines_init_wait(self.cluster_size)
        # Launched with programmatic dependent launch: everything above overlaps the kernel
        # before this one on the stream (the work list). No global memory is read or written
        # above; the K/V prefetches only move lines into L2 (coherent), never into the CTA.
        cute.arch.griddepcontrol_wait()

        sQ = storage.sQ.get_tensor(layouts.q.outer, swizzle=layouts.q.inner)
        sO = storage.sO.get_tensor(layouts.o.outer, swizzle=layouts.o.inner)
        # The producer's TileInfo for the tile in each Q stage, handed to the consumers with its Q.
        sMeta = storage.tile_meta.get_tensor(cute.make_layout((TileInfo.FIELDS, self.Q_STAGES)))
        # (D, n, stage) view of V: the MN-major B operand of O += P V.
        sVt = cute.composition(
            sV, cute.make_ordered_layout((self.head_dim, self.tile_n, self.KV_STAGES), order=(1, 0, 2)))

        if const_expr(self.cfg.direction == "kv"):
            tiles_per_head = g.tile_start[n_kv_batch + 1]
        else:
            tiles_per_head = dims.n_out * self.chunks
        flat = False
        if const_expr(self.flat_path):
            flat = scalars.q_flat != 0 and g.grouped[0] != 0
        tiles = tiles_per_head * dims.n_heads
        whole = 0  # tail_split: the tiles that run whole (a compile-time 0 elsewhere: the same code)
        total = tiles
        if const_expr(self.cfg.tail_split):
            whole = self.scheduler.whole_tiles(tiles_per_head, dims.n_heads, g.tile_start, n_kv_batch + 1)
            total = whole + (tiles - whole) * n_splits
        elif const_expr(self.cfg.split_kv):
            total = tiles * n_splits
        sched = Schedule(total, tiles_per_head, dims.n_q_batch, n_kv_batch, dims.n_heads, dims.n_kv_heads,
                         dims.kv_len, scalars.max_keys, flat, n_splits, scalars.split_keys, rank, whole)
        smem_t = SharedTensors(sQ, sK, sV, sVt, sO, sMeta)
        pipes = Pipelines(pipe_q, pipe_k, pipe_v)

        if warp_idx < 4:
            self.registers.enter_producer()
            if warp_idx == 0:
                self.producer(tma, g, smem_t, pipes, sched)
        else:
            self.registers.enter_consumer()
            self.consumer(mmas, tma, g, whole_out, smem_t, pipes, sched, scalars.scale_log2, tidx - 128, storage)
        if const_expr(self.pair):
            cluster_end()

    # ------------------------------------------------------------ tiles
    @cute.jit
    def slot_info(self, s, info: TileInfo, mCand):
        """Slot s of a tile -> (stored?, query batch coord, output batch coord, row block).

        KV broadcast: slot s holds rows s * R : (s + 1) * R of the tile (R = box_rows), part of
        one candidate; a slot past the tile's rows is not stored (it loads the last stored one
        again, so a Q stage always takes the same bytes). Q broadcast: one candidate."""
        valid = True
        row_block = Int32(0)
        q_b = info.q_coord
        out_b = info.first
        if const_expr(self.dense):
            r = self.slot_rows
            valid = s * r < info.n_valid
            row = info.row0 + cutlass.min(s, (info.n_valid - 1) // r) * r
            c = row // self.s_q
            q_b = mCand[info.first + c]
            out_b = q_b
            row_block = (row - c * self.s_q) // r
        elif const_expr(self.s_q > 64):
            row_block = info.chunk * 2 + s
            valid = row_block * 64 < self.s_q
        else:
            valid = s == 0
        return valid, q_b, out_b, row_block

    # ------------------------------------------------------------- producer
    @cute.jit
    def producer(self, tma: TmaOperands, g: GlobalTensors, smem: SharedTensors, pipes: Pipelines, sched: Schedule):
        """Warp 0: per tile its TileInfo and Q slots, then K/V blocks last to first."""
        group = sched.group()
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.Q_STAGES)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.KV_STAGES)
        if const_expr(self.dynamic):
            # The next tile is asked for once this one's loads are all issued (its consumers are
            # then on its last blocks), so a CTA holds at most the tile in its other Q stage.
            counter = TileCounter(g.walk)
            t = counter.first()
            while t < sched.total_tiles:
                info = self.scheduler.tile_info(t, g, sched)
                if const_expr(self.cfg.split_kv):
                    if info.n_keys == 0:
                        self.empty_piece(info, g)
                    else:
                        q_state, kv_state = self.load_tile(info, q_state, kv_state, tma, smem, pipes, g.cand,
                                                           group)
                else:
                    q_state, kv_state = self.load_tile(info, q_state, kv_state, tma, smem, pipes, g.cand, group)
                t = counter.next()
            # The END mark in the next Q stage, with an arrive of no bytes on its full barrier.
            pipeline.PipelineAsync.producer_acquire(pipes.q, q_state)
            TileInfo.store_end(smem.meta, q_state.index)
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive(pipes.q.producer_get_barrier(q_state))
            counter.finish()
        else:
            walk = strided_tiles(Int32(0), cluster=self.cluster_size)
            t = walk.first
            while t < sched.total_tiles:
                info = self.scheduler.tile_info(t, g, sched)
                q_state, kv_state = self.load_tile(info, q_state, kv_state, tma, smem, pipes, g.cand, group)
                t += walk.stride
        # Every load of this CTA is issued: the kernel after this one (the merge, the next call)
        # may launch on the SMs that free up; it waits for this grid to finish before reading.
        cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def empty_piece(self, info: TileInfo, g: GlobalTensors):
        """split_kv under the dynamic walk: a split with no key of its row (or of an out-of-range
        index) is written here as lse alone, -inf (NaN), for the merge, which then reads none of its
        output; no Q load, nothing for the consumers."""
        value = Float32.nan if info.invalid else -Float32.inf
        for row in cutlass.range(cute.arch.lane_idx(), info.n_valid, 32, unroll=1):
            b, q_row = self.dense_row(info, row, g.cand)
            g.lse[b, info.out_head, q_row] = value

    @cute.jit
    def prefetch_first_blocks(self, tma: TmaOperands, sK, sV, dims: ProblemDims, scalars: FwdScalars,
                              g: GlobalTensors):
        """Warp 0, before the work list is done: K and V blocks that the first tiles read first,
        prefetched into L2 by TMA (no barrier, no shared memory), while DRAM would idle.

        The items are (depth, head, K/V row, split), depth slowest: depth 0 is each split's last
        block (the producer loads blocks last to first), depth 1 the one before. CTA c's lane l
        (l < ``prefetch_blocks``) takes item c + l x grid. Where the tiles fit one round of the
        grid (the short calls this is for) every item is read by some first tile; beyond, some
        lines are read later or evicted, which costs DRAM time only while the CTAs wait. Rows of
        their own lengths (``tail_masked``) read their keys from kv_lengths or kv_offsets, inputs
        of the call that the work list does not write; a stale value could only make a useless
        prefetch, clamped into K/V as the tiles clamp it."""
        d = self.head_dim
        n_kv_batch, n_kv_heads, kv_len = dims.n_kv_batch, dims.n_kv_heads, dims.kv_len
        split_keys, prefetch_blocks = scalars.split_keys, scalars.prefetch_blocks
        lane = cute.arch.lane_idx()
        bid, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        splits = Int32(1)
        if const_expr(self.pair):
            splits = Int32(self.cluster_size)
        elif const_expr(self.cfg.split_kv and not self.cfg.tail_split):
            splits = scalars.n_splits
        per_depth = splits * n_kv_heads * n_kv_batch
        item = Int32(bid) + Int32(lane) * Int32(grid)
        if Int32(lane) < prefetch_blocks and item < per_depth * prefetch_blocks:
            depth = item // per_depth
            rest = item - depth * per_depth
            split = rest % splits
            rest = rest // splits
            user = rest % n_kv_batch
            head = rest // n_kv_batch
            n_keys = kv_len
            kv_base = Int32(0)
            batch_row = user
            if const_expr(self.tail_masked):
                n_keys, kv_base = self.scheduler.row_keys(user, g.kv_lengths, g.kv_offsets, kv_len, scalars.max_keys)
                n_keys = cutlass.min(cutlass.max(n_keys, 0), kv_len)  # lengths the op clamps after this read
                if const_expr(self.cfg.jagged):
                    batch_row = Int32(0)  # one packed batch row
            start = Int32(0)
            end = n_keys
            if const_expr(self.key_split and not self.cfg.tail_split):  # tail_split: the whole tiles come first
                start = split * split_keys
                end = cutlass.min(start + split_keys, n_keys)
            block = (end - 1) // self.tile_n - depth
            if end > start and block * self.tile_n >= start:
                for atom, mX, sX in ((tma.atom_k, tma.k, sK), (tma.atom_v, tma.v, sV)):
                    mRow = mX[None, None, head, batch_row]
                    if const_expr(self.cfg.jagged):
                        mRow = cute.domain_offset((kv_base, 0), mRow)
                    gX = cute.local_tile(mRow, (self.tile_n, d), (None, 0))
                    _, tXgX = cpasync.tma_partition(
                        atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2))
                    cute.prefetch(atom, tXgX[None, block])

    @cute.jit
    def load_tile(self, info: TileInfo, q_state, kv_state, tma: TmaOperands, smem: SharedTensors, pipes: Pipelines,
                  mCand, group: Int32):
        """One tile's loads: its TileInfo and Q slots, then its K/V blocks last to first."""
        d = self.head_dim
        tma_atom_K, mK, tma_atom_V, mV = tma.atom_k, tma.k, tma.atom_v, tma.v
        sQ, sK, sV, sMeta = smem.q, smem.k, smem.v, smem.meta
        pipe_q, pipe_k, pipe_v = pipes
        h_kv = info.head // group
        if const_expr(self.cfg.jagged or self.key_split):
            # The keys start at kv_base: the row's in the one packed batch row (jagged), plus
            # the split's first (split_kv, split_pair).
            row = Int32(0) if const_expr(self.cfg.jagged) else info.kv_coord
            gK = cute.local_tile(cute.domain_offset((info.kv_base, 0), mK[None, None, h_kv, row]),
                                 (self.tile_n, d), (None, 0))
            gV = cute.local_tile(cute.domain_offset((info.kv_base, 0), mV[None, None, h_kv, row]),
                                 (self.tile_n, d), (None, 0))
        else:
            gK = cute.local_tile(mK[None, None, h_kv, info.kv_coord], (self.tile_n, d), (None, 0))
            gV = cute.local_tile(mV[None, None, h_kv, info.kv_coord], (self.tile_n, d), (None, 0))
        tKsK, tKgK = cpasync.tma_partition(
            tma_atom_K, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(
            tma_atom_V, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))
        n_blocks = (info.n_keys + self.tile_n - 1) // self.tile_n
        # Q first: its other stage was released when the tile before the previous one
        # ended, so this does not wait and the load runs under the previous tile's
        # last blocks. The K stage below waits for the previous tile's K releases.
        # The stage's TileInfo slot is free once its Q is: wait, write the info, then arrive
        # (with the Q bytes to expect), so the consumers' Q wait also covers the info.
        pipeline.PipelineAsync.producer_acquire(pipe_q, q_state)
        info.store(sMeta, q_state.index)
        pipe_q.producer_acquire(q_state, try_acquire_token=True)
        if const_expr(self.flat_path):
            if info.flat:
                self.load_q_halves(tma.atom_qf, tma.qf, sQ, pipe_q, q_state, info)
            else:
                self.load_q_slots(tma.atom_q, tma.q, sQ, pipe_q, q_state, info, mCand)
        else:
            self.load_q_slots(tma.atom_q, tma.q, sQ, pipe_q, q_state, info, mCand)
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
        return q_state, kv_state

    @cute.jit
    def load_q_slots(self, tma_atom_Q, mQ, sQ, pipe_q, q_state, info: TileInfo, mCand):
        """The tile's Q, one (R, D) box per slot, each from its candidate's rows. Unrolled where
        slots are few (their lookups in flight together) and for Q broadcast (no lookup, at most
        16 slots); up to 16 in unrolled groups of at most Q_SLOTS_UNROLLED (the largest that divides
        the slots: 6 slots of a 192-row tile go in groups of 3); a loop where there are dozens."""
        per = self.q_slot_group
        if const_expr(per == self.slots):
            for s in cutlass.range_constexpr(self.slots):
                self.load_q_slot(s, tma_atom_Q, mQ, sQ, pipe_q, q_state, info, mCand)
        elif const_expr(per > 1):
            for h in cutlass.range(self.slots // per, unroll=1):
                for s in cutlass.range_constexpr(per):
                    self.load_q_slot(h * per + s, tma_atom_Q, mQ, sQ, pipe_q, q_state, info, mCand)
        else:
            for s in cutlass.range(self.slots, unroll=1):
                self.load_q_slot(s, tma_atom_Q, mQ, sQ, pipe_q, q_state, info, mCand)

    @cute.jit
    def load_q_slot(self, s, tma_atom_Q, mQ, sQ, pipe_q, q_state, info: TileInfo, mCand):
        d, r = self.head_dim, self.slot_rows
        valid, q_b, out_b, row_block = self.slot_info(s, info, mCand)
        gQ = cute.local_tile(mQ[None, None, info.head, q_b], (r, d), (row_block, 0))
        sQ_s = cute.local_tile(sQ[None, None, q_state.index], (r, d), (s, 0))
        tQsQ, tQgQ = cpasync.tma_partition(
            tma_atom_Q, 0, cute.make_layout(1), cute.group_modes(sQ_s, 0, 2), cute.group_modes(gQ, 0, 2))
        cute.copy(tma_atom_Q, tQgQ, tQsQ, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))

    @cute.jit
    def load_q_halves(self, tma_atom_Qf, mQf, sQ, pipe_q, q_state, info: TileInfo):
        """The tile's Q as one (64, D) box of consecutive rows of q per consumer warpgroup (rows past
        the user's run, or past q, load too and are never stored: the stage takes the same bytes as
        by slots)."""
        d = self.head_dim
        for half in cutlass.range_constexpr(self.consumer_wgs):
            gQ = cute.local_tile(cute.domain_offset((info.q_coord + half * 64, 0), mQf[None, None, info.head]),
                                 (64, d), (0, 0))
            sQ_h = cute.local_tile(sQ[None, None, q_state.index], (64, d), (half, 0))
            tQsQ, tQgQ = cpasync.tma_partition(
                tma_atom_Qf, 0, cute.make_layout(1), cute.group_modes(sQ_h, 0, 2), cute.group_modes(gQ, 0, 2))
            cute.copy(tma_atom_Qf, tQgQ, tQsQ, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))

    # ------------------------------------------------------------ consumers
    @cute.jit
    def consumer(self, mmas: TiledMmas, tma: TmaOperands, g: GlobalTensors, whole_out: OutTarget | None,
                 smem: SharedTensors, pipes: Pipelines, sched: Schedule, scale_log2: Float32, tidx: Int32, storage):
        """Consumer warpgroups: per tile the main loop over its key blocks, then the epilogue."""
        d, n = self.head_dim, self.tile_n
        tiled_mma_qk, tiled_mma_pv = mmas
        sQ, sK, sV, sVt, sMeta = smem.q, smem.k, smem.v, smem.vt, smem.meta
        pipe_q, pipe_k, pipe_v = pipes
        mKg, mVg = g.k, g.v
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
        acc_S_mn = acc_mn_view(cute.make_rmem_tensor(wg_mma_qk.partition_shape_C((self.tile_m, n)), Float32))
        acc_O_mn = acc_mn_view(acc_O)
        # Column of each score register, row of each output register.
        # Columns as thread 0's (compile-time) plus this thread's offset: no column registers.
        tScS_mn = acc_mn_view(tiled_mma_qk.get_slice(0).partition_C(cute.make_identity_tensor((self.tile_m, n))))
        col_offset = acc_mn_view(thr_mma_qk.partition_C(cute.make_identity_tensor((self.tile_m, n))))[0, 0][1]
        softmax = OnlineSoftmax.create(cute.size(acc_S_mn, mode=[0]), acc_O_mn)
        st = ConsumerState(
            tiled_mma_qk=tiled_mma_qk, tiled_mma_pv=tiled_mma_pv, tSrQ=tSrQ, tSrK=tSrK, tOrV=tOrV, tOrP=tOrP,
            acc_O=acc_O, acc_O_mn=acc_O_mn, tScS_mn=tScS_mn, col_offset=col_offset, softmax=softmax,
            tOcO_mn=acc_mn_view(thr_mma_pv.partition_C(cute.make_identity_tensor((self.tile_m, d)))),
            pipe_k=pipe_k, pipe_v=pipe_v, sQ=sQ, sV=sV, mKg=mKg, mVg=mVg, wg=wg)

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.Q_STAGES)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.KV_STAGES)
        if const_expr(self.cfg.overlap):
            self.ping_pong.start(wg)
        walk = strided_tiles(Int32(0), cluster=self.cluster_size)
        t = walk.first
        n_ex = Int32(0)  # split_pair: exchanges of this warpgroup's rows so far
        live = t < sched.total_tiles
        if const_expr(self.dynamic):  # the tiles end where a Q stage holds the END mark
            pipe_q.consumer_wait(q_state)
            live = TileInfo.is_tile(sMeta, q_state.index)
        while live:
            # The producer looked the tile up (a search over dependent loads, off the
            # consumers' path); its info arrives with the tile's Q and stays in registers for
            # the epilogue.
            if const_expr(not self.dynamic):
                pipe_q.consumer_wait(q_state)
            info = TileInfo.load(sMeta, q_state.index, self.dense, self.cfg.split_kv)
            n_blocks = (info.n_keys + n - 1) // n
            acc_O.fill(0.0)
            softmax.reset()
            if n_blocks > 0:
                # Blocks run last to first: only the first one processed needs the key mask.
                n_cols = info.n_keys - (n_blocks - 1) * n
                if const_expr(self.cfg.overlap):
                    kv_state = self.mainloop_overlapped(st, kv_state, q_state.index, n_blocks, n_cols,
                                                        scale_log2, tidx)
                else:
                    kv_state = self.mainloop_serial(st, kv_state, q_state.index, n_blocks, n_cols,
                                                    scale_log2, tidx)
            if const_expr(self.cfg.overlap):
                if softmax.any_row_to_redo():
                    if const_expr(self.cfg.jagged or self.key_split):  # the keys from kv_base on
                        key0 = sMeta[TileInfo.KV_BASE, q_state.index]
                        batch = Int32(0) if const_expr(self.cfg.jagged) else info.kv_coord  # jagged: one row
                        softmax.exact_rows(sQ, q_state.index, cute.domain_offset((key0, 0, 0, 0), mKg),
                                           cute.domain_offset((key0, 0, 0, 0), mVg), st.tOcO_mn, self.head_dim,
                                           info.n_keys, info.head // sched.group(), batch, scale_log2, tidx)
                    else:
                        softmax.exact_rows(sQ, q_state.index, mKg, mVg, st.tOcO_mn, self.head_dim, info.n_keys,
                                           info.head // sched.group(), info.kv_coord, scale_log2, tidx)
            whole = Int32(0)
            if const_expr(self.cfg.whole_rows_out):
                whole = sMeta[TileInfo.WHOLE, q_state.index]
            pipe_q.consumer_release(q_state)
            q_state.advance()
            lse = softmax.finish(info.invalid, scale_log2)
            store = True
            if const_expr(self.pair):
                # CTA r stores warpgroup r's rows, merged with the peer's split of them; rows past
                # the tile's (warpgroup 1's of a tile of at most 64) are exchanged by neither.
                if wg == 0 or info.n_valid > 64:
                    if wg == sched.rank:
                        self.pair_receive(st, lse, storage, n_ex, sched.rank, tidx % 128, wg)
                    else:
                        self.pair_send(st, lse, storage, n_ex, sched.rank, tidx % 128)
                        store = False
                    n_ex += 1
                else:
                    store = False
            out = OutTarget(tma.atom_o, tma.o, tma.atom_of, tma.of, g.out, g.lse)
            if const_expr(self.cfg.whole_rows_out):
                # A row of one split: out and lse directly, and the mark that has the merge skip it.
                if whole != 0:
                    self.epilogue(st, info, lse, tiled_mma_pv, tidx, whole_out, smem.o, g.cand, wg, warp_in_wg,
                                  mark=cute.recast_tensor(g.lse, Int32))
                else:
                    self.epilogue(st, info, lse, tiled_mma_pv, tidx, out, smem.o, g.cand, wg, warp_in_wg)
            elif store:
                self.epilogue(st, info, lse, tiled_mma_pv, tidx, out, smem.o, g.cand, wg, warp_in_wg)
            if const_expr(self.dynamic):
                pipe_q.consumer_wait(q_state)
                live = TileInfo.is_tile(sMeta, q_state.index)
            else:
                t += walk.stride
                live = t < sched.total_tiles
        if warp_in_wg == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def mainloop_serial(self, st: ConsumerState, kv_state, q_stage: Int32, n_blocks: Int32, n_cols: Int32,
                        scale_log2: Float32, tidx: Int32):
        """Per block: S = Q K^T, wait, softmax, O += P V, wait (the first block is masked)."""
        self.first_block(st, kv_state, q_stage, n_cols, scale_log2, tidx)
        kv_state = self.pv_block(st, kv_state)
        for i in cutlass.range(n_blocks - 1, unroll=1):
            st.pipe_k.consumer_wait(kv_state)
            acc_S = self.gemm_qk(st, q_stage, kv_state.index)
            warpgroup.wait_group(0)
            st.pipe_k.consumer_release(kv_state)
            st.softmax.online(acc_S, scale_log2)
            st.softmax.rescale_o()
            self.convert_p(st, acc_S)
            kv_state = self.pv_block(st, kv_state)
        return kv_state

    @cute.jit
    def mainloop_overlapped(self, st: ConsumerState, kv_state, q_stage: Int32, n_blocks: Int32, n_cols: Int32,
                            scale_log2: Float32, tidx: Int32):
        """S of block j is issued before P V of block j-1; the softmax of j runs while P V
        of j-1 is on the tensor cores. The end of the softmax is the path to this
        warpgroup's next GEMM turn, so after the tile's first block it exponentiates against
        the running max as it stands (``OnlineSoftmax.stale_max``) and O is rescaled only in
        the rare block where a P may exceed 2^STALE_MAX (``stale_max_grew``)."""
        self.first_block(st, kv_state, q_stage, n_cols, scale_log2, tidx)
        for i in cutlass.range(n_blocks - 1, unroll=1):
            v_state = kv_state.clone()
            kv_state.advance()
            st.pipe_k.consumer_wait(kv_state)
            # This warpgroup's turn: the other one is between its GEMM issues and its softmax.
            self.ping_pong.wait(st.wg)
            acc_S = self.gemm_qk(st, q_stage, kv_state.index)
            st.pipe_v.consumer_wait(v_state)
            self.gemm_pv(st, v_state.index)
            self.ping_pong.hand_over(st.wg)
            warpgroup.wait_group(1)
            st.pipe_k.consumer_release(kv_state)
            grew = st.softmax.stale_max(acc_S, scale_log2)
            warpgroup.wait_group(0)
            st.pipe_v.consumer_release(v_state)
            self.convert_p(st, acc_S)
            if grew:
                st.softmax.stale_max_grew(acc_S, scale_log2)
                self.convert_p(st, acc_S)
        return self.pv_block(st, kv_state)

    @cute.jit
    def first_block(self, st: ConsumerState, kv_state, q_stage: Int32, n_cols: Int32, scale_log2: Float32,
                    tidx: Int32):
        """S of the tile's first block (its last keys), masked past ``n_cols``, softmax, P in registers;
        with kv_lengths or jagged K/V, the V rows past ``n_cols`` are zeroed too."""
        st.pipe_k.consumer_wait(kv_state)
        acc_S = self.gemm_qk(st, q_stage, kv_state.index)
        warpgroup.wait_group(0)
        st.pipe_k.consumer_release(kv_state)
        st.softmax.mask_keys(acc_S, n_cols, st.tScS_mn, st.col_offset)
        st.softmax.online(acc_S, scale_log2, first=True)
        if const_expr(self.cfg.overlap):
            st.softmax.mark_rows_without_max()
        self.convert_p(st, acc_S)
        if const_expr(self.tail_masked):
            st.pipe_v.consumer_wait(kv_state)
            self.zero_v_tail(st, kv_state.index, n_cols, tidx)

    @cute.jit
    def pv_block(self, st: ConsumerState, kv_state):
        """O += P V of the block in ``kv_state``, waited for; its V stage released; the state advanced."""
        st.pipe_v.consumer_wait(kv_state)
        self.gemm_pv(st, kv_state.index)
        warpgroup.wait_group(0)
        st.pipe_v.consumer_release(kv_state)
        kv_state.advance()
        return kv_state

    @cute.jit
    def gemm_qk(self, st: ConsumerState, q_stage: Int32, stage: Int32):
        # A fresh accumulator per block: the previous scores are dead once converted to P.
        acc_S = cute.make_rmem_tensor(st.tiled_mma_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        warpgroup_gemm(st.tiled_mma_qk, acc_S, st.tSrQ[None, None, None, q_stage], st.tSrK[None, None, None, stage],
                       zero_init=True)
        return acc_S

    @cute.jit
    def gemm_pv(self, st: ConsumerState, stage: Int32):
        # acc_O starts at 0 for every tile, so P V always accumulates.
        warpgroup_gemm(st.tiled_mma_pv, st.acc_O, st.tOrP, st.tOrV[None, None, None, stage], zero_init=False)

    @cute.jit
    def convert_p(self, st: ConsumerState, acc_S):
        p = acc_as_frag_a(acc_S)
        if const_expr(self.tile_n == 128):
            st.tOrP.store(p.load().to(self.dtype))
        else:
            # Per k-step of P V: the DSL converts a 96-value vector one value at a time (and ptxas
            # then packs the pairs between the wgmmas), an 8-value one in pairs. A 64-value one
            # converts in pairs too, so 128-key blocks keep the one conversion (other SASS).
            for kk in cutlass.range_constexpr(cute.size(p, mode=[2])):
                st.tOrP[None, None, kk].store(p[None, None, kk].load().to(self.dtype))

    @cute.jit
    def zero_v_tail(self, st: ConsumerState, stage: Int32, n_cols: Int32, tidx: Int32):
        """Zero V rows at or past the valid length in this stage, so padding that is not
        finite (keys kept out of the softmax by kv_lengths, or the next row's keys of jagged K/V)
        cannot turn 0 * V into NaN. 16-byte stores in passes over the rows from n_cols on: every
        consumer warpgroup takes part (thread t a row's 16-byte chunk t % chunks, in every pass)
        and meet at a barrier before P V reads V."""
        if const_expr(self.tail_masked):
            if n_cols < self.tile_n:
                sV_s = st.sV[None, None, stage]
                vec = 128 // self.dtype.width
                chunks = self.head_dim // vec  # 16-byte chunks a row
                rows_per_pass = self.consumer_threads // chunks
                zero = cute.make_rmem_tensor(cute.make_layout(vec), self.dtype)
                zero.fill(0.0)
                chunk = tidx % chunks
                # A loop, not unrolled: the consumers have no registers to spare at D 128.
                for p in cutlass.range(n_cols // rows_per_pass, -(-self.tile_n // rows_per_pass), unroll=1):
                    row = p * rows_per_pass + tidx // chunks
                    if const_expr(self.tile_n % rows_per_pass == 0):
                        if row >= n_cols:
                            cute.autovec_copy(zero, cute.local_tile(sV_s, (1, vec), (row, chunk)))
                    elif row >= n_cols and row < self.tile_n:  # 384 threads: passes of 48 or 24 rows
                        cute.autovec_copy(zero, cute.local_tile(sV_s, (1, vec), (row, chunk)))
                cute.arch.fence_view_async_shared()
                bar_sync(FwdBarrier.V_TAIL, self.consumer_threads)

    def pair_buffer(self, storage, rows_of: Int32, t: Int32):
        """Thread t's slot of the exchange buffer: the sO rows of warpgroup ``rows_of`` (the one
        that never stores in the receiving CTA), as 32-bit words, word k at ``pair_offset(k)``.
        Each 64-column panel of sO holds a warpgroup's 64 rows in 8 KiB."""
        base = cute.recast_ptr(storage.sO.data_ptr(), dtype=Int32) + (rows_of * (64 * 64 // 2) + t * 4)
        return cute.make_tensor(base, cute.make_layout(self.pair_offset(self.pair_words - 1) + 1))

    def pair_offset(self, k: int) -> int:
        """Word k (compile time) of a thread's slot: panel k // 16, 16-byte group (k % 16) // 4 of
        the warpgroup's 128 (so a warp's stores cover 512 neighbouring bytes)."""
        return (k // 16) * (self.tile_m * 64 // 2) + ((k % 16) // 4) * 128 * 4 + k % 4

    def pair_lse(self, storage, t: Int32):
        """Thread t's two lse words of the exchange (its two rows)."""
        return cute.make_tensor(cute.recast_ptr(storage.pair_lse.data_ptr(), dtype=Float32) + t * 2,
                                cute.make_layout(2))

    @cute.jit
    def pair_send(self, st: ConsumerState, lse, storage, n_ex: Int32, rank: Int32, t: Int32):
        """split_pair, the warpgroup whose rows the peer CTA stores: once the peer has read the
        previous exchange (``free``), its normalized O (in the dtype) and its rows' lse, by
        ``st.async`` into the peer's buffer, completing on the peer's ``full``."""
        bars = storage.pair_bars.data_ptr()
        if n_ex > 0:
            cute.arch.mbarrier_wait(bars + 1, (n_ex - 1) % 2)
        rO = cute.make_rmem_tensor_like(st.acc_O, self.dtype)
        rO.store(st.acc_O.load().to(self.dtype))
        words = cute.recast_tensor(rO, Int32)
        peer = 1 - rank
        base = self.pair_buffer(storage, rank, t).iterator
        sent = 0  # bytes this thread stores (compile time): what the peer arms its barrier with
        for k in cutlass.range_constexpr(0, self.pair_words, 4):
            store_remote(base, self.pair_offset(k), [words[k + e] for e in range(4)], bars, peer)
            sent += 16
        store_remote(self.pair_lse(storage, t).iterator, 0, [lse[0], lse[1]], bars, peer)
        sent += 8
        if const_expr(sent * self.WARPGROUP_THREADS != self.pair_tx):
            raise ValueError(f"IkboAttentionFwdSm90: a split pair sends {sent} bytes a thread, the peer expects "
                             f"{self.pair_tx} from 128 threads")

    @cute.jit
    def pair_receive(self, st: ConsumerState, lse, storage, n_ex: Int32, rank: Int32, t: Int32, wg: Int32):
        """split_pair, the warpgroup whose rows this CTA stores: the peer's split of them arrives
        (``full``, armed here with the bytes) and is merged into O in fp32, each split weighed by
        exp(its lse - the rows' lse), which replaces ``lse`` (-inf without a key in either split;
        NaN stays NaN); the buffer is released to the peer once every thread has read it."""
        bars = storage.pair_bars.data_ptr()
        if t == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(bars, self.pair_tx)
        cute.arch.mbarrier_wait(bars, n_ex % 2)
        rP = cute.make_rmem_tensor_like(st.acc_O, self.dtype)
        words = cute.recast_tensor(rP, Int32)
        buf = self.pair_buffer(storage, 1 - rank, t)
        for k in cutlass.range_constexpr(self.pair_words):
            words[k] = buf[self.pair_offset(k)]
        lse_buf = self.pair_lse(storage, t)
        peer_lse = [lse_buf[0], lse_buf[1]]
        # Every thread has its words: the peer may overwrite them.
        bar_sync(FwdBarrier.EPILOGUE + wg, 128)
        if t == 0:
            release_peers(bars + 1, rank, self.cluster_size)
        pO = cute.make_rmem_tensor_like(st.acc_O, Float32)
        pO.store(rP.load().to(Float32))
        pO_mn = acc_mn_view(pO)
        # This split's O rounded as the peer's was, and the sum below in split order: a row's
        # result then does not depend on which CTA stores it (the work-list kernel may put a
        # candidate in either warpgroup's rows from run to run).
        own = cute.make_rmem_tensor_like(st.acc_O, self.dtype)
        own.store(st.acc_O.load().to(self.dtype))
        st.acc_O.store(own.load().to(Float32))
        # The sum in split order (split 0's term first) whichever CTA this is, so that both
        # owners evaluate the same expression on the same values (contracted to the same FMAs).
        first = rank == 0  # this CTA runs split 0
        for m in cutlass.range_constexpr(2):
            l0 = lse[m] if first else peer_lse[m]
            l1 = peer_lse[m] if first else lse[m]
            top = cute.arch.fmax(l0, l1, nan=True)
            none = top == -Float32.inf  # neither split has a key: O stays 0
            w0 = Float32(0.0) if none else cute.math.exp2((l0 - top) * LOG2_E, fastmath=True)
            w1 = Float32(0.0) if none else cute.math.exp2((l1 - top) * LOG2_E, fastmath=True)
            total = w0 + w1
            inv = Float32(0.0) if none else cute.arch.rcp_approx(total)
            lse[m] = top if none else top + cute.math.log2(total, fastmath=True) * LN_2
            w0 = w0 * inv
            w1 = w1 * inv
            for c in cutlass.range_constexpr(cute.size(st.acc_O_mn, mode=[1])):
                o0 = st.acc_O_mn[m, c] if first else pO_mn[m, c]
                o1 = pO_mn[m, c] if first else st.acc_O_mn[m, c]
                st.acc_O_mn[m, c] = o0 * w0 + o1 * w1

    @cute.jit
    def epilogue(self, st: ConsumerState, info: TileInfo, lse, tiled_mma_pv, tidx: Int32, out: OutTarget,
                 sO, mCand, wg: Int32, warp_in_wg: Int32, mark=None):
        """O / row_sum (and the lse) to sO, then one TMA store per stored slot of this warpgroup
        (or, for a flat tile whose 64 rows here are all stored, one box) into ``out``; with
        ``direct_rows``, rows that are not such a box go from registers to out (store_rows). No
        keys: O = 0, lse = -inf. Out-of-range index: NaN. ``mark`` (whole_rows_out, a row of one
        split: the workspace's lse as int32): each row's split-0 word set to WHOLE_ROW."""
        mLSE = out.lse
        r = self.slot_rows
        n_rows = cute.size(st.acc_O_mn, mode=[0])
        rO = cute.make_rmem_tensor_like(st.acc_O, self.dtype)
        rO.store(st.acc_O.load().to(self.dtype))

        staged = True
        if const_expr(self.direct_rows):
            staged = info.flat and info.n_valid >= (wg + 1) * 64
            if not staged:
                self.store_rows(st, info, rO, mCand, out.rows)
        if staged:
            # This warpgroup's previous TMA stores must have read sO before it is rewritten.
            if warp_in_wg == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            bar_sync(FwdBarrier.EPILOGUE + wg, 128)
            store_atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                             self.dtype)
            thr_copy_O = cute.make_tiled_copy_C(store_atom, tiled_mma_pv).get_slice(tidx)
            cute.copy(store_atom, thr_copy_O.retile(rO), thr_copy_O.partition_D(sO))

        if const_expr(mLSE is not None or mark is not None):
            tOcO_mn = st.tOcO_mn
            if tOcO_mn[0, 0][1] == 0:
                for m in cutlass.range_constexpr(n_rows):
                    row = tOcO_mn[m, 0][0]
                    if const_expr(self.dense):
                        if row < info.n_valid:
                            b, q_row = self.dense_row(info, row, mCand)
                            if const_expr(mLSE is not None):
                                mLSE[b, info.out_head, q_row] = lse[m]
                            if const_expr(mark is not None):
                                mark[b, info.out_head, q_row] = Int32(WHOLE_ROW)
                    else:
                        s = row // r
                        valid, q_b, out_b, row_block = self.slot_info(s, info, mCand)
                        q_row = row_block * r + (row - s * r)
                        if valid and q_row < self.s_q:
                            if const_expr(mLSE is not None):
                                mLSE[out_b, info.out_head, q_row] = lse[m]
                            if const_expr(mark is not None):
                                mark[out_b, info.out_head, q_row] = Int32(WHOLE_ROW)

        if staged:
            self.store_staged(info, out.atom_o, out.o, out.atom_of, out.of, sO, mCand, wg, warp_in_wg)

    @cute.jit
    def store_staged(self, info: TileInfo, tma_atom_O, mO, tma_atom_Of, mOf, sO, mCand, wg: Int32,
                     warp_in_wg: Int32):
        """The warpgroup's rows of sO to out by TMA: one box where they are 64 consecutive rows
        of out (always, with ``direct_rows``), else one per stored slot."""
        cute.arch.fence_view_async_shared()
        bar_sync(FwdBarrier.EPILOGUE + wg, 128)
        if warp_in_wg == 0:
            if const_expr(self.direct_rows):
                self.store_box(info, tma_atom_Of, mOf, sO, wg)
            elif const_expr(self.flat_path):
                if info.flat and info.n_valid >= (wg + 1) * 64:
                    self.store_box(info, tma_atom_Of, mOf, sO, wg)
                else:
                    self.store_o_slots(info, tma_atom_O, mO, sO, mCand, wg)
            else:
                self.store_o_slots(info, tma_atom_O, mO, sO, mCand, wg)
            cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def store_box(self, info: TileInfo, tma_atom_Of, mOf, sO, wg: Int32):
        """Warpgroup wg's 64 rows of sO as one box of consecutive rows of out."""
        d = self.head_dim
        gO = cute.local_tile(cute.domain_offset((info.q_coord + wg * 64, 0), mOf[None, None, info.out_head]),
                             (64, d), (0, 0))
        sO_h = cute.local_tile(sO, (64, d), (wg, 0))
        tOsO_h, tOgO = cpasync.tma_partition(
            tma_atom_Of, 0, cute.make_layout(1), cute.group_modes(sO_h, 0, 2), cute.group_modes(gO, 0, 2))
        cute.copy(tma_atom_Of, tOsO_h, tOgO)

    @cute.jit
    def store_rows(self, st: ConsumerState, info: TileInfo, rO, mCand, mO):
        """Each thread's stored rows of rO straight to out (``mO``, [S_q, D, H, B]): a row's
        candidate is looked up once, its values stored as they lie in the thread's registers."""
        tOcO_mn = st.tOcO_mn
        rO_mn = acc_mn_view(rO)
        for m in cutlass.range_constexpr(cute.size(rO_mn, mode=[0])):
            row = tOcO_mn[m, 0][0]
            if row < info.n_valid:
                b, s = self.dense_row(info, row, mCand)
                for j in cutlass.range_constexpr(cute.size(rO_mn, mode=[1])):
                    mO[s, tOcO_mn[m, j][1], info.out_head, b] = rO_mn[m, j]

    @cute.jit
    def dense_row(self, info: TileInfo, row, mCand):
        """KV broadcast: tile row ``row`` -> (its candidate, its query row in that candidate)."""
        run_row = info.row0 + row
        c = run_row // self.s_q
        return mCand[info.first + c], run_row - c * self.s_q

    @cute.jit
    def store_o_slots(self, info: TileInfo, tma_atom_O, mO, sO, mCand, wg: Int32):
        """One TMA store per stored slot of warpgroup wg's rows of sO (a loop as in load_q_slots)."""
        if const_expr(self.slots_per_wg <= 8):
            for i in cutlass.range_constexpr(self.slots_per_wg):
                self.store_o_slot(wg * self.slots_per_wg + i, info, tma_atom_O, mO, sO, mCand)
        else:
            for i in cutlass.range(self.slots_per_wg, unroll=1):
                self.store_o_slot(wg * self.slots_per_wg + i, info, tma_atom_O, mO, sO, mCand)

    @cute.jit
    def store_o_slot(self, s, info: TileInfo, tma_atom_O, mO, sO, mCand):
        d, r = self.head_dim, self.slot_rows
        valid, q_b, out_b, row_block = self.slot_info(s, info, mCand)
        if valid:
            gO = cute.local_tile(mO[None, None, info.out_head, out_b], (r, d), (row_block, 0))
            sO_s = cute.local_tile(sO, (r, d), (s, 0))
            tOsO_s, tOgO = cpasync.tma_partition(
                tma_atom_O, 0, cute.make_layout(1), cute.group_modes(sO_s, 0, 2), cute.group_modes(gO, 0, 2))
            cute.copy(tma_atom_O, tOsO_s, tOgO)
