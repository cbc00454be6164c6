"""Shared CuTeDSL machinery: compile cache, architecture checks, torch interop
(fake tensors, TMA-ready operands and store targets, the forward-only autograd
guard, torch.library registration for torch.compile), launch-plan cache,
persistent tile scheduling and small synchronization helpers.

Nothing here knows about IKBO; the kernels in ``ikbo_gemm`` and ``ikbo_fa`` build on it.
"""
import os

# The Hopper MMA helpers consult the target architecture while tracing. On a
# machine without a GPU the DSL would otherwise assume sm_100a.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from . import checks  # noqa: E402
from .arch import (  # noqa: E402
    TARGET_ARCH,
    context_sm_count,
    cuda_sm90_available,
    is_sm90,
    max_active_clusters,
    on_device,
    require_sm90,
    sm_count,
)
from .compile import CompiledKernel, compile_kernel, kernel_cache  # noqa: E402
from .interop import (  # noqa: E402
    copy_back,
    cutlass_dtype,
    dense_unit_strides,
    fake_stream,
    fake_tensor,
    forward_only,
    into_out,
    library_op,
    store_target,
    tma_ready,
)
from .plans import PlanCache  # noqa: E402

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
    "fake_stream",
    "fake_tensor",
    "forward_only",
    "into_out",
    "library_op",
    "is_sm90",
    "kernel_cache",
    "PlanCache",
    "max_active_clusters",
    "on_device",
    "require_sm90",
    "sm_count",
    "store_target",
    "tma_ready",
]
