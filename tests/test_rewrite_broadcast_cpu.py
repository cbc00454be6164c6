"""Broadcast detection: every gather form is found and rewritten (here through the lce
rewrite, which needs the user part recognised), whatever the batch sizes; gathers that are
not broadcasts are not."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.export import Dim

from rewrite_helpers import check_close, exported, has

M, N, K_USER, K_CAND = 5, 6, 4, 3


def _gather(form: str, user: torch.Tensor, idx: torch.Tensor, counts=None, r=None):
    B = idx.shape[0]
    if form == "index":
        return user[idx]
    if form == "index_select":
        return user.index_select(0, idx)
    if form == "gather":
        return torch.gather(user, 0, idx.view(B, 1, 1).expand(B, user.shape[1], user.shape[2]))
    if form == "repeat_interleave":
        return user.repeat_interleave(counts, dim=0, output_size=B)
    if form == "expand_interleave":
        U = user.shape[0]
        return user.unsqueeze(1).expand(U, r, *user.shape[1:]).reshape(U * r, *user.shape[1:])
    if form == "expand_tile":
        U = user.shape[0]
        return user.unsqueeze(0).expand(r, U, *user.shape[1:]).reshape(r * U, *user.shape[1:])
    raise ValueError(form)


class LceBlock(nn.Module):
    """cat([user gathered, cand], K) then a linear over K, as in Wukong's compression."""

    def __init__(self, form: str, r: int = 0):
        super().__init__()
        self.form, self.r = form, r
        self.compress = nn.Linear(K_USER + K_CAND, M, bias=False)

    def forward(self, user, cand, idx, counts=None):
        e = torch.cat([_gather(self.form, user, idx, counts, self.r), cand], dim=1)
        return self.compress(e.transpose(1, 2)).transpose(1, 2)


def _inputs(B, U, seed, form):
    g = torch.Generator().manual_seed(seed)
    user = torch.randn(U, K_USER, N, generator=g).bfloat16()
    cand = torch.randn(B, K_CAND, N, generator=g).bfloat16()
    if form == "expand_interleave":
        idx = torch.arange(B) // (B // U)
    elif form == "expand_tile":
        idx = torch.arange(B) % U
    else:
        idx = torch.randint(0, U, (B,), generator=g)
    counts = torch.bincount(idx, minlength=U) if form == "repeat_interleave" else None
    if form == "repeat_interleave":
        idx = idx.sort().values
    return user, cand, idx, counts


