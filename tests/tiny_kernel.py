"""A kernel that compiles in about a second (y = x + x over fp16), for tests of the compile machinery."""
import cutlass
import cutlass.cute as cute

from cute_kernels import compile_kernel, fake_stream, fake_tensor


@cute.kernel
def _double_kernel(src: cute.Tensor, dst: cute.Tensor, n: cutlass.Int32):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = bidx * 128 + tidx
    if i < n:
        dst[i] = src[i] + src[i]


@cute.jit
def _double(src: cute.Tensor, dst: cute.Tensor, n: cutlass.Int32, stream):
    _double_kernel(src, dst, n).launch(grid=[(n + 127) // 128, 1, 1], block=[128, 1, 1], stream=stream)


def compile_tiny(**kw):
    """The kernel compiled for sm_90a -> CompiledKernel (``compile_kernel``'s options)."""
    t = fake_tensor(cutlass.Float16, (None,), align=16)
    return compile_kernel(_double, t, t, cutlass.Int32(0), fake_stream(), **kw)
