"""hoist: row-wise work on a broadcast moves before it, so that it runs at U rows.

``f(src[idx]) == f(src)[idx]`` whenever row b of ``f``'s output depends only on row b of
its input: pointwise ops (their other operands free of the batch, or gathered by the same
index), views that keep dim 0, a constant padding of the other dims, reductions and
normalizations over other dims, a linear on the gathered tensor alone (also on [B, L, E]
rows merged into [B * L, E] and split back), a concat of gathers by one index. Each step
leaves the original nodes in the graph, so a step that does not pay is undone at the end
(see :func:`undo_unpaid`): a matmul or a reduction pays by itself; pointwise work, views and
pads pay only where what they lead to pays or an IKBO op absorbs the gather after them.
Otherwise Inductor's fusion of the gather into them is as good.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
from torch.fx import Node

from .broadcast import Broadcast, index_node
from .context import Context, HoistStep
from .fx_utils import Builder, RESHAPES, aten, is_one, is_op, ndim, norm_dim, replace, same, shape, tensor_val

_VIEWS_KEEPING_ROWS = (aten.clone, aten.alias, aten.contiguous, aten.detach)
_REDUCTIONS = (aten.sum, aten.mean, aten.amax, aten.amin)
_SOFTMAX = (aten._softmax, aten._log_softmax, aten.softmax, aten.log_softmax)
_CONVERSIONS = (torch.ops.prims.convert_element_type, aten._to_copy)


def _is_pointwise(n: Node) -> bool:
    t = n.target
    tags = getattr(t, "tags", ())
    if torch.Tag.nondeterministic_seeded in tags:
        return False
    if is_op(n, aten._to_copy):  # a dtype change only, on the same device and layout
        return set(n.kwargs) <= {"dtype"} and len(n.args) == 1
    return torch.Tag.pointwise in tags or is_op(n, *_CONVERSIONS)


def _tensor_args(n: Node) -> list:
    out = []
    torch.fx.node.map_arg((n.args, n.kwargs), lambda a: out.append(a) if tensor_val(a) is not None else None)
    return out


class _Plan:
    """How one user of a broadcast runs at U rows: its args with the gathers replaced."""

    def __init__(self, kind: str, args=None, kwargs=None):
        self.kind, self.args, self.kwargs = kind, args, kwargs


def _swap(ctx: Context, n: Node, bc: Broadcast, row_dims_ok) -> Optional[dict]:
    """{gathered arg: its source} when every tensor arg of ``n`` is either gathered by bc's
    index (``row_dims_ok(arg)``) or free of the batch; None otherwise."""
    swaps, out_rank = {}, ndim(n)
    for a in _tensor_args(n):
        other = ctx.broadcast(a)
        if other is not None and other.key == bc.key and row_dims_ok(a):
            swaps[a] = other.source
        elif ndim(a) is not None and out_rank is not None and (ndim(a) < out_rank or is_one(shape(a)[0])):
            continue
        else:
            return None
    return swaps if bc.node in swaps else None


def _plan(ctx: Context, n: Node, bc: Broadcast) -> Optional[_Plan]:
    g, rank = bc.node, ndim(bc.node)
    out = tensor_val(n)
    if n.op != "call_function" or rank is None:
        return None
    args, kwargs = n.args, n.kwargs
    same_rank = lambda a: ndim(a) == ndim(n)  # noqa: E731

    if out is not None and _is_pointwise(n):
        swaps = _swap(ctx, n, bc, same_rank)
        return None if swaps is None else _Plan("pointwise", *_sub(args, kwargs, swaps))
    if not (n.args and n.args[0] is g) and not is_op(n, aten.bmm, aten.cat, aten.addmm):
        return None
    swaps = {g: bc.source}
    if is_op(n, *_VIEWS_KEEPING_ROWS):
        return _Plan("view", *_sub(args, kwargs, swaps))
    if is_op(n, aten.unsqueeze) and norm_dim(args[1], rank + 1) >= 1:
        return _Plan("view", *_sub(args, kwargs, swaps))
    if is_op(n, aten.squeeze) and len(args) > 1:
        dims = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
        if all(norm_dim(d, rank) >= 1 for d in dims):
            return _Plan("view", *_sub(args, kwargs, swaps))
    if is_op(n, aten.permute) and norm_dim(args[1][0], rank) == 0:
        return _Plan("view", *_sub(args, kwargs, swaps))
    if is_op(n, aten.transpose) and min(norm_dim(args[1], rank), norm_dim(args[2], rank)) >= 1:
        return _Plan("view", *_sub(args, kwargs, swaps))
    if is_op(n, aten.slice, aten.select) and norm_dim(args[1] if len(args) > 1 else 0, rank) >= 1:
        return _Plan("view", *_sub(args, kwargs, swaps))
    if is_op(n, aten.flatten) and norm_dim(args[1] if len(args) > 1 else 0, rank) >= 1:
        return _Plan("view", *_sub(args, kwargs, swaps))
    if is_op(n, aten.constant_pad_nd, aten.pad) and _pads_rows_alone(n, rank):
        return _Plan("pad", *_sub(args, kwargs, swaps))
    if is_op(n, *RESHAPES, aten.expand) and out is not None and same(out.shape[0], shape(g)[0]):
        sizes = list(args[1])
        if is_op(n, aten.expand):
            if out.dim() != rank:  # new leading dims: the batch is no longer dim 0
                return None
            sizes[0] = -1
        elif not any(isinstance(s, int) and s == -1 for s in sizes[1:]):
            sizes[0] = -1
        else:
            return None
        return _Plan("view", (bc.source, sizes) + tuple(args[2:]), dict(kwargs))
    if is_op(n, *_REDUCTIONS) and len(args) > 1 and args[1]:
        dims = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
        if all(norm_dim(d, rank) >= 1 for d in dims):
            return _Plan("reduction", *_sub(args, kwargs, swaps))
    if is_op(n, *_SOFTMAX) and norm_dim(args[1], rank) >= 1:
        return _Plan("norm", *_sub(args, kwargs, swaps))
    if is_op(n, aten.native_layer_norm, aten.layer_norm) and len(args[1]) < rank:
        if _free_of_batch(args[2:4] if len(args) > 2 else (), n):
            return _Plan("norm", *_sub(args, kwargs, swaps))
    if is_op(n, aten.mm) and rank == 2:
        return _Plan("matmul", *_sub(args, kwargs, swaps))
    if is_op(n, aten.matmul) and rank >= 2 and ndim(args[1]) is not None and ndim(args[1]) <= 2:
        return _Plan("matmul", *_sub(args, kwargs, swaps))
    if is_op(n, aten.linear) and rank >= 2 and ndim(args[1]) == 2 and (len(args) < 3 or args[2] is None
                                                                       or ndim(args[2]) == 1):
        return _Plan("matmul", *_sub(args, kwargs, swaps))
    if is_op(n, aten.addmm) and args[1] is g and _free_of_batch(args[:1], n):
        return _Plan("matmul", *_sub(args, kwargs, swaps))
    if is_op(n, aten.bmm):
        swaps = _swap(ctx, n, bc, lambda a: True)
        if swaps is not None and len(swaps) == 2:
            return _Plan("matmul", *_sub(args, kwargs, swaps))
    if is_op(n, aten.cat) and norm_dim(args[1] if len(args) > 1 else 0, rank) >= 1:
        parts = [ctx.broadcast(p) for p in args[0]]
        if all(p is not None and p.key == bc.key for p in parts):
            swaps = {p.node: p.source for p in parts}
            return _Plan("cat", *_sub(args, kwargs, swaps))
    return None


def _pads_rows_alone(n: Node, rank: int) -> bool:
    """A constant padding (``constant_pad_nd``, ``pad`` of mode "constant") that leaves dim 0 as
    it is: each row is padded by itself (pad_mm's K columns on the GPU). ``pad`` lists pairs
    from the last dim back."""
    pad = n.args[1]
    mode = "constant"
    if is_op(n, aten.pad):  # constant_pad_nd's third arg is the value
        mode = n.args[2] if len(n.args) > 2 else n.kwargs.get("mode", "constant")
    return mode == "constant" and (len(pad) <= 2 * (rank - 1) or all(p == 0 for p in pad[2 * (rank - 1):]))


def _free_of_batch(args, n: Node) -> bool:
    rank = ndim(n)
    for a in args:
        if isinstance(a, Node) and tensor_val(a) is not None and not (ndim(a) < rank or is_one(shape(a)[0])):
            return False
    return True


def _sub(args, kwargs, swaps: dict):
    f = lambda a: swaps.get(a, a)  # noqa: E731
    return torch.fx.node.map_arg(tuple(args), f), torch.fx.node.map_arg(dict(kwargs), f)


def _gather(ctx: Context, b: Builder, bc: Broadcast, source: Node, parent) -> Node:
    g = b.call(aten.index.Tensor, source, [index_node(bc, b)])
    ctx.broadcasts[g] = bc.with_node(g, source)
    ctx.step_of[g] = parent
    return g


def _apply(ctx: Context, n: Node, bc: Broadcast, plan: _Plan) -> list:
    """Run ``n`` at U rows before it, gather its result(s), and return the new broadcasts."""
    single = isinstance(tensor_val(n), torch.Tensor)
    if not single and any(u.target is not operator.getitem for u in n.users):
        return []  # a tuple (native_layer_norm) is hoisted through its getitems only
    b = Builder(ctx.graph, n)
    hoisted = b.call(n.target, *plan.args, **plan.kwargs)
    step = HoistStep(plan.kind, [], [], inputs=[a for a in _tensor_args(n) if ctx.broadcast(a)],
                     parent=ctx.step_of.get(bc.node))
    if single:
        outs = [(n, hoisted)]
    else:
        outs = [(u, b.call(operator.getitem, hoisted, u.args[1])) for u in list(n.users)]
    new = []
    for original, at_users in outs:
        g = _gather(ctx, b, bc, at_users, step)
        replace(original, g)
        step.originals.append(original)
        step.gathers.append(g)
        new.append(ctx.broadcasts[g])
    _record(ctx, step)
    return new


def _record(ctx: Context, step: HoistStep) -> None:
    ctx.steps.append(step)
    if step.parent is not None:
        step.parent.children.append(step)


def _merged_rows(view: Node, bc: Broadcast) -> Optional[int]:
    """j when ``view`` reshapes the broadcast's dims 0..j (j >= 1) into its dim 0 and keeps the rest."""
    s_in, s_out = shape(bc.node), shape(view)
    if not is_op(view, *RESHAPES) or s_out is None or len(s_out) < 1:
        return None
    for j in range(1, len(s_in)):
        rest_in, rest_out = s_in[j + 1:], s_out[1:]
        if len(rest_in) == len(rest_out) and all(same(a, c) for a, c in zip(rest_in, rest_out)):
            merged = 1
            for s in s_in[: j + 1]:
                merged = merged * s
            return j if same(merged, s_out[0]) else None
    return None


def _row_chain(start: Node, view: Node, bc: Broadcast, j: int) -> Optional[list]:
    """[c1, ..., split]: single-user row-wise ops on the merged rows ending in a reshape that
    splits dim 0 back into the broadcast's dims 0..j."""
    chain, n = [], start
    s_in = shape(bc.node)
    while True:
        prev = chain[-1] if chain else view
        if is_op(n, *RESHAPES) and chain and ndim(n) >= j + 1:
            if all(same(a, c) for a, c in zip(shape(n)[: j + 1], s_in[: j + 1])):
                return chain + [n]
        ok = (is_op(n, aten.mm) and n.args[0] is prev) or (
            is_op(n, aten.addmm) and n.args[1] is prev and _free_of_batch(n.args[:1], n))
        ok = ok or (_is_pointwise(n) and all(
            a is prev or ndim(a) < ndim(n) or is_one(shape(a)[0]) for a in _tensor_args(n)))
        if not ok or len(n.users) != 1:
            return None
        chain.append(n)
        n = next(iter(n.users))


def _apply_chain(ctx: Context, view: Node, bc: Broadcast, j: int, chain: list) -> list:
    split = chain[-1]
    b = Builder(ctx.graph, split)
    merged = b.mul([b.size(bc.source, d) for d in range(j + 1)])
    cur = b.call(view.target, bc.source, [merged] + list(view.args[1][1:]))
    prev = view
    for c in chain[:-1]:
        cur = b.call(c.target, *torch.fx.node.map_arg(c.args, lambda a, p=prev, x=cur: x if a is p else a), **c.kwargs)
        prev = c
    sizes = list(split.args[1])
    sizes[0] = b.size(bc.source, 0)
    cur = b.call(split.target, cur, sizes)
    step = HoistStep("matmul" if any(is_op(c, aten.mm, aten.addmm) for c in chain) else "pointwise", [split], [],
                     inputs=[bc.node], parent=ctx.step_of.get(bc.node))
    g = _gather(ctx, b, bc, cur, step)
    replace(split, g)
    step.gathers.append(g)
    _record(ctx, step)
    return [ctx.broadcasts[g]]


def hoist_all(ctx: Context) -> None:
    """Hoist until nothing after a broadcast is row-wise."""
    work = list(ctx.broadcasts.values())
    while work:
        bc = work.pop()
        for user in list(bc.node.users):
            plan = _plan(ctx, user, bc)
            if plan is not None:
                work += _apply(ctx, user, bc, plan)
                continue
            j = _merged_rows(user, bc)
            if j is None:
                continue
            for start in list(user.users):
                chain = _row_chain(start, user, bc, j)
                if chain is not None:
                    work += _apply_chain(ctx, user, bc, j, chain)


def undo_unpaid(ctx: Context) -> None:
    """Put back the steps that pay neither by themselves nor through what follows them."""

    def kept(step: HoistStep) -> bool:
        if step.pays or any(g in ctx.absorbed for g in step.gathers):
            return True
        return any(kept(c) for c in step.children if not c.undone)

    for step in reversed(ctx.steps):  # children before their parents
        if not kept(step):
            for original, g in zip(step.originals, step.gathers):
                replace(g, original)
                for x in step.inputs:  # why the work stayed after the gather it reads
                    for why in ctx.reasons.get(g, []):
                        ctx.leave(x, why)
            step.undone = True
    for step in ctx.steps:
        if not step.undone:
            ctx.report.add("hoist", step.originals, f"{step.kind} at U rows")
