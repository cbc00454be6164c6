"""FP8 quantization that reads x once (sm_90a): class QuantizeStagedSm90, ``quantize_fp8``'s kernel
for scale groups that fit the shared memory of a cluster.

    x [G, E] (group g's E = R x C elements contiguous; fp16, bf16 or fp32) -> scale [G] (fp32),
    x8 [G, E] ("same") or [G, C, Rp] ("transposed": x8[g, c, r] = e4m3(x[g, r, c] * (1 / scale[g])),
    rows Rp apart, Rp >= R a multiple of 16)

The formula is QuantizeSm90's (``quantize_sm90``, which takes the groups this kernel does not):
``scale = max(amax, AMAX_FLOOR) * fp32(1 / 448)``, ``x8 = e4m3(x * (1 / scale))``, the same bits.
"""
from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.memory
import torch
from cutlass import Float32, Int32, const_expr
from cutlass.experimental import primitives as prims

from cute_kernels.arguments import kernel_arguments
from cute_kernels.cluster_reduce import store_remote
from cute_kernels.compile import compile_kernel, kernel_cache
from cute_kernels.interop import cutlass_dtype, fake_stream, fake_tensor

from .quantize_sm90 import AMAX_FLOOR, INV_FP8_MAX, cta_max, max_nan

# The shipped shared-memory stages (bytes a CTA holds) and their CTAs' threads, in the order a plan
# tries them: rows of a linear's x (one CTA each, up to 13 CTAs an SM), then groups over clusters,
# four CTAs an SM, then two (lce's e at K 1184: 160 rows of 256 a CTA). On an H100 the 56 KB stage
# ran lce's e at K 872 8% faster than 112 KB stages of half the CTAs (docs/perf/2026-12-06-quantize-read-once.md).
STAGE_THREADS = {16 * 1024: 128, 56 * 1024: 256, 112 * 1024: 256}
STAGE_BYTES = tuple(STAGE_THREADS)
MAX_CTAS = 8  # CTAs a group may span: the portable cluster size
VEC = 16  # elements a thread converts and stores at once (16 bytes of e4m3)


@kernel_arguments
class QuantizeArgs(NamedTuple):
    """What the op hands the kernel."""

    x: cute.Tensor  # [G, E], E contiguous, 16-byte aligned groups
    x8: cute.Tensor  # [G, E] ("same") or [G, C, Rp] ("transposed"), float8_e4m3fn
    scale: cute.Tensor  # [G] fp32
    cols: Int32  # C: a group's columns (transposed; 1 otherwise)
    chunk: Int32  # elements of a group each CTA holds: a multiple of 16 (of 16 C when transposed)
    ctas: Int32  # CTAs a group spans (the cluster), 1 to MAX_CTAS


