"""GPU tests of the default policy's split by cost (``AttentionPolicy.split_by_cost``): long
histories of few users split several ways, against fp32 at the extremes (no key, one key, 32,768
keys, a user of one candidate and one of 10,000), NaN isolation, CUDA-graph replay with new idx
and kv_offsets written in place, and the same bits from run to run with shuffled idx (the
work-list kernel's order within a user changes, the result must not).
"""
import importlib

import pytest
import torch

import ikbo_fa
from attention_inputs import assert_nan_rows_only, user_groups

pytestmark = pytest.mark.gpu
attention_mod = importlib.import_module("ikbo_fa.attention")
NAN = float("nan")


def _idx(counts, seed):
    """int64 idx with ``counts[u]`` candidates of user u, shuffled."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.arange(len(counts)).repeat_interleave(torch.tensor(counts))
    return idx[torch.randperm(len(idx), generator=g)].cuda()


def _jagged(lengths, H, D, seed):
    g = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0] + list(lengths)).cumsum(0).cuda()
    k, v = (torch.randn(int(offsets[-1]), H, D, generator=g).bfloat16().cuda() for _ in range(2))
    return (k, v), offsets


def _check(out, lse, ref, ref_lse, keep):
    assert not out[keep].isnan().any()
    err = ((out[keep].float() - ref[keep]).norm() / ref[keep].norm()).item()
    assert err < 1e-2, err
    torch.testing.assert_close(lse[keep], ref_lse[keep], rtol=1e-4, atol=1e-4)


def _splits(*args, **kw) -> int:
    return attention_mod.launch_plan(*args, **kw).n_splits


def test_long_padded_histories_of_few_users():
    """8 users of 16,384 keys, 64 candidates each, H 4: split four ways (132 SMs), against fp32."""
    q, k, v, idx = user_groups(61, 8, 64, 1, 16384, H=4, order="shuffled")
    out = torch.full_like(q, NAN)
    o, lse = ikbo_fa.attention(q, (k, v), idx, out=out, return_lse=True)
    assert _splits(q, (k, v), idx, out=out, return_lse=True) > 2
    ref, ref_lse = ikbo_fa.attention_reference(q.float(), (k.float(), v.float()), idx, return_lse=True)
    _check(o, lse, ref, ref_lse, torch.ones(len(idx), dtype=torch.bool, device="cuda"))


def test_jagged_extremes():
    """Rows of 0, 1, 32,768, 129 and 5,000 keys (max_kv_len 32,768) with 3, 10, 1, 20 and 6
    candidates: eight splits; an empty row gives 0 and -inf."""
    lengths, counts = [0, 1, 32768, 129, 5000], [3, 10, 1, 20, 6]
    kv, offsets = _jagged(lengths, 4, 128, 62)
    idx = _idx(counts, 62)
    q = torch.randn(len(idx), 1, 4, 128, device="cuda").bfloat16()
    kw = dict(kv_offsets=offsets, max_kv_len=32768)
    out = torch.full_like(q, NAN)
    o, lse = ikbo_fa.attention(q, kv, idx, out=out, return_lse=True, **kw)
    assert _splits(q, kv, idx, out=out, return_lse=True, **kw) == 8
    ref, ref_lse = ikbo_fa.attention_reference(q.float(), tuple(t.float() for t in kv), idx, return_lse=True, **kw)
    empty = idx == 0
    assert (o[empty] == 0).all() and torch.isneginf(lse[empty]).all()
    _check(o, lse, ref, ref_lse, ~empty)


def test_user_of_ten_thousand_and_user_of_one():
    """Ratio 10,000 beside a user of one candidate, 8,192 keys, H 1: three splits."""
    idx = _idx([10000, 1], 63)
    g = torch.Generator().manual_seed(63)
    q = torch.randn(len(idx), 1, 1, 128, generator=g).bfloat16().cuda()
    k, v = (torch.randn(2, 8192, 1, 128, generator=g).bfloat16().cuda() for _ in range(2))
    lengths = torch.tensor([8192, 4097], dtype=torch.int32, device="cuda")
    out = torch.full_like(q, NAN)
    o, lse = ikbo_fa.attention(q, (k, v), idx, kv_lengths=lengths, out=out, return_lse=True)
    assert _splits(q, (k, v), idx, kv_lengths=lengths, out=out, return_lse=True) > 1
    ref, ref_lse = ikbo_fa.attention_reference(q.float(), (k.float(), v.float()), idx, kv_lengths=lengths,
                                               return_lse=True)
    _check(o, lse, ref, ref_lse, torch.ones(len(idx), dtype=torch.bool, device="cuda"))


def test_nan_isolation():
    """An index out of range gives a NaN row, a NaN key gives its user's rows NaN; no other row."""
    q, k, v, idx = user_groups(64, 8, 64, 1, 16384, H=4, order="shuffled")
    bad = idx.clone()
    bad[5] = 8
    k[3, 7000] = NAN
    o, lse = ikbo_fa.attention(q, (k, v), bad, return_lse=True, validate=False)
    assert _splits(q, (k, v), bad, return_lse=True) > 2
    assert_nan_rows_only(o, lse, (bad == 8) | (bad == 3))


