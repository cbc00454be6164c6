"""Finding broadcasts: a tensor whose rows (dim 0) are rows of another tensor chosen by an
integer index of another batch, ``out[b] = src[idx[b]]``.

The user and candidate batches are told apart by the gather itself, not by symbols: its
input is the user side (U rows) and its output the candidate side (B rows). An index
gather is a broadcast even when U and B have one symbol or U is the constant 1. Forms:

- ``aten.index.Tensor(src, [idx])`` (``src[idx]``; also ``index_select`` after grad passes),
- ``aten.index_select(src, 0, idx)``,
- ``aten.embedding(src, idx)`` (``F.embedding(idx, src)`` of a 2-D table that is not a weight
  the graph holds),
- ``aten.gather(src, 0, idx expanded over the other dims)``,
- ``src.unsqueeze(1).expand(U, r, ...).reshape(U * r, ...)``: equal groups, user-major
  (``repeat_interleave(r)``), and ``src.unsqueeze(0).expand(r, U, ...)...``: ``repeat``;
  their index (``arange // r`` or ``arange % U``) is built only where a rewrite needs it.

``repeat_interleave(counts, output_size=B)`` produces an index tensor and an index gather,
so it is the first form.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Optional

import torch
from torch.fx import Graph, Node

from .fx_utils import (Builder, RESHAPES, aten, example_value, is_constant, is_one, is_op, ndim, norm_dim, same, shape,
                       tensor_val)

INDEX_DTYPES = (torch.int32, torch.int64)
_PASS_THROUGH = (aten.clone, aten.alias, aten.contiguous)


@dataclasses.dataclass
class Broadcast:
    node: Node  # the gathered tensor [B, ...]
    source: Node  # the per-user tensor [U, ...]
    form: str
    index: Optional[Node] = None  # idx [B] where the graph has it
    groups: Optional[tuple] = None  # ("interleave" | "tile", r, U) or ("counts", counts, B)

    @property
    def key(self):
        """Equal keys: provably the same row selection."""
        return ("index", self.index) if self.index is not None else self.groups

    def with_node(self, node: Node, source: Node) -> "Broadcast":
        return dataclasses.replace(self, node=node, source=source)


def _index_ok(idx, batch) -> bool:
    v = tensor_val(idx)
    return v is not None and v.dtype in INDEX_DTYPES and v.dim() == 1 and same(v.shape[0], batch)


def _at_most(a, b) -> bool:
    """Size ``a`` <= size ``b``, by their values where symbolic (True where one has none)."""
    a, b = (x if isinstance(x, int) else example_value(x) for x in (a, b))
    return a is None or b is None or a <= b


def _strip(n: Node, targets) -> Node:
    while is_op(n, *targets):
        n = n.args[0]
    return n


def _gather_index(index: Node, out_shape) -> Optional[Node]:
    """The 1-D index behind ``gather``'s index when it only varies along dim 0."""
    n = _strip(index, (aten.expand, *_PASS_THROUGH))
    while is_op(n, aten.unsqueeze, *RESHAPES) and ndim(n.args[0]) is not None:
        inner = n.args[0]
        if is_op(n, aten.unsqueeze) and norm_dim(n.args[1], ndim(n)) == 0:
            return None
        if not is_op(n, aten.unsqueeze) and not same(shape(n)[0], shape(inner)[0]):
            return None
        n = inner
    if ndim(n) != 1 or not _index_ok(n, out_shape[0]):
        return None
    return n


def _expand_groups(n: Node) -> Optional[tuple]:
    """(source, ("interleave" | "tile", r, U)) for reshape(expand(unsqueeze(src))) merging
    the expanded dim into dim 0."""
    if not is_op(n, *RESHAPES):
        return None
    e = _strip(n.args[0], _PASS_THROUGH)
    if not is_op(e, aten.expand):
        return None
    u = e.args[0]
    if not is_op(u, aten.unsqueeze) or shape(u) is None:
        return None
    src, d = u.args[0], norm_dim(u.args[1], ndim(u))
    s_src, s_e, s_out = shape(src), shape(e), shape(n)
    if d not in (0, 1) or len(s_src) < 1 or len(s_out) != len(s_src):
        return None
    if not all(same(a, b) for a, b in zip(s_e[2:], s_src[1:])) or not all(same(a, b) for a, b in zip(s_out[1:], s_src[1:])):
        return None
    r = s_e[d]
    if not same(s_out[0], s_src[0] * r) or is_one(r):
        return None
    return src, ("interleave" if d == 1 else "tile", r, s_src[0])


