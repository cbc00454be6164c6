"""FP8 quantization on Hopper (sm_90a): class QuantizeSm90, the kernel of ``quantize_fp8``.

    x [G, R, C] (C contiguous; fp16, bf16 or fp32) -> scale [G] (fp32),
    x8 [G, R, C] ("same") or [G, C, R] ("transposed"), float8_e4m3fn

with ``scale[g] = max(amax(|x[g]|), AMAX_FLOOR) * fp32(1 / 448)`` and
``x8 = e4m3(x * (1 / scale))`` (the reciprocal rounded once per group, each product rounded,
then to nearest even, saturated at 448): the formula of ``quantize.quantize_fp8_reference``,
which the op's other layouts run (it takes these constants from here), bit for bit: every step
is one correctly rounded fp32 operation, on the CPU as on the GPU.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory
import torch
from cutlass import Float32, const_expr

from cute_kernels.compile import compile_kernel, kernel_cache
from cute_kernels.interop import cutlass_dtype, fake_stream, fake_tensor

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
AMAX_FLOOR = 1e-12  # the smallest amax a scale is taken from
INV_FP8_MAX = 1 / FP8_MAX  # a scale is amax times this, rounded to fp32 (as torch rounds the scalar)


class QuantizeSm90:
    """One CTA per scale group g (x[g], R x C elements), no warp specialization:
      1. amax: the CTA's threads read x[g] along its contiguous columns, each keeping the
         largest |x| it saw (NaN wins, as torch.amax), then a butterfly over each warp's lanes
         and one shared-memory slot per warp; every thread reduces the slots itself;
      2. scale: max(amax, AMAX_FLOOR) * (1 / 448) (NaN stays NaN; thread 0 writes it);
      3. the values again (from L2 or L1: the group was read just before), times the
         scale's reciprocal, converted with cvt.rn.satfinite (e4m3), stored:
         "same": row by row, as read; "transposed": through shared memory in 32 x 32 tiles,
         read along x's columns and written along the output's rows (x8[g, c, r]), both
         coalesced.
    Step 3 reads x again: from L2 while the groups in flight fit there (rows of linear's x: a
    few KB each), from DRAM where they do not. ``quantize_fp8`` runs this kernel only for the
    groups ``QuantizeStagedSm90`` (which reads x once) does not take: groups under 2 KB, over
    what a cluster's shared memory holds, or not 16 bytes apart.
    """

    THREADS = 256
    TILE = 32  # transposed: the staged tile is TILE x TILE, each thread TILE * TILE / THREADS of it

    def __init__(self, dtype: torch.dtype, transposed: bool):
        self.dtype = cutlass_dtype(dtype)
        self.transposed = transposed
        self.warps = self.THREADS // 32
        self.tile_rows = self.THREADS // self.TILE  # rows of a tile the threads cover at once

    @cute.jit
    def __call__(
        self,
        x: cute.Tensor,  # [G, R, C], C contiguous
        x8: cute.Tensor,  # [G, R, C] or (transposed) [G, C, R], float8_e4m3fn, contiguous
        scale: cute.Tensor,  # [G] fp32
        stream,
    ):
        @cute.struct
        class SharedStorage:
            amax: cute.struct.MemRange[Float32, self.warps]
            tile: cute.struct.Align[cute.struct.MemRange[Float32, self.TILE * (self.TILE + 1)], 16]

        self.shared_storage = SharedStorage
        self.kernel(x, x8, scale).launch(grid=[cute.size(x, mode=[0]), 1, 1], block=[self.THREADS, 1, 1],
                                         stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mX8: cute.Tensor, mScale: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        g, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        sAmax = storage.amax.get_tensor(cute.make_layout(self.warps))
        n_rows = cute.size(mX, mode=[1])
        n_cols = cute.size(mX, mode=[2])

        amax = Float32(0.0)
        for r in cutlass.range(n_rows, unroll=1):
            for c in cutlass.range(tidx, n_cols, self.THREADS, unroll=1):
                v = Float32(mX[g, r, c])
                amax = max_nan(amax, v if v >= Float32(0.0) else -v)
        amax = cta_max(amax, sAmax, tidx, self.warps)
        scale = max_nan(amax, Float32(AMAX_FLOOR)) * Float32(INV_FP8_MAX)
        if tidx == 0:
            mScale[g] = scale
        inv = Float32(1.0) / scale

        if const_expr(self.transposed):
            sTile = storage.tile.get_tensor(cute.make_layout((self.TILE, self.TILE), stride=(self.TILE + 1, 1)))
            self.store_transposed(mX, mX8, sTile, g, inv, n_rows, n_cols, tidx)
        else:
            for r in cutlass.range(n_rows, unroll=1):
                for c in cutlass.range(tidx, n_cols, self.THREADS, unroll=1):
                    mX8[g, r, c] = _to_fp8(Float32(mX[g, r, c]) * inv)

    @cute.jit
    def store_transposed(self, mX, mX8, sTile, g, inv: Float32, n_rows, n_cols, tidx):
        """x8[g, c, r] = e4m3(x[g, r, c] * inv), tile by tile through shared memory (its rows
        padded by one word: the transposed reads hit 32 banks)."""
        lane = tidx % self.TILE
        row = tidx // self.TILE
        for r0 in cutlass.range(0, n_rows, self.TILE, unroll=1):
            for c0 in cutlass.range(0, n_cols, self.TILE, unroll=1):
                for j in cutlass.range_constexpr(self.TILE // self.tile_rows):
                    r = r0 + row + j * self.tile_rows
                    c = c0 + lane
                    if (r < n_rows) & (c < n_cols):
                        sTile[row + j * self.tile_rows, lane] = Float32(mX[g, r, c])
                cute.arch.sync_threads()
                for j in cutlass.range_constexpr(self.TILE // self.tile_rows):
                    c = c0 + row + j * self.tile_rows
                    r = r0 + lane
                    if (r < n_rows) & (c < n_cols):
                        mX8[g, c, r] = _to_fp8(sTile[lane, row + j * self.tile_rows] * inv)
                cute.arch.sync_threads()


@cute.jit
def cta_max(v: Float32, sAmax, tidx, warps: int) -> Float32:
    """The CTA's largest ``v`` (NaN if any thread has one), in every thread: a butterfly over
    each warp's lanes, then one shared-memory slot per warp (``sAmax``), reduced by every thread."""
    for i in cutlass.range_constexpr(5):
        v = max_nan(v, cute.arch.shuffle_sync_bfly(v, offset=1 << i))
    if tidx % 32 == 0:
        sAmax[tidx // 32] = v
    cute.arch.sync_threads()
    m = sAmax[0]
    for w in cutlass.range_constexpr(1, warps):
        m = max_nan(m, sAmax[w])
    return m


@cute.jit
def max_nan(a: Float32, b: Float32) -> Float32:
    """max(a, b), NaN if either is (fmax would drop it)."""
    return a if (a > b) | (a != a) else b


@cute.jit
def _to_fp8(v: Float32):
    """``v`` rounded to e4m3 (nearest even, saturated at 448; NaN stays NaN)."""
    r = cute.make_rmem_tensor(cute.make_layout(1), Float32)
    r[0] = v
    q = cute.make_rmem_tensor(cute.make_layout(1), cutlass.Float8E4M3FN)
    q.store(r.load().to(cutlass.Float8E4M3FN))
    return q[0]


def compile_quantize(dtype: torch.dtype, transposed: bool, keep_ptx: bool = False, ptxas_report: bool = False):
    """Compile QuantizeSm90 for sm_90a (no GPU needed) -> CompiledKernel."""
    elt = torch.tensor([], dtype=dtype).element_size()
    args = (
        fake_tensor(cutlass_dtype(dtype), (None, None, None), align=elt),  # x [G, R, C]
        fake_tensor(cutlass.Float8E4M3FN, (None, None, None), align=1),  # x8
        fake_tensor(Float32, (None,), align=4),  # scale [G]
        fake_stream(),
    )
    return compile_kernel(QuantizeSm90(dtype, transposed), *args, keep_ptx=keep_ptx, ptxas_report=ptxas_report)


def quantize_kernel(dtype: torch.dtype, transposed: bool):
    """The compiled kernel (once per process; kept on disk across processes)."""
    return kernel_cache.get(("ikbo_gemm.quantize", dtype, transposed), lambda: compile_quantize(dtype, transposed),
                            package="ikbo_gemm")
