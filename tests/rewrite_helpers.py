"""Shared pieces of the ikbo_rewrite tests: float64 references, bf16 tolerances, the pass
applied through export (fast, no Inductor) or compile, a model of two attention calls on one
index, and attention as models write it out (hand-written, SDPA with a finite mask)."""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import Graph, GraphModule, Node

import ikbo_rewrite


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def reference64(model: torch.nn.Module, args) -> torch.Tensor:
    """The model as written, in float64 (same weights), on float64 copies of the inputs."""
    m64 = copy.deepcopy(model).double()
    args64 = [a.double() if a.is_floating_point() else a for a in args]
    with torch.no_grad():
        return m64(*args64)


def check_close(out: torch.Tensor, model: torch.nn.Module, args, tol: float = 2e-2) -> None:
    """``out`` (the rewritten model's) is as close to the float64 reference as the model as
    written is, within bf16's tolerance."""
    ref = reference64(model, args)
    with torch.no_grad():
        base = rel_err(model(*args), ref)
    err = rel_err(out, ref)
    assert err <= max(tol, 3 * base), (err, base)


def exported(model, args, dynamic_shapes=None):
    with torch.no_grad():
        return ikbo_rewrite.export(model, args, dynamic_shapes=dynamic_shapes)


def targets(module) -> list:
    return [str(n.target) for n in module.graph.nodes if n.op == "call_function"]


def has(module, name: str) -> bool:
    return any(name in t for t in targets(module))


def bf16(*tensors):
    return [t.bfloat16() if t.is_floating_point() else t for t in tensors]


class FakeCudaGraph:
    """An ATen graph of CUDA tensors built node by node on a machine without a GPU (fake
    tensors), to give the pass the graphs Inductor makes on the GPU. ``op`` computes a node's
    value under the fake mode, or takes ``val`` where an op's fake kernel needs a real device.
    A size given as ``(name, value)`` is a symbol of that value, as ``compile(dynamic=True)``
    makes every input size (one symbol per name)."""

    def __init__(self):
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        self.shape_env = ShapeEnv()
        self.mode = FakeTensorMode(shape_env=self.shape_env)
        self.graph = Graph()
        self.symbols = {}

    def size(self, s):
        if not isinstance(s, tuple):
            return s
        from torch._dynamo.source import ConstantSource
        from torch.fx.experimental.symbolic_shapes import DimDynamic

        name, value = s
        if name not in self.symbols:
            expr = self.shape_env.create_symbol(value, ConstantSource(name), dynamic_dim=DimDynamic.DYNAMIC)
            self.symbols[name] = self.shape_env.create_symintnode(expr, hint=value)
        return self.symbols[name]

    def empty(self, shape, dtype) -> torch.Tensor:
        with self.mode:
            return torch.empty([self.size(s) for s in shape], dtype=dtype, device="cuda")

    def symbol(self, name: str, value: int) -> Node:
        """A size as the graph's input (Inductor passes each symbol the graph reads as one)."""
        n = self.graph.placeholder(f"sym_{name}")
        n.meta["val"] = self.size((name, value))
        return n

    def input(self, name: str, shape, dtype) -> Node:
        n = self.graph.placeholder(name)
        n.meta["val"] = self.empty(shape, dtype)
        return n

    def op(self, target, *args, val=None) -> Node:
        n = self.graph.call_function(target, args)
        if val is None:
            fake = torch.fx.node.map_aggregate(args, lambda a: a.meta["val"] if isinstance(a, Node) else a)
            with self.mode:
                val = target(*fake)
        n.meta["val"] = val
        return n

    def module(self, out: Node) -> GraphModule:
        self.graph.output(out)
        return GraphModule(torch.nn.Module(), self.graph)


class TwoSequences(torch.nn.Module):
    """Two behaviour sequences of the same users (clicks, purchases), each attended by the same
    candidates' queries: two SDPA calls over K/V gathered by one idx."""

    def __init__(self, mask: bool = False, third_s_q: bool = False):
        super().__init__()
        self.mask, self.third_s_q = mask, third_s_q

    def forward(self, q, k1, v1, k2, v2, idx, lengths):
        t = lambda x: x.transpose(1, 2)  # noqa: E731  [batch, L, H, D] -> [batch, H, L, D]
        outs = []
        for k, v in ((k1, v1), (k2, v2)):
            mask = None
            if self.mask:
                ar = torch.arange(k.shape[1], device=q.device)
                mask = (ar[None, :] < lengths[idx][:, None])[:, None, None, :]
            outs.append(F.scaled_dot_product_attention(t(q), t(k[idx]), t(v[idx]), attn_mask=mask))
        if self.third_s_q:  # one query row per candidate: another S_q, its own work list
            outs.append(F.scaled_dot_product_attention(t(q[:, :1]), t(k1[idx]), t(v1[idx])).expand_as(outs[0]))
        return sum(o.transpose(1, 2) for o in outs)


class HandWritten(nn.Module):
    """q [B, H, S_q, D] per candidate; k, v [U, H, L, D] per user, gathered by idx; a key-padding
    mask from the users' lengths, spelled as ``mask``."""

    def __init__(self, mask: str = "none"):
        super().__init__()
        self.mask = mask

    def forward(self, q, k, v, idx, lengths):
        k, v = k[idx], v[idx]
        if self.mask == "scaled_after_masking":  # the scale applies to the fill too
            keep = (torch.arange(k.shape[2], device=q.device)[None, :] < lengths[idx][:, None])[:, None, None, :]
            scores = (q @ k.transpose(-2, -1)).masked_fill(~keep, -1e9) * q.shape[-1] ** -0.5
            return F.softmax(scores, dim=-1) @ v
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        keep = (torch.arange(k.shape[2], device=q.device)[None, :] < lengths[idx][:, None])[:, None, None, :]
        if self.mask == "masked_fill_inf":
            scores = scores.masked_fill(~keep, float("-inf"))
        elif self.mask == "masked_fill_1e9":
            scores = scores.masked_fill(keep == 0, -1e9)
        elif self.mask == "where_min":
            scores = torch.where(keep, scores, torch.finfo(scores.dtype).min)
        elif self.mask == "bias_1e9":
            scores = scores + (~keep).to(scores.dtype) * -1e9
        elif self.mask == "bias_min":
            scores = scores + (1.0 - keep.to(scores.dtype)) * torch.finfo(scores.dtype).min
        elif self.mask == "soft":
            scores = scores.masked_fill(~keep, -1e4)
        elif self.mask == "causal":
            later = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(later, float("-inf"))
        return F.softmax(scores, dim=-1) @ v


class SdpaFiniteMask(nn.Module):
    """SDPA with the additive key-padding mask DIN-style code writes (-1e9 for a padded key)."""

    def forward(self, q, k, v, idx, lengths):
        keep = torch.arange(k.shape[2], device=q.device)[None, :] < lengths[:, None]
        bias = (~keep).to(q.dtype)[idx][:, None, None, :] * -1e9
        return F.scaled_dot_product_attention(q, k[idx], v[idx], attn_mask=bias)
