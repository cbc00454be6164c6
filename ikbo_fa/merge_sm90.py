"""The merge of split-KV partial results (sm_90a): class SplitMergeSm90."""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, const_expr

from cute_kernels.compile import compile_kernel, kernel_cache
from cute_kernels.interop import cutlass_dtype, fake_stream, fake_tensor

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


class SplitMergeSm90:
    """``out[b, s, h] = sum_i exp(lse_i - lse) o_i`` with ``lse = log sum_i exp(lse_i)`` over the
    ``n`` splits of a row's keys (``ws_o`` [B, S_q, n x H, D] in the output dtype, ``ws_lse``
    [B, n x H, S_q] fp32, split-major heads), in fp32, rounded once. A row no split has a key
    for gets 0 and -inf; a NaN lse (an out-of-range index) gives NaN.

    One thread per output element (the lse of its row is read by each of the row's D threads,
    from L1); 256 threads a CTA. No shared memory, barriers or pipelines. Launched dependent on
    the attention kernel (programmatic dependent launch): every thread waits for that grid
    (griddepcontrol.wait) before reading.
    """

    NUM_THREADS = 256

    def __init__(self, dtype: torch.dtype, with_lse: bool):
        self.dtype = cutlass_dtype(dtype)
        self.with_lse = with_lse

    @cute.jit
    def __call__(self, mWsO: cute.Tensor, mWsLse: cute.Tensor, mOut: cute.Tensor, mLse: cute.Tensor | None,
                 n_splits: Int32, stream):
        total = mOut.shape[0] * mOut.shape[1] * mOut.shape[2] * mOut.shape[3]
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
        t = bidx * self.NUM_THREADS + tidx
        if t < B * S * H * D:
            d = t % D
            r = t // D
            h = r % H
            r = r // H
            s = r % S
            b = r // S
            top = -Float32.inf
            nan = Int32(0)
            for i in cutlass.range(n_splits, unroll=1):
                lse_i = mWsLse[b, i * H + h, s]
                if lse_i != lse_i:
                    nan = Int32(1)
                top = cute.arch.fmax(top, lse_i)  # (fmax drops NaN: flagged above)
            acc = Float32(0.0)
            total = Float32(0.0)
            if top != -Float32.inf:
                for i in cutlass.range(n_splits, unroll=1):
                    w = cute.math.exp2((mWsLse[b, i * H + h, s] - top) * LOG2_E, fastmath=True)
                    total += w
                    acc += w * Float32(mWsO[b, s, i * H + h, d])
                acc = acc / total
            lse = top + cute.math.log2(total, fastmath=True) * LN_2 if top != -Float32.inf else top
            if nan != 0:
                acc = Float32.nan
                lse = Float32.nan
            mOut[b, s, h, d] = acc.to(self.dtype)
            if const_expr(self.with_lse):
                if d == 0:
                    mLse[b, h, s] = lse


def compile_merge(dtype: torch.dtype, with_lse: bool, keep_ptx: bool = False, ptxas_report: bool = False):
    dt = cutlass_dtype(dtype)
    args = (
        fake_tensor(dt, (None, None, None, None), align=dtype.itemsize),
        fake_tensor(Float32, (None, None, None), align=4),
        fake_tensor(dt, (None, None, None, None), align=dtype.itemsize),
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
