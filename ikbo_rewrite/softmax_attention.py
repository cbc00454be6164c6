"""Hand-written attention, ``softmax(q @ k^T * scale + mask) @ v``, read as SDPA.

Inductor turns only some spellings into SDPA before the pass (unmasked, static shapes), and an
exported graph keeps them all as written. This reads the rest, in both graphs:

- the two contractions as ``matmul`` (export) or ``bmm`` between reshapes of no-op expands
  (Inductor), k^T as ``transpose`` / ``permute`` of k [B, H, L, D] or a gather of a transposed
  per-user tensor (a hoist moves the transpose before the gather);
- the scale as ``mul`` / ``div`` by a number of the graph (``math.sqrt(d)`` included, which
  dynamic shapes compute from the head dim's symbol: guarded where the graph is compiled);
- a key-padding mask as ``masked_fill(drop, fill)``, ``where`` with a fill, or an added float
  bias; ``masks.prefix_lengths`` then decides whether it is a prefix mask;
- the softmax over the keys as the op or its decomposition (in fp32 between casts), the
  scale moved inside it as Inductor's joint-graph pass writes it (with or without the
  ``where`` that keeps non-finite scores exact).

A contraction of a softmax it cannot read is left with a reason naming it.

What comes out is an :class:`~ikbo_rewrite.attention.Sdpa` over new nodes (k untransposed,
gathered anew where the graph gathers k^T); unused, they are dead code.
"""
from __future__ import annotations

import math
import operator
from typing import Optional

import torch
from torch.fx import Node

from .broadcast import index_node
from .context import Context
from .fx_utils import RESHAPES, SAME, Builder, aten, example_value, is_op, ndim, norm_dim, same, shape, tensor_val

_CASTS = (torch.ops.prims.convert_element_type, aten._to_copy)
_SOFTMAX = (aten.softmax, aten._softmax, aten._safe_softmax)
_COMPARE = {aten.ge: operator.ge, aten.gt: operator.gt, aten.le: operator.le, aten.lt: operator.lt}


def _strip(n, targets):
    while is_op(n, *targets):
        n = n.args[0]
    return n


def _noop_expand(n):
    """``n`` without expands and copies that keep its shape (Inductor writes them before a bmm)."""
    while is_op(n, aten.expand, *SAME) and _same_shape(n, n.args[0]):
        n = n.args[0]
    return n


def _same_shape(a, b) -> bool:
    sa, sb = shape(a), shape(b)
    return sa is not None and sb is not None and len(sa) == len(sb) and all(same(x, y) for x, y in zip(sa, sb))


def _contraction(n) -> Optional[tuple]:
    """(a, b) for a [.., M, K] @ b [.., K, N] over 4-D operands: ``matmul``, or a reshape of a
    ``bmm`` of both merged to [B * H, .., ..]."""
    if is_op(n, aten.matmul) and ndim(n) == 4 and ndim(n.args[0]) == 4 and ndim(n.args[1]) == 4:
        return n.args[0], n.args[1]
    if not (is_op(n, *RESHAPES) and ndim(n) == 4 and is_op(n.args[0], aten.bmm)):
        return None
    out = shape(n)
    parts = []
    for x in n.args[0].args[:2]:
        if not (is_op(x, *RESHAPES) and ndim(x.args[0]) == 4):
            return None
        inner = _noop_expand(x.args[0])
        if not all(same(a, b) for a, b in zip(shape(inner)[:2], out[:2])):
            return None
        parts.append(inner)
    return tuple(parts)


def _softmax_input(ctx: Context, p, hw: "_Scores") -> Optional[Node]:
    """x for p = softmax(x, -1) (the op or its decomposition), cast back to x's dtype or not;
    a scale Inductor moved inside the softmax multiplies ``hw.scale``."""
    p = _strip(p, _CASTS)
    if is_op(p, *_SOFTMAX) and norm_dim(p.args[1], ndim(p)) == ndim(p) - 1:
        return p.args[0]
    if not is_op(p, aten.div) or not is_op(p.args[0], aten.exp) or not is_op(p.args[1], aten.sum):
        return None
    e, total = p.args
    sub = e.args[0]
    scale, stable = 1.0, False
    if is_op(sub, aten.where) and is_op(sub.args[2], aten.sub):
        # Inductor's softmax with the scale moved inside, kept exact for non-finite scores:
        # where(finite, the stable form below, x - amax(x)); the second is the definition.
        sub = sub.args[2]
    elif is_op(sub, aten.mul, aten.div) and is_op(sub.args[0], aten.sub):
        # The stable form alone (older torch, and a scale known safe):
        # (x * s - amax(x * s)) / (s * c), s the sign of c, is softmax's input x / c.
        c = number(ctx, sub.args[1], hw.guards)
        if c is None or c == 0:
            return None
        scale, sub, stable = (c if is_op(sub, aten.mul) else 1.0 / c), sub.args[0], True
    if not (total.args[0] is e and is_op(sub, aten.sub) and is_op(sub.args[1], aten.amax)):
        return None
    x = sub.args[0]
    if sub.args[1].args[0] is not x or [norm_dim(d, ndim(x)) for d in total.args[1]] != [ndim(x) - 1]:
        return None
    if stable and is_op(x, aten.mul) and len(_tensor_args(x)) == 1:  # x * s
        t = _tensor_args(x)[0]
        s = number(ctx, x.args[1] if t is x.args[0] else x.args[0], hw.guards)
        if s is None or s == 0:
            return None
        scale, x = scale * s, t
    hw.scale *= scale
    return _strip(x, _CASTS)


