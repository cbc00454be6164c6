"""GPU tests of split-KV: where a KV-broadcast problem has few tiles, each row's keys go over
several CTAs and the op merges their partial outputs; against fp32 attention and against the
same problem unsplit, in bf16 and fp16, on padded and jagged K/V; Q broadcast never splits."""
import pytest
import torch

import ikbo_fa
from attention_inputs import random_jagged_problem
from ikbo_fa import AttentionPolicy
from ikbo_fa.config import WHOLE_ROW

pytestmark = pytest.mark.gpu
attention_mod = __import__("importlib").import_module("ikbo_fa.attention")
NAN = float("nan")
# Splits of 512 keys, so that short histories split too: split boundaries inside and at the ends
# of the key blocks, up to 8 splits, and the merge, at small sizes; by the half-idle rule (the
# split by cost: tests/test_attention_split_cost_gpu.py).
SPLITS = AttentionPolicy(split_min_keys=512, split_by_cost=False)


def _problem(seed, U, ratio, S_q, L, H=2, H_kv=2, D=128, order="sorted", dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    B = U * ratio
    idx = torch.arange(U).repeat_interleave(ratio)
    if order == "shuffled":
        idx = idx[torch.randperm(B, generator=g)]
    q = torch.randn(B, S_q, H, D, generator=g).to(dtype).cuda()
    k, v = (torch.randn(U, L, H_kv, D, generator=g).to(dtype).cuda() for _ in range(2))
    return q, k, v, idx.cuda()


def _reference(q, k, v, idx, lengths=None):
    """fp32 attention -> (out, lse): the op's reference on the inputs in float32."""
    return ikbo_fa.attention_reference(q.float(), (k.float(), v.float()), idx, kv_lengths=lengths, return_lse=True)


def _unsplit(*args, **kw):
    return ikbo_fa.attention(*args, policy=AttentionPolicy(split_min_keys=512, split_kv=False), **kw)


def _plan(*args, **kw):
    """The launch plan of a call with SPLITS."""
    return attention_mod.launch_plan(*args, policy=SPLITS, **kw)


def _poison_workspace(monkeypatch):
    """The split workspace NaN-filled at each call: every split of every row must write its
    partial output and lse, an empty split too (the merge weighs it by exp(-inf) = 0, and
    0 x NaN is NaN)."""
    make = attention_mod._split_workspace

    def poisoned(plan, lse_scratch=False):
        ws_o, ws_lse, scratch = make(plan, lse_scratch)
        for t in (ws_o, ws_lse) if scratch is None else (ws_o, ws_lse, scratch):
            t.fill_(NAN)
        return ws_o, ws_lse, scratch

    monkeypatch.setattr(attention_mod, "_split_workspace", poisoned)


def _splits(B, U, S_q, H, L):
    """The split count the op plans under SPLITS."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return attention_mod.problem_splits(B, U, S_q, H, L, sms, SPLITS)[0]


@pytest.mark.parametrize("order", ["sorted", "shuffled"])
@pytest.mark.parametrize("U, S_q, L", [(32, 1, 2048), (32, 1, 8192), (8, 2, 1024), (2, 17, 4096), (1, 64, 8192)])
def test_split_matches_fp32_and_unsplit(U, S_q, L, order):
    assert _splits(U * 64, U, S_q, 2, L) > 1  # the problem is one that splits
    q, k, v, idx = _problem(S_q * 7 + L, U, 64, S_q, L, order=order)
    out = torch.full_like(q, float("nan"))
    o, lse = ikbo_fa.attention(q, (k, v), idx, out=out, return_lse=True, policy=SPLITS)
    ref, ref_lse = _reference(q, k, v, idx)
    err = ((o.float() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, err
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)
    whole = _unsplit(q, (k, v), idx)
    assert ((o.float() - whole.float()).norm() / whole.float().norm()).item() < 1e-2


def test_split_with_lengths_and_empty_users():
    q, k, v, idx = _problem(5, 4, 64, 1, 4096, H=4, H_kv=1)
    lengths = torch.tensor([4096, 0, 1, 2049], dtype=torch.int32, device="cuda")
    o, lse = ikbo_fa.attention(q, (k, v), idx, kv_lengths=lengths, return_lse=True, policy=SPLITS)
    ref, ref_lse = _reference(q, k, v, idx, lengths)
    assert ((o.float() - ref).norm() / ref.norm()).item() < 1e-2
    empty = idx == 1
    assert (o[empty] == 0).all() and torch.isneginf(lse[empty]).all()
    torch.testing.assert_close(lse[~empty], ref_lse[~empty], rtol=1e-4, atol=1e-4)


def test_split_out_of_range_idx_is_nan_and_isolated():
    q, k, v, idx = _problem(6, 8, 64, 1, 4096)
    bad = idx.clone()
    bad[3] = 8
    o = ikbo_fa.attention(q, (k, v), bad, validate=False, policy=SPLITS)
    assert o[3].isnan().all()
    keep = torch.ones(len(idx), dtype=torch.bool, device="cuda")
    keep[3] = False
    assert not o[keep].isnan().any()


def test_split_graph_replay_follows_new_idx():
    q, k, v, idx = _problem(7, 16, 64, 1, 8192)
    static_idx = idx.clone()
    ikbo_fa.attention(q, (k, v), static_idx, policy=SPLITS)  # compile and plan outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ikbo_fa.attention(q, (k, v), static_idx, policy=SPLITS)
    new = idx[torch.randperm(len(idx), device="cuda")]
    static_idx.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    ref, _ = _reference(q, k, v, new)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("with_lse", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n_splits", [2, 5])
def test_merge_kernel_matches_its_definition(n_splits, dtype, with_lse):
    """The compiled merge against merge_splits (torch), with empty rows, a NaN row and rows
    marked WHOLE_ROW (left alone); without lse it leaves the lse buffer alone."""
    from ikbo_fa.merge_sm90 import merge_kernel

    g = torch.Generator().manual_seed(n_splits)
    B, S, H, D = 9, 3, 2, 128
    ws_o = torch.randn(B, S, n_splits * H, D, generator=g).to(dtype).cuda()
    ws_lse = (torch.randn(B, n_splits * H, S, generator=g) * 4).cuda()
    ws_lse[1] = float("-inf")  # no key in any split
    ws_lse[2, ::H] = float("-inf")  # head 0: no key in any split
    ws_lse[3, 0] = float("-inf")  # split 0, head 0: none in that split
    ws_o[3, :, 0] = float("nan")  # ... and its output never written (the dynamic walk skips it)
    ws_lse[4, H - 1] = float("nan")
    ws_lse.view(torch.int32)[5, 1, 0] = WHOLE_ROW  # row 5, head 1, query 0: written by the forward
    ws_lse.view(torch.int32)[6, 0] = WHOLE_ROW  # row 6, head 0, every query
    out, lse = torch.full((B, S, H, D), 7.0).to(dtype).cuda(), torch.full((B, H, S), 7.0).cuda()
    ref, ref_lse = out.clone(), lse.clone()
    attention_mod.merge_splits(ws_o, ws_lse, n_splits, ref, ref_lse if with_lse else None)
    merge_kernel(dtype, with_lse).fn(ws_o, ws_lse, out, lse if with_lse else None, n_splits)
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2, equal_nan=True)
    assert (out[1] == 0).all() and out[4, :, H - 1].isnan().all()
    assert (out[5, 0, 1] == 7.0).all() and (out[6, :, 0] == 7.0).all() and (out[6, :, 1] != 7.0).any()
    if with_lse:
        torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5, equal_nan=True)
        assert torch.isneginf(lse[1]).all()
    else:
        assert (lse == 7.0).all()


@pytest.mark.parametrize("S_q, L, with_lengths", [(1, 4096, False), (17, 2048, True)])
def test_split_fp16_matches_fp32_and_unsplit(S_q, L, with_lengths):
    """fp16 partial outputs in the workspace and the fp16 merge: S_q 1 at D 128, and S_q 17 at
    D 64 with grouped heads, kv_lengths and an empty user."""
    U, ratio, H, H_kv, D = (8, 16, 2, 2, 128) if S_q == 1 else (4, 16, 4, 2, 64)
    assert _splits(U * ratio, U, S_q, H, L) > 1
    q, k, v, idx = _problem(S_q + L, U, ratio, S_q, L, H=H, H_kv=H_kv, D=D, order="shuffled", dtype=torch.float16)
    lengths = torch.tensor([L, 0, 1, 1000], dtype=torch.int32, device="cuda") if with_lengths else None
    out = torch.full_like(q, NAN)
    o, lse = ikbo_fa.attention(q, (k, v), idx, kv_lengths=lengths, out=out, return_lse=True, policy=SPLITS)
    assert _plan(q, (k, v), idx, kv_lengths=lengths, out=out, return_lse=True).n_splits > 1
    ref, ref_lse = _reference(q, k, v, idx, lengths)
    keep = torch.ones(len(idx), dtype=torch.bool, device="cuda") if lengths is None else lengths[idx] > 0
    assert not o.isnan().any() and (o[~keep] == 0).all() and torch.isneginf(lse[~keep]).all()
    assert ((o[keep].float() - ref[keep]).norm() / ref[keep].norm()).item() < 1e-2
    torch.testing.assert_close(lse[keep], ref_lse[keep], rtol=1e-4, atol=1e-4)
    whole = _unsplit(q, (k, v), idx, kv_lengths=lengths)
    assert ((o.float() - whole.float()).norm() / whole.float().norm()).item() < 1e-2


# One row of no key, of a key, about one key block, one past it, over more than two splits, and at
# the hint (the rows shorter than the hint leave their last splits without a key).
JAGGED_LENGTHS = (0, 1, 127, 129, 3000, 4096)
HINT = 4096


@pytest.mark.parametrize("off_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("S_q, H, H_kv, D", [(1, 2, 2, 128), (17, 2, 1, 64)])
def test_split_jagged_matches_fp32(monkeypatch, S_q, H, H_kv, D, off_dtype):
    """Jagged K/V with a max_kv_len hint splits as padded K/V of L = the hint does: against fp32
    attention_reference, with a NaN-poisoned out and workspace."""
    U, B = len(JAGGED_LENGTHS), 16 * len(JAGGED_LENGTHS)
    _poison_workspace(monkeypatch)
    q, kv, k, v, idx, offsets = random_jagged_problem(S_q + D, "kv", B, U, S_q, H, H_kv, D, JAGGED_LENGTHS,
                                                      torch.bfloat16, offsets_dtype=off_dtype, device="cuda")
    out = torch.full((B, S_q, H, D), NAN, dtype=torch.bfloat16, device="cuda")
    _, lse = ikbo_fa.attention(q, kv, idx, kv_offsets=offsets, max_kv_len=HINT, out=out, return_lse=True,
                               policy=SPLITS)
    plan = _plan(q, kv, idx, kv_offsets=offsets, max_kv_len=HINT, out=out, return_lse=True)
    assert plan.n_splits > 1 and 3000 > 2 * plan.split_keys
    ref, ref_lse = ikbo_fa.attention_reference(q.float(), (k.float(), v.float()), idx, kv_offsets=offsets,
                                               max_kv_len=HINT, return_lse=True)
    keep = torch.tensor(JAGGED_LENGTHS, device="cuda")[idx] > 0
    assert not out.isnan().any() and not lse.isnan().any()
    assert (out[~keep] == 0).all() and torch.isneginf(lse[~keep]).all()
    assert ((out[keep].float() - ref[keep]).norm() / ref[keep].norm()).item() < 1e-2
    torch.testing.assert_close(lse[keep], ref_lse[keep], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("B, U, S_q", [(4, 1, 1), (8, 2, 17)])
def test_q_broadcast_never_splits(B, U, S_q):
    """A shape that splits as KV broadcast (few tiles, long rows) runs unsplit as Q broadcast:
    split-KV splits a user's keys, and Q broadcast has no user keys to share."""
    H, D, L = 2, 128, 8192
    assert _splits(B, U, S_q, H, L) > 1  # as KV broadcast, this shape splits
    g = torch.Generator().manual_seed(B + S_q)
    q = torch.randn(U, S_q, H, D, generator=g).bfloat16().cuda()
    k, v = (torch.randn(B, L, H, D, generator=g).bfloat16().cuda() for _ in range(2))
    idx = torch.randperm(B, generator=g).remainder(U).cuda()
    out = torch.full((B, S_q, H, D), NAN, dtype=torch.bfloat16, device="cuda")
    _, lse = ikbo_fa.attention(q, (k, v), idx, out=out, return_lse=True, policy=SPLITS)
    plan = _plan(q, (k, v), idx, out=out, return_lse=True)
    assert plan.direction == "q" and plan.n_splits == 1 and plan.merge is None
    ref, ref_lse = ikbo_fa.attention_reference(q.float(), (k.float(), v.float()), idx, return_lse=True)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)