def as_broadcast(n: Node) -> Optional[Broadcast]:
    """The broadcast ``n`` computes, or None."""
    s = shape(n)
    if not s:
        return None
    if is_op(n, aten.index) and len(n.args[1]) == 1 and n.args[1][0] is not None:
        src, idx = n.args[0], n.args[1][0]
        if ndim(src) and _index_ok(idx, s[0]):
            return Broadcast(n, src, "index", index=idx)
    if is_op(n, aten.embedding) and ndim(n.args[0]) == 2 and not is_constant(n.args[0]):
        # F.embedding(idx, table) is table[idx] (padding_idx only masks the gradient). A table the
        # graph holds (nn.Embedding's weight), or one with more rows than lookups (a weight passed
        # in, as without freezing), is a vocabulary: work hoisted onto it would run at its size.
        if _index_ok(n.args[1], s[0]) and _at_most(shape(n.args[0])[0], s[0]):
            return Broadcast(n, n.args[0], "embedding", index=n.args[1])
    if is_op(n, aten.index_select) and ndim(n.args[0]) and norm_dim(n.args[1], ndim(n.args[0])) == 0:
        if _index_ok(n.args[2], s[0]):
            return Broadcast(n, n.args[0], "index_select", index=n.args[2])
    if is_op(n, aten.gather) and ndim(n.args[0]) and norm_dim(n.args[1], ndim(n.args[0])) == 0:
        src = n.args[0]
        if ndim(src) == len(s) and all(same(a, b) for a, b in zip(shape(src)[1:], s[1:])):
            idx = _gather_index(n.args[2], s)
            if idx is not None:
                return Broadcast(n, src, "gather", index=idx)
    if is_op(n, aten.repeat_interleave) and n.args and ndim(n.args[0]) and len(n.args) > 2:
        src, repeats, dim = n.args[0], n.args[1], norm_dim(n.args[2], ndim(n.args[0]))
        if dim == 0 and isinstance(repeats, Node) and _index_ok(repeats, shape(src)[0]):
            return Broadcast(n, src, "repeat_interleave", groups=("counts", repeats, s[0]))
        if dim == 0 and isinstance(repeats, int) and repeats > 1:
            return Broadcast(n, src, "repeat_interleave", groups=("interleave", repeats, shape(src)[0]))
    found = _expand_groups(n)
    if found is not None and not is_constant(found[0]):
        return Broadcast(n, found[0], "expand+reshape", groups=found[1])
    return None


def find_broadcasts(graph: Graph) -> dict:
    """node -> Broadcast for every broadcast in the graph."""
    found = {}
    for n in graph.nodes:
        b = as_broadcast(n)
        if b is not None:
            found[n] = b
    return found


def index_node(bc: Broadcast, builder: Builder) -> Node:
    """``idx`` [B] of a broadcast; for the expand forms, built (int64) before the builder's anchor."""
    if bc.index is not None:
        return bc.index
    how, r, _ = bc.groups
    batch = builder.size(bc.node, 0)
    if how == "counts":  # repeat_interleave(counts, output_size=B)
        return builder.call(aten.repeat_interleave.Tensor, r, output_size=batch)
    users = builder.size(bc.source, 0)
    ar = builder.call(aten.arange.default, batch, dtype=torch.int64, device=tensor_val(bc.source).device)
    if how == "tile":
        return builder.call(aten.remainder.Scalar, ar, users)
    if not isinstance(r, int):  # r = B / U, from the graph's own sizes
        r = builder.call(operator.floordiv, batch, users)
    return builder.call(aten.div.Tensor_mode, ar, r, rounding_mode="floor")
