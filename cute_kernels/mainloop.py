"""The wgmma main loop of a ping-pong consumer warpgroup, shared by the GEMM kernels.

The consumer owning a tile waits for each stage of the TMA ring, issues its wgmmas (one
group in flight) and releases each stage one k-block behind, then hands the tensor cores to
the other consumer (:class:`cute_kernels.warp_specialized.PingPong`) as soon as its last
wgmma is issued, before waiting for them.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import warpgroup


@cute.jit
def pingpong_mainloop(ab_pipeline, state, tiled_mma, acc, tCrA, tCrB, k_blocks: Int32, zero_init, ping_pong,
                      consumer_idx: Int32):
    """wgmma over ``k_blocks`` stages from ``state`` (>= 1); returns the state after them.

    With ``zero_init`` the first wgmma overwrites the accumulator, otherwise it accumulates
    onto what ``acc`` holds. ``ping_pong`` None: a consumer that takes no turns (the only one
    running tiles)."""
    release = state.clone()
    ab_pipeline.consumer_wait(state)
    tiled_mma.set(warpgroup.Field.ACCUMULATE, not zero_init)
    mma_k_block(tiled_mma, acc, tCrA, tCrB, state.index, first=True)
    state.advance()
    for k in cutlass.range(1, k_blocks, unroll=1):
        ab_pipeline.consumer_wait(state)
        mma_k_block(tiled_mma, acc, tCrA, tCrB, state.index)
        warpgroup.wait_group(1)
        ab_pipeline.consumer_release(release)
        release.advance()
        state.advance()
    # Every wgmma of this tile is issued: the other consumer may start its main loop.
    if const_expr(ping_pong is not None):
        ping_pong.hand_over(consumer_idx)
    warpgroup.wait_group(0)
    ab_pipeline.consumer_release(release)
    return state


@cute.jit
def mma_k_block(tiled_mma, acc, tCrA, tCrB, stage: Int32, first: cutlass.Constexpr = False):
    """The wgmmas of one k-block (stage ``stage``) as one wgmma group."""
    # Orders the accumulator's earlier writes (a loaded user tile; the group still in flight)
    # before these wgmmas; without it ptxas inserts one of its own.
    warpgroup.fence()
    for kk in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
        coord = (None, None, kk, stage)
        cute.gemm(tiled_mma, acc, tCrA[coord], tCrB[coord], acc)
        if const_expr(first and kk == 0):
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
