"""linear: a linear over ``x = cat([x_user[idx], x_cand], dim=1)`` [B, K] with a constant
weight becomes ``ikbo_gemm.linear`` (the user GEMM at U rows, the gather in the epilogue);
a bias add and an activation that follow it, where it is their only input, are folded into
the op's epilogue (a custom op is opaque to Inductor's fusion, so they would otherwise run
as kernels of their own). Enabled when ``torch.ops.ikbo_gemm.linear`` is registered."""
from __future__ import annotations

import torch
from torch.fx import Node

from .broadcast import index_node
from .concat import check_dtypes, joined, padded_columns, split_concat, weight_columns
from .context import Context
from .contraction import kept_rows, read
from .fx_utils import Builder, aten, is_op, ndim, replace, same, shape
from .layout import follow

NOT_AVAILABLE = "linear: op not available (ikbo_gemm.linear is not registered)"


def available() -> bool:
    import ikbo_gemm  # noqa: F401  (registers the ops)

    return hasattr(torch.ops.ikbo_gemm, "linear")


def _activation(n: Node):
    """The op's name for an activation node, or None."""
    if is_op(n, aten.relu):
        return "relu"
    if is_op(n, aten.gelu):
        approx = n.kwargs.get("approximate", n.args[1] if len(n.args) > 1 else "none")
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(approx)
    if is_op(n, aten.silu):
        return "silu"
    if is_op(n, aten.sigmoid):
        return "sigmoid"
    return None


def _only_user(n: Node):
    return next(iter(n.users)) if len(n.users) == 1 else None


def _epilogue(res: Node, bias, n_out):
    """(last node replaced, bias, activation): the bias add and activation after ``res``."""
    last = res
    nxt = _only_user(last)
    if bias is None and is_op(nxt, aten.add) and len(nxt.args) == 2 and nxt.args[0] is last:
        b = nxt.args[1]
        if isinstance(b, Node) and ndim(b) == 1 and same(shape(b)[0], n_out) and not nxt.kwargs:
            bias, last, nxt = b, nxt, _only_user(nxt)
    act = _activation(nxt) if nxt is not None else None
    if act is not None:
        last = nxt
    return last, bias, act


def rewrite_linear(ctx: Context) -> None:
    enabled = available()
    for cat in list(ctx.graph.nodes):
        split, why = split_concat(ctx, cat)
        if split is None or len(shape(cat)) != 2:
            continue
        for user, axes, _, act in follow(cat, [("b",), ("k",)], dict(zip("bk", shape(cat)))):
            _rewrite_one(ctx, split, user, act, axes, enabled)


def _rewrite_one(ctx: Context, split, user: Node, act: Node, axes, enabled: bool) -> None:
    con, weight = read(user, act, axes)
    gathers = split.gathers
    leave = lambda why: [ctx.leave(g, why) for g in gathers]  # noqa: E731
    if con is None:
        leave(f"linear: the weight of {user.name} is not a constant" if weight is not None
              else f"linear: {user.name} is not a linear over the concat")
        return
    if axes[con.k_axis] != ("k",) or con.out_axes != [("b",), ("m",)]:
        leave(f"linear: {user.name} does not reduce over the concat's K alone")
        return
    why = check_dtypes(split, con.weight)
    if why:
        leave(f"linear: {why}")
        return
    if not enabled:
        leave(NOT_AVAILABLE)
        return
    target, rows = kept_rows(con)
    n_out = shape(user)[1] if rows is None else rows
    bias = con.bias
    if bias is not None and not (ndim(bias) == 1 or (ndim(bias) == 2 and shape(bias)[0] == 1)):
        leave("linear: the bias varies per row")
        return
    why = padded_columns(ctx, con, split)
    if why:
        leave(f"linear: {why}")
        return
    b = Builder(ctx.graph, target)
    if bias is not None and rows is not None:
        bias = b.call(aten.slice.Tensor, bias, -1, 0, rows)
    last, bias, activation = _epilogue(target, bias, n_out)
    b = Builder(ctx.graph, last)
    w_cand, w_user = weight_columns(ctx, b, con.weight, con.weight_k, split, user.name, rows)
    if bias is not None and ndim(bias) == 2:
        bias = b.call(aten.reshape.default, bias, [n_out])
    x_user, x_cand = joined(b, split.user, 1), joined(b, split.cand, 1)
    out = b.call(torch.ops.ikbo_gemm.linear.default, x_cand, x_user, index_node(split.broadcast, b), w_cand, w_user,
                 bias, activation, ctx.validate)
    replace(last, out)
    ctx.absorbed.update(gathers)
    folded = ", ".join(x for x in ("bias" if bias is not None else "", activation or "") if x)
    ctx.report.add("linear", [split.cat, user] + ([last] if last is not user else []),
                   f"N {n_out}, K_user {sum(k for _, k, _ in split.user)}, K_cand "
                   f"{sum(k for _, k, _ in split.cand)}" + (f", epilogue: {folded}" if folded else ""))
