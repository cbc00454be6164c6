"""GPU tests of the dynamic tile walk (``AttentionConfig.dynamic_walk``: ordered tiles handed out by
a counter in the work list): against fp32 at the extremes (no key, one key, 32,768 keys, a user of
one candidate and one of 10,000), with and without splits, the same results as the static walk,
NaN isolation, and the counter back at zero after every call, shared work lists and CUDA-graph
replays with idx and kv_offsets written in place included.
"""
import dataclasses
import importlib

import pytest
import torch

import ikbo_fa
from attention_inputs import assert_nan_rows_only, random_jagged_problem, run_with_policy

pytestmark = pytest.mark.gpu
attention_mod = importlib.import_module("ikbo_fa.attention")
STATIC = ikbo_fa.AttentionPolicy(dynamic_walk=False)
# Splits costed as free: the most splits the rows allow, every piece from the counter.
MANY_SPLITS = ikbo_fa.AttentionPolicy(merge_blocks=0, tile_blocks=0, split_min_keys=128)


def _lognormal(U, median, cap, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.exp(torch.randn(U, generator=g) + torch.log(torch.tensor(float(median)))).ceil().clamp(1, cap).long()


def _reference(q, kv, idx, **kw):
    return ikbo_fa.attention_reference(q.float(), tuple(t.float() for t in kv), idx, return_lse=True, **kw)


def _check(out, lse, ref, ref_lse, keep):
    assert not out[keep].isnan().any()
    err = ((out[keep].float() - ref[keep]).norm() / ref[keep].norm()).item()
    assert err < 1e-2, err
    torch.testing.assert_close(lse[keep], ref_lse[keep], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("policy", [None, MANY_SPLITS], ids=["default", "many-splits"])
@pytest.mark.parametrize("S_q", [1, 4, 17])
def test_jagged_lognormal_rows(policy, S_q):
    """Lognormal rows of up to 8,192 keys (a row of 0 and one of 1 among them), 48 users of 6
    candidates, H 2, D 128 (few tiles: splits pay): the dynamic walk against fp32."""
    U = 48
    lengths = _lognormal(U, 1024, 8192, S_q)
    lengths[0], lengths[1], lengths[2] = 0, 1, 8192
    q, kv, _, _, idx, offsets = random_jagged_problem(70 + S_q, "kv", 6 * U, U, S_q, 2, 2, 128, lengths.tolist(),
                                                      torch.bfloat16, device="cuda")
    kw = dict(kv_offsets=offsets, max_kv_len=8192)
    out, lse, plan = run_with_policy(policy, q, kv, idx, **kw)
    assert plan.config.dynamic_walk
    if policy is MANY_SPLITS:
        assert plan.n_splits > 1 and plan.config.split_kv
    ref, ref_lse = _reference(q, kv, idx, **kw)
    empty = idx == 0
    assert (out[empty] == 0).all() and torch.isneginf(lse[empty]).all()
    _check(out, lse, ref, ref_lse, ~empty)


def test_extremes_and_the_static_walk():
    """Rows of 0, 1, 32,768, 129 and 5,000 keys with 3, 10, 1, 10,000 and 6 candidates, S_q 2:
    the dynamic walk and the static walk, both against fp32."""
    lengths, counts = [0, 1, 32768, 129, 5000], [3, 10, 1, 10000, 6]
    g = torch.Generator().manual_seed(71)
    idx = torch.arange(5).repeat_interleave(torch.tensor(counts))
    idx = idx[torch.randperm(len(idx), generator=g)].cuda()
    offsets = torch.tensor([0] + lengths).cumsum(0).cuda()
    kv = tuple(torch.randn(int(offsets[-1]), 4, 64, generator=g).bfloat16().cuda() for _ in range(2))
    q = torch.randn(len(idx), 2, 4, 64, generator=g).bfloat16().cuda()
    kw = dict(kv_offsets=offsets, max_kv_len=32768)
    out, lse, plan = run_with_policy(MANY_SPLITS, q, kv, idx, **kw)
    out_s, lse_s, plan_s = run_with_policy(dataclasses.replace(MANY_SPLITS, dynamic_walk=False), q, kv, idx, **kw)
    assert plan.config.dynamic_walk and not plan_s.config.dynamic_walk
    ref, ref_lse = _reference(q, kv, idx, **kw)
    keep = idx != 0
    _check(out, lse, ref, ref_lse, keep)
    _check(out_s, lse_s, ref, ref_lse, keep)


@pytest.mark.parametrize("with_lengths", [False, True], ids=["jagged", "kv_lengths"])
def test_shared_work_list_and_graph_replays(with_lengths):
    """Three calls sharing one work list (the counter must be back at zero for each), then a CUDA
    graph of a call replayed with new q, idx and lengths written in place; NaN rows where idx is
    out of range."""
    U, B, S_q, H, D, L = 12, 1500, 3, 2, 128, 3000
    g = torch.Generator().manual_seed(72)
    lengths = _lognormal(U, 600, L, 72)
    if with_lengths:
        k, v = (torch.randn(U, L, H, D, generator=g).bfloat16().cuda() for _ in range(2))
        kv, kw = (k, v), dict(kv_lengths=lengths.to(torch.int32).cuda())
    else:
        _, kv, _, _, _, offsets = random_jagged_problem(72, "kv", B, U, S_q, H, H, D, lengths.tolist(),
                                                        torch.bfloat16, device="cuda")
        kw = dict(kv_offsets=offsets.clone(), max_kv_len=L)
    idx = torch.randint(0, U, (B,), generator=g).cuda()
    idx[:7] = torch.tensor([-1, U, 5, U + 3, 0, -2, 11])
    bad = (idx < 0) | (idx >= U)
    wl = ikbo_fa.work_list(idx, U, S_q, validate=False, **kw)
    qs = [torch.randn(B, S_q, H, D, generator=g).bfloat16().cuda() for _ in range(3)]
    for q in qs:
        out = torch.full_like(q, float("nan"))
        _, lse = ikbo_fa.attention(q, kv, idx, out=out, return_lse=True, work_list=wl, validate=False, **kw)
        ref, ref_lse = _reference(q, kv, idx.clamp(0, U - 1), **kw)
        assert_nan_rows_only(out, lse, bad)
        _check(out, lse, ref, ref_lse, ~bad)
    assert attention_mod.launch_plan(qs[0], kv, idx, work_list=wl, return_lse=True, **kw).config.dynamic_walk
    assert wl.walk.tolist() == [0, 0]

    # One capture of work list + call; new q, idx and lengths written in place before each replay.
    q, static_idx = qs[0].clone(), idx.clone()
    ikbo_fa.attention(q, kv, static_idx, validate=False, **kw)  # compile and plan outside
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = ikbo_fa.attention(q, kv, static_idx, return_lse=True, validate=False, **kw)
    for r in range(3):
        q.copy_(torch.randn(q.shape, generator=g).bfloat16())
        static_idx.copy_(torch.randint(-1, U + 1, (B,), generator=g))
        new_lengths = _lognormal(U, 600, L, 80 + r)
        if with_lengths:
            kw["kv_lengths"].copy_(new_lengths.to(torch.int32))
        else:  # the same keys cut into other rows, none past max_kv_len
            kw["kv_offsets"].copy_(torch.cat([torch.zeros(1, dtype=torch.long), torch.full((U,), L).cumsum(0)])
                                   .clamp(max=int(kw["kv_offsets"][-1])))
        graph.replay()
        bad = (static_idx < 0) | (static_idx >= U)
        ref, ref_lse = _reference(q, kv, static_idx.clamp(0, U - 1), **kw)
        assert_nan_rows_only(out, lse, bad)
        _check(out, lse, ref, ref_lse, ~bad)