def test_graph_replay_follows_new_idx_and_offsets():
    """One capture; new idx and kv_offsets (the same keys cut into other rows) written in place."""
    lengths = [32768, 1, 0, 700, 9000, 129]
    kv, offsets = _jagged(lengths, 2, 128, 65)
    idx = _idx([4, 1, 2, 30, 7, 9], 65)
    q = torch.randn(len(idx), 1, 2, 128, device="cuda").bfloat16()
    kw = dict(max_kv_len=32768)
    static_idx, static_offsets = idx.clone(), offsets.clone()
    ikbo_fa.attention(q, kv, static_idx, kv_offsets=static_offsets, **kw)  # compile and plan outside
    assert _splits(q, kv, static_idx, kv_offsets=static_offsets, **kw) > 2
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = ikbo_fa.attention(q, kv, static_idx, kv_offsets=static_offsets, return_lse=True, **kw)
    new_lengths = [9000, 129, 32768, 1, 700, 0]
    static_offsets.copy_(torch.tensor([0] + new_lengths).cumsum(0))
    static_idx.copy_(idx[torch.randperm(len(idx), device="cuda")])
    graph.replay()
    torch.cuda.synchronize()
    ref, ref_lse = ikbo_fa.attention_reference(q.float(), tuple(t.float() for t in kv), static_idx,
                                               kv_offsets=static_offsets, return_lse=True, **kw)
    empty = static_idx == 5
    assert (out[empty] == 0).all() and torch.isneginf(lse[empty]).all()
    _check(out, lse, ref, ref_lse, ~empty)


@pytest.mark.parametrize("s_q, default, old", [(16, 1, 2), (4, 2, 4)])
def test_jagged_rows_split_by_their_total_keys(s_q, default, old):
    """32 users of 64 candidates, rows of 1 to 8,192 keys (about half on average): the default
    splits by the packed K/V's total keys (fewer splits than rows all 8,192 long would take), and
    gives attention over all keys under both counts."""
    g = torch.Generator().manual_seed(67 + s_q)
    lengths = torch.randint(1, 8193, (32,), generator=g).tolist()
    lengths[0] = 8192
    kv, offsets = _jagged(lengths, 2, 128, 67 + s_q)
    idx = _idx([64] * 32, 67 + s_q)
    q = torch.randn(len(idx), s_q, 2, 128, generator=g).bfloat16().cuda()
    kw = dict(kv_offsets=offsets, max_kv_len=8192)
    rule = ikbo_fa.AttentionPolicy(split_by_total_keys=False)
    assert _splits(q, kv, idx, **kw) == default and _splits(q, kv, idx, policy=rule, **kw) == old
    ref, ref_lse = ikbo_fa.attention_reference(q.float(), tuple(t.float() for t in kv), idx, return_lse=True, **kw)
    keep = torch.ones(len(idx), dtype=torch.bool, device="cuda")
    for policy in (ikbo_fa.DEFAULT_POLICY, rule):
        out = torch.full_like(q, NAN)
        o, lse = ikbo_fa.attention(q, kv, idx, out=out, return_lse=True, policy=policy, **kw)
        _check(o, lse, ref, ref_lse, keep)


@pytest.mark.parametrize("shape", [(32, 64, 1, 1024), (8, 64, 1, 16384)], ids=["pair", "workspace"])
def test_same_bits_every_run(shape):
    """Shuffled idx: the work list's order within a user may change from run to run; a split pair
    (S_q 1, L 1024) and the workspace split give the same bits each time."""
    U, ratio, S_q, L = shape
    q, k, v, idx = user_groups(66, U, ratio, S_q, L, order="shuffled")
    plan = attention_mod.launch_plan(q, (k, v), idx)
    assert plan.config.split_pair if L == 1024 else plan.config.split_kv
    first = ikbo_fa.attention(q, (k, v), idx)
    for _ in range(8):
        assert torch.equal(ikbo_fa.attention(q, (k, v), idx), first)
