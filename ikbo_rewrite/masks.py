"""Key-padding masks that are prefix masks: ``keep[r, j] = j < lengths[r]``, however the
model and SDPA's own decomposition spell it (a bool mask; ``where(keep, 0, -inf)``;
``masked_fill(0, ~keep, -inf)``; ``(~keep).to(dtype) * -1e9``, ``(1 - keep.to(dtype)) * fill``;
``keep == 0``; any fill <= -65504, as CUDA SDPA's cuDNN kernel takes -inf; ``~(j >= lengths)``;
unsqueezed, expanded, padded to an aligned width and sliced back; gathered to the candidates
before or after the comparison).
Anything else is not proven a prefix mask and the attention is left as it is."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch.fx import Node

from .context import Context
from .fx_utils import RESHAPES, SAME, aten, get_attr_value, is_one, is_op, ndim, norm_dim, same, shape, tensor_val, val

_ARANGES = (aten.arange, torch.ops.prims.iota)


@dataclasses.dataclass
class Lengths:
    node: Node  # 1-D integer lengths
    broadcast: object  # the Broadcast crossed on the way (lengths then per user), or None
    gathers: list  # the gathers crossed (the rewrite makes them dead)
    fills: list  # the values that drop a key (-inf, or finite: see finite_fill)

    @property
    def finite_fill(self) -> Optional[float]:
        """A finite value that drops keys, where the mask has one: eager then gives a row without
        keys the mean of its V rows (a softmax over equal scores), not 0. SDPA's own bias of a
        bool mask (-65504 for its cuDNN kernel) is not one."""
        finite = [f for f in self.fills if f != float("-inf") and f not in _SDPA_FILLS]
        return finite[0] if finite else None


def _scalar(n, ctx: Optional[Context] = None) -> Optional[float]:
    """The one value of a number or a constant tensor (a full / zeros tensor of any shape, a
    scalar tensor, a held constant whose elements are all equal), else None."""
    if isinstance(n, (int, float)):
        return float(n)
    if is_op(n, aten.full, aten.full_like):
        return _scalar(n.args[1])
    if is_op(n, aten.zeros, aten.zeros_like, aten.new_zeros):
        return 0.0
    if is_op(n, aten.scalar_tensor):
        return float(n.args[0])
    if ctx is not None and isinstance(n, Node) and n.op == "get_attr":
        t = get_attr_value(ctx.gm, n.target)
        if isinstance(t, torch.Tensor) and t.numel() and t.is_floating_point():
            first = t.reshape(-1)[0]
            if bool((t == first).all()) or (bool(torch.isnan(first)) and bool(torch.isnan(t).all())):
                return float(first)
    return None


def _non_one(n: Node) -> list:
    return [i for i, s in enumerate(shape(n)) if not is_one(s)]


class _Walk:
    def __init__(self, ctx: Context):
        self.ctx, self.bc, self.gathers, self.why = ctx, None, [], None
        self.stop = None  # where the walk found no mask spelling it knows (for the report)
        self.fills = []  # the drop values met

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
        if is_op(n, aten._to_copy, torch.ops.prims.convert_element_type):
            # A float cast keeps 0 and -inf (a bool -> float cast would not: not crossed).
            before, after = tensor_val(n.args[0]), tensor_val(n)
            if before is not None and after is not None and before.is_floating_point() and after.is_floating_point():
                return n.args[0]
            return None
        if is_op(n, *SAME, aten.expand, aten.unsqueeze, aten.squeeze, *RESHAPES):
            inner = n.args[0]
            if is_op(n, *RESHAPES) and [shape(n)[i] for i in _non_one(n)] != [shape(inner)[i] for i in _non_one(inner)]:
                return None
            return inner
        if is_op(n, aten.slice) and norm_dim(n.args[1], ndim(n)) == ndim(n) - 1:
            inner = n.args[0]
            if _right_pad(inner):
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


# The bias SDPA makes of a bool mask drops a key with -inf, or (cuDNN's kernel) with -65504,
# fp16's lowest value, which bf16 rounds to -65536: either weighs that key exp(-65504) = 0 in
# fp32 next to any kept key. A bias of a smaller magnitude is a soft mask, not a dropped key.
_DROP_AT = -65504.0
_SDPA_FILLS = (-65504.0, -65536.0)


def drops(x: Optional[float]) -> bool:
    return x is not None and x <= _DROP_AT


def _drop(w: _Walk, x: Optional[float]) -> bool:
    if drops(x):
        w.fills.append(x)
        return True
    return False


def _scalar_arg(w: _Walk, x) -> Optional[float]:
    """A number, or a 0-d constant node's value."""
    if isinstance(x, Node):
        v = tensor_val(x)
        return _scalar(w.down(x), w.ctx) if v is not None and v.dim() == 0 else None
    return _scalar(x)