def number(ctx: Context, n, guards: list) -> Optional[float]:
    """The value of a scalar the graph computes (a number, a 0-d full / scalar_tensor, casts
    and sqrt of one, a symbol where guards are allowed: appended to ``guards``), else None."""
    if isinstance(n, bool):
        return None
    if isinstance(n, (int, float)):
        return float(n)
    if isinstance(n, torch.SymInt):
        value = example_value(n)
        if value is None or not ctx.guards:
            return None
        guards.append(n == value)
        return float(value)
    if not isinstance(n, Node) or (tensor_val(n) is not None and tensor_val(n).dim() != 0):
        return None
    if is_op(n, aten.scalar_tensor):
        return number(ctx, n.args[0], guards)
    if is_op(n, aten.full) and list(n.args[0]) == []:
        return number(ctx, n.args[1], guards)
    if is_op(n, *_CASTS):
        x = number(ctx, n.args[0], guards)
        dtype = tensor_val(n).dtype
        return None if x is None else float(torch.tensor(x, dtype=torch.float64).to(dtype))
    if is_op(n, aten.sqrt):
        x = number(ctx, n.args[0], guards)
        return None if x is None or x < 0 else math.sqrt(x)
    if is_op(n, aten.neg):
        x = number(ctx, n.args[0], guards)
        return None if x is None else -x
    if is_op(n, aten.mul, aten.div):
        a, b = (number(ctx, y, guards) for y in n.args[:2])
        if a is None or b is None or (is_op(n, aten.div) and b == 0):
            return None
        return a * b if is_op(n, aten.mul) else a / b
    if is_op(n, aten.ge, aten.gt, aten.le, aten.lt):  # a truth as 1.0 or 0.0
        a, b = (number(ctx, y, guards) for y in n.args[:2])
        if a is None or b is None:
            return None
        return float(_COMPARE[n.target.overloadpacket](a, b))
    if is_op(n, aten.where):  # the sign Inductor takes of a scale: where(c >= 0, 1, -1)
        cond = number(ctx, n.args[0], guards)
        return None if cond is None else number(ctx, n.args[1] if cond else n.args[2], guards)
    if n.op == "call_function" and n.target in (math.sqrt, torch.sym_sqrt):
        x = number(ctx, n.args[0], guards)
        return None if x is None or x < 0 else math.sqrt(x)
    if n.op == "call_function" and n.target in (torch.sym_float, operator.neg):  # symbolic scalars
        x = number(ctx, n.args[0], guards)
        return None if x is None else (x if n.target is torch.sym_float else -x)
    if n.op == "call_function" and n.target in (operator.mul, operator.truediv):
        a, b = (number(ctx, y, guards) for y in n.args[:2])
        if a is None or b is None or (n.target is operator.truediv and b == 0):
            return None
        return a * b if n.target is operator.mul else a / b
    v = n.meta.get("val")
    if isinstance(v, torch.SymInt):
        return number(ctx, v, guards)
    return None


class _Scores:
    """What the scores of a softmax(QK^T)V are made of."""

    def __init__(self):
        self.scale, self.guards = 1.0, []
        self.mask, self.mask_drops, self.fill = None, False, None
        self.mask_scale = 1.0  # the part of the scale applied after the mask (it scales the fill too)


