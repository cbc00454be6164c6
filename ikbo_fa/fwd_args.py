"""The forward kernel's arguments, as named bundles defined once.

Host -> compiled kernel (what ``attention._run`` passes, what ``fwd_compile.compile_config`` compiles
with as fake tensors, what the test emulation receives): ``FwdTensors``, ``FwdWorkList``,
``FwdScalars``, in that order, then the grid's CTA count and the stream. Absent tensors are None
(the configuration says which are present).

``__call__`` -> device kernel: ``TmaOperands``, ``GlobalTensors``, ``ProblemDims``,
``FwdScalars`` (their fields, flattened in order, are the kernel's parameters), and the
compile-time ``TiledMmas`` and ``SmemLayouts`` (no parameter bytes).

The work-list kernel (worklist_sm90.py) writes a ``FwdWorkList`` from idx, with
``WorkListScalars``.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import cutlass.cute as cute
from cutlass import Float32, Int32


class FwdTensors(NamedTuple):
    """The problem's tensors."""

    q: cute.Tensor  # [Bq, S_q, H, D]
    k: cute.Tensor  # [Bkv, L, H_kv, D] (jagged: [1, total_L, H_kv, D])
    v: cute.Tensor  # as k
    out: cute.Tensor  # [B, S_q, H, D] (split_kv: the workspace, n_splits x H heads)
    lse: Optional[cute.Tensor]  # [B, H, S_q] fp32 (split_kv: the workspace's)
    kv_lengths: Optional[cute.Tensor]  # [Bkv] int32, clamped to [0, L]
    kv_offsets: Optional[cute.Tensor]  # jagged: [Bkv + 1] int32
    # whole_rows_out: the op's out [B, S_q, H, D] and lse [B, H, S_q] (None: not asked for), which
    # rows of one split write directly
    final_out: Optional[cute.Tensor] = None
    final_lse: Optional[cute.Tensor] = None


class FwdWorkList(NamedTuple):
    """The tiles' candidates: KV broadcast's work list (worklist.py), or Q broadcast's idx."""

    cand: cute.Tensor  # kv: candidates grouped by user [B]; q: idx [B] (int32)
    cand_start: Optional[cute.Tensor]  # kv: [U + 2] first candidate of each group
    tile_start: Optional[cute.Tensor]  # kv: [U + 2] first tile of each group (ordered: by position)
    grouped: Optional[cute.Tensor]  # kv: [1] int32, 1 where the work list's order is 0, 1, ...
    perm: Optional[cute.Tensor]  # ordered: the groups longest first (U + 1 entries read)
    # dynamic_walk: [2] the tiles handed out past the grid's first ones, and the CTAs done; zero
    # between launches (the work-list kernel zeroes it, the last CTA of a launch resets it).
    walk: Optional[cute.Tensor]


class WorkListScalars(NamedTuple):
    """Run-time scalars of the work-list kernel."""

    n_users: Int32  # U
    rows_per_cand: Int32  # S_q
    total_keys: Int32  # offsets: the key rows of the packed K/V
    max_keys: Int32  # offsets: keys past this many in a row are not read


class FwdScalars(NamedTuple):
    """Run-time scalars of one launch."""

    q_flat: Int32  # kv: 1 where q's and out's batch stride is S_q times their row stride
    max_keys: Int32  # jagged: keys past this many in a row are not read
    n_splits: Int32  # split_kv: splits of each row's keys (1 otherwise)
    split_keys: Int32  # split_kv, split_pair: keys per split, a multiple of 128
    prefetch_blocks: Int32  # K/V blocks per CTA to prefetch into L2 (0: none)
    scale_log2: Float32  # scale * log2(e), > 0
    scale: Float32


class TmaOperands(NamedTuple):
    """TMA atoms and the global tensors they partition: (rows, D, head, batch) views of q, k, v,
    out; with the one-box path, (rows, D, head) views of q and out as B * S_q rows."""

    atom_q: cute.CopyAtom
    q: cute.Tensor
    atom_k: cute.CopyAtom
    k: cute.Tensor
    atom_v: cute.CopyAtom
    v: cute.Tensor
    atom_o: cute.CopyAtom
    o: cute.Tensor
    atom_qf: Optional[cute.CopyAtom]
    qf: Optional[cute.Tensor]
    atom_of: Optional[cute.CopyAtom]
    of: Optional[cute.Tensor]


class OutTarget(NamedTuple):
    """Where a tile's O and lse go: TMA atoms and views of out as TmaOperands holds them (slots;
    the one-box path's 64-row boxes), direct_rows' (S_q, D, H, B) view, and the lse."""

    atom_o: cute.CopyAtom
    o: cute.Tensor
    atom_of: Optional[cute.CopyAtom]
    of: Optional[cute.Tensor]
    rows: Optional[cute.Tensor]
    lse: Optional[cute.Tensor]


class GlobalTensors(NamedTuple):
    """What the kernel reads or writes in global memory without TMA."""

    lse: Optional[cute.Tensor]
    cand: cute.Tensor
    cand_start: Optional[cute.Tensor]
    tile_start: Optional[cute.Tensor]
    kv_lengths: Optional[cute.Tensor]
    grouped: Optional[cute.Tensor]
    kv_offsets: Optional[cute.Tensor]
    perm: Optional[cute.Tensor]
    walk: Optional[cute.Tensor]
    k: cute.Tensor  # (L, D, H_kv, batch) view of K, for the exact recompute
    v: cute.Tensor  # ... and of V
    out: Optional[cute.Tensor]  # direct_rows: (S_q, D, H, B) view of out, for store_rows


class ProblemDims(NamedTuple):
    """The problem's sizes, read from the tensors' shapes."""

    n_q_batch: Int32
    n_kv_batch: Int32  # the K/V rows (jagged: len(kv_offsets) - 1)
    n_heads: Int32
    n_kv_heads: Int32
    kv_len: Int32  # keys per K/V row (jagged: total_L)
    n_out: Int32  # B


class TiledMmas(NamedTuple):
    """The two GEMMs of a consumer warpgroup (compile time)."""

    qk: cute.TiledMma  # S = Q K^T
    pv: cute.TiledMma  # O += P V, P from registers


class SmemLayouts(NamedTuple):
    """Shared-memory layouts (compile time; swizzled, so composed)."""

    q: cute.ComposedLayout  # (rows, D, Q stage)
    o: cute.ComposedLayout  # (rows, D)
    k: cute.ComposedLayout  # (keys, D, K/V stage)
    v: cute.ComposedLayout
