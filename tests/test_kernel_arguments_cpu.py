"""Named kernel arguments (cute_kernels.arguments): the checks at class definition, the order in
which a kernel receives a bundle's fields, and a bundle through a sm_90a compile into the
kernel's parameter list."""
from typing import NamedTuple, Optional

import cutlass
import cutlass.cute as cute
import pytest
import torch
from cutlass import Int32

from cute_kernels import compile_kernel, fake_stream, fake_tensor
from cute_kernels.arguments import bundle_items, kernel_arguments
from ikbo_gemm.lce_sm90 import LceEpilogue, LceLaunch, LceOperands
from ikbo_gemm.linear_sm90 import LinearEpilogue, LinearLaunch, LinearOperands


@kernel_arguments
class Io(NamedTuple):
    src: cute.Tensor
    dst: cute.Tensor
    extra: Optional[cute.Tensor]


@kernel_arguments
class Sizes(NamedTuple):
    n: Int32
    scale: cutlass.Float32


@kernel_arguments
class Call(NamedTuple):
    io: Io
    sizes: Sizes


@cute.kernel
def _add_kernel(io: Io, sizes: Sizes):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = bidx * 128 + tidx
    if i < sizes.n:
        v = io.src[i] * sizes.scale
        if cutlass.const_expr(io.extra is not None):
            v = v + io.extra[i]
        io.dst[i] = v


@cute.jit
def _add(call: Call, stream):
    _add_kernel(call.io, call.sizes).launch(grid=[(call.sizes.n + 127) // 128, 1, 1], block=[128, 1, 1],
                                            stream=stream)


def _compile(with_extra: bool):
    t = fake_tensor(cutlass.Float32, (None,), align=16)
    call = Call(Io(t, t, t if with_extra else None), Sizes(Int32(1), cutlass.Float32(1.0)))
    return compile_kernel(_add, call, fake_stream(), keep_ptx=True)


def _entry_params(ptx: str) -> int:
    entry = ptx[ptx.index(".entry"):]
    return entry[: entry.index(")")].count(".param")


def test_a_bundle_compiles_its_fields_in_order_and_none_is_absent():
    with_extra, without = _compile(True), _compile(False)
    # src, dst (and extra) as tensor parameters, then n and scale: a None field is no parameter.
    assert _entry_params(with_extra.ptx) == 5 and _entry_params(without.ptx) == 4


def test_kernel_arguments_refuses_fields_the_calling_convention_cannot_pass():
    with pytest.raises(TypeError, match=r"Bad\.n is annotated <class 'int'>"):
        @kernel_arguments
        class Bad(NamedTuple):
            t: cute.Tensor
            n: int

    with pytest.raises(TypeError, match="Torch.t"):
        @kernel_arguments
        class Torch(NamedTuple):
            t: torch.Tensor

    class Plain(NamedTuple):  # a bundle not marked as one
        t: cute.Tensor

    with pytest.raises(TypeError, match="Nested.inner"):
        @kernel_arguments
        class Nested(NamedTuple):
            inner: Plain

    with pytest.raises(TypeError, match="must be a typing.NamedTuple"):
        kernel_arguments(tuple)


def test_bundle_items_flatten_in_the_kernels_order():
    call = Call(Io("s", "d", None), Sizes(3, 1.5))
    assert list(bundle_items(call)) == [("io.src", "s"), ("io.dst", "d"), ("io.extra", None), ("sizes.n", 3),
                                        ("sizes.scale", 1.5)]


def test_the_gemm_kernels_take_marked_bundles():
    for bundle in (LceOperands, LceEpilogue, LceLaunch, LinearOperands, LinearEpilogue, LinearLaunch):
        assert bundle.__kernel_arguments__
    assert LceLaunch._fields == ("tile_begin", "tile_end", "grid_size", "wait_prior", "cooperative")
    assert LinearEpilogue._fields == ("out", "ws", "bias", "a_scale", "b_scale")  # the scales: FP8 only
