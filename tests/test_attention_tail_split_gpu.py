"""GPU tests of the last round's split (``AttentionPolicy.tail_split``, ``AttentionConfig.tail_split``):
KV broadcast over padded K/V whose tiles fill whole rounds of the grid and part of one more runs
those rounds' tiles whole and splits the rest. Against fp32 at one user of 10,000 candidates,
ratio 1, keys that end anywhere in a block, S_q 1 to 64, both dtypes and head dims; NaN isolation,
out-of-range indices, graph replay with idx written in place, and the default's pick."""
import math

import pytest
import torch

import ikbo_fa
from attention_inputs import assert_nan_rows_only, capture_graph, materialize, random_problem, run_with_policy

pytestmark = pytest.mark.gpu

TAIL = ikbo_fa.AttentionPolicy(tail_merge_blocks=0)  # the last round split wherever it has tiles to spread


def _fp32(q, k, v, idx):
    """fp32 attention on the materialized problem -> (out [B, S_q, H, D], lse [B, H, S_q])."""
    qm, km, vm, _ = materialize(q, k, v, idx, "kv", None)
    group = q.shape[2] // k.shape[2]
    qf = qm.float().transpose(1, 2)
    kf = km.float().repeat_interleave(group, dim=2).transpose(1, 2)
    vf = vm.float().repeat_interleave(group, dim=2).transpose(1, 2)
    s = qf @ kf.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return (torch.softmax(s, dim=-1) @ vf).transpose(1, 2), torch.logsumexp(s, dim=-1)


def _tiles(idx, U, S_q, H):
    """The launch's tiles over every head: each user's rows in 128-row tiles."""
    counts = torch.bincount(idx.long().cpu(), minlength=U)
    return H * int(((counts * S_q + 127) // 128).sum())


def _check(q, kv, k, v, idx, policy=TAIL):
    out, lse, plan = run_with_policy(policy, q, kv, idx)
    assert plan.config.tail_split and plan.n_splits > 1, (plan.config, plan.n_splits)
    tiles = _tiles(idx, k.shape[0], q.shape[1], q.shape[2])
    assert tiles > plan.n_ctas and tiles % plan.n_ctas, (tiles, plan.n_ctas)  # whole rounds and a split tail
    ref, ref_lse = _fp32(q, k, v, idx)
    assert not out.isnan().any() and not lse.isnan().any()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, err
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)
    return out, lse


# (B, U, S_q, H, H_kv, D, L, sorted): tiles over every head past one round of 132 SMs and short of
# the next, with keys ending inside a block (300, 700, 1000) and on one (1024)
SHAPES = [
    (2048, 32, 16, 2, 2, 128, 1024, True),  # the S_q sweep's point: 4 rounds and 16 tiles
    (1000, 9, 4, 4, 2, 64, 700, False),  # uneven users, shuffled idx, GQA
    (10000, 1, 1, 2, 1, 128, 300, True),  # one user of 10,000 candidates
    (300, 300, 64, 1, 1, 64, 1000, False),  # ratio 1: every candidate its own user
    (1500, 25, 17, 2, 1, 128, 513, False),  # a candidate over two tiles
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-U{}-sq{}-h{}-d{}-L{}".format(*s[:4], s[5], s[6]))
def test_tail_split_against_fp32(shape, dtype):
    B, U, S_q, H, H_kv, D, L, sort = shape
    q, kv, k, v, idx, _ = random_problem(B + S_q, "kv", B, U, S_q, H, H_kv, D, L, dtype, sort=sort, device="cuda")
    _check(q, kv, k, v, idx)


def test_the_same_results_as_without_it():
    q, kv, k, v, idx, _ = random_problem(11, "kv", 2048, 32, 16, 2, 2, 128, 1024, torch.bfloat16, device="cuda")
    out, lse = _check(q, kv, k, v, idx, policy=None)  # the default takes it here
    out0, lse0, plan0 = run_with_policy(ikbo_fa.AttentionPolicy(tail_split=False), q, kv, idx)
    assert not plan0.config.tail_split
    assert ((out.float() - out0.float()).norm() / out0.float().norm()).item() < 1e-2
    torch.testing.assert_close(lse, lse0, rtol=1e-4, atol=1e-4)


def test_nan_and_out_of_range_stay_in_their_rows():
    q, kv, k, v, idx, _ = random_problem(3, "kv", 1000, 9, 10, 2, 1, 128, 700, torch.bfloat16, device="cuda")
    _check(q, kv, k, v, idx)
    clean = ikbo_fa.attention(q, kv, idx, policy=TAIL)
    # a NaN in one query row changes that row only, bit for bit elsewhere (whole tiles and split ones)
    for b in (7, 990):
        q_nan = q.clone()
        q_nan[b, 3, 1, 10] = float("nan")
        o = ikbo_fa.attention(q_nan, kv, idx, policy=TAIL)
        other = torch.ones_like(o, dtype=torch.bool)
        other[b, 3, 1] = False
        assert torch.equal(o[other], clean[other])
    # a NaN key of user 1 makes its candidates NaN, no other
    k_nan = k.clone()
    k_nan[1, 650, 0, 3] = float("nan")
    o = ikbo_fa.attention(q, (k_nan, v), idx, policy=TAIL)
    assert o[idx == 1].isnan().all() and not o[idx != 1].isnan().any()
    # out-of-range indices give NaN rows (out and lse), no other
    bad_idx = idx.clone()
    bad_idx[5], bad_idx[900] = 9, -1
    out = torch.full_like(q, float("nan"))
    _, lse = ikbo_fa.attention(q, kv, bad_idx, out=out, return_lse=True, validate=False, policy=TAIL)
    bad = torch.zeros(1000, dtype=torch.bool, device="cuda")
    bad[5] = bad[900] = True
    assert_nan_rows_only(out, lse, bad)


def test_graph_replay_with_new_idx():
    q, kv, k, v, idx, _ = random_problem(5, "kv", 1000, 9, 10, 2, 1, 128, 700, torch.bfloat16, device="cuda")
    _check(q, kv, k, v, idx)
    out = torch.full_like(q, float("nan"))
    ikbo_fa.attention(q, kv, idx, out=out, policy=TAIL)
    graph = capture_graph(lambda: ikbo_fa.attention(q, kv, idx, out=out, policy=TAIL))
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        idx.copy_(torch.randint(0, 9, (1000,), generator=g).cuda())
        out.fill_(float("nan"))
        graph.replay()
        ref, _ = _fp32(q, k, v, idx)
        assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
