"""Key-padding masks that are prefix masks: ``keep[r, j] = j < lengths[r]``, however the
model and SDPA's own decomposition spell it (a bool mask; ``where(keep, 0, -inf)``;
``masked_fill(0, ~keep, -inf)``; ``~(j >= lengths)``; unsqueezed, expanded, padded to an
aligned width and sliced back; gathered to the candidates before or after the comparison).
Anything else is not proven a prefix mask and the attention is left as it is."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from torch.fx import Node

from .context import Context
from .fx_utils import aten, is_one, is_op, ndim, norm_dim, same, shape, tensor_val, val

_SAME = (aten.clone, aten.alias, aten.contiguous, aten.detach)
_RESHAPES = (aten.view, aten.reshape, aten._unsafe_view)
_ARANGES = (aten.arange, torch.ops.prims.iota)


@dataclasses.dataclass
class Lengths:
    node: Node  # 1-D integer lengths
    broadcast: object  # the Broadcast crossed on the way (lengths then per user), or None
    gathers: list  # the gathers crossed (the rewrite makes them dead)


def _scalar(n) -> Optional[float]:
    if isinstance(n, (int, float)):
        return float(n)
    if is_op(n, aten.full) and not n.args[0]:
        return float(n.args[1])
    if is_op(n, aten.scalar_tensor):
        return float(n.args[0])
    return None


def _non_one(n: Node) -> list:
    return [i for i, s in enumerate(shape(n)) if not is_one(s)]


class _Walk:
    def __init__(self, ctx: Context):
        self.ctx, self.bc, self.gathers, self.why = ctx, None, [], None

    def cross(self, n: Node) -> Optional[Node]:
        """The next node below a view-like ``n`` (or a gather), mapping dims; None if ``n`` is not one."""
        bc = self.ctx.broadcast(n)
        if bc is not None:
            if self.bc is not None and self.bc.key != bc.key:
                self.why = "the mask is gathered by two indices"
                return None
            self.bc = bc
            self.gathers.append(n)
            return bc.source
        if is_op(n, *_SAME, aten.expand, aten.unsqueeze, aten.squeeze, *_RESHAPES):
            inner = n.args[0]
            if is_op(n, *_RESHAPES) and [shape(n)[i] for i in _non_one(n)] != [shape(inner)[i] for i in _non_one(inner)]:
                return None
            return inner
        if is_op(n, aten.slice) and norm_dim(n.args[1], ndim(n)) == ndim(n) - 1:
            inner = n.args[0]
            if is_op(inner, aten.constant_pad_nd) and len(inner.args[1]) == 2 and inner.args[1][0] == 0:
                base = inner.args[0]  # padded to an aligned width, then sliced back to it
                if (len(n.args) > 2 and n.args[2] == 0 and len(n.args) > 3 and same(val(n.args[3]), shape(base)[-1])):
                    return base
            if len(n.args) > 2 and n.args[2] == 0 and len(n.args) > 3 and same(val(n.args[3]), shape(inner)[-1]):
                return inner
        return None

    def down(self, n: Node) -> Node:
        while True:
            nxt = self.cross(n)
            if nxt is None:
                return n
            n = nxt


def _keep(w: _Walk, n: Node):
    """(bool node, polarity): scores are kept where the bool node equals polarity."""
    n = w.down(n)
    v = tensor_val(n)
    if v is None:
        return None
    if v.dtype == torch.bool:
        if is_op(n, aten.logical_not, aten.bitwise_not):
            inner = _keep(w, n.args[0])
            return None if inner is None else (inner[0], not inner[1])
        return n, True
    if is_op(n, aten.where):
        a, b = _scalar(n.args[1]), _scalar(n.args[2])
        if a == 0.0 and b == -math.inf:
            inner = _keep(w, n.args[0])
        elif a == -math.inf and b == 0.0:
            inner = _keep(w, n.args[0])
            inner = None if inner is None else (inner[0], not inner[1])
        else:
            return None
        return inner
    if is_op(n, aten.masked_fill) and _scalar(n.args[2]) == -math.inf and _scalar(w.down(n.args[0])) == 0.0:
        inner = _keep(w, n.args[1])
        return None if inner is None else (inner[0], not inner[1])
    return None


def _arange_of(w: _Walk, n: Node, length) -> bool:
    n = w.down(n)
    if is_op(n, torch.ops.prims.iota):
        return n.kwargs.get("start", 0) == 0 and n.kwargs.get("step", 1) == 1 and same(val(n.args[0]), length)
    if is_op(n, aten.arange):
        a = [val(x) for x in n.args if not isinstance(x, torch.dtype)]
        ends = {1: (0, a[0] if a else None, 1), 2: (a[0], a[1], 1) if len(a) > 1 else None,
                3: tuple(a[:3]) if len(a) > 2 else None}.get(len(a))
        return ends is not None and ends[0] == 0 and ends[2] == 1 and same(ends[1], length)
    return False


def prefix_lengths(ctx: Context, mask: Node, key_len) -> tuple[Optional[Lengths], str]:
    """The lengths of a prefix key-padding mask [.., 1, 1, L] (or [.., L]), or (None, why)."""
    rank = ndim(mask)
    if rank is None or rank > 4:
        return None, "the mask is not a tensor of rank <= 4"
    w = _Walk(ctx)
    found = _keep(w, mask)
    if found is None:
        return None, w.why or "the mask is not provably a key-padding prefix mask (j < length)"
    cmp, polarity = found
    if is_op(cmp, aten.lt, aten.ge):
        j, length, polarity = cmp.args[0], cmp.args[1], polarity == is_op(cmp, aten.lt)
    elif is_op(cmp, aten.gt, aten.le):
        length, j, polarity = cmp.args[0], cmp.args[1], polarity == is_op(cmp, aten.gt)
    else:
        return None, "the mask is not provably a key-padding prefix mask (j < length)"
    if not polarity or not isinstance(j, Node) or not isinstance(length, Node):
        return None, "the mask keeps j >= length, not a prefix"
    s = shape(cmp)
    if len(s) != 2 or not same(s[1], key_len) or _non_one(j) != [ndim(j) - 1] or _non_one(length) not in ([0], []):
        return None, "the mask's comparison is not [rows, L] = arange(L) against lengths[:, None]"
    if ndim(length) != 2 or ndim(j) != 2 or not _arange_of(w, j, key_len):
        return None, "the mask compares against something other than arange(L)"
    lengths = w.down(length)
    v = tensor_val(lengths)
    if v is None or v.dim() != 1 or v.dtype not in (torch.int32, torch.int64):
        return None, "the mask's lengths are not a 1-D int32/int64 tensor"
    if not _mask_dims_ok(mask):
        return None, "the mask varies along heads or queries"
    return Lengths(lengths, w.bc, w.gathers), ""


def _mask_dims_ok(mask: Node) -> bool:
    """The mask's own rank-4 shape (before SDPA expands it) is 1 along heads and queries."""
    n = mask
    while is_op(n, aten.expand, *_SAME) or (is_op(n, aten.slice) and is_op(n.args[0], aten.constant_pad_nd)):
        n = n.args[0] if not is_op(n, aten.slice) else n.args[0].args[0]
    s = (1,) * (4 - ndim(n)) + shape(n)
    return is_one(s[1]) and is_one(s[2])
