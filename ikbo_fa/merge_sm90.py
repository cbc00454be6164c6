"""The merge of split-KV partial results (sm_90a): class SplitMergeSm90."""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, const_expr

from cute_kernels.compile import compile_kernel, kernel_cache
from cute_kernels.interop import cutlass_dtype, fake_stream, fake_tensor

from .config import MAX_SPLITS, WHOLE_ROW

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


class SplitMergeSm90:
    """``out[b, s, h] = sum_i exp(lse_i - lse) o_i`` with ``lse = log sum_i exp(lse_i)`` over the
    ``n`` splits of a row's keys (``ws_o`` [B, S_q, n x H, D] in the output dtype, ``ws_lse``
    [B, n x H, S_q] fp32, split-major heads; n <= MAX_SPLITS), in fp32, rounded once. A row no
    split has a key for gets 0 and -inf; a NaN lse (an out-of-range index) gives NaN. The output
    of a split of lse -inf is not used (the attention kernel's dynamic walk never writes it). A
    row whose split-0 lse word is WHOLE_ROW (``whole_rows_out``: the attention kernel wrote it to
    out and lse itself) is left alone.

    One thread per ``VEC`` consecutive elements of an output row (16 bytes: one vector load per
    split, one store); the splits' loads are unrolled to MAX_SPLITS and predicated, so they are
    in flight together. The lse of a row is read by each of its D / VEC threads, from L1. 256
    threads a CTA; no shared memory, barriers or pipelines. Launched dependent on the attention
    kernel (programmatic dependent launch): every thread waits for that grid
    (griddepcontrol.wait) before reading. ``ws_o`` and ``out`` are 16-byte aligned with strides
    in multiples of VEC elements (the op's workspace and store target are).
    """

    NUM_THREADS = 256
    VEC = 8
    MAX_SPLITS = MAX_SPLITS

    def __init__(self, dtype: torch.dtype, with_lse: bool):
        self.dtype = cutlass_dtype(dtype)
        self.with_lse = with_lse

    @cute.jit
    def __call__(self, mWsO: cute.Tensor, mWsLse: cute.Tensor, mOut: cute.Tensor, mLse: cute.Tensor | None,
                 n_splits: Int32, stream):
        total = mOut.shape[0] * mOut.shape[1] * mOut.shape[2] * (mOut.shape[3] // self.VEC)
        grid = (total + self.NUM_THREADS - 1) // self.NUM_THREADS
        self.kernel(mWsO, mWsLse, mOut, mLse, n_splits).launch(
            grid=[grid, 1, 1], block=[self.NUM_THREADS, 1, 1], stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, mWsO: cute.Tensor, mWsLse: cute.Tensor, mOut: cute.Tensor, mLse: cute.Tensor | None,
               n_splits: Int32):
        cute.arch.griddepcontrol_wait()
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        B, S, H, D = mOut.shape[0], mOut.shape[1], mOut.shape[2], mOut.shape[3]
        chunks = D // self.VEC
        t = bidx * self.NUM_THREADS + tidx
        whole = Int32(0)
        c = h = s = b = Int32(0)
        if t < B * S * H * chunks:
            c = t % chunks
            r = t // chunks
            h = r % H
            r = r // H
            s = r % S
            b = r // S
            if cute.recast_tensor(mWsLse, Int32)[b, h, s] == Int32(WHOLE_ROW):
                whole = Int32(1)
        if t < B * S * H * chunks and whole == 0:
            lse_i = cute.make_rmem_tensor((self.MAX_SPLITS,), Float32)
            parts = cute.make_rmem_tensor(cute.make_layout((self.MAX_SPLITS, self.VEC), stride=(self.VEC, 1)), self.dtype)
            top = -Float32.inf
            nan = Int32(0)
            for i in cutlass.range_constexpr(self.MAX_SPLITS):
                lse_i[i] = -Float32.inf
                if i < n_splits:
                    lse_i[i] = mWsLse[b, i * H + h, s]
                    cute.autovec_copy(cute.local_tile(mWsO[b, s, i * H + h, None], (self.VEC,), (c,)),
                                      parts[i, None])
                    if lse_i[i] != lse_i[i]:
                        nan = Int32(1)
                    top = cute.arch.fmax(top, lse_i[i])  # (fmax drops NaN: flagged above)
            acc = cute.make_rmem_tensor((self.VEC,), Float32)
            acc.fill(0.0)
            total = Float32(0.0)
            if top != -Float32.inf:
                for i in cutlass.range_constexpr(self.MAX_SPLITS):
                    # A split of lse -inf adds nothing, and its output may never have been written.
                    if i < n_splits and lse_i[i] != -Float32.inf:
                        w = cute.math.exp2((lse_i[i] - top) * LOG2_E, fastmath=True)
                        total += w
                        for j in cutlass.range_constexpr(self.VEC):
                            acc[j] += w * Float32(parts[i, j])
                inv = cute.arch.rcp_approx(total)
                for j in cutlass.range_constexpr(self.VEC):
                    acc[j] = acc[j] * inv
            if nan != 0:
                acc.fill(Float32.nan)
            res = cute.make_rmem_tensor((self.VEC,), self.dtype)
            res.store(acc.load().to(self.dtype))
            cute.autovec_copy(res, cute.local_tile(mOut[b, s, h, None], (self.VEC,), (c,)))
            if const_expr(self.with_lse):
                if c == 0:
                    lse = top + cute.math.log2(total, fastmath=True) * LN_2 if top != -Float32.inf else top
                    if nan != 0:
                        lse = Float32.nan
                    mLse[b, h, s] = lse


def compile_merge(dtype: torch.dtype, with_lse: bool, keep_ptx: bool = False, ptxas_report: bool = False):
    dt = cutlass_dtype(dtype)
    args = (
        fake_tensor(dt, (None, None, None, None), divisibility=SplitMergeSm90.VEC),
        fake_tensor(Float32, (None, None, None), align=4),
        fake_tensor(dt, (None, None, None, None), divisibility=SplitMergeSm90.VEC),
        fake_tensor(Float32, (None, None, None), align=4) if with_lse else None,
        Int32(2),
        fake_stream(),
    )
    return compile_kernel(SplitMergeSm90(dtype, with_lse), *args, keep_ptx=keep_ptx, ptxas_report=ptxas_report)


def merge_kernel(dtype: torch.dtype, with_lse: bool):
    """The compiled merge for ``dtype`` (compiled at first use). Call:
    ``fn(ws_o, ws_lse, out, lse_or_None, n_splits)`` on the current stream."""
    return kernel_cache.get(("ikbo_fa.merge_sm90", dtype, with_lse), lambda: compile_merge(dtype, with_lse),
                            package="ikbo_fa")
