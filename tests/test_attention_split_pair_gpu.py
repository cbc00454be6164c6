"""GPU tests of split pairs (``AttentionConfig.split_pair``): two splits of a row's keys on the
two CTAs of a cluster, merged there; against fp32 and the workspace split, S_q 1 to 64, sorted
and shuffled, kv_lengths with empty splits and users, jagged, NaN rows, a small grid of many
tiles per cluster, and graph replay.
"""
import importlib

import pytest
import torch

import ikbo_fa
from attention_inputs import run_with_policy, user_groups
from ikbo_fa import AttentionPolicy

pytestmark = pytest.mark.gpu
attention_mod = importlib.import_module("ikbo_fa.attention")
# The half-idle split rule (not split_by_cost, whose merge launch cost rarely takes a workspace pair).
PAIR = AttentionPolicy(split_min_keys=512, split_pair=True, split_by_cost=False, d64_tile_m=128)  # pairs: 128 rows


def _run(pair, q, kv, idx, **kw):
    """The op with split pairs on or off -> (out, lse, the config it compiled)."""
    # The static walk: under the dynamic one jagged rows never split in pairs.
    policy = AttentionPolicy(split_min_keys=512, split_pair=pair, split_by_cost=False, dynamic_walk=False,
                             d64_tile_m=128)
    out, lse, plan = run_with_policy(policy, q, kv, idx, **kw)
    return out, lse, plan.config


def _pair(q, kv, idx, **kw):
    """The op with split pairs and with the workspace split: both two splits, both against fp32."""
    out, lse, cfg = _run(True, q, kv, idx, **kw)
    ws, ws_lse, ws_cfg = _run(False, q, kv, idx, **kw)
    assert cfg.split_pair and ws_cfg.split_kv
    k, v = kv
    ref, ref_lse = ikbo_fa.attention_reference(q.float(), (k.float(), v.float()), idx, return_lse=True,
                                               validate=False, **kw)  # NaN rows for an index out of range
    U = kw["kv_offsets"].shape[0] - 1 if "kv_offsets" in kw else k.shape[0]
    bad = (idx < 0) | (idx >= U)
    assert out[bad].isnan().all() and lse[bad].isnan().all()
    keep = ~bad
    empty = torch.isneginf(ref_lse) & keep[:, None, None]
    assert torch.isneginf(lse[empty]).all() and (out.transpose(1, 2)[empty] == 0).all()
    for o in (out, ws):
        assert not o[keep].isnan().any()
        assert ((o[keep].float() - ref[keep]).norm() / ref[keep].norm()).item() < 1e-2
    live = keep[:, None, None] & ~empty
    torch.testing.assert_close(lse[live], ref_lse[live], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.float(), ws.float(), rtol=2e-2, atol=2e-2, equal_nan=True)
    return out, lse


@pytest.mark.parametrize("order", ["sorted", "shuffled"])
@pytest.mark.parametrize("S_q, U, ratio, L", [(1, 32, 64, 1024), (1, 20, 65, 1500), (2, 16, 64, 1200),
                                              (17, 6, 30, 1100), (64, 4, 3, 1400)])
def test_split_pair_matches_fp32(order, S_q, U, ratio, L):
    """Tiles of at most 64 rows (only warpgroup 0's rows exchanged) and of more, splits ending
    inside a key block. Every shape has at most 66 (tile, head) pairs and fewer than 1536 keys:
    two splits of at least 512."""
    q, k, v, idx = user_groups(S_q + U, U, ratio, S_q, L, order=order)
    _pair(q, (k, v), idx)


def test_split_pair_lengths_nan_and_small_grid(monkeypatch, fresh_attention_plans):
    """kv_lengths with users of no key and of keys in the first split only (the second split has
    none); an out-of-range index; 3 clusters, so each walks many tiles (the exchange's barriers
    change phase many times); fp16, D 64, grouped heads."""
    monkeypatch.setattr(attention_mod, "max_active_clusters", lambda device, size: 3)
    q, k, v, idx = user_groups(3, 8, 10, 17, 1400, H=4, D=64, order="shuffled", dtype=torch.float16)
    k, v = k[:, :, :2].contiguous(), v[:, :, :2].contiguous()
    idx[5] = 8
    lengths = torch.randint(0, 1401, (8,))
    lengths[:4] = torch.tensor([0, 1, 511, 512])
    _pair(q, (k, v), idx, kv_lengths=lengths.cuda())


def test_split_pair_jagged():
    U, ratio, S_q, H, D = 30, 60, 1, 2, 128
    lens = torch.randint(0, 2000, (U,))
    lens[:3] = torch.tensor([0, 700, 1999])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).cuda()
    idx = torch.arange(U).repeat_interleave(ratio).cuda()
    q = torch.randn(U * ratio, S_q, H, D, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(int(offsets[-1]), H, D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    _pair(q, (k, v), idx, kv_offsets=offsets, max_kv_len=2000)


def test_split_pair_graph_replay():
    q, k, v, idx = user_groups(9, 32, 64, 1, 1024)
    out = torch.empty_like(q)
    ikbo_fa.attention(q, (k, v), idx, out=out, policy=PAIR)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ikbo_fa.attention(q, (k, v), idx, out=out, policy=PAIR)
    assert attention_mod.launch_plan(q, (k, v), idx, out=out, policy=PAIR).config.split_pair
    for _ in range(3):
        idx.copy_(idx[torch.randperm(idx.shape[0], device="cuda")])
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = ikbo_fa.attention_reference(q.float(), (k.float(), v.float()), idx)
        assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
