"""Collapsing the chains of views and copies that a rewrite leaves after an IKBO op.

A rewritten op returns its result in its own layout ([B, M, N] for lce), and the graph after it
still rearranges what the replaced matmul returned: a permute back to the matmul's layout, the
reshapes of ``nn.Linear`` over a 3-D input, the model's own transpose and the copy Inductor
wrote for a reshape of a non-contiguous tensor. Where the whole chain amounts to a reshape of
the op's (contiguous) result, it becomes that reshape, a view: the copies go.

The chain is read as values, not strides: a reshape of a reshape is one reshape, a reshape to
its input's shape and a permute that composes to the identity are nothing, a clone is its input.
It is collapsed only where each tensor along it has a single user (so no one sees that the end
is now a view of the op's result) and its end is not a graph output (whose strides stay).
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
from torch.fx import Node

from .context import Context
from .fx_utils import Builder, RESHAPES, SAME, aten, is_op, norm_dim, same, shape

# The ops the rewrites insert (registered when ikbo_gemm and ikbo_fa are imported).
_IKBO_OPS = (torch.ops.ikbo_gemm.lce, torch.ops.ikbo_gemm.linear, torch.ops.ikbo_fa.attention)


def _step(n: Node) -> Optional[tuple]:
    """The chain step ``n`` is: ("reshape", None), ("permute", dims), ("copy", None) or None."""
    if is_op(n, *RESHAPES, aten.flatten):
        return ("reshape", None)
    if is_op(n, aten.permute):
        return ("permute", tuple(norm_dim(d, len(shape(n))) for d in n.args[1]))
    if is_op(n, aten.transpose):
        rank = len(shape(n))
        a, b = norm_dim(n.args[1], rank), norm_dim(n.args[2], rank)
        dims = list(range(rank))
        dims[a], dims[b] = b, a
        return ("permute", tuple(dims))
    if is_op(n, aten.t) and len(shape(n)) == 2:
        return ("permute", (1, 0))
    if is_op(n, *SAME):
        return ("copy", None)
    return None


def _chain(root: Node) -> list:
    """The nodes after ``root`` that only rearrange it, each the single user of the one before."""
    nodes, n = [], root
    while len(n.users) == 1:
        (u,) = n.users
        if u.op != "call_function" or u.args[0] is not n or _step(u) is None or shape(u) is None:
            break
        nodes.append(u)
        n = u
    return nodes


def _simplify(steps: list, start_shape) -> list:
    """``steps`` (each with the shape it gives) with copies dropped, adjacent reshapes and
    permutes composed, and identities removed."""
    out = []  # (kind, arg, shape after)
    for kind, arg, after in steps:
        if kind == "copy":
            continue
        out.append((kind, arg, after))
        changed = True
        while changed and out:
            changed = False
            before = out[-2][2] if len(out) > 1 else start_shape
            k, a, s = out[-1]
            if k == "reshape" and len(s) == len(before) and all(same(x, y) for x, y in zip(s, before)):
                out.pop()
                changed = True
            elif k == "permute" and a == tuple(range(len(a))):
                out.pop()
                changed = True
            elif len(out) > 1 and out[-2][0] == k:
                prev = out.pop(-2)
                out[-1] = (k, tuple(prev[1][i] for i in a) if k == "permute" else a, s)
                changed = True
    return out


def _sizes_of(end: Node) -> Optional[list]:
    """A shape argument for a reshape to ``end``'s shape that does not read ``end``: its own
    where it is a reshape, else its sizes where they are ints."""
    if is_op(end, *RESHAPES):
        return list(end.args[1])
    s = shape(end)
    return list(s) if all(isinstance(x, int) for x in s) else None


def _roots(ctx: Context) -> list:
    """The tensors the IKBO ops return (attention's output through its getitem)."""
    roots = []
    for n in ctx.graph.nodes:
        if not is_op(n, *_IKBO_OPS):
            continue
        if isinstance(n.meta.get("val"), torch.Tensor):
            roots.append(n)
        else:
            roots += [u for u in n.users if u.target is operator.getitem and u.args[1] == 0]
    return roots


def collapse_view_chains(ctx: Context) -> None:
    """Replace each chain after an IKBO op's result that amounts to a reshape by that reshape."""
    for root in _roots(ctx):
        nodes = _chain(root)
        if not nodes or not root.meta["val"].is_contiguous():
            continue
        end = nodes[-1]
        if any(u.op == "output" for u in end.users):
            continue
        left = _simplify([(*_step(n), shape(n)) for n in nodes], shape(root))
        if len(left) >= len(nodes) or any(k != "reshape" for k, _, _ in left):
            continue
        if not left:
            new = root
        else:
            sizes = _sizes_of(end)
            if sizes is None:
                continue
            new = Builder(ctx.graph, end).call(aten.reshape.default, root, sizes)
        end.replace_all_uses_with(new, propagate_meta=False)
        ctx.report.notes.append(f"{len(nodes)} view/copy node(s) after {root.name} collapsed to "
                                f"{'a reshape' if left else 'nothing'}")
