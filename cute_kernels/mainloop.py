"""The wgmma main loops of a consumer warpgroup, shared by the GEMM kernels.

The consumer owning a tile waits for each stage of the TMA ring, issues its wgmmas (one
group in flight) and releases each stage one k-block behind, then hands the tensor cores to
the other consumer (:class:`cute_kernels.warp_specialized.PingPong`) as soon as its last
wgmma is issued, before waiting for them. ``promoting_mainloop`` does the same with each
k-block summed from zero and added into the fp32 accumulator (FP8).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from .accumulator import fence_operand, warpgroup_gemm


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


# k-blocks of a promotion group (promoting_mainloop): the tensor cores drain once a group.
PROMOTE_GROUP = 4
STAGGER = PROMOTE_GROUP // 2


@cute.jit
def promoting_mainloop(ab_pipeline, state, tiled_mma, acc, partials, tCrA, tCrB, k_blocks: Int32, ping_pong,
                       consumer_idx: Int32, stagger):
    """``pingpong_mainloop`` (``zero_init``) with promotion: each k-block sums from zero into one
    of the two ``partials`` in turn, and once its wgmmas are done (``wait_group(1)``, while the
    next k-block's run) the partial is added into ``acc`` in fp32 registers. 8-bit wgmma keeps
    about 14 mantissa bits in its accumulator; a k-block's sum is short, so the rounding stays
    at fp32's past it.

    The k-blocks run in groups of PROMOTE_GROUP (the rest one by one), each ending with
    ``wait_group(0)``: ptxas follows a wgmma group only within the code that issued it, and
    where a partial is read after a wgmma in flight across a loop's back edge it serializes
    every wgmma. With ``stagger`` (one consumer of a shared tile) the first STAGGER k-blocks
    run as a group of their own: the two consumers then drain at different k-blocks, each
    while the other's wgmmas keep the tensor cores busy."""
    acc.fill(0.0)
    rest = k_blocks
    if stagger & (k_blocks > STAGGER):
        state = _promote_group(ab_pipeline, state, tiled_mma, acc, partials, tCrA, tCrB, STAGGER, None,
                               consumer_idx, False)
        rest = k_blocks - STAGGER
    groups = rest // PROMOTE_GROUP
    singles = rest - groups * PROMOTE_GROUP
    for g in cutlass.range(groups, unroll=1):
        state = _promote_group(ab_pipeline, state, tiled_mma, acc, partials, tCrA, tCrB, PROMOTE_GROUP, ping_pong,
                               consumer_idx, (g == groups - 1) & (singles == 0))
    for i in cutlass.range(singles, unroll=1):
        state = _promote_group(ab_pipeline, state, tiled_mma, acc, partials, tCrA, tCrB, 1, ping_pong, consumer_idx,
                               i == singles - 1)
    return state


@cute.jit
def _promote_group(ab_pipeline, state, tiled_mma, acc, partials, tCrA, tCrB, n: cutlass.Constexpr, ping_pong,
                   consumer_idx: Int32, last):
    """``n`` k-blocks from ``state``, partial 0 and 1 in turn, each added into ``acc`` once done,
    every stage released; returns the state after them. ``last``: the tile's last k-blocks
    (the other consumer's turn starts once they are issued)."""
    release = state.clone()
    for i in cutlass.range_constexpr(n):
        ab_pipeline.consumer_wait(state)
        _promote_issue(tiled_mma, partials[i % 2], tCrA, tCrB, state.index)
        state.advance()
        if const_expr(i > 0):
            warpgroup.wait_group(1)
            ab_pipeline.consumer_release(release)
            release.advance()
            _add_into(acc, partials[(i - 1) % 2])
    if const_expr(ping_pong is not None):
        if last:
            ping_pong.hand_over(consumer_idx)
    warpgroup.wait_group(0)
    ab_pipeline.consumer_release(release)
    _add_into(acc, partials[(n - 1) % 2])
    return state


@cute.jit
def _promote_issue(tiled_mma, partial, tCrA, tCrB, stage: Int32):
    """The k-block's wgmmas into ``partial``, the first overwriting it. Its own MMA atom: the
    tiled MMA's accumulate flag is trace-time state, which a dynamic branch may not change."""
    warpgroup_gemm(tiled_mma, partial, tCrA[(None, None, None, stage)], tCrB[(None, None, None, stage)], True)


@cute.jit
def _add_into(acc, partial):
    """acc += partial, register by register (fp32), pinned after the wait before it and before
    the next wgmma issue (``fence_operand``)."""
    fence_operand(partial)
    for i in cutlass.range_constexpr(cute.size(acc)):
        acc[i] = acc[i] + partial[i]
    fence_operand(acc)
