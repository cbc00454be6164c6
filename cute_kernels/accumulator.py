"""Views of a Hopper wgmma accumulator fragment, and one warpgroup GEMM issue.

A thread's fp32 accumulator of an (M, N) wgmma tile has the layout ((2, 2, N/8), M/64, N/...):
two rows (8 apart) by pairs of neighbouring columns. These views give its registers as a
(row, column) matrix, or as the A operand of a following wgmma (P in registers).
"""
from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op


def acc_mn_view(acc):
    """((2, 2, N/8), M, N) accumulator -> (rows, cols) view: ((2, M), (2, N/8, N))."""
    l = cute.make_layout(acc.layout.shape)
    shape = ((l.shape[0][1], l.shape[1]), (l.shape[0][0], l.shape[0][2], l.shape[2]))
    stride = ((l.stride[0][1], l.stride[1]), (l.stride[0][0], l.stride[0][2], l.stride[2]))
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, cute.make_layout(shape, stride=stride)))


def acc_as_frag_a(acc):
    """fp32 accumulator viewed in the register layout of a following wgmma's A operand:
    ((2, 2, N/8), M, N) -> ((2, 2, 2), M, (N/16, N))."""
    l = cute.logical_divide(acc.layout, ((None, None, 2), None, None))
    frag = cute.make_layout(
        ((l.shape[0][0], l.shape[0][1], l.shape[0][2][0]), l.shape[1], (l.shape[0][2][1], l.shape[2])),
        stride=((l.stride[0][0], l.stride[0][1], l.stride[0][2][0]), l.stride[1], (l.stride[0][2][1], l.stride[2])),
    )
    return cute.make_tensor(acc.iterator, frag)


def warpgroup_gemm(tiled_mma, acc, tA, tB, zero_init: bool):
    """Issue one warpgroup MMA over the K mode as one wgmma group (asynchronous: the caller
    waits with ``warpgroup.wait_group``)."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in range(cute.size(tA.shape[2])):
        cute.gemm(atom, acc, tA[None, None, k], tB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()


@dsl_user_op
def fence_operand(frag, *, loc=None, ip=None):
    """Pin an fp32 fragment's registers in program order: an empty volatile asm reads and writes
    each, so the compiler moves no read or write of them across it, nor across the wgmma issues
    and waits around it (left free, it may sink adds of a retired wgmma result past the next
    wgmma, which then copies registers in flight and serializes)."""
    for i in range(cute.size(frag)):
        frag[i] = Float32(llvm.inline_asm(T.f32(), [Float32(frag[i]).ir_value(loc=loc, ip=ip)], "", "=f,0",
                                          has_side_effects=True, is_align_stack=False, loc=loc, ip=ip))
