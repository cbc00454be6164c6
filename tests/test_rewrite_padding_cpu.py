"""Inductor's alignment padding of matmul rows (pad_mm on the GPU), taken off by the pass
where it hides a broadcast: graphs as Inductor leaves them, built node by node."""
from __future__ import annotations

import torch

from ikbo_rewrite import padding
from ikbo_rewrite.context import Context
from rewrite_helpers import FakeCudaGraph

aten = torch.ops.aten
U, B, K, N, PAD = 3, 11, 6, 4, 5
BF = torch.bfloat16


def _graph(gathered=True, k_cols=0, extra_user=False, slice_end=-PAD):
    """mm(constant_pad_nd(x, [0, k_cols, 0, PAD]), w)[:slice_end] with x = x_user[idx] (or an
    input of B rows); ``extra_user``: the padded tensor also feeds a sum."""
    f = FakeCudaGraph()
    w = f.input("w", (K + k_cols, N), BF)
    if gathered:
        x = f.op(aten.index.Tensor, f.input("x_user", (U, K), BF), [f.input("idx", (B,), torch.int64)])
    else:
        x = f.input("x", (B, K), BF)
    pad = f.op(aten.constant_pad_nd.default, x, [0, k_cols, 0, PAD])
    out = f.op(aten.slice.Tensor, f.op(aten.mm.default, pad, w), 0, 0, slice_end)
    if extra_user:
        total = f.op(aten.sum.dim_IntList, pad, [1], True, val=f.empty((B + PAD, 1), BF))
        out = f.op(aten.add.Tensor, out, f.op(aten.slice.Tensor, total, 0, 0, -PAD))
    return f.module(out)


def _run(gm):
    ctx = Context(gm)
    padding.undo_row_padding(ctx)
    gm.graph.lint()
    return ctx.report


def _pads(gm) -> list:
    return [n.args[1] for n in gm.graph.nodes if n.target is aten.constant_pad_nd.default]


def test_padded_rows_behind_a_broadcast_are_taken_off():
    gm = _graph()
    report = _run(gm)
    assert _pads(gm) == [] and not any(n.target is aten.slice.Tensor for n in gm.graph.nodes)
    (mm,) = [n for n in gm.graph.nodes if n.target is aten.mm.default]
    assert mm.args[0].target is aten.index.Tensor and tuple(mm.meta["val"].shape) == (B, N)
    assert any("row padding" in n for n in report.notes)


def test_padded_k_columns_stay_when_the_rows_go():
    gm = _graph(k_cols=2)
    _run(gm)
    assert _pads(gm) == [[0, 2]]


def test_padding_elsewhere_or_not_sliced_back_stays():
    for gm in (_graph(gathered=False), _graph(extra_user=True), _graph(slice_end=B - 1)):
        _run(gm)
        assert _pads(gm) == [[0, 0, 0, PAD]]