def _ones_where(w: _Walk, n: Node):
    """(bool node, polarity) for a float tensor that is 1 where the bool equals polarity and 0
    elsewhere (a cast of a bool, or 1 minus one), else None."""
    n = w.down(n)
    one_minus = None
    if is_op(n, aten.rsub) and len(n.args) == 2 and _scalar(n.args[1], w.ctx) == 1.0:
        one_minus = n.args[0]
    elif is_op(n, aten.sub) and len(n.args) == 2 and _scalar_arg(w, n.args[0]) == 1.0:
        one_minus = n.args[1]
    if one_minus is not None:
        inner = _ones_where(w, one_minus)
        return None if inner is None else (inner[0], not inner[1])
    if is_op(n, torch.ops.prims.convert_element_type, aten._to_copy, aten.to):
        inner = tensor_val(n.args[0])
        if inner is not None and inner.dtype == torch.bool:
            return _keep(w, n.args[0])
    return None


def _keep(w: _Walk, n: Node):
    """(bool node, polarity): scores are kept where the bool node equals polarity."""
    n = w.down(n)
    w.stop = n
    v = tensor_val(n)
    if v is None:
        return None
    if v.dtype == torch.bool:
        if is_op(n, aten.logical_not, aten.bitwise_not):
            inner = _keep(w, n.args[0])
            return None if inner is None else (inner[0], not inner[1])
        if is_op(n, aten.eq, aten.ne) and len(n.args) == 2 and _scalar_arg(w, n.args[1]) in (0.0, 1.0):
            # mask == 0, mask != 0, mask == 1 of a bool mask or of its 0/1 cast
            t = tensor_val(n.args[0])
            inner = _keep(w, n.args[0]) if t is not None and t.dtype == torch.bool else _ones_where(w, n.args[0])
            flip = is_op(n, aten.eq) == (_scalar_arg(w, n.args[1]) == 0.0)
            return None if inner is None else (inner[0], inner[1] != flip)
        return n, True
    if is_op(n, aten.where):
        a, b = (_scalar(w.down(x), w.ctx) if isinstance(x, Node) else _scalar(x) for x in n.args[1:3])
        if a == 0.0 and _drop(w, b):
            inner = _keep(w, n.args[0])
        elif b == 0.0 and _drop(w, a):
            inner = _keep(w, n.args[0])
            inner = None if inner is None else (inner[0], not inner[1])
        else:
            return None
        return inner
    if (is_op(n, aten.masked_fill) and _scalar(w.down(n.args[0]), w.ctx) == 0.0
            and _drop(w, _scalar(n.args[2], w.ctx))):
        inner = _keep(w, n.args[1])
        return None if inner is None else (inner[0], not inner[1])
    if is_op(n, aten.mul) and len(n.args) == 2:
        # (~keep).to(dtype) * -1e9, (1 - keep.to(dtype)) * finfo.min: a bias that drops where it is 1.
        for t, c in (n.args, n.args[::-1]):
            if isinstance(t, Node) and tensor_val(t) is not None and tensor_val(t).dim() > 0:
                if _drop(w, _scalar_arg(w, c)):
                    inner = _ones_where(w, t)
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


def prefix_lengths(ctx: Context, mask: Node, key_len, drop: bool = False) -> tuple[Optional[Lengths], str]:
    """The lengths of a prefix key-padding mask [.., 1, 1, L] (or [.., L]), or (None, why).
    ``drop``: a bool mask that drops the keys where it is True (``masked_fill``'s)."""
    rank = ndim(mask)
    if rank is None or rank > 4:
        return None, "the mask is not a tensor of rank <= 4"
    w = _Walk(ctx)
    found = _keep(w, mask)
    if found is not None and drop:
        found = (found[0], not found[1])
    if found is None:
        at = f" (no known spelling at {getattr(w.stop, 'target', w.stop)})" if w.stop is not None else ""
        return None, w.why or f"the mask is not provably a key-padding prefix mask (j < length){at}"
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
    if not _mask_dims_ok(ctx, mask):
        return None, "the mask varies along heads or queries"
    return Lengths(lengths, w.bc, w.gathers, w.fills), ""


def _right_pad(n) -> bool:
    """A constant pad of the last dim on its right only (``constant_pad_nd``, or ``pad`` before
    decomposition), as SDPA's efficient kernel pads its mask to an aligned width."""
    if is_op(n, aten.constant_pad_nd):
        return len(n.args[1]) == 2 and n.args[1][0] == 0
    if is_op(n, aten.pad):
        mode = n.args[2] if len(n.args) > 2 else n.kwargs.get("mode", "constant")
        return mode == "constant" and len(n.args[1]) == 2 and n.args[1][0] == 0
    return False


def _mask_dims_ok(ctx: Context, mask: Node) -> bool:
    """The mask's own rank-4 shape (before SDPA expands it) is 1 along heads and queries. A
    gather along dim 0 is crossed: the expand may have been hoisted before it."""
    n = mask
    while True:
        bc = ctx.broadcast(n)
        if bc is not None:
            n = bc.source
        elif is_op(n, aten.expand, *SAME):
            n = n.args[0]
        elif is_op(n, aten.slice) and _right_pad(n.args[0]):
            n = n.args[0].args[0]
        else:
            break
    s = (1,) * (4 - ndim(n)) + shape(n)
    return is_one(s[1]) and is_one(s[2])
