"""Shared CuTeDSL machinery: compile cache, architecture checks, torch interop
(fake tensors, TMA-ready operands and store targets, the forward-only autograd
guard, torch.library registration for torch.compile), launch-plan cache,
persistent tile scheduling, and the warp-specialized skeleton every kernel is written on
(``warp_specialized``: register split, named barriers, ping-pong turns, pipeline contracts;
``accumulator``: wgmma accumulator views; ``cluster_reduce``: a tile's K split over a cluster,
its partial sums added in shared memory; ``staged_stores``: output staged through shared memory
and TMA-stored, one barrier a sub-tile). Importing it changes no process-wide setting:
kernels are compiled for sm_90a by naming the target in each compile.

Nothing here knows about IKBO; the kernels in ``ikbo_gemm`` and ``ikbo_fa`` build on it.
"""
from . import checks
from .arch import (
    TARGET_ARCH,
    context_sm_count,
    cuda_sm90_available,
    is_sm90,
    max_active_clusters,
    on_device,
    require_sm90,
    sm_count,
)
from .compile import CompiledKernel, compile_kernel, kernel_cache
from .interop import (
    copy_back,
    cutlass_dtype,
    dense_unit_strides,
    fake_stream,
    fake_tensor,
    forward_only,
    into_out,
    k_major_operand,
    library_op,
    store_target,
    tma_ready,
)
from .plans import PlanCache, on_gpu, plan_key

__all__ = [
    "checks",
    "TARGET_ARCH",
    "CompiledKernel",
    "compile_kernel",
    "context_sm_count",
    "copy_back",
    "cuda_sm90_available",
    "cutlass_dtype",
    "dense_unit_strides",
    "k_major_operand",
    "fake_stream",
    "fake_tensor",
    "forward_only",
    "into_out",
    "library_op",
    "is_sm90",
    "kernel_cache",
    "PlanCache",
    "plan_key",
    "on_gpu",
    "max_active_clusters",
    "on_device",
    "require_sm90",
    "sm_count",
    "store_target",
    "tma_ready",
]
