"""The linear rewrite: a linear over cat([x_user[idx], x_cand]) becomes ``ikbo_gemm.linear``
with a following bias and activation in its epilogue. Runs once the op exists in
ikbo_gemm; until then the pass reports the layer as left, "op not available"."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ikbo_rewrite import linear
from rewrite_helpers import check_close, exported, has

needs_op = pytest.mark.skipif(not linear.available(), reason="ikbo_gemm.linear is not in ikbo_gemm yet")
KU, KC, N_OUT = 5, 6, 7


class Head(nn.Module):
    def __init__(self, act=None, bias=True, separate_bias=False):
        super().__init__()
        self.fc = nn.Linear(KU + KC, N_OUT, bias=bias and not separate_bias)
        self.extra = nn.Parameter(torch.randn(N_OUT)) if separate_bias else None
        self.act = act

    def forward(self, user, cand, idx):
        y = self.fc(torch.cat([user[idx], cand], dim=1))
        if self.extra is not None:
            y = y + self.extra
        return {None: lambda t: t, "relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
                "silu": F.silu, "sigmoid": torch.sigmoid}[self.act](y) * 2.0


def _inputs(B=9, U=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(U, KU, generator=g).bfloat16(), torch.randn(B, KC, generator=g).bfloat16(),
            torch.randint(0, U, (B,), generator=g))


@needs_op
@pytest.mark.parametrize("act", [None, "relu", "gelu", "gelu_tanh", "silu", "sigmoid"])
@pytest.mark.parametrize("bias, separate", [(True, False), (False, False), (True, True)])
def test_linear_with_its_epilogue(act, bias, separate):
    model = Head(act, bias, separate).bfloat16().eval()
    args = _inputs(seed=len(str(act)) + bias + 2 * separate)
    module, report = exported(model, args)
    assert report.kinds() == ["linear"] and report.left == [], str(report)
    detail = report.rewrites[0].detail
    assert ("bias" in detail) == bias and ((act or "none") in detail or act is None)
    assert has(module, "ikbo_gemm.linear") and not has(module, "aten.cat")
    check_close(module(*args), model, args)


class WeightInput(nn.Module):
    def forward(self, w, user, cand, idx):
        return F.linear(torch.cat([user[idx], cand], dim=1), w)


@needs_op
def test_a_weight_that_is_not_a_constant_is_left():
    module, report = exported(WeightInput(), (torch.randn(N_OUT, KU + KC).bfloat16(), *_inputs()))
    assert report.rewrites == [] and "not a constant" in str(report.left)


@pytest.mark.skipif(linear.available(), reason="ikbo_gemm.linear exists: the rewrite runs instead")
def test_without_the_op_the_layer_is_left_and_reported():
    model = Head("relu").bfloat16().eval()
    args = _inputs(seed=5)
    module, report = exported(model, args)
    assert report.rewrites == [] and has(module, "aten.cat")
    assert "linear: op not available" in str(report)
    check_close(module(*args), model, args)


class PaddedHead(nn.Module):
    """The concat zero-padded along K before the matmul, as Inductor's GPU alignment padding
    leaves it, against a weight with columns for the padding."""

    def __init__(self, pad=3, extra=0.0):
        super().__init__()
        self.pad = pad
        self.w = nn.Parameter(torch.randn(N_OUT, KU + KC + pad))
        with torch.no_grad():
            self.w[:, KU + KC:] = extra

    def forward(self, user, cand, idx):
        x = F.pad(torch.cat([user[idx], cand], dim=1), (0, self.pad))
        return F.linear(x, self.w)


@needs_op
@pytest.mark.parametrize("extra", [0.0, 1.5])
def test_a_zero_padded_concat_is_a_linear_over_it(extra):
    model = PaddedHead(extra=extra).bfloat16().eval()
    args = _inputs(seed=11)
    module, report = exported(model, args)
    assert report.kinds() == ["linear"] and report.left == [], str(report)
    check_close(module(*args), model, args)


@needs_op
def test_padded_weight_columns_that_are_not_finite_are_left():
    model = PaddedHead(extra=float("inf")).bfloat16().eval()
    module, report = exported(model, _inputs(seed=12))
    assert report.kinds() == [] and "not finite" in str(report), str(report)


@needs_op
def test_a_zero_padded_concat_after_decomposition():
    """Through ikbo_rewrite.compile the padding reaches the pass as aten.constant_pad_nd."""
    import ikbo_rewrite

    model = PaddedHead().bfloat16().eval()
    args = _inputs(B=40, U=2, seed=13)
    with torch.no_grad():
        fast = ikbo_rewrite.compile(model, dynamic=False)
        out = fast(*args)
    assert fast.report.kinds() == ["linear"], str(fast.report)
    check_close(out, model, args)