FORMS = ["index", "index_select", "gather", "repeat_interleave", "expand_interleave", "expand_tile"]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("B, U", [(12, 3), (4, 4), (6, 1)])
def test_each_form_is_found_and_rewritten(form, B, U):
    user, cand, idx, counts = _inputs(B, U, seed=B * 10 + U, form=form)
    model = LceBlock(form, r=B // U).bfloat16().eval()
    args = (user, cand, idx) + ((counts,) if counts is not None else ())
    module, report = exported(model, args)
    if form.startswith("expand") and B == U:  # r = 1: an identity, not a broadcast
        assert report.broadcasts == 0
        return
    assert report.broadcasts >= 1
    assert "lce" in report.kinds(), str(report)
    assert has(module, "ikbo_gemm.lce") and not has(module, "aten.cat")
    check_close(module(*args), model, args)


def test_dynamic_batch_sizes_one_symbol_or_two():
    """Exported with B and U dynamic, the rewritten module serves other sizes (U = B too)."""
    model = LceBlock("index").bfloat16().eval()
    user, cand, idx, _ = _inputs(10, 3, 1, "index")
    b, u = Dim("B"), Dim("U")
    module, report = exported(model, (user, cand, idx), dynamic_shapes=({0: u}, {0: b}, {0: b}))
    assert report.kinds() == ["lce"]
    for B, U, seed in ((7, 7, 2), (20, 2, 3), (5, 4, 4)):
        args = _inputs(B, U, seed, "index")[:3]
        check_close(module(*args), model, args)


class GatherDim1(nn.Module):
    """A gather along dim 1 (a selection of features, not of users) before the concat."""

    def __init__(self):
        super().__init__()
        self.compress = nn.Linear(K_USER + K_CAND, M, bias=False)

    def forward(self, user, cand, idx):
        e = torch.cat([user.index_select(1, idx), cand], dim=1)
        return self.compress(e.transpose(1, 2)).transpose(1, 2)


def test_gather_along_dim_1_is_not_a_broadcast():
    g = torch.Generator().manual_seed(5)
    cand = torch.randn(6, K_CAND, N, generator=g).bfloat16()
    user = torch.randn(6, 9, N, generator=g).bfloat16()
    idx = torch.randint(0, 9, (K_USER,), generator=g)
    module, report = exported(GatherDim1().bfloat16().eval(), (user, cand, idx))
    assert report.broadcasts == 0 and report.rewrites == [] and has(module, "aten.cat")


class MaskedSelect(nn.Module):
    """Rows picked by a boolean mask: not an integer index, not a broadcast."""

    def forward(self, x, keep):
        return x[keep] * 2


def test_boolean_row_selection_is_not_a_broadcast():
    x, keep = torch.randn(5, 3), torch.tensor([True, False, True, True, False])
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(MaskedSelect(), tracing_mode="fake")(x, keep)
    import ikbo_rewrite

    assert ikbo_rewrite.rewrite(gm).broadcasts == 0


class EmbeddingLookup(nn.Module):
    """A user tower's features looked up for each candidate as an embedding table indexed by idx
    (``F.embedding(idx, users)``), then a linear over [user, candidate] features."""

    def __init__(self):
        super().__init__()
        self.user_mlp, self.cand_mlp, self.head = nn.Linear(K_USER, 8), nn.Linear(K_CAND, 8), nn.Linear(16, M)

    def forward(self, users, cands, idx):
        u = nn.functional.embedding(idx, users)
        return self.head(torch.cat([self.user_mlp(u).relu(), self.cand_mlp(cands)], 1))


def test_embedding_lookup_of_a_user_table_is_a_broadcast():
    from ikbo_rewrite import linear

    g = torch.Generator().manual_seed(31)
    model = EmbeddingLookup().bfloat16().eval()
    args = (torch.randn(3, K_USER, generator=g).bfloat16(), torch.randn(10, K_CAND, generator=g).bfloat16(),
            torch.randint(0, 3, (10,), generator=g))
    module, report = exported(model, args)
    assert report.broadcasts == 1 and report.left == [], str(report)
    assert "hoist" in report.kinds() and ("linear" in report.kinds()) == linear.available(), str(report)
    assert not has(module, "embedding")
    check_close(module(*args), model, args)


def test_an_embedding_table_the_model_holds_is_no_broadcast():
    """nn.Embedding's weight is a vocabulary (its rows are not the users): hoisting work onto it
    would run it at the vocabulary's size."""

    class Vocabulary(nn.Module):
        def __init__(self):
            super().__init__()
            self.table, self.proj = nn.Embedding(50, 8), nn.Linear(8, 4)

        def forward(self, ids):
            return self.proj(self.table(ids))

    model = Vocabulary().bfloat16().eval()
    args = (torch.randint(0, 50, (9,), generator=torch.Generator().manual_seed(32)),)
    module, report = exported(model, args)
    assert report.broadcasts == 0 and report.rewrites == [], str(report)
    torch.testing.assert_close(module(*args), model(*args), rtol=0, atol=0)


def test_an_embedding_table_passed_in_with_more_rows_than_lookups_is_no_broadcast():
    """A vocabulary given as an input (weights unfrozen): work hoisted onto it would run at its size."""

    class Lookup(nn.Module):
        def forward(self, table, ids):
            return nn.functional.embedding(ids, table).sum(-1)

    g = torch.Generator().manual_seed(33)
    args = (torch.randn(50, 8, generator=g).bfloat16(), torch.randint(0, 50, (9,), generator=g))
    module, report = exported(Lookup(), args)
    assert report.broadcasts == 0, str(report)
    torch.testing.assert_close(module(*args), Lookup()(*args), rtol=0, atol=0)
