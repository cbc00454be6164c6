"""GPU tests of 192-row tiles on three consumer warpgroups at D 64 in KV broadcast
(``AttentionPolicy.d64_tile_m``, ``AttentionConfig.tile_m``): against fp32 over padded K/V (keys
ending anywhere in a block, S_q packing 1 to 64 rows a candidate, a candidate over two tiles),
kv_lengths and jagged K/V, one user of 10,000 candidates and ratio 1, key splits (workspace and
last round), scores that jump in a later block, NaN isolation and graph replay."""
import math

import pytest
import torch

import ikbo_fa
from attention_inputs import (check_graph_replay, check_nan_isolation, check_scores_jump, fp32_attention,
                              materialize, random_jagged_problem, random_problem, run_with_policy)

pytestmark = pytest.mark.gpu

TALL = ikbo_fa.AttentionPolicy(d64_tall_gain=100)  # 192-row tiles at any shape


def _check(q, kv, k, v, idx, lengths=None, policy=TALL, **kw):
    out, lse, plan = run_with_policy(policy, q, kv, idx, kv_lengths=lengths, **kw)
    assert plan.config.tile_m == 192 and plan.config.key_block == 128, plan.config
    ref, ref_lse = fp32_attention(q, k, v, idx, "kv", lengths)
    keep = torch.ones(idx.shape[0], dtype=torch.bool, device=q.device)
    if lengths is not None:
        keep = materialize(q, k, v, idx, "kv", lengths)[3] > 0
    assert not out.isnan().any()
    err = ((out[keep].float() - ref[keep]).norm() / ref[keep].norm()).item()
    assert err < 1e-2, err
    torch.testing.assert_close(lse[keep], ref_lse[keep], rtol=1e-4, atol=1e-4)
    assert (out[~keep] == 0).all() and (lse[~keep] == -math.inf).all()
    return plan


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("L", [1, 129, 700])
@pytest.mark.parametrize("S_q", [1, 4, 17, 32, 64, 100])
def test_padded_against_fp32(S_q, L, dtype):
    q, kv, k, v, idx, _ = random_problem(L + S_q, "kv", 70, 5, S_q, 4, 2, 64, L, dtype, device="cuda")
    _check(q, kv, k, v, idx)


@pytest.mark.parametrize("grouped", [False, True])
def test_one_user_of_10000_candidates_and_ratio_1(grouped):
    # 10,000 rows: 52 tiles of 192 and one of 16 rows; idx grouped takes the one-box path
    q, kv, k, v, idx, _ = random_problem(11, "kv", 10_000, 1, 1, 2, 1, 64, 300, torch.bfloat16, sort=grouped,
                                         device="cuda")
    _check(q, kv, k, v, idx)
    q, kv, k, v, idx, _ = random_problem(12, "kv", 50, 50, 16, 2, 1, 64, 200, torch.bfloat16, sort=grouped,
                                         device="cuda")
    _check(q, kv, k, v, idx, broadcast="kv")


@pytest.mark.parametrize("S_q", [1, 16])
def test_rows_of_their_own_lengths(S_q):
    q, kv, k, v, idx, lengths = random_problem(13 + S_q, "kv", 300, 7, S_q, 2, 1, 64, 2500, torch.bfloat16,
                                               jagged=True, device="cuda")
    lengths[0] = 0  # a user of no key: its rows are 0, lse -inf
    _check(q, kv, k, v, idx, lengths)
    qj, kvj, kj, vj, idxj, offsets = random_jagged_problem(14 + S_q, "kv", 300, 4, S_q, 2, 1, 64,
                                                           [0, 1, 3000, 700], torch.bfloat16, device="cuda")
    out, lse, plan = run_with_policy(TALL, qj, kvj, idxj, kv_offsets=offsets)
    assert plan.config.tile_m == 192 and plan.config.jagged
    ref = ikbo_fa.attention_reference(qj.float(), (kj.float(), vj.float()), idxj, kv_offsets=offsets)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


def test_default_takes_192_rows_where_users_fill_them():
    for S_q, rows in ((1, 128), (16, 192)):
        q, kv, k, v, idx, _ = random_problem(S_q, "kv", 2048, 32, S_q, 2, 2, 64, 600, torch.bfloat16, sort=True,
                                             device="cuda")
        out, lse, plan = run_with_policy(None, q, kv, idx)
        assert plan.config.tile_m == rows, (S_q, plan.config)
        ref, _ = fp32_attention(q, k, v, idx, "kv", None)
        assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


def test_split_keys():
    # Few tiles over long rows: the keys split over a workspace (never a split pair on 192 rows)
    q, kv, k, v, idx, _ = random_problem(15, "kv", 8, 2, 4, 2, 1, 64, 8192, torch.bfloat16, device="cuda")
    plan = _check(q, kv, k, v, idx)
    assert plan.config.split_kv and not plan.config.split_pair and plan.n_splits > 1
    # The last round's tiles split: 2,000 candidates of 20 users at S_q 16, 2 heads (about 340 tiles)
    tail = ikbo_fa.AttentionPolicy(d64_tall_gain=100, tail_split_from=1, tail_merge_blocks=0, tail_split_tall=True)
    q, kv, k, v, idx, _ = random_problem(16, "kv", 2000, 20, 16, 2, 1, 64, 4096, torch.bfloat16, sort=True,
                                         device="cuda")
    plan = _check(q, kv, k, v, idx, policy=tail)
    assert plan.config.tail_split and plan.n_splits > 1


@pytest.mark.parametrize("factor", [4.0, 60.0])
def test_scores_jump_in_a_later_block(factor):
    assert check_scores_jump(TALL, factor, 150).config.tile_m == 192


def test_nan_and_out_of_range_stay_in_their_rows():
    q, kv, k, v, idx, _ = random_problem(3, "kv", 64, 4, 17, 2, 1, 64, 400, torch.bfloat16, device="cuda")
    check_nan_isolation(TALL, q, kv, k, v, idx, nan_rows=(7, 40), nan_key=250, bad_rows=(5, 60))


def test_graph_replay_with_new_idx():
    q, kv, k, v, idx, _ = random_problem(5, "kv", 200, 6, 4, 2, 1, 64, 600, torch.bfloat16, device="cuda")
    check_graph_replay(TALL, q, kv, k, v, idx, 6)