def _scores(ctx: Context, x, hw: _Scores) -> tuple[Optional[tuple], str]:
    """Peel the scale and the mask off the scores: (q, k^T) of the contraction, or (None, why)."""
    while True:
        found = _contraction(x)
        if found is not None:
            return found, ""
        if is_op(x, aten.mul, aten.div) and len(_tensor_args(x)) == 1:
            t = _tensor_args(x)[0]
            if is_op(x, aten.div) and t is not x.args[0]:
                return None, "the scores divide a constant"
            c = number(ctx, x.args[1] if t is x.args[0] else x.args[0], hw.guards)
            if c is None or c == 0:
                return None, "the scores are scaled by something other than a constant"
            hw.scale *= c if is_op(x, aten.mul) else 1.0 / c
            x = t
            continue
        if hw.mask is not None:
            return None, "the scores are masked twice"
        hw.mask_scale = hw.scale
        if is_op(x, aten.masked_fill):
            hw.mask, hw.mask_drops, hw.fill = x.args[1], True, number(ctx, x.args[2], hw.guards)
            if hw.fill is None:
                return None, "the scores are masked_fill-ed with something other than a constant"
            x = x.args[0]
        elif is_op(x, aten.where):
            a, b = (number(ctx, y, hw.guards) if not _is_tensor(y) or ndim(y) == 0 else None for y in x.args[1:3])
            if a is not None:
                hw.mask, hw.mask_drops, hw.fill, x = x.args[0], True, a, x.args[2]
            elif b is not None:
                hw.mask, hw.mask_drops, hw.fill, x = x.args[0], False, b, x.args[1]
            else:
                return None, "the scores go through a where without a constant side"
        elif is_op(x, aten.add) and len(_tensor_args(x)) == 2 and len(x.args) == 2:
            a, b = x.args
            # The scores are the side that leads to the contraction; the other is the bias.
            if _leads_to_contraction(a):
                x, hw.mask = a, b
            elif _leads_to_contraction(b):
                x, hw.mask = b, a
            else:
                return None, "the scores are a sum the pass cannot split into scores and a mask"
        else:
            return None, f"the scores are not q @ k^T scaled and masked (at {getattr(x, 'target', x)})"


def _is_tensor(n) -> bool:
    return tensor_val(n) is not None


def _tensor_args(n: Node) -> list:
    return [a for a in n.args if _is_tensor(a) and ndim(a) > 0]


def _leads_to_contraction(n) -> bool:
    for _ in range(4):
        if _contraction(n) is not None:
            return True
        if not is_op(n, aten.mul, aten.div, aten.masked_fill, aten.where):
            return False
        n = n.args[2] if is_op(n, aten.where) else n.args[0]
    return False


def _untransposed(n) -> Optional[Node]:
    """k for k^T written as a transpose or permute of its last two dims."""
    if is_op(n, aten.transpose) and ndim(n) == 4 and sorted(norm_dim(d, 4) for d in n.args[1:3]) == [2, 3]:
        return n.args[0]
    if is_op(n, aten.permute) and [norm_dim(d, 4) for d in n.args[1]] == [0, 1, 3, 2]:
        return n.args[0]
    return None


def _looks_like_softmax(p) -> bool:
    """p is a softmax over the last dim by its last step (the op, or exp(..) / sum(exp(..)))."""
    p = _strip(p, _CASTS)
    return is_op(p, *_SOFTMAX) or (is_op(p, aten.div) and is_op(p.args[0], aten.exp) and is_op(p.args[1], aten.sum))


def _gathers_behind(ctx: Context, n: Node, limit: int = 256) -> list:
    """The broadcasts among the nodes ``n`` is computed from (the nearest ``limit`` of them)."""
    seen, work, out = {n}, [n], []
    while work and len(seen) < limit:
        for a in work.pop(0).all_input_nodes:
            if a in seen:
                continue
            seen.add(a)
            if ctx.broadcast(a) is not None:
                out.append(a)
            else:
                work.append(a)
    return out


def read(ctx: Context, n: Node):
    """(Sdpa, gathers, why) for a node computing softmax(QK^T)V [B, H, S_q, D], or (None, [], "")
    when ``n`` is no such contraction; ``why`` says why one seen cannot be read."""
    from .attention import Sdpa

    found = _contraction(n)
    if found is None:
        return None, [], ""
    p, v = found
    hw = _Scores()
    x = _softmax_input(ctx, _noop_expand(p), hw)
    name = f"hand-written softmax(q k^T) v at {n.name}"
    if x is None:
        if not _looks_like_softmax(_noop_expand(p)):
            return None, [], ""
        why = "the softmax over the keys is spelled in a way the pass cannot read"
        return None, _gathers_behind(ctx, n), f"{name}: {why}"
    qk, why = _scores(ctx, x, hw)
    if qk is None:
        return None, _gathers_behind(ctx, n), f"{name}: {why}"
    q, kt = qk
    gathers = [g for g in (q, kt, v) if ctx.broadcast(g) is not None]
    if not gathers:
        return None, [], ""
    k = _untransposed(kt)
    if k is None:
        bc = ctx.broadcast(kt)
        if bc is None:
            return None, gathers, f"{name}: k^T is not a transpose of k"
        # The hoist moved the transpose before the gather: gather k itself.
        b = Builder(ctx.graph, n)
        inner = _untransposed(bc.source)
        if inner is None:
            inner = b.call(aten.permute.default, bc.source, [0, 1, 3, 2])
        k = b.call(aten.index.Tensor, inner, [index_node(bc, b)])
        ctx.broadcasts[k] = bc.with_node(k, inner)
    if hw.mask is not None and hw.mask_scale <= 0:
        return None, gathers, f"{name}: the mask is scaled by {hw.mask_scale:g}"
    return Sdpa(n, n, q, k, v, hw.mask, 0.0, False, hw.scale, mask_drops=hw.mask_drops, fill=hw.fill,
                guards=hw.guards, name=name, mask_scale=hw.mask_scale), gathers, ""
