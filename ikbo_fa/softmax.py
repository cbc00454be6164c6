"""The online softmax of one consumer warpgroup's query rows: class OnlineSoftmax.

Per thread it owns, for each of its accumulator rows, the running max (raw scores, before the
scale), the partial row sum (this thread's columns; the four lanes of a row are added in
``finish``), the factor O is rescaled by before a block's P V, and the largest move of the
running max in one stale-max rescale of the tile (``jump``, log2 units).

Blocks of keys run from the last to the first, so only the first block processed is masked.
After a tile's first block the overlapped main loop exponentiates each block against the
running max as it stands, without the block's own max (``stale_max``), and rescales only when
a P may exceed 2^STALE_MAX (``stale_max_grew``). A move of the max past REDO_MAX (P could
overflow, or its rescale factor underflow) marks the row for an exact recompute on the CUDA
cores at the end of the tile (``exact_rows``). Every decision is taken per row: a row's result
never depends on the other rows of its warp (with S_q <= 8, another candidate's).
"""
from __future__ import annotations

import dataclasses
import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from cute_kernels.accumulator import acc_mn_view

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)
STALE_MAX = 8.0
REDO_MAX = 120.0


@dataclasses.dataclass(frozen=True)  # frozen: the DSL carries it through loops as read-only
class OnlineSoftmax:
    """Row max, row sums, the O rescale factor and the max jumps of one thread's rows (register
    tensors, updated in place), and the thread's O accumulator as (rows, cols), rescaled with
    the rows."""

    row_max: object
    row_sum: object
    corr: object
    jump: object
    acc_O_mn: object
    n_rows: int

    @staticmethod
    def create(n_rows: int, acc_O_mn) -> "OnlineSoftmax":
        make = lambda: cute.make_rmem_tensor((n_rows,), Float32)  # noqa: E731
        row_max, row_sum, corr, jump = make(), make(), make(), make()
        return OnlineSoftmax(row_max, row_sum, corr, jump, acc_O_mn, n_rows)

    def reset(self):
        """A new tile: no keys seen yet."""
        self.row_max.fill(-Float32.inf)
        self.row_sum.fill(0.0)
        self.jump.fill(0.0)

    @cute.jit
    def mask_keys(self, acc_S, n_cols: Int32, tScS_mn, col_offset):
        """Scores of keys at or past the valid length (TMA zero fill, kv_lengths) -> -inf.
        ``tScS_mn``: thread 0's (compile-time) columns; ``col_offset``: this thread's offset."""
        acc_S_mn = acc_mn_view(acc_S)
        limit = n_cols - col_offset
        # Selects, not branches: a branch per element makes the compiler carry every score
        # through each one (about a thousand extra instructions per tile).
        for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
            keep = tScS_mn[0, c][1] < limit
            for m in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
                acc_S_mn[m, c] = acc_S_mn[m, c] if keep else -Float32.inf

    @cute.jit
    def online(self, acc_S, scale_log2: Float32, first: bool = False):
        """S -> unnormalized P = exp2(S * scale_log2 - max * scale_log2) in place; updates the
        running row max and (per-thread partial) row sum, and ``corr``, the factor O must be
        scaled by before this block's P V. ``first``: the tile's first block (nothing to rescale;
        exp2(-inf * scale) would be NaN for scale 0)."""
        acc_S_mn, row_max, row_sum, corr = acc_mn_view(acc_S), self.row_max, self.row_sum, self.corr
        n_cols = cute.size(acc_S_mn, mode=[1])
        assert n_cols % 4 == 0
        for m in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
            # Four independent max / sum chains per row (a single chain is latency bound).
            mx = [acc_S_mn[m, i] for i in range(4)]
            for c in cutlass.range_constexpr(4, n_cols, 4):
                for i in cutlass.range_constexpr(4):
                    mx[i] = cute.arch.fmax(mx[i], acc_S_mn[m, c + i])
            blk_max = cute.arch.fmax(cute.arch.fmax(mx[0], mx[1]), cute.arch.fmax(mx[2], mx[3]))
            blk_max = cute.arch.fmax(blk_max, cute.arch.shuffle_sync_bfly(blk_max, offset=1))
            blk_max = cute.arch.fmax(blk_max, cute.arch.shuffle_sync_bfly(blk_max, offset=2))
            new_max = cute.arch.fmax(row_max[m], blk_max)
            # A row with no unmasked score yet keeps max -inf: offset 0, so exp2 gives 0, not NaN.
            max_scaled = new_max * scale_log2 if new_max != -Float32.inf else Float32(0.0)
            if const_expr(first):
                corr[m] = Float32(1.0)
            else:
                corr[m] = cute.math.exp2(row_max[m] * scale_log2 - max_scaled, fastmath=True)
            row_max[m] = new_max
            blk_sum = _exp2_row(acc_S_mn, m, scale_log2, max_scaled)
            if const_expr(first):
                row_sum[m] = blk_sum
            else:
                row_sum[m] = row_sum[m] * corr[m] + blk_sum

    @cute.jit
    def mark_rows_without_max(self):
        """After the first block: a row with no finite score in it (every valid key -inf: an inf
        in K or an overflowed q.k) has no running max for ``stale_max`` to exponentiate
        against: it is recomputed exactly at the end of the tile."""
        for m in cutlass.range_constexpr(cute.size(self.row_max, mode=[0])):
            self.jump[m] = Float32.inf if self.row_max[m] == -Float32.inf else self.jump[m]

    @cute.jit
    def stale_max(self, acc_S, scale_log2: Float32):
        """S -> P = exp2(S * scale_log2 - running max * scale_log2) in place, the row sums
        updated, without this block's max: the exponentials start at once. Returns whether
        in some row of this warp P may exceed 2^STALE_MAX (``stale_max_grew`` then rescales)."""
        acc_S_mn, row_max, row_sum = acc_mn_view(acc_S), self.row_max, self.row_sum
        grew = False
        for m in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
            # After the first block the running max is finite (it holds a valid key).
            blk_sum = _exp2_row(acc_S_mn, m, scale_log2, row_max[m] * scale_log2)
            # No P exceeds this thread's sum of them, so a sum within 2^STALE_MAX bounds them
            # all without a max (an inf P makes the sum inf).
            grew = grew | (blk_sum > Float32(2.0 ** STALE_MAX))
            row_sum[m] = row_sum[m] + blk_sum
        return cute.arch.vote_any_sync(grew)

    @cute.jit
    def stale_max_grew(self, acc_S, scale_log2: Float32):
        """The rare step after ``stale_max`` when a P may exceed 2^STALE_MAX: the running max
        moves up by log2 of the row's largest P, and P, the row sums and O (its P V of the
        blocks before, waited for) are rescaled to it. The largest move is kept in ``jump``:
        past REDO_MAX (P may have overflowed), ``exact_rows`` recomputes the row at the end
        of the tile."""
        acc_S_mn, row_max, row_sum = acc_mn_view(acc_S), self.row_max, self.row_sum
        n_cols = cute.size(acc_S_mn, mode=[1])
        for m in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
            p_max = acc_S_mn[m, 0]
            for c in cutlass.range_constexpr(1, n_cols):
                p_max = cute.arch.fmax(p_max, acc_S_mn[m, c])
            p_max = cute.arch.fmax(p_max, cute.arch.shuffle_sync_bfly(p_max, offset=1))
            p_max = cute.arch.fmax(p_max, cute.arch.shuffle_sync_bfly(p_max, offset=2))
            # Only a row that itself crossed 2^STALE_MAX moves: the warp-wide vote that brought us
            # here must not change other rows (with S_q <= 8 they belong to another candidate).
            # The sums are stale_max's, to the bit (same chains over the same P).
            part = _sum_row(acc_S_mn, m)
            part = cute.arch.fmax(part, cute.arch.shuffle_sync_bfly(part, offset=1))
            part = cute.arch.fmax(part, cute.arch.shuffle_sync_bfly(part, offset=2))
            jump = cute.arch.fmax(cute.math.log2(p_max, fastmath=True), Float32(0.0))
            jump = jump if part > Float32(2.0 ** STALE_MAX) else Float32(0.0)
            self.jump[m] = cute.arch.fmax(self.jump[m], jump)
            new_max = row_max[m] + jump / scale_log2 if jump > Float32(0.0) else row_max[m]
            # Through new_max * scale_log2, the offset later blocks exponentiate against, so the
            # rescaled P and the later P share one offset to the last bit.
            f = cute.math.exp2(row_max[m] * scale_log2 - new_max * scale_log2, fastmath=True)
            for c in cutlass.range_constexpr(n_cols):
                acc_S_mn[m, c] = acc_S_mn[m, c] * f
            row_sum[m] = row_sum[m] * f
            row_max[m] = new_max
            for c in cutlass.range_constexpr(cute.size(self.acc_O_mn, mode=[1])):
                self.acc_O_mn[m, c] = self.acc_O_mn[m, c] * f

    @cute.jit
    def rescale_o(self):
        """O *= corr, row by row (before the P V of a block whose max moved)."""
        for m in cutlass.range_constexpr(cute.size(self.acc_O_mn, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(self.acc_O_mn, mode=[1])):
                self.acc_O_mn[m, c] = self.acc_O_mn[m, c] * self.corr[m]

    @cute.jit
    def any_row_to_redo(self):
        """Whether some row of this warp moved its max past REDO_MAX in this tile."""
        redo = False
        for m in cutlass.range_constexpr(self.n_rows):
            redo = redo | (self.jump[m] > Float32(REDO_MAX))
        return cute.arch.vote_any_sync(redo)

    @cute.jit
    def exact_rows(self, sQ, q_stage: Int32, mKg, mVg, tOcO_mn, head_dim: cutlass.Constexpr, n_keys: Int32,
                   h_kv: Int32, kv_coord: Int32, scale_log2: Float32, tidx: Int32):
        """This thread's rows of O, their max and sum, recomputed on the CUDA cores in fp32
        over all ``n_keys`` keys (Q from shared memory stage ``q_stage``, K and V from global
        memory: (L, D, H_kv, batch) views ``mKg``, ``mVg``). Runs after the tile's main loop in
        a warp where some row's running max moved by more than REDO_MAX in one rescale (scores
        far outside the usual range); only those rows are recomputed, the others keep their
        values. The four lanes sharing a row split each dot product. ``tOcO_mn``: the (row, col)
        coordinates of this thread's O registers."""
        acc_O_mn, row_max, row_sum, tOcO = self.acc_O_mn, self.row_max, self.row_sum, tOcO_mn
        n_rows = cute.size(acc_O_mn, mode=[0])
        n_cols = cute.size(acc_O_mn, mode=[1])
        quarter = head_dim // 4
        lane = tidx % 4
        # Only the rows whose own max moved past REDO_MAX (uniform over the four lanes of a row);
        # the other rows of the warp keep their results (with S_q <= 8: another candidate's).
        redo = [self.jump[m] > Float32(REDO_MAX) for m in range(n_rows)]
        for m in cutlass.range_constexpr(n_rows):
            row_max[m] = -Float32.inf if redo[m] else row_max[m]
            row_sum[m] = Float32(0.0) if redo[m] else row_sum[m]
            for c in cutlass.range_constexpr(n_cols):
                acc_O_mn[m, c] = Float32(0.0) if redo[m] else acc_O_mn[m, c]
        for key in cutlass.range(n_keys, unroll=1):
            s = [Float32(0.0)] * n_rows
            for j in cutlass.range_constexpr(quarter):
                kk = Float32(mKg[key, lane * quarter + j, h_kv, kv_coord])
                for m in cutlass.range_constexpr(n_rows):
                    s[m] = s[m] + Float32(sQ[tOcO[m, 0][0], lane * quarter + j, q_stage]) * kk
            v = [Float32(mVg[key, tOcO[0, c][1], h_kv, kv_coord]) for c in range(n_cols)]
            for m in cutlass.range_constexpr(n_rows):
                s[m] = s[m] + cute.arch.shuffle_sync_bfly(s[m], offset=1)
                s[m] = s[m] + cute.arch.shuffle_sync_bfly(s[m], offset=2)
                new_max = cute.arch.fmax(row_max[m], s[m])
                # No finite score yet (new_max -inf): nothing to rescale, and this key weighs 0.
                none = new_max == -Float32.inf
                f = Float32(1.0) if none else cute.math.exp2((row_max[m] - new_max) * scale_log2, fastmath=True)
                p = Float32(0.0) if none else cute.math.exp2((s[m] - new_max) * scale_log2, fastmath=True)
                row_sum[m] = row_sum[m] * f + p if redo[m] else row_sum[m]
                row_max[m] = new_max if redo[m] else row_max[m]
                for c in cutlass.range_constexpr(n_cols):
                    acc_O_mn[m, c] = acc_O_mn[m, c] * f + p * v[c] if redo[m] else acc_O_mn[m, c]
        # finish adds the row sum over the four lanes of a row: a recomputed row's sum is whole
        # in every lane.
        for m in cutlass.range_constexpr(n_rows):
            row_sum[m] = Float32(0.0) if redo[m] and lane != 0 else row_sum[m]

    @cute.jit
    def finish(self, invalid, scale_log2: Float32):
        """O / row sum in place, and the rows' log-sum-exp (natural log), returned. No keys:
        O = 0, lse = -inf; ``invalid`` (an out-of-range index): NaN."""
        acc_O_mn, row_max, row_sum = self.acc_O_mn, self.row_max, self.row_sum
        n_rows = cute.size(acc_O_mn, mode=[0])
        lse = cute.make_rmem_tensor((n_rows,), Float32)
        for m in cutlass.range_constexpr(n_rows):
            total = row_sum[m]
            total = total + cute.arch.shuffle_sync_bfly(total, offset=1)
            total = total + cute.arch.shuffle_sync_bfly(total, offset=2)
            has_keys = total != 0.0
            inv = cute.arch.rcp_approx(total) if has_keys else Float32(0.0)
            lse_m = (row_max[m] * scale_log2 + cute.math.log2(total, fastmath=True)) * LN_2 if has_keys \
                else -Float32.inf
            inv = Float32.nan if invalid else inv
            lse[m] = Float32.nan if invalid else lse_m
            for c in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[1])):
                acc_O_mn[m, c] = acc_O_mn[m, c] * inv
        return lse


def _exp2_row(acc_S_mn, m: int, scale_log2: Float32, offset: Float32):
    """Row m of S -> exp2(S * scale_log2 - offset) in place; returns this thread's sum of the row
    (four independent chains: a single one is latency bound)."""
    n_cols = cute.size(acc_S_mn, mode=[1])
    sums = [Float32(0.0)] * 4
    for c in range(0, n_cols, 4):
        for i in range(4):
            p = cute.math.exp2(acc_S_mn[m, c + i] * scale_log2 - offset, fastmath=True)
            acc_S_mn[m, c + i] = p
            sums[i] = sums[i] + p
    return (sums[0] + sums[1]) + (sums[2] + sums[3])


def _sum_row(acc_S_mn, m: int):
    """This thread's sum of row m of P, in _exp2_row's order (the same bits)."""
    n_cols = cute.size(acc_S_mn, mode=[1])
    sums = [Float32(0.0)] * 4
    for c in range(0, n_cols, 4):
        for i in range(4):
            sums[i] = sums[i] + acc_S_mn[m, c + i]
    return (sums[0] + sums[1]) + (sums[2] + sums[3])
