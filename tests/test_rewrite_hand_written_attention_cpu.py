"""Hand-written attention, softmax(q k^T * scale + mask) v, becomes ``ikbo_fa.attention`` in
exported graphs and under ``compile(dynamic=True)``, with the key-padding masks models write
(masked_fill, where, an additive bias); a finite fill keeps eager's result for users without
keys (the mean of their V rows); what is left names the attention and why."""
from __future__ import annotations

import operator

import pytest
import torch

import ikbo_rewrite
from rewrite_helpers import FakeCudaGraph, HandWritten, SdpaFiniteMask, check_close, exported, has

H, S_Q, L, D = 2, 3, 11, 64


def _inputs(B, U, seed, empty_user=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S_Q, D, generator=g).bfloat16()
    k, v = (torch.randn(U, H, L, D, generator=g).bfloat16() for _ in range(2))
    idx = torch.randint(0, U, (B,), generator=g)
    lengths = torch.randint(1, L + 1, (U,), generator=g)
    if empty_user:  # a user without keys, with candidates
        lengths[idx[0]] = 0
    return q, k, v, idx, lengths


FINITE = ["masked_fill_1e9", "where_min", "bias_1e9", "bias_min", "scaled_after_masking"]


@pytest.mark.parametrize("mask", ["none", "masked_fill_inf"] + FINITE)
def test_hand_written_attention_through_export(mask):
    model = HandWritten(mask)
    finite = mask in FINITE
    args = _inputs(9, 3, seed=len(mask), empty_user=finite)
    module, report = exported(model, args)
    assert report.kinds().count("attention") == 1 and report.left == [], str(report)
    assert not has(module, "softmax") and not has(module, "matmul")
    detail = str(report)
    assert ("kv_lengths from the key-padding mask" in detail) == (mask != "none")
    assert ("a row without keys gets the mean of its V rows" in detail) == finite, detail
    out = module(*args)
    check_close(out, model, args)
    if finite:  # the user without keys: eager's uniform weights over its padded keys
        with torch.no_grad():
            ref = model(*args)
        empty = args[4][args[3]] == 0
        assert empty.any()
        torch.testing.assert_close(out[empty].float(), ref[empty].float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("mask", ["masked_fill_inf", "masked_fill_1e9"])
def test_hand_written_attention_under_dynamic_compile(mask):
    torch._dynamo.reset()
    model = HandWritten(mask)
    compiled = ikbo_rewrite.compile(model, dynamic=True)
    with torch.no_grad():
        for B, U, seed in ((9, 4, 1), (14, 5, 2)):
            args = _inputs(B, U, seed, empty_user=mask == "masked_fill_1e9")
            check_close(compiled(*args), model, args)
    report = compiled.report
    assert len(compiled.reports) == 1 and report.kinds().count("attention") == 1, str(report)
    assert report.left == [] and "D 64" in str(report), str(report)
    torch._dynamo.reset()


@pytest.mark.parametrize("mask, why", [
    ("soft", "a soft mask"),
    ("causal", "not provably a key-padding prefix mask"),
])
def test_what_is_left_names_the_hand_written_attention(mask, why):
    model = HandWritten(mask)
    args = _inputs(8, 3, seed=7)
    module, report = exported(model, args)
    assert "attention" not in report.kinds() and has(module, "softmax")
    reasons = [r for left in report.left for r in left.reasons]
    assert any("hand-written softmax(q k^T) v" in r and why in r for r in reasons), str(report)
    check_close(module(*args), model, args)


def test_sdpa_with_a_finite_mask_keeps_eager_for_users_without_keys():
    model = SdpaFiniteMask()
    args = _inputs(10, 3, seed=21, empty_user=True)
    module, report = exported(model, args)
    assert report.kinds().count("attention") == 1, str(report)
    assert "mean of its V rows" in str(report)
    out = module(*args)
    with torch.no_grad():
        ref = model(*args)
    empty = args[4][args[3]] == 0
    torch.testing.assert_close(out[empty].float(), ref[empty].float(), atol=2e-2, rtol=2e-2)
    check_close(out, model, args)


def _gpu_graph(softmax: str, D: int = 64):
    """The post-grad graph ``compile(dynamic=True)`` makes on the GPU of the unmasked
    ``softmax(q k^T / sqrt(d)) v``, every size a symbol: both matmuls as bmm between expands and
    reshapes, and the scaled softmax as Inductor's joint-graph pass writes it:

    - "stable": (x * s - amax(x * s)) / (s * c), s the sign of c = sqrt(d) (older torch; newer
      torch where the scale is known safe);
    - "symfloat": that form with c a symbolic float (s a number);
    - "preserved": that form where the scores are finite, else x / c - amax(x / c) (torch 2.13);
    - "other_dim": the stable form normalized over another dim (not a softmax over the keys)."""


    aten, prims, bf, f32 = torch.ops.aten, torch.ops.prims, torch.bfloat16, torch.float32
    f = FakeCudaGraph()
    sizes = {"B": 40, "H": 2, "S": 2, "L": 48, "D": D}
    sym = {n: f.symbol(n, v) for n, v in sizes.items()}
    q = f.input("q", [(n, sizes[n]) for n in "BHSD"], bf)
    k, v = (f.input(x, (("U", 3),) + tuple((n, sizes[n]) for n in "HLD"), bf) for x in ("k", "v"))
    idx = f.input("idx", (("B", sizes["B"]),), torch.int64)
    bh = f.op(operator.mul, sym["B"], sym["H"])

    def bmm(a, b, a_dims: str, b_dims: str):
        a3, b3 = (f.op(aten.reshape.default, f.op(aten.expand.default, x, [sym[c] for c in "BH" + dims]),
                       [bh] + [sym[c] for c in dims]) for x, dims in ((a, a_dims), (b, b_dims)))
        out = [sym[c] for c in "BH" + a_dims[0] + b_dims[1]]
        return f.op(aten.reshape.default, f.op(aten.bmm.default, a3, b3), out)

    kt = f.op(aten.permute.default, f.op(aten.index.Tensor, k, [idx]), [0, 1, 3, 2])
    scores = bmm(q, kt, "SD", "DL")
    x = f.op(prims.convert_element_type.default, scores, f32)
    if softmax == "symfloat":  # the scale a symbolic float, its sign a number
        c = f.op(torch.sym_sqrt, f.op(torch.sym_float, sym["D"]))
        sign, sign_c = 1, f.op(operator.mul, 1, c)
    else:
        d = f.op(aten.scalar_tensor.default, sym["D"], val=f.empty((), f32))
        c = f.op(prims.convert_element_type.default, f.op(aten.sqrt.default, f.op(
            prims.convert_element_type.default, d, torch.float64)), f32)
        one = f.op(aten.scalar_tensor.default, 1, val=f.empty((), f32))
        sign = f.op(aten.where.self, f.op(aten.ge.Scalar, c, 0), one, f.op(aten.neg.default, one))
        sign_c = f.op(aten.mul.Tensor, sign, c)
    xs = f.op(aten.mul.Tensor, x, sign)
    y = f.op(aten.div.Tensor, f.op(aten.sub.Tensor, xs, f.op(aten.amax.default, xs, [-1], True)), sign_c)
    if softmax == "preserved":
        scaled = f.op(prims.convert_element_type.default, f.op(aten.div.Tensor, scores, c), f32)
        original = f.op(aten.sub.Tensor, scaled, f.op(aten.amax.default, scaled, [-1], True))
        rows = f.empty([(n, sizes[n]) for n in "BHS"] + [1], torch.bool)  # isinf has no fake kernel off a GPU
        inf = f.op(aten.isinf.default, scaled, val=f.empty([(n, sizes[n]) for n in "BHSL"], torch.bool))
        finite = f.op(aten.logical_not.default, f.op(aten.any.dims, inf, [-1], True, val=rows), val=rows)
        y = f.op(aten.where.self, finite, y, original)
    e = f.op(aten.exp.default, y)
    total = f.op(aten.sum.dim_IntList, e, [-2 if softmax == "other_dim" else -1], True)
    p = f.op(prims.convert_element_type.default, f.op(aten.div.Tensor, e, total), bf)
    out = bmm(p, f.op(aten.index.Tensor, v, [idx]), "SL", "LD")
    return f, f.module(out)


@pytest.mark.parametrize("softmax", ["stable", "symfloat", "preserved"])
def test_hand_written_attention_in_the_gpu_graph_under_dynamic_shapes(softmax):
    from ikbo_rewrite.passes import run

    f, gm = _gpu_graph(softmax)
    report = run(gm, guards=True)
    assert report.kinds().count("attention") == 1 and report.left == [], str(report)
    assert "D 64" in str(report) and not has(gm, "bmm") and not has(gm, "amax")
    (att,) = [n for n in gm.graph.nodes if "ikbo_fa.attention" in str(n.target)]
    assert att.args[3] == pytest.approx(64 ** -0.5)  # the scale read back from the sign trick
    guards = sorted(str(g.expr) for g in f.shape_env.guards)
    assert guards and all(g.startswith("Eq(s") and g.endswith(", 64)") for g in guards), guards


def test_an_unread_softmax_in_the_gpu_graph_is_named_in_the_report():
    from ikbo_rewrite.passes import run

    _, gm = _gpu_graph("other_dim")
    report = run(gm, guards=True)
    assert "attention" not in report.kinds() and len(report.left) == 2, str(report)
    for left in report.left:  # the k and v gathers: each names the attention it feeds
        assert any("hand-written softmax(q k^T) v" in r and "softmax over the keys" in r for r in left.reasons), \
            str(report)
