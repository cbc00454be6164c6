"""Following a tensor's dimensions through views: each dimension is a group of labelled
source dimensions (a reshape merges or splits groups), so that a matmul several views away
from a concat can be asked which source dimension it reduces over."""
from __future__ import annotations

from typing import Optional

from torch.fx import Node

from .fx_utils import RESHAPES, SAME, aten, is_one, is_op, norm_dim, same, shape

Axes = list  # [tuple of labels] per dimension; () is a dimension of size 1



def regroup(axes: Axes, sizes: dict, out_shape) -> Optional[Axes]:
    """The groups of a reshape to ``out_shape``, or None where it is not a regrouping."""
    labels = [lab for group in axes for lab in group]
    out, i = [], 0
    for s in out_shape:
        if is_one(s):
            out.append(())
            continue
        group, prod = [], 1
        while i < len(labels) and not same(prod, s):
            group.append(labels[i])
            prod = prod * sizes[labels[i]]
            i += 1
        if not group or not same(prod, s):
            return None
        out.append(tuple(group))
    return out if i == len(labels) else None


def step(n: Node, axes: Axes, sizes: dict) -> Optional[Axes]:
    """The axes of view ``n`` of a tensor with ``axes`` (its first argument), or None."""
    rank = len(axes)
    if is_op(n, *SAME):
        return list(axes)
    if is_op(n, aten.permute):
        return [axes[norm_dim(d, rank)] for d in n.args[1]]
    if is_op(n, aten.transpose):
        a, b = norm_dim(n.args[1], rank), norm_dim(n.args[2], rank)
        out = list(axes)
        out[a], out[b] = out[b], out[a]
        return out
    if is_op(n, aten.t) and rank == 2:
        return [axes[1], axes[0]]
    if is_op(n, aten.unsqueeze):
        out = list(axes)
        out.insert(norm_dim(n.args[1], rank + 1), ())
        return out
    if is_op(n, *RESHAPES, aten.flatten, aten.squeeze):
        return regroup(axes, sizes, shape(n))
    return None


def appended_zeros(n: Node) -> Optional[list]:
    """The zeros ``n`` appends after each dim, last dim first (``[after_last, after_2nd_last,
    ...]``), where ``n`` is a constant zero padding that adds nothing before any dim
    (``constant_pad_nd``, or ``F.pad`` before decomposition); None otherwise."""
    if not is_op(n, aten.constant_pad_nd, aten.pad) or len(n.args) < 2:
        return None
    pad = list(n.args[1])
    if is_op(n, aten.pad):  # F.pad before decomposition: pad(t, pad, mode, value)
        mode = n.args[2] if len(n.args) > 2 else n.kwargs.get("mode", "constant")
        value = n.args[3] if len(n.args) > 3 else n.kwargs.get("value", None)
        if mode != "constant":
            return None
        value = 0 if value is None else value
    else:
        value = n.args[2] if len(n.args) > 2 else n.kwargs.get("value", 0)
    if value != 0 or len(pad) % 2 or not all(isinstance(p, int) and p >= 0 for p in pad) or any(pad[0::2]):
        return None
    return pad[1::2]


def zero_pad_of_last(n: Node) -> bool:
    """``n`` appends zeros to its input's last dim alone: Inductor's alignment padding of a
    matmul's reduction dim on the GPU. A contraction over that dim is the same without the
    padded columns."""
    after = appended_zeros(n)
    return after is not None and len(after) >= 1 and not any(after[1:])


def zero_pad_rows(n: Node) -> tuple:
    """(K columns, rows) of zeros ``n`` appends to a 2-D tensor, rows > 0 (Inductor's alignment
    padding of a matmul's activation on the GPU); (0, 0) otherwise."""
    after = appended_zeros(n) if len(shape(n) or ()) == 2 else None
    return (after[0], after[1]) if after is not None and len(after) == 2 and after[1] > 0 else (0, 0)


def follow(start: Node, axes: Axes, sizes: dict):
    """(node, axes, path) for every non-view user reached from ``start`` through views:
    ``node`` reads the view whose axes are given, which is ``path[-1]`` (or ``start``).
    A zero padding of a last axis labelled "k" (the reduction of a linear) counts as a view."""
    out, work = [], [(start, axes, [])]
    while work:
        t, ax, path = work.pop()
        for u in t.users:
            if u.args and u.args[0] is t:
                nxt = list(ax) if ax and ax[-1] == ("k",) and zero_pad_of_last(u) else step(u, ax, sizes)
                if nxt is not None:
                    work.append((u, nxt, path + [u]))
                    continue
            out.append((u, ax, path, t))
    return out


def weight_axes(w: Node):
    """(get_attr node, axes over its labels ("w0", "w1"), the labels of axes seen zero-padded)
    for a constant 2-D weight seen through views, a broadcast along a new leading dim and
    zero padding of its last axis; None otherwise."""
    chain = []
    n = w
    while n.op == "call_function":
        chain.append(n)
        n = n.args[0]
        if not isinstance(n, Node):
            return None
    if n.op != "get_attr" or shape(n) is None or len(shape(n)) != 2:
        return None
    sizes = {"w0": shape(n)[0], "w1": shape(n)[1]}
    axes: Axes = [("w0",), ("w1",)]
    padded = set()
    for c in reversed(chain):
        if zero_pad_of_last(c) and len(axes) == 2 and len(axes[-1]) == 1:
            padded.add(axes[-1][0])  # zero columns past the activation's K (see follow) if that axis is K
            continue
        if is_op(c, aten.expand):  # new leading dims, or size-1 dims, broadcast as a batch
            new, old = shape(c), shape(c.args[0])
            lead = len(new) - len(old)
            if lead < 0 or any(a != () and not same(new[lead + i], old[i]) for i, a in enumerate(axes)):
                return None
            axes = [("batch",)] * lead + [a if a != () else ("batch",) for a in axes]
            continue
        try:
            axes = step(c, axes, sizes)
        except KeyError:  # a reshape across the broadcast batch
            return None
        if axes is None:
            return None
    return n, axes, padded
