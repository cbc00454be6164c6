"""Matmul-like nodes read as one contraction: which operand is the activation, which axis of
it is reduced, the weight operand, and the output's axes."""
from __future__ import annotations

import dataclasses
from typing import Optional

from torch.fx import Node

from .fx_utils import aten, is_op, ndim, prefix_slice, shape
from .layout import Axes, weight_axes


@dataclasses.dataclass
class Contraction:
    node: Node
    k_axis: int  # the reduced axis of the activation operand
    out_axes: Axes  # the output's axes, over the activation's labels and "m"
    weight: Node  # get_attr of the 2-D weight
    weight_k: str  # "w0" or "w1": the weight's reduced dimension
    bias: Optional[Node] = None  # added to the output (addmm, linear)

    @property
    def m_dim(self) -> int:
        return self.out_axes.index(("m",))


def kept_rows(con: Contraction) -> tuple[Node, Optional[int]]:
    """(the node a rewrite replaces, how many of the weight's output rows it keeps, or None
    for all). On the GPU Inductor pads a matmul's output width to an aligned one (pad_mm:
    zero weight rows, frozen into one constant) and slices the result back. Where the
    contraction's only user is that slice, the rewrite computes the kept rows alone, from the
    weight's first rows, and replaces the slice: no wasted rows, and no strided result left
    for a copy to make contiguous."""
    n, rank = con.node, len(shape(con.node))
    (s,) = n.users if len(n.users) == 1 else (None,)
    cut = prefix_slice(s) if s is not None and s.args[0] is n else None
    if cut is None or cut[0] != con.m_dim:
        return n, None
    full, keep = shape(n)[cut[0]], cut[1]
    if not 0 < keep < full or (con.bias is not None and (cut[0] != rank - 1 or shape(con.bias)[-1] != full)):
        return n, None  # (a bias that does not run along the last axis keeps the slice)
    return s, keep


def _weight(w, k_pos: int, m_pos: int):
    """(get_attr, its K label) when operand ``w`` is a constant whose operand axes
    ``k_pos`` / ``m_pos`` are its two dimensions."""
    if not isinstance(w, Node):
        return None
    found = weight_axes(w)
    if found is None:
        return None
    attr, axes, padded = found
    k, m = axes[k_pos], axes[m_pos]
    if len(k) != 1 or len(m) != 1 or {k[0], m[0]} != {"w0", "w1"} or m[0] in padded:
        return None  # (a padded output axis would change the result's width)
    if any(a not in ((), ("batch",)) for i, a in enumerate(axes) if i not in (k_pos % len(axes), m_pos % len(axes))):
        return None
    return attr, k[0]


def read(n: Node, act: Node, axes: Axes) -> tuple[Optional[Contraction], Optional[Node]]:
    """(the contraction, None) when ``n`` contracts ``act`` (with ``axes``) against a weight;
    (None, the weight operand) when only the weight is not a constant; (None, None) when
    ``n`` is no contraction of ``act``."""
    rank, m = len(axes), [("m",)]

    def result(k_axis, out_axes, w, k_pos, m_pos, bias=None):
        found = _weight(w, k_pos, m_pos)
        if found is None:
            return None, w
        return Contraction(n, k_axis, out_axes, found[0], found[1], bias), None

    a = n.args
    if is_op(n, aten.mm) and rank == 2:
        if a[0] is act:
            return result(1, [axes[0]] + m, a[1], 0, 1)
        return result(0, m + [axes[1]], a[0], 1, 0)
    if is_op(n, aten.addmm) and rank == 2:
        if a[1] is act:
            return result(1, [axes[0]] + m, a[2], 0, 1, a[0])
        return result(0, m + [axes[1]], a[1], 1, 0, a[0])
    if is_op(n, aten.bmm) and rank == 3:
        if a[0] is act:
            return result(2, [axes[0], axes[1]] + m, a[1], 1, 2)
        return result(1, [axes[0]] + m + [axes[2]], a[0], 2, 1)
    if is_op(n, aten.linear) and a[0] is act:
        return result(rank - 1, axes[:-1] + m, a[1], 1, 0, a[2] if len(a) > 2 else n.kwargs.get("bias"))
    if is_op(n, aten.matmul):
        if a[0] is act and ndim(a[1]) == 2:
            return result(rank - 1, axes[:-1] + m, a[1], 0, 1)
        if a[1] is act and ndim(a[0]) == 2 and rank >= 2:
            return result(rank - 2, axes[:-2] + m + axes[-1:], a[0], 1, 0)
    if is_op(n, aten.einsum) and len(a[1]) == 2 and act in a[1]:
        return _einsum(n, act, axes, result)
    return None, None


def _einsum(n: Node, act: Node, axes: Axes, result):
    eq = n.args[0].replace(" ", "")
    if "..." in eq or "->" not in eq:
        return None, None
    ins, out = eq.split("->")
    specs = ins.split(",")
    i = list(n.args[1]).index(act)
    xs, ws = specs[i], specs[1 - i]
    if len(xs) != len(axes) or len(ws) != 2:
        return None, None
    reduced = [c for c in ws if c in xs and c not in out]
    kept = [c for c in ws if c not in xs]
    if len(reduced) != 1 or len(kept) != 1 or any(c not in xs and c != kept[0] for c in out):
        return None, None
    k_axis = xs.index(reduced[0])
    if sorted(out) != sorted([c for c in xs if c != reduced[0]] + kept):
        return None, None
    out_axes = [("m",) if c == kept[0] else axes[xs.index(c)] for c in out]
    return result(k_axis, out_axes, n.args[1][1 - i], ws.index(reduced[0]), ws.index(kept[0]))
