"""Torch <-> CuTeDSL: dtypes and the fake tensors that kernels are traced with.

Kernels are compiled once per static configuration from fake tensors whose
sizes and strides are symbolic, then called with torch tensors through the
TVM-FFI calling convention (the tensors are passed as they are, on the
current torch stream).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import cutlass
import cutlass.cute as cute
import torch

_DTYPES = {
    torch.float16: cutlass.Float16,
    torch.bfloat16: cutlass.BFloat16,
    torch.float32: cutlass.Float32,
    torch.int32: cutlass.Int32,
    torch.int64: cutlass.Int64,
    torch.float8_e4m3fn: cutlass.Float8E4M3FN,
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


def tma_ready(t: torch.Tensor, strides_ok: Optional[bool] = None) -> torch.Tensor:
    """``t`` as a TMA descriptor can take it: ``t`` itself where its data is 16-byte aligned and
    its strides are usable (``strides_ok``; default: contiguous), else a contiguous, aligned copy.
    Either way with :func:`dense_unit_strides`."""
    if not ((t.is_contiguous() if strides_ok is None else strides_ok) and t.data_ptr() % 16 == 0):
        t = t.contiguous()
        if t.data_ptr() % 16:  # a contiguous view of misaligned data
            t = t.clone()
    return dense_unit_strides(t)


def k_major_operand(t: torch.Tensor, k_pad: int) -> torch.Tensor:
    """A GEMM operand ``t`` [..., K], K its contiguous reduction dim, as TMA takes it. TMA reads
    past K's extent as zeros, so only the pitches must be 16-byte multiples: ``t`` itself where
    they are (a view into rows padded to 16 bytes, as ``quantize_fp8`` returns, included),
    else a contiguous copy zero-padded to ``k_pad``."""
    if _rows_16_bytes_apart(t) and t.data_ptr() % 16 == 0:
        return t
    if t.shape[-1] == k_pad:
        return tma_ready(t)
    if t.dtype.itemsize == 1:  # no 8-bit pad kernel: the bytes are padded
        return torch.nn.functional.pad(t.view(torch.uint8), (0, k_pad - t.shape[-1])).view(t.dtype)
    return torch.nn.functional.pad(t, (0, k_pad - t.shape[-1]))


def _rows_16_bytes_apart(t: torch.Tensor) -> bool:
    """Unit stride last, and every other stride a positive multiple of 16 bytes that steps past
    the dims inside it (a TMA descriptor takes no overlapping or repeated rows: an expanded
    tensor's zero strides are copied)."""
    if t.stride(-1) != 1:
        return False
    inner = t.shape[-1]  # elements the dims inside d span
    for d in range(t.dim() - 2, -1, -1):
        s = t.stride(d)
        if s * t.element_size() % 16 or s < max(inner, 1):
            return False
        inner = s * t.shape[d]
    return True


def dense_unit_strides(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a view of the same elements whose size-1 dims have the strides a dense layout
    gives them. torch calls a tensor contiguous whatever its size-1 dims' strides are (movedim
    and empty_like make odd ones), and the launcher does not check them, but a TMA descriptor
    takes every stride: one that is not a multiple of 16 bytes makes it invalid."""
    shape = t.shape
    if 1 not in shape:
        return t
    strides, inner, fixed = t.stride(), 1, None
    for d in range(len(shape) - 1, -1, -1):
        if shape[d] != 1:
            inner = strides[d] * shape[d]
        elif strides[d] != inner:
            fixed = fixed or list(strides)
            fixed[d] = inner
    return t if fixed is None else t.as_strided(shape, fixed)


def store_target(out: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Where a kernel's TMA stores of ``shape`` go for ``out``: ``out`` itself (as
    :func:`dense_unit_strides` gives it) when it has that shape and 16-byte aligned data,
    else a new tensor (:func:`copy_back` then fills ``out``)."""
    if tuple(out.shape) == tuple(shape) and out.data_ptr() % 16 == 0:
        return dense_unit_strides(out)
    return torch.empty(tuple(shape), dtype=out.dtype, device=out.device)


def copy_back(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``out`` holding what the kernel stored in ``target`` (its leading columns, where wider).
    Its version counter moves either way, as after any in-place write, so a backward that saved
    ``out`` before the call raises instead of reading the new values."""
    if target.data_ptr() != out.data_ptr():
        out.copy_(target[..., : out.shape[-1]])
    else:
        torch.autograd.graph.increment_version(out)
    return out


def fake_stream():
    """The stream argument: at run time the TVM-FFI launcher uses torch's current stream."""
    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


def _no_backward(op: str, reference: str) -> RuntimeError:
    return RuntimeError(
        f"{op} has no backward: it is an inference kernel. For gradients call "
        f"{reference} (same signature); for inference, run it under torch.no_grad() "
        f"or torch.inference_mode()."
    )


class _NoBackward(torch.autograd.Function):
    """An autograd node for a kernel's results whose backward raises."""

    @staticmethod
    def forward(ctx, op: str, reference: str, run: Callable, *inputs):
        ctx.op, ctx.reference = op, reference
        return run(*(t.detach() if isinstance(t, torch.Tensor) else t for t in inputs))

    @staticmethod
    def backward(ctx, *grads):
        raise _no_backward(ctx.op, ctx.reference)


def into_out(out: Optional[torch.Tensor], result):
    """``result`` (an op's tensor, or tuple of tensors whose first is the output) with its output
    copied into ``out`` where given, by an in-place copy that autograd records."""
    if out is None:
        return result
    if isinstance(result, tuple):
        out.copy_(result[0])
        return (out, *result[1:])
    out.copy_(result)
    return out


def library_op(name: str, op: str, reference: str, fake: Callable):
    """Register the decorated function as the torch.library op ``name``: torch.compile traces
    it as one node whose outputs ``fake`` describes (from fake tensors), and its backward raises,
    naming ``reference``, as :func:`forward_only`'s does."""

    def backward(ctx, *grads):
        raise _no_backward(op, reference)

    def register(fn: Callable):
        library = torch.library.custom_op(name, mutates_args=())(fn)
        library.register_fake(fake)
        library.register_autograd(backward, setup_context=lambda ctx, inputs, output: None)
        return library

    return register


def forward_only(op: str, reference: str, run: Callable, inputs: Sequence, out: Optional[torch.Tensor] = None):
    """``run(*inputs, out=out)``: results computed from ``inputs`` by a kernel with no backward
    (the first result written into ``out`` where given).

    When grad mode is on and an input requires grad, ``run`` gets the inputs detached and its
    results an autograd node whose backward raises (naming ``reference``, the differentiable
    PyTorch version) instead of silently carrying no gradient to the inputs. ``out`` then takes
    the first result by an in-place copy that autograd records, so that a tensor ``out`` is a
    view of depends on the node too.
    """
    if torch.is_grad_enabled():  # a plain loop: this runs on every call of the ops
        for t in inputs:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                return into_out(out, _NoBackward.apply(op, reference, lambda *ts: run(*ts, out=None), *inputs))
    return run(*inputs, out=out)
