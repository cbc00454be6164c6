"""A concat along the reduction axis of a user part (gathered) and a candidate part, and the
weight split that goes with it: ``cat([x_u[idx], x_c], k) @ W == (x_u @ W_u)[idx] + x_c @ W_c``
with ``W_u``, ``W_c`` the weight's columns at the concat's offsets (new constants)."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch.fx import Node

from .broadcast import Broadcast
from .context import Context
from .fx_utils import Builder, aten, get_attr_value, is_op, norm_dim, shape, tensor_val

GPU_DTYPES = (torch.float16, torch.bfloat16)


@dataclasses.dataclass
class Split:
    cat: Node
    dim: int
    broadcast: Broadcast  # the user parts' common row selection
    user: list  # (offset, size, source node at U rows)
    cand: list  # (offset, size, node at B rows)

    @property
    def gathers(self) -> list:
        return [n for n in self.cat.args[0] if n not in [c[2] for c in self.cand]]


def split_concat(ctx: Context, cat: Node) -> tuple[Optional[Split], Optional[str]]:
    """(the split, None), or (None, why not) for a concat with a broadcast part; (None, None)
    for one without."""
    if not is_op(cat, aten.cat):
        return None, None
    parts = list(cat.args[0])
    rank = len(shape(cat) or ())
    dim = norm_dim(cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0), rank)
    bcs = [ctx.broadcast(p) for p in parts]
    if not any(bcs):
        return None, None
    if dim == 0:
        return None, "the concat is along the batch dim"
    keys = {b.key for b in bcs if b is not None}
    if len(keys) > 1:
        return None, "the concat's user parts are gathered by different indices"
    if all(bcs):
        return None, None  # a row-wise concat: hoisting moves it before the gather
    user, cand, off = [], [], 0
    for p, b in zip(parts, bcs):
        k = _static(shape(p)[dim])
        if k is None:
            return None, "a concat part has a dynamic size along the concat dim"
        (user if b is not None else cand).append((off, k, b.source if b is not None else p))
        off += k
    bc = next(b for b in bcs if b is not None)
    return Split(cat, dim, bc, user, cand), None


def _static(size) -> Optional[int]:
    """An int for a size; a symbolic one (``dynamic=True`` makes every size so) is
    specialized, which adds a guard: a model's feature widths are fixed."""
    if isinstance(size, int):
        return size
    try:
        return int(size)
    except Exception:  # marked dynamic on purpose (export's Dim): cannot specialize
        return None


def check_dtypes(split: Split, weight: Node) -> Optional[str]:
    dtypes = {tensor_val(n).dtype for n in [split.cat, weight]}
    if len(dtypes) != 1 or next(iter(dtypes)) not in GPU_DTYPES:
        return f"dtype {', '.join(str(d) for d in dtypes)}: the IKBO ops take fp16 or bf16"
    return None


def padded_columns(ctx: Context, con, split: Split) -> Optional[str]:
    """Where the concat reached the matmul zero-padded along K, the weight is wider than the
    concat: its extra columns meet zeros, and leaving them out is exact if they are finite."""
    w = get_attr_value(ctx.gm, con.weight.target)
    w = w.t() if con.weight_k == "w0" else w
    k = sum(size for _, size, _ in split.user + split.cand)
    if w.shape[1] > k and not torch.isfinite(w[:, k:]).all():
        return "the weight's columns past the zero-padded concat are not finite"
    return None


def weight_columns(ctx: Context, b: Builder, attr: Node, k_label: str, split: Split, name: str,
                   rows: Optional[int] = None):
    """(w_cand, w_user) [out, K_cand] / [out, K_user]: new constants from the weight's columns
    (its first ``rows`` output rows where given)."""
    w = get_attr_value(ctx.gm, attr.target).detach()
    if k_label == "w0":
        w = w.t()
    if rows is not None:
        w = w[:rows]
    cols = lambda spans: torch.cat([w[:, o:o + k] for o, k, _ in spans], dim=1).contiguous()  # noqa: E731
    return b.constant(ctx.gm, f"_ikbo_{name}_w_cand", cols(split.cand)), \
        b.constant(ctx.gm, f"_ikbo_{name}_w_user", cols(split.user))


def joined(b: Builder, spans: list, dim: int) -> Node:
    """One tensor of the parts (a concat where there are several)."""
    nodes = [n for _, _, n in spans]
    return nodes[0] if len(nodes) == 1 else b.call(aten.cat.default, nodes, dim)
