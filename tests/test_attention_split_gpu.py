"""GPU tests of split-KV: where a KV-broadcast problem has few tiles, each row's keys go over
several CTAs and the op merges their partial outputs; against fp32 attention and against the
same problem unsplit."""
import pytest
import torch

import ikbo_fa
from cute_kernels.plans import PlanCache

pytestmark = pytest.mark.gpu
attention_mod = __import__("importlib").import_module("ikbo_fa.attention")


@pytest.fixture(autouse=True)
def short_splits(monkeypatch):
    """Splits of 512 keys, so that short histories split too: split boundaries inside and at
    the ends of the key blocks, up to 8 splits, and the merge, at small sizes."""
    monkeypatch.setattr(attention_mod, "_SPLIT_MIN_KEYS", 512)
    monkeypatch.setattr(attention_mod, "_plans", PlanCache())


def _problem(seed, U, ratio, S_q, L, H=2, H_kv=2, D=128, order="sorted"):
    g = torch.Generator().manual_seed(seed)
    B = U * ratio
    idx = torch.arange(U).repeat_interleave(ratio)
    if order == "shuffled":
        idx = idx[torch.randperm(B, generator=g)]
    q = torch.randn(B, S_q, H, D, generator=g).bfloat16().cuda()
    k, v = (torch.randn(U, L, H_kv, D, generator=g).bfloat16().cuda() for _ in range(2))
    return q, k, v, idx.cuda()


def _reference(q, k, v, idx, lengths=None):
    """fp32 attention -> (out, lse): the op's reference on the inputs in float32."""
    return ikbo_fa.attention_reference(q.float(), (k.float(), v.float()), idx, kv_lengths=lengths, return_lse=True)


def _unsplit(monkeypatch, *args, **kw):
    with monkeypatch.context() as m:
        m.setattr(attention_mod, "_SPLIT_KV", False)
        m.setattr(attention_mod, "_plans", PlanCache())
        return ikbo_fa.attention(*args, **kw)


def _splits(B, U, S_q, H, L):
    from ikbo_fa.worklist import max_tiles_per_head

    dense = -(-B * S_q // 128)
    tiles = (dense + max_tiles_per_head(B, U, S_q)) // 2
    return attention_mod.kv_splits(tiles, H, L, torch.cuda.get_device_properties(0).multi_processor_count)[0]


@pytest.mark.parametrize("order", ["sorted", "shuffled"])
@pytest.mark.parametrize("U, S_q, L", [(32, 1, 2048), (32, 1, 8192), (8, 2, 1024), (2, 17, 4096), (1, 64, 8192)])
def test_split_matches_fp32_and_unsplit(monkeypatch, U, S_q, L, order):
    assert _splits(U * 64, U, S_q, 2, L) > 1  # the problem is one that splits
    q, k, v, idx = _problem(S_q * 7 + L, U, 64, S_q, L, order=order)
    out = torch.full_like(q, float("nan"))
    o, lse = ikbo_fa.attention(q, (k, v), idx, out=out, return_lse=True)
    ref, ref_lse = _reference(q, k, v, idx)
    err = ((o.float() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, err
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)
    whole = _unsplit(monkeypatch, q, (k, v), idx)
    assert ((o.float() - whole.float()).norm() / whole.float().norm()).item() < 1e-2


def test_split_with_lengths_and_empty_users():
    q, k, v, idx = _problem(5, 4, 64, 1, 4096, H=4, H_kv=1)
    lengths = torch.tensor([4096, 0, 1, 2049], dtype=torch.int32, device="cuda")
    o, lse = ikbo_fa.attention(q, (k, v), idx, kv_lengths=lengths, return_lse=True)
    ref, ref_lse = _reference(q, k, v, idx, lengths)
    assert ((o.float() - ref).norm() / ref.norm()).item() < 1e-2
    empty = idx == 1
    assert (o[empty] == 0).all() and torch.isneginf(lse[empty]).all()
    torch.testing.assert_close(lse[~empty], ref_lse[~empty], rtol=1e-4, atol=1e-4)


def test_split_out_of_range_idx_is_nan_and_isolated():
    q, k, v, idx = _problem(6, 8, 64, 1, 4096)
    bad = idx.clone()
    bad[3] = 8
    o = ikbo_fa.attention(q, (k, v), bad, validate=False)
    assert o[3].isnan().all()
    keep = torch.ones(len(idx), dtype=torch.bool, device="cuda")
    keep[3] = False
    assert not o[keep].isnan().any()


def test_split_graph_replay_follows_new_idx():
    q, k, v, idx = _problem(7, 16, 64, 1, 8192)
    static_idx = idx.clone()
    ikbo_fa.attention(q, (k, v), static_idx)  # compile and plan outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ikbo_fa.attention(q, (k, v), static_idx)
    new = idx[torch.randperm(len(idx), device="cuda")]
    static_idx.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    ref, _ = _reference(q, k, v, new)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("n_splits", [2, 5])
def test_merge_kernel_matches_its_definition(n_splits):
    """The compiled merge against merge_splits (torch), with empty rows and a NaN row."""
    from ikbo_fa.merge_sm90 import merge_kernel

    g = torch.Generator().manual_seed(n_splits)
    B, S, H, D = 9, 3, 2, 128
    ws_o = torch.randn(B, S, n_splits * H, D, generator=g).bfloat16().cuda()
    ws_lse = (torch.randn(B, n_splits * H, S, generator=g) * 4).cuda()
    ws_lse[1] = float("-inf")  # no key in any split
    ws_lse[2, ::H] = float("-inf")  # head 0: no key in any split
    ws_lse[3, 0] = float("-inf")  # split 0, head 0: none in that split
    ws_lse[4, H - 1] = float("nan")
    out, lse = torch.full((B, S, H, D), 7.0).bfloat16().cuda(), torch.full((B, H, S), 7.0).cuda()
    ref, ref_lse = torch.empty_like(out), torch.empty_like(lse)
    attention_mod.merge_splits(ws_o, ws_lse, n_splits, ref, ref_lse)
    merge_kernel(torch.bfloat16, True).fn(ws_o, ws_lse, out, lse, n_splits)
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2, equal_nan=True)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert (out[1] == 0).all() and torch.isneginf(lse[1]).all() and out[4, :, H - 1].isnan().all()
