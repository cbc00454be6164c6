"""The attention rewrite: SDPA over gathered K/V (or Q) becomes ``ikbo_fa.attention``; a
key-padding prefix mask becomes ``kv_lengths``; what the op would compute otherwise stays."""
from __future__ import annotations

import math
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ikbo_rewrite
from rewrite_helpers import FakeCudaGraph, TwoSequences, check_close, exported, has

H, L, S_Q = 2, 7, 3


class Target(nn.Module):
    """q per candidate [B, H, S_q, D], k/v per user gathered by idx (layout [U, L, H, D] as stored)."""

    def __init__(self, mode: str = "kv", mask: str = "none", causal=False, dropout=0.0, gqa=False):
        super().__init__()
        self.mode, self.mask, self.causal, self.dropout, self.gqa = mode, mask, causal, dropout, gqa

    def forward(self, q, k, v, idx, lengths):
        t = lambda x: x.transpose(1, 2)  # noqa: E731  [batch, L, H, D] -> [batch, H, L, D]
        if self.mode == "kv":
            q, k, v = t(q), t(k[idx]), t(v[idx])
        else:
            q, k, v = t(q.index_select(0, idx)), t(k), t(v)
        ar = torch.arange(k.shape[2], device=q.device)
        mask = None
        if self.mask == "prefix":  # per user, gathered after the comparison
            keep = ar[None, :] < lengths[:, None]
            mask = (keep[idx] if self.mode == "kv" else keep)[:, None, None, :]
        elif self.mask == "prefix_lengths_gathered":
            mask = (ar[None, :] < lengths[idx][:, None])[:, None, None, :]
        elif self.mask in ("cuda_bias", "cuda_bias_filled"):
            # The float bias CUDA SDPA makes of a bool mask for its efficient kernel: -inf where a key
            # is dropped, expanded to [B, H, S_q, L], padded to a multiple of 16 keys and sliced back.
            keep = (ar[None, :] < lengths[idx][:, None])[:, None, None, :]
            if self.mask == "cuda_bias":
                bias = torch.where(keep.logical_not(), float("-inf"), torch.scalar_tensor(0.0, dtype=q.dtype))
            else:
                bias = torch.zeros_like(keep, dtype=q.dtype).masked_fill(keep.logical_not(), float("-inf"))
            bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
            mask = F.pad(bias, (0, 16 - k.shape[2] % 16))[..., : k.shape[2]]
        elif self.mask == "cudnn_bias":
            # The bias CUDA SDPA makes of a bool mask for its cuDNN kernel: -65504 for a dropped key.
            keep = (ar[None, :] < lengths[idx][:, None])[:, None, None, :]
            mask = torch.where(keep, torch.full((), 0.0, dtype=q.dtype), torch.full((), -65504.0, dtype=q.dtype))
        elif self.mask == "suffix":
            mask = (ar[None, :] >= lengths[idx][:, None])[:, None, None, :]
        elif self.mask == "per_candidate":
            mask = (ar[None, :] < (idx % k.shape[2] + 1)[:, None])[:, None, None, :]
        elif self.mask == "float_additive":
            mask = ((ar[None, :] >= lengths[idx][:, None]).to(q.dtype) * -10000.0)[:, None, None, :]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal, dropout_p=self.dropout,
                                           enable_gqa=self.gqa)
        return o.transpose(1, 2)


