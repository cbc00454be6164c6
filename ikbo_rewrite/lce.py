"""lce: a contraction over K of ``e = cat([e_user[idx], e_cand], dim=1)`` [B, K, N] with a
constant weight [M, K] (however the model reaches it: ``torch.matmul(W, e)``, an
``nn.Linear`` over ``e.transpose(1, 2)``, ``bmm``, ``einsum``, and the views Inductor puts
between) becomes ``ikbo_gemm.lce`` [B, M, N], viewed as the contraction's output."""
from __future__ import annotations

import torch
from torch.fx import Node

from .broadcast import index_node
from .concat import check_dtypes, joined, padded_columns, split_concat, weight_columns
from .context import Context
from .contraction import kept_rows, read
from .fx_utils import Builder, aten, replace, shape
from .layout import follow

_LABELS = ("b", "k", "n")


def _as_output(b: Builder, lce: Node, out_axes, out_node: Node) -> Node:
    """The lce result [B, M, N] permuted and reshaped to the contraction's output."""
    order = [lab for group in out_axes for lab in group]
    perm = [("b", "m", "n").index(lab) for lab in order]
    res = lce if perm == [0, 1, 2] else b.call(aten.permute.default, lce, perm)
    if [len(g) for g in out_axes] != [1, 1, 1]:
        pos = {lab: i for i, lab in enumerate(("b", "m", "n"))}
        sizes = [b.mul([b.size(lce, pos[lab]) for lab in g]) for g in out_axes]
        res = b.call(aten.reshape.default, res, sizes)
    return res


def rewrite_lce(ctx: Context) -> None:
    for cat in list(ctx.graph.nodes):
        split, why = split_concat(ctx, cat)
        if split is None:
            if why:
                for g in cat.args[0]:
                    if ctx.broadcast(g):
                        ctx.leave(g, why)
            continue
        if len(shape(cat)) != 3 or split.dim != 1:
            continue  # a 2-D concat is the linear rewrite's; others neither's
        sizes = dict(zip(_LABELS, shape(cat)))
        for user, axes, _, act in follow(cat, [(lab,) for lab in _LABELS], sizes):
            _rewrite_one(ctx, split, user, act, axes)


def _rewrite_one(ctx: Context, split, user: Node, act: Node, axes) -> None:
    con, weight = read(user, act, axes)
    gathers = split.gathers
    if con is None:
        why = (f"the weight of {user.name} is not a constant (compile under torch.no_grad() with "
               "freezing, or export)") if weight is not None else f"{user.name} is not a matmul over the concat"
        for g in gathers:
            ctx.leave(g, f"lce: {why}")
        return
    labels = sorted(lab for group in con.out_axes for lab in group)
    if axes[con.k_axis] != ("k",) or labels != ["b", "m", "n"]:
        for g in gathers:
            ctx.leave(g, f"lce: {user.name} does not reduce over the concat's K alone")
        return
    why = check_dtypes(split, con.weight) or padded_columns(ctx, con, split)
    if why:
        for g in gathers:
            ctx.leave(g, f"lce: {why}")
        return
    target, rows = kept_rows(con)
    b = Builder(ctx.graph, target)
    w_cand, w_user = weight_columns(ctx, b, con.weight, con.weight_k, split, user.name, rows)
    e_user, e_cand = joined(b, split.user, 1), joined(b, split.cand, 1)
    out = b.call(torch.ops.ikbo_gemm.lce.default, w_cand, w_user, e_cand, e_user, index_node(split.broadcast, b),
                 ctx.validate, "fused")
    res = _as_output(b, out, con.out_axes, user)
    if con.bias is not None:
        bias = con.bias if rows is None else b.call(aten.slice.Tensor, con.bias, -1, 0, rows)
        res = b.call(aten.add.Tensor, res, bias)
    replace(target, res)
    ctx.absorbed.update(gathers)
    ctx.report.add("lce", [split.cat, user] + ([target] if target is not user else []),
                   f"M {shape(out)[1]}, N {shape(out)[2]}, K_user "
                   f"{sum(k for _, k, _ in split.user)}, K_cand {sum(k for _, k, _ in split.cand)}")
