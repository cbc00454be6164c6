"""The lce rewrite: every way of writing a contraction over the concat's K becomes
``ikbo_gemm.lce`` with the weight split as constants; what is not that stays."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from rewrite_helpers import check_close, exported, has

M, N, KU, KC = 6, 5, 4, 7


class Lce(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.w = nn.Parameter(torch.randn(M, KU + KC) / 3)

    def forward(self, user, cand, idx):
        e = torch.cat([user[idx], cand], dim=1)  # [B, K, N]
        if self.how == "matmul":
            return torch.matmul(self.w, e)
        if self.how == "einsum":
            return torch.einsum("mk,bkn->bmn", self.w, e)
        if self.how == "einsum_nm":
            return torch.einsum("bkn,mk->bnm", e, self.w)
        if self.how == "bmm":
            return torch.bmm(self.w.expand(e.shape[0], M, KU + KC), e)
        if self.how == "matmul_t":
            return e.transpose(1, 2) @ self.w.t()  # [B, N, M]
        raise ValueError(self.how)


def _inputs(B=9, U=3, seed=0, dtype=torch.bfloat16, ku=KU):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(U, ku, N, generator=g).to(dtype), torch.randn(B, KC, N, generator=g).to(dtype),
            torch.randint(0, U, (B,), generator=g))


@pytest.mark.parametrize("how", ["matmul", "einsum", "einsum_nm", "bmm", "matmul_t"])
def test_each_spelling_becomes_lce(how):
    model = Lce(how).bfloat16().eval()
    args = _inputs(seed=hash(how) % 1000)
    module, report = exported(model, args)
    assert report.kinds() == ["lce"], str(report)
    assert not has(module, "aten.cat") and not has(module, "aten.index")
    check_close(module(*args), model, args)


class Segments(nn.Module):
    """User and candidate parts interleaved: [u1[idx], c1, u2[idx], c2]."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3 + 2 + 4 + 5, M, bias=True)

    def forward(self, u1, u2, c1, c2, idx):
        e = torch.cat([u1[idx], c1, u2.index_select(0, idx), c2], dim=1)
        return self.lin(e.transpose(1, 2))


def test_interleaved_segments_split_the_weight_at_each_offset():
    g = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=g).bfloat16()  # noqa: E731
    args = (r(2, 3, N), r(2, 4, N), r(7, 2, N), r(7, 5, N), torch.randint(0, 2, (7,), generator=g))
    model = Segments().bfloat16().eval()
    module, report = exported(model, args)
    assert report.kinds() == ["lce"] and "K_user 7, K_cand 7" in report.rewrites[0].detail
    check_close(module(*args), model, args)


class WeightInput(nn.Module):
    def forward(self, w, user, cand, idx):
        return torch.matmul(w, torch.cat([user[idx], cand], dim=1))


def test_a_weight_that_is_not_a_constant_is_left():
    user, cand, idx = _inputs()
    w = torch.randn(M, KU + KC).bfloat16()
    module, report = exported(WeightInput(), (w, user, cand, idx))
    assert report.rewrites == [] and has(module, "aten.cat")
    assert "not a constant" in str(report.left)


def test_fp32_is_left_the_gpu_op_takes_half_precision():
    model = Lce("matmul").eval()
    module, report = exported(model, _inputs(dtype=torch.float32))
    assert report.rewrites == [] and "fp16 or bf16" in str(report.left)


class OverN(nn.Module):
    """The concat is along K but the matmul reduces over N."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(N, 3))

    def forward(self, user, cand, idx):
        return torch.cat([user[idx], cand], dim=1) @ self.w


def test_a_contraction_over_another_dim_is_left():
    args = _inputs()
    model = OverN().bfloat16().eval()
    module, report = exported(model, args)
    assert report.rewrites == [] and "does not reduce over the concat's K" in str(report.left)
    check_close(module(*args), model, args)


class TwoIndices(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(M, 2 * KU + KC))

    def forward(self, user, cand, idx, idx2):
        return torch.matmul(self.w, torch.cat([user[idx], cand, user[idx2]], dim=1))


def test_user_parts_gathered_by_different_indices_are_left():
    user, cand, idx = _inputs()
    module, report = exported(TwoIndices().bfloat16().eval(), (user, cand, idx, idx.flip(0)))
    assert report.rewrites == [] and "different indices" in str(report.left)
