"""GPU tests of the work list built in each CTA (``AttentionConfig.in_cta_worklist``, the op's
``_IN_CTA_WORKLIST``): against fp32 and bit for bit against the work-list kernel's launch (a
row's result does not depend on the rows that share its tile), S_q 1 to 129, sorted and
shuffled, int32 and int64 idx, one user and one candidate per user, the largest batch and user
count it takes, split pairs and split_kv, out-of-range indices, and graph replay after new idx
values.
"""
import importlib

import pytest
import torch

import ikbo_fa
from cute_kernels.plans import PlanCache
from ikbo_fa.config import IN_CTA_MAX_BATCH

pytestmark = pytest.mark.gpu
attention_mod = importlib.import_module("ikbo_fa.attention")
NAN = float("nan")


def _run(monkeypatch, in_cta, q, kv, idx):
    """The op with _IN_CTA_WORKLIST set to ``in_cta`` -> (out, lse, its config); out poisoned."""
    with monkeypatch.context() as m:
        m.setattr(attention_mod, "_IN_CTA_WORKLIST", in_cta)
        m.setattr(attention_mod, "_plans", PlanCache())
        out = torch.full((idx.shape[0], *q.shape[1:]), NAN, dtype=q.dtype, device=q.device)
        _, lse = ikbo_fa.attention(q, kv, idx, out=out, return_lse=True, validate=False)
        (plan,) = attention_mod._plans.values()
        return out, lse, plan.config


def _problem(seed, U, counts, S_q, L, H=2, D=128, order="sorted", idx_dtype=torch.int32, dtype=torch.bfloat16):
    """``counts`` candidates per user (an int: all the same, or a list)."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.tensor([counts] * U if isinstance(counts, int) else counts)
    idx = torch.arange(U).repeat_interleave(counts)
    if order == "shuffled":
        idx = idx[torch.randperm(idx.shape[0], generator=g)]
    q = torch.randn(idx.shape[0], S_q, H, D, generator=g).to(dtype).cuda()
    k, v = (torch.randn(U, L, H, D, generator=g).to(dtype).cuda() for _ in range(2))
    return q, (k, v), idx.to(idx_dtype).cuda()


def _check(monkeypatch, q, kv, idx):
    """In-CTA against fp32 and, bit for bit, against the work-list kernel's launch."""
    out, lse, cfg = _run(monkeypatch, True, q, kv, idx)
    base, base_lse, base_cfg = _run(monkeypatch, False, q, kv, idx)
    assert cfg.in_cta_worklist == idx.dtype and base_cfg.in_cta_worklist is None
    k, v = kv
    U = k.shape[0]
    bad = (idx < 0) | (idx >= U)
    ref, ref_lse = ikbo_fa.attention_reference(q.float(), (k.float(), v.float()), idx, return_lse=True,
                                               validate=False)
    assert out[bad].isnan().all() and lse[bad].isnan().all()
    keep = ~bad
    assert not out[keep].isnan().any()
    assert ((out[keep].float() - ref[keep]).norm() / ref[keep].norm()).item() < 1e-2
    torch.testing.assert_close(lse[keep], ref_lse[keep], rtol=1e-4, atol=1e-4)
    assert torch.equal(out[keep], base[keep]) and torch.equal(lse[keep], base_lse[keep])
    return cfg


@pytest.mark.parametrize("order", ["sorted", "shuffled"])
@pytest.mark.parametrize("S_q", [1, 2, 3, 7, 17, 64, 65, 129])
def test_in_cta_matches_fp32_and_the_worklist_kernel(monkeypatch, order, S_q):
    # Uneven users (a candidate over two tiles, users of one tile and of several).
    counts = [1, 300, 64, 65, 7, 129, 2, 40]
    q, kv, idx = _problem(S_q, 8, counts, S_q, 700, order=order)
    _check(monkeypatch, q, kv, idx)


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("U, counts", [(1, 1000), (1, 1), (500, 1), (1000, 4)], ids=["one-user", "one-candidate",
                                                                                     "ratio-1", "most-users"])
def test_in_cta_extremes(monkeypatch, idx_dtype, U, counts):
    """One user, a single candidate, one candidate per user, and IN_CTA_MAX_BATCH candidates of
    1000 users (D 128 holds the counters of up to 1251)."""
    q, kv, idx = _problem(U, U, counts, 1, 300, order="shuffled", idx_dtype=idx_dtype)
    assert idx.shape[0] <= IN_CTA_MAX_BATCH
    _check(monkeypatch, q, kv, idx)


@pytest.mark.parametrize("L, what", [(1024, "split_pair"), (8192, "split_kv")])
def test_in_cta_with_key_splits(monkeypatch, L, what):
    """S_q 1 at ratio 64: two splits in a cluster (L 1024), more in the workspace (L 8192, few tiles)."""
    q, kv, idx = _problem(L, 8, 64, 1, L, order="shuffled")
    cfg = _check(monkeypatch, q, kv, idx)
    assert getattr(cfg, what)


def test_in_cta_out_of_range_rows_are_nan_and_isolated(monkeypatch):
    q, kv, idx = _problem(5, 6, 50, 3, 500, order="shuffled")
    idx[[0, 7, 299]] = torch.tensor([-1, 6, 2**30], dtype=idx.dtype, device=idx.device)
    _check(monkeypatch, q, kv, idx)


def test_in_cta_graph_replay_after_new_idx(monkeypatch):
    """A captured call replayed after writing new values into its idx: sorted, then shuffled (the
    work list's grouped flag changes), then with an out-of-range entry."""
    monkeypatch.setattr(attention_mod, "_IN_CTA_WORKLIST", True)
    q, (k, v), idx = _problem(9, 16, 64, 1, 1024)
    out = torch.full((idx.shape[0], *q.shape[1:]), NAN, dtype=q.dtype, device=q.device)
    ikbo_fa.attention(q, (k, v), idx, out=out, validate=False)  # compile and plan outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ikbo_fa.attention(q, (k, v), idx, out=out, validate=False)
    g = torch.Generator().manual_seed(10)
    sorted_idx = idx.clone()
    for new in (sorted_idx[torch.randperm(idx.shape[0], generator=g).cuda()], sorted_idx.flip(0)):
        idx.copy_(new)
        out.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        ref = ikbo_fa.attention_reference(q.float(), (k.float(), v.float()), idx, validate=False)
        assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
    idx[5] = -1
    out.fill_(NAN)
    graph.replay()
    torch.cuda.synchronize()
    assert out[5].isnan().all() and not out[torch.arange(idx.shape[0]) != 5].isnan().any()
    (plan,) = attention_mod._plans.values()
    assert plan.config.in_cta_worklist == torch.int32
