"""Inductor's alignment padding of matmul rows, taken off where it hides a broadcast.

On the GPU Inductor's pad_mm pads a matmul to aligned sizes: zero rows (and K columns) on the
activation, zero weight columns frozen into the constant, and slices of the result back. A
broadcast behind padded rows is no longer a gather of rows (the pad mixes in rows of no
user), so neither a hoist nor a rewrite would see it. Where the padded activation depends on
a broadcast and every matmul that reads it slices the rows back, the rows are not padded:
each matmul reads the activation itself (K columns still padded, which the rewrites read
through) and its row slice goes. The IKBO ops and the hoisted matmuls take any row count;
matmuls elsewhere keep their padding.
"""
from __future__ import annotations

from torch.fx import Node

from .context import Context
from .fx_utils import RESHAPES, SAME, Builder, aten, is_op, ndim, prefix_slice, replace, shape
from .layout import zero_pad_rows


_CARRY = RESHAPES + SAME + (aten.permute, aten.transpose, aten.flatten, aten.unsqueeze, aten.cat)


def _behind_broadcast(ctx: Context) -> set:
    """The nodes reached from a broadcast through views and concats (the pads among them)."""
    seen, work = set(), list(ctx.broadcasts)
    while work:
        n = work.pop()
        for u in n.users:
            if u not in seen and (is_op(u, *_CARRY) or zero_pad_rows(u)[1]):
                seen.add(u)
                work.append(u)
    return seen


def _row_slice(mm: Node, pad: Node, rows: int):
    """The slice taking the padded rows off ``mm`` (a matmul of ``pad`` as its activation and
    of no other padded operand), or None."""
    pos = {aten.mm: 0, aten.addmm: 1}
    i = next((v for k, v in pos.items() if is_op(mm, k)), None)
    if i is None or mm.args[i] is not pad or pad in mm.args[i + 1:] or mm.kwargs.keys() - {"beta", "alpha"}:
        return None
    if i == 1 and ndim(mm.args[0]) == 2 and shape(mm.args[0])[0] != 1:
        return None  # a bias per row: padded with the rows
    if len(mm.users) != 1:
        return None
    (s,) = mm.users
    cut = prefix_slice(s)
    if s.args[0] is not mm or cut is None or cut != (0, shape(mm)[0] - rows):
        return None
    return s


def undo_row_padding(ctx: Context) -> None:
    reach = _behind_broadcast(ctx)
    for pad in list(ctx.graph.nodes):
        k_cols, rows = zero_pad_rows(pad)
        if not rows or pad not in reach:
            continue
        slices = [_row_slice(mm, pad, rows) for mm in pad.users]
        if not slices or None in slices:
            continue
        b = Builder(ctx.graph, pad)
        act = b.call(aten.constant_pad_nd.default, pad.args[0], [0, k_cols]) if k_cols else pad.args[0]
        for s in slices:
            mm = s.args[0]
            new = Builder(ctx.graph, mm).call(mm.target, *[act if a is pad else a for a in mm.args], **mm.kwargs)
            replace(s, new)
            ctx.graph.erase_node(s)
            ctx.graph.erase_node(mm)
        ctx.graph.erase_node(pad)
        ctx.report.notes.append(f"the row padding of {pad.name} ({rows} rows) taken off")
