"""Torch <-> CuTeDSL: dtypes and the fake tensors that kernels are traced with.

Kernels are compiled once per static configuration from fake tensors whose
sizes and strides are symbolic, then called with torch tensors through the
TVM-FFI calling convention (the tensors are passed as they are, on the
current torch stream).
"""
from __future__ import annotations

from typing import Optional, Sequence

import cutlass
import cutlass.cute as cute
import torch

_DTYPES = {
    torch.float16: cutlass.Float16,
    torch.bfloat16: cutlass.BFloat16,
    torch.float32: cutlass.Float32,
    torch.int32: cutlass.Int32,
    torch.int64: cutlass.Int64,
}


def cutlass_dtype(dtype: torch.dtype):
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise TypeError(f"no CuTeDSL element type for {dtype}") from None


def fake_tensor(
    dtype,
    shape: Sequence[Optional[int]],
    *,
    leading_dim: int = -1,
    divisibility: int = 1,
    align: int = 16,
):
    """A fake tensor for tracing: ``None`` sizes become symbolic, strides are
    symbolic except ``leading_dim`` (stride 1). ``divisibility`` (elements)
    is promised for every symbolic stride, so TMA descriptors can be built.
    """
    rank = len(shape)
    leading_dim = leading_dim % rank
    sizes = tuple(cute.sym_int() if s is None else s for s in shape)
    strides = tuple(
        1 if i == leading_dim else cute.sym_int64(divisibility=divisibility) for i in range(rank)
    )
    return cute.runtime.make_fake_tensor(dtype, sizes, stride=strides, assumed_align=align)


def fake_stream():
    """The stream argument: at run time the TVM-FFI launcher uses torch's current stream."""
    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