class QuantizeStagedSm90:
    """A cluster of ``ctas`` CTAs per scale group, no warp specialization. CTA
    ``rank`` holds the group's elements [rank * chunk, (rank + 1) * chunk) (for "transposed",
    whole rows of x[g]).

    1. load: one thread arms the ``load`` mbarrier and issues one bulk copy (``cp.async.bulk``)
       of the CTA's chunk into shared memory: x is read once, with no registers in flight.
    2. amax: every thread over 16-byte vectors of the stage (NaN wins, as torch.amax), then a
       butterfly over each warp and one slot per warp (``cta_max``).
    3. exchange (clusters of more than one CTA): one thread stores the CTA's amax into its slot
       in every other CTA's shared memory (``st.async``, completing 8 bytes on that CTA's
       ``peers`` mbarrier) and arms its own ``peers`` for the others' 8 bytes each; every thread
       then takes the largest of the slots. A cluster barrier after the barriers' init keeps
       stores out of a CTA that has not set up its barriers, and one at the end keeps every CTA
       alive until the stores into it have landed.
    4. store: each thread converts 16 elements at a time (times the scale's reciprocal, then
       ``cvt.rn.satfinite`` to e4m3) and stores 16 bytes: "same", neighbouring elements of the
       stage; "transposed", 16 rows of one column (x8[g, c, r:r + 16]; neighbouring threads take
       neighbouring columns, so the stage reads hit distinct banks). Rows past R in the last
       16-row block are stored as zeros: they lie in the output's row padding.

    Barriers:

    | barrier | arrives | completes when |
    | --- | --- | --- |
    | load | 1 (the issuing thread, arming the chunk's bytes) + transaction bytes | the chunk is in shared memory |
    | peers | 1 (this CTA, arming 8 bytes per other CTA) + transaction bytes | every other CTA's amax has landed |
    """

    def __init__(self, dtype: torch.dtype, transposed: bool, stage_bytes: int, threads: int):
        if stage_bytes % 1024 or not 0 < stage_bytes <= 200 * 1024 or threads % 32:
            raise ValueError(f"QuantizeStagedSm90: a stage of {stage_bytes} bytes, {threads} threads")
        self.dtype = cutlass_dtype(dtype)
        self.elt = torch.tensor([], dtype=dtype).element_size()
        self.transposed = transposed
        self.stage_elems = stage_bytes // self.elt
        self.threads = threads
        self.warps = threads // 32

    @cute.jit
    def __call__(self, args: QuantizeArgs, stream):
        @cute.struct
        class SharedStorage:
            stage: cute.struct.Align[cute.struct.MemRange[self.dtype, self.stage_elems], 128]
            bars: cute.struct.MemRange[cutlass.Int64, 2]  # load, peers
            slots: cute.struct.MemRange[Float32, 2 * MAX_CTAS]  # rank r's amax at 2 r
            warp_amax: cute.struct.MemRange[Float32, self.warps]

        self.shared_storage = SharedStorage
        groups = cute.size(args.x, mode=[0])
        self.kernel(args).launch(grid=[groups * args.ctas, 1, 1], block=[self.threads, 1, 1],
                                 cluster=[args.ctas, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, args: QuantizeArgs):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        rank = cute.arch.block_idx_in_cluster()
        g = bidx // args.ctas
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        stage = storage.stage.get_tensor(cute.make_layout(self.stage_elems))
        load_bar = storage.bars.data_ptr()
        peers_bar = load_bar + 1
        start = rank * args.chunk
        n = cutlass.min(args.chunk, cute.size(args.x, mode=[1]) - start)  # elements this CTA holds
        n = cutlass.max(n, 0)

        if tidx == 0:
            cute.arch.mbarrier_init(load_bar, 1)
            cute.arch.mbarrier_init(peers_bar, 1)
            cute.arch.mbarrier_init_fence()
            cute.arch.mbarrier_arrive_and_expect_tx(load_bar, n * self.elt)
            if n > 0:
                src = args.x.iterator + cute.crd2idx((g, start), args.x.layout)
                prims.cp_async_bulk_shared_cluster_global(stage.iterator, src, load_bar, n * self.elt)
        # Every CTA's barriers are set up before any other CTA stores into them.
        cute.arch.cluster_arrive_relaxed()
        cute.arch.cluster_wait()

        cute.arch.mbarrier_wait(load_bar, 0)
        amax = self.stage_amax(stage, n, tidx)
        amax = cta_max(amax, storage.warp_amax.get_tensor(cute.make_layout(self.warps)), tidx, self.warps)
        slots = storage.slots.get_tensor(cute.make_layout(2 * MAX_CTAS))
        if tidx == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(peers_bar, (args.ctas - 1) * 8)
            mine = slots.iterator + 2 * rank
            for peer in cutlass.range(args.ctas, unroll=1):
                if peer != rank:
                    store_remote(mine, 0, [amax, amax], peers_bar, peer)
        cute.arch.mbarrier_wait(peers_bar, 0)
        for peer in cutlass.range(args.ctas, unroll=1):
            if peer != rank:
                amax = max_nan(amax, slots[2 * peer])
        cute.arch.cluster_arrive()  # this CTA's slots are read: the others may exit once stored
        scale = max_nan(amax, Float32(AMAX_FLOOR)) * Float32(INV_FP8_MAX)
        if (tidx == 0) & (rank == 0):
            args.scale[g] = scale
        inv = Float32(1.0) / scale

        if const_expr(self.transposed):
            self.store_transposed(args, stage, g, start, n, inv, tidx)
        else:
            self.store_same(args, stage, g, start, n, inv, tidx)
        cute.arch.cluster_wait()

    @cute.jit
    def stage_amax(self, stage, n: Int32, tidx) -> Float32:
        """The largest |x| of this thread's 16-byte vectors of the stage (NaN if one is)."""
        per = 16 // self.elt
        amax = Float32(0.0)
        for v in cutlass.range(tidx, n // per, self.threads, unroll=2):
            vals = cute.local_tile(stage, (per,), (v,)).load().to(Float32)
            for i in cutlass.range_constexpr(per):
                a = vals[i]
                amax = max_nan(amax, a if a >= Float32(0.0) else -a)
        return amax

    @cute.jit
    def store_same(self, args: QuantizeArgs, stage, g, start, n: Int32, inv: Float32, tidx):
        """x8[g, start + 16 i + j] for the stage's 16-element pieces i."""
        for i in cutlass.range(tidx, n // VEC, self.threads, unroll=1):
            vals = cute.local_tile(stage, (VEC,), (i,)).load().to(Float32)
            q = cute.make_rmem_tensor(cute.make_layout(VEC), Float32)
            for j in cutlass.range_constexpr(VEC):
                q[j] = vals[j] * inv
            self.store_vec(q, cute.local_tile(args.x8[g, None], (VEC,), (start // VEC + i,)))

    @cute.jit
    def store_transposed(self, args: QuantizeArgs, stage, g, start, n: Int32, inv: Float32, tidx):
        """x8[g, c, r0 + 16 b + j] = x[g, r0 + 16 b + j, c] for the stage's rows r0 + ..."""
        cols = args.cols
        rows = n // cols
        blocks = (rows + VEC - 1) // VEC
        for i in cutlass.range(tidx, blocks * cols, self.threads, unroll=1):
            c = i % cols
            b = i // cols
            q = cute.make_rmem_tensor(cute.make_layout(VEC), Float32)
            for j in cutlass.range_constexpr(VEC):
                q[j] = Float32(0.0)
                if b * VEC + j < rows:
                    q[j] = Float32(stage[(b * VEC + j) * cols + c]) * inv
            self.store_vec(q, cute.local_tile(args.x8[g, c, None], (VEC,), (start // (cols * VEC) + b,)))

    @cute.jit
    def store_vec(self, q, dst):
        """16 values rounded to e4m3 (nearest even, saturated at 448; NaN stays NaN), one 16-byte store."""
        out = cute.make_rmem_tensor(cute.make_layout(VEC), cutlass.Float8E4M3FN)
        out.store(q.load().to(cutlass.Float8E4M3FN))
        cute.autovec_copy(out, dst)


def compile_quantize_staged(dtype: torch.dtype, transposed: bool, stage_bytes: int, keep_ptx: bool = False,
                            ptxas_report: bool = False):
    """Compile QuantizeStagedSm90 for sm_90a (no GPU needed) -> CompiledKernel."""
    args = QuantizeArgs(
        x=fake_tensor(cutlass_dtype(dtype), (None, None), align=16),
        x8=fake_tensor(cutlass.Float8E4M3FN, (None,) * (3 if transposed else 2), divisibility=16, align=16),
        scale=fake_tensor(Float32, (None,), align=4),
        cols=Int32(1), chunk=Int32(16), ctas=Int32(1),
    )
    kernel = QuantizeStagedSm90(dtype, transposed, stage_bytes, STAGE_THREADS[stage_bytes])
    return compile_kernel(kernel, args, fake_stream(),
                          keep_ptx=keep_ptx, ptxas_report=ptxas_report)


def quantize_staged_kernel(dtype: torch.dtype, transposed: bool, stage_bytes: int):
    """The compiled kernel (once per process; kept on disk across processes)."""
    return kernel_cache.get(("ikbo_gemm.quantize_staged", dtype, transposed, stage_bytes, STAGE_THREADS[stage_bytes]),
                            lambda: compile_quantize_staged(dtype, transposed, stage_bytes), package="ikbo_gemm")