def _inputs(mode="kv", B=8, U=3, D=64, h_kv=H, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    qb, kb = (B, U) if mode == "kv" else (U, B)
    q = torch.randn(qb, S_Q, H, D, generator=g).to(dtype)
    k = torch.randn(kb, L, h_kv, D, generator=g).to(dtype)
    v = torch.randn(kb, L, h_kv, D, generator=g).to(dtype)
    idx = torch.randint(0, U, (B,), generator=g)
    lengths = torch.randint(1, L + 1, (kb,), generator=g)  # one per key/value row
    return q, k, v, idx, lengths


@pytest.mark.parametrize("mode, mask", [("kv", "none"), ("kv", "prefix"), ("kv", "prefix_lengths_gathered"),
                                        ("kv", "cuda_bias"), ("kv", "cuda_bias_filled"), ("kv", "cudnn_bias"),
                                        ("q", "none"),
                                        ("q", "prefix")])
@pytest.mark.parametrize("D", [64, 128])
def test_gathered_side_becomes_ikbo_attention(mode, mask, D):
    model = Target(mode, mask)
    args = _inputs(mode, D=D, seed=D)
    module, report = exported(model, args)
    assert report.kinds().count("attention") == 1, str(report)
    assert report.left == [] and not has(module, "scaled_dot_product")
    assert ("kv_lengths" in report.rewrites[-1].detail or any(r.kind == "attention" and "kv_lengths" in r.detail
                                                              for r in report.rewrites)) == (mask != "none")
    check_close(module(*args), model, args)


def test_grouped_query_heads():
    model = Target("kv", "prefix", gqa=True)
    args = _inputs("kv", h_kv=1, seed=4)
    module, report = exported(model, args)
    assert "attention" in report.kinds() and "H 2, H_kv 1" in str(report)
    check_close(module(*args), model, args)


@pytest.mark.parametrize("kwargs, D, dtype, why", [
    (dict(causal=True), 64, torch.bfloat16, "causal"),
    (dict(dropout=0.5), 64, torch.bfloat16, "dropout"),
    (dict(), 96, torch.bfloat16, "head dim 96"),
    (dict(), 64, torch.float32, "fp16 or bf16"),
    (dict(mask="suffix"), 64, torch.bfloat16, "not a prefix"),
    (dict(mask="per_candidate"), 64, torch.bfloat16, "per candidate"),
    (dict(mask="float_additive"), 64, torch.bfloat16, "prefix mask"),
])
def test_what_the_op_would_compute_differently_is_left(kwargs, D, dtype, why):
    model = Target(**kwargs)
    args = _inputs(D=D, dtype=dtype, seed=D + 1)
    module, report = exported(model, args)
    assert "attention" not in report.kinds() and has(module, "scaled_dot_product")
    assert why in str(report), str(report)
    if not kwargs.get("dropout"):
        check_close(module(*args), model, args)


def test_a_random_mask_is_not_a_prefix_mask():
    class Masked(nn.Module):
        def forward(self, q, k, v, idx, mask):
            return F.scaled_dot_product_attention(q, k[idx], v[idx], attn_mask=mask[idx][:, None, None, :])

    g = torch.Generator().manual_seed(9)
    q = torch.randn(6, H, S_Q, 64, generator=g).bfloat16()
    k, v = (torch.randn(2, H, L, 64, generator=g).bfloat16() for _ in range(2))
    mask = torch.rand(2, L, generator=g) > 0.3
    mask[:, 0] = True
    args = (q, k, v, torch.randint(0, 2, (6,), generator=g), mask)
    module, report = exported(Masked(), args)
    assert report.rewrites == [] and "prefix" in str(report.left)
    check_close(module(*args), Masked(), args)


class HandWritten(nn.Module):
    """softmax(q k^T / sqrt(d)) v, written out: Inductor turns it into SDPA before the pass."""

    def forward(self, q, k, v, idx):
        k, v = k[idx], v[idx]
        s = torch.matmul(q, k.transpose(-2, -1)).div(math.sqrt(q.shape[-1]))
        return torch.matmul(s.softmax(dim=-1), v)


def test_hand_written_attention_through_compile():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(11)
    q = torch.randn(9, H, 4, 64, generator=g).bfloat16()
    k, v = (torch.randn(3, H, 16, 64, generator=g).bfloat16() for _ in range(2))
    args = (q, k, v, torch.randint(0, 3, (9,), generator=g))
    model = HandWritten()
    with torch.no_grad():
        compiled = ikbo_rewrite.compile(model)
        out = compiled(*args)
    assert "attention" in compiled.report.kinds(), str(compiled.report)
    check_close(out, model, args)


def _cuda_target_attention(kernel: str, fill: float, L: int = 13, B: int = 8, U: int = 3, H: int = 2, D: int = 64):
    """The post-grad graph Inductor makes on the GPU for DIN's attention (one query per candidate,
    K/V and a key-padding mask gathered from the users): SDPA's cuDNN kernel takes the bool mask
    as a bias of ``fill``, its efficient kernel that bias expanded over heads, padded to a multiple
    of 16 keys and sliced back."""
    aten, bf = torch.ops.aten, torch.bfloat16
    f = FakeCudaGraph()
    q0 = f.input("q", (B, 1, H * D), bf)
    ku, vu = f.input("k_user", (U, L, H * D), bf), f.input("v_user", (U, L, H * D), bf)
    lengths, idx = f.input("lengths", (U,), torch.int64), f.input("idx", (B,), torch.int64)

    def heads(x, rows, seq):
        return f.op(aten.permute.default, f.op(aten.reshape.default, x, [rows, seq, H, D]), [0, 2, 1, 3])

    q = heads(q0, B, 1)
    k, v = heads(f.op(aten.index.Tensor, ku, [idx]), B, L), heads(f.op(aten.index.Tensor, vu, [idx]), B, L)
    j = f.op(aten.unsqueeze.default, f.op(torch.ops.prims.iota.default, L, val=f.empty((L,), torch.int64)), 0)
    keep = f.op(aten.lt.Tensor, j, f.op(aten.unsqueeze.default, lengths, 1))  # [U, L]
    keep = f.op(aten.unsqueeze.default, f.op(aten.unsqueeze.default, f.op(aten.index.Tensor, keep, [idx]), 1), 2)
    zero = f.op(aten.full.default, [], 0.0, val=f.empty((), bf))
    drop = f.op(aten.full.default, [], fill, val=f.empty((), bf))
    bias = f.op(aten.where.self, keep, zero, drop, val=f.empty((B, 1, 1, L), bf))
    if kernel == "cudnn":
        att = f.op(aten._scaled_dot_product_cudnn_attention.default, q, k, v, bias, False)
    else:
        bias = f.op(aten.expand.default, bias, [B, H, 1, L])
        padded = f.op(aten.constant_pad_nd.default, bias, [0, 16 - L % 16])
        bias = f.op(aten.slice.Tensor, padded, -1, 0, L)
        att = f.op(aten._scaled_dot_product_efficient_attention.default, q, k, v, bias, False)
    o = f.op(aten.permute.default, f.op(operator.getitem, att, 0), [0, 2, 1, 3])
    return f.module(f.op(aten.reshape.default, o, [B, H * D]))


@pytest.mark.parametrize("kernel", ["cudnn", "efficient"])
@pytest.mark.parametrize("fill", [-65536.0, float("-inf")])  # bf16's -65504, and -inf
def test_cuda_sdpa_kernels_with_a_mask_bias_become_ikbo_attention(kernel, fill):
    gm = _cuda_target_attention(kernel, fill)
    report = ikbo_rewrite.rewrite(gm)
    assert report.kinds().count("attention") == 1 and report.left == [], str(report)
    assert "kv_lengths from the key-padding mask" in str(report)
    assert not has(gm, "scaled_dot_product")
    (att,) = [n for n in gm.graph.nodes if "ikbo_fa.attention" in str(n.target)]
    kv_lengths = att.args[4]
    assert kv_lengths.op == "placeholder" and kv_lengths.target == "lengths", kv_lengths  # per user, no gather


@pytest.mark.parametrize("kernel", ["cudnn", "efficient"])
def test_cuda_sdpa_kernels_with_a_soft_bias_stay(kernel):
    gm = _cuda_target_attention(kernel, -1000.0)
    report = ikbo_rewrite.rewrite(gm)
    assert "attention" not in report.kinds() and has(gm, "scaled_dot_product")
    assert any("not provably a key-padding prefix mask" in r for left in report.left for r in left.reasons), str(report)


@pytest.mark.parametrize("mask, third_s_q, D", [(False, False, 64), (True, False, 64), (False, True, 64),
                                                 (True, False, 128)])
def test_calls_on_one_index_share_a_work_list(mask, third_s_q, D):
    g = torch.Generator().manual_seed(11)
    B, U = 9, 3
    q = torch.randn(B, S_Q, H, D, generator=g).bfloat16()
    k1, v1 = (torch.randn(U, L, H, D, generator=g).bfloat16() for _ in range(2))
    k2, v2 = (torch.randn(U, L + 4, H, D, generator=g).bfloat16() for _ in range(2))
    idx = torch.randint(0, U, (B,), generator=g)
    lengths = torch.randint(1, L + 1, (U,), generator=g)
    args = (q, k1, v1, k2, v2, idx, lengths)
    model = TwoSequences(mask, third_s_q)
    module, report = exported(model, args)
    assert report.kinds().count("attention") == 2 + third_s_q, str(report)
    nodes = [n for n in module.graph.nodes if n.op == "call_function"]
    built = [n for n in nodes if n.target is torch.ops.ikbo_fa.work_list.default]
    calls = [n for n in nodes if n.target is torch.ops.ikbo_fa.attention.default]
    assert len(built) == 1 and len(calls) == 2 + third_s_q
    with_list = [c for c in calls if len(c.args) > 8]
    assert len(with_list) == 2 and all(c.args[10] == S_Q for c in with_list)
    assert (built[0].args[3] is not None) == mask  # ordered by the first call's lengths where masked
    # D 64: the list counts the tiles of the calls' D and H (192 rows where those pay), and the
    # calls take its rows as chosen (0); other D: 128-row tiles, as every call runs
    assert tuple(built[0].args[7:]) == ((64, H) if D == 64 else ())
    assert all(c.args[-1] == (0 if D == 64 else 128) for c in with_list)
    assert str(report).count("one work list for the calls on this index") == 2
    check_close(module(*args), model, args)


def test_shared_work_list_through_compile():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(12)
    q = torch.randn(9, S_Q, H, 64, generator=g).bfloat16()
    k1, v1, k2, v2 = (torch.randn(3, L, H, 64, generator=g).bfloat16() for _ in range(4))
    args = (q, k1, v1, k2, v2, torch.randint(0, 3, (9,), generator=g), torch.randint(1, L + 1, (3,), generator=g))
    model = TwoSequences(mask=True)
    with torch.no_grad():
        compiled = ikbo_rewrite.compile(model)
        out = compiled(*args)
    assert str(compiled.report).count("one work list for the calls on this index") == 2, str(compiled.report)
    check_close(out, model, args)
    torch._dynamo.reset()


def test_symbolic_head_dim_under_dynamic_compile():
    """``compile(dynamic=True)`` makes every input dim a symbol, the head dim included (the graphs
    the GPU sees too): the pass guards it to its value where that is 64 or 128 and rewrites; the
    batch and sequence dims stay symbols (one graph for two batch sizes), and another head dim
    recompiles and stays as written."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(13)
    model = TwoSequences(mask=True)
    compiled = ikbo_rewrite.compile(model, dynamic=True)

    def inputs(B, U, D):
        q = torch.randn(B, 1, H, D, generator=g).bfloat16()
        k1, v1 = (torch.randn(U, L, H, D, generator=g).bfloat16() for _ in range(2))
        k2, v2 = (torch.randn(U, L + 9, H, D, generator=g).bfloat16() for _ in range(2))
        idx = torch.randint(0, U, (B,), generator=g)
        return q, k1, v1, k2, v2, idx, torch.randint(1, L + 1, (U,), generator=g)

    with torch.no_grad():
        for B, U in ((11, 3), (17, 5)):
            args = inputs(B, U, 64)
            check_close(compiled(*args), model, args)
        report = str(compiled.report)
        assert len(compiled.reports) == 1 and compiled.report.kinds().count("attention") == 2, report
        assert "D 64" in report and report.count("one work list for the calls on this index") == 2, report
        assert compiled.report.left == [], report
        args = inputs(7, 2, 32)
        check_close(compiled(*args), model, args)
    assert len(compiled.reports) == 2 and "attention" not in compiled.report.kinds()
    assert "head dim" in str(compiled.report) and "cannot be guarded" not in str(compiled.report)
    torch._dynamo.reset()


def _flash_graph_with_symbols(D):
    """The post-grad graph of target attention that ``compile(dynamic=True)`` makes on the GPU
    (SDPA's flash kernel): every input size a symbol, the head dim's value ``D``."""
    f = FakeCudaGraph()
    bf = torch.bfloat16
    q = f.input("q", (("B", 40), ("H", 2), 1, ("D", D)), bf)
    k, v = (f.input(x, (("U", 3), ("H", 2), ("L", 200), ("D", D)), bf) for x in ("k", "v"))
    idx = f.input("idx", (("B", 40),), torch.int64)
    kg, vg = f.op(torch.ops.aten.index.Tensor, k, [idx]), f.op(torch.ops.aten.index.Tensor, v, [idx])
    outs = tuple(f.empty((), torch.float32) for _ in range(9))
    att = f.op(torch.ops.aten._scaled_dot_product_flash_attention.default, q, kg, vg, val=outs)
    return f, f.module(f.op(operator.getitem, att, 0, val=q.meta["val"]))


@pytest.mark.parametrize("D", [64, 128])
def test_symbolic_head_dim_in_the_gpu_graph_is_guarded(D):
    from ikbo_rewrite.passes import run

    f, gm = _flash_graph_with_symbols(D)
    report = run(gm, guards=True)
    assert report.kinds() == ["attention"] and report.left == [], str(report)
    assert f"D {D}" in str(report)
    guards = [str(g.expr) for g in f.shape_env.guards]
    assert len(guards) == 1 and guards[0].startswith("Eq(s") and guards[0].endswith(f", {D})"), guards


def test_symbolic_head_dim_without_guards_or_of_another_value_is_left():
    f, gm = _flash_graph_with_symbols(128)
    report = ikbo_rewrite.rewrite(gm)  # an ATen graph given as it is: no guards
    assert report.rewrites == [] and "cannot be guarded" in str(report), str(report)
    from ikbo_rewrite.passes import run

    f, gm = _flash_graph_with_symbols(96)
    report = run(gm, guards=True)
    assert report.rewrites == [] and "head dim" in str(report) and not f.shape_env.guards, str(report)
