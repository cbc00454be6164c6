"""GPU tests of the last round's split (``AttentionPolicy.tail_split``, ``AttentionConfig.tail_split``):
KV broadcast over padded K/V whose tiles fill whole rounds of the grid and part of one more runs
those rounds' tiles whole and splits the rest. Against fp32 at one user of 10,000 candidates,
ratio 1, keys that end anywhere in a block, S_q 1 to 64, both dtypes and head dims; NaN isolation,
out-of-range indices, graph replay with idx written in place, and the default's pick."""

import pytest
import torch

import ikbo_fa
from attention_inputs import check_graph_replay, check_nan_isolation, fp32_attention, random_problem, run_with_policy

pytestmark = pytest.mark.gpu

# the last round split wherever it has tiles to spread, unsplit plans replaced too
# (on 128-row tiles; tests/test_attention_tile192_gpu.py splits 192-row ones)
TAIL = ikbo_fa.AttentionPolicy(tail_split=True, tail_merge_blocks=0, tail_split_from=1, d64_tile_m=128)


def _tiles(idx, U, S_q, H, rows):
    """The launch's tiles over every head: each user's rows in tiles of ``rows`` rows."""
    counts = torch.bincount(idx.long().cpu(), minlength=U)
    return H * int(((counts * S_q + rows - 1) // rows).sum())


def _check(q, kv, k, v, idx, policy=TAIL):
    out, lse, plan = run_with_policy(policy, q, kv, idx, broadcast="kv")
    assert plan.config.tail_split and plan.n_splits > 1, (plan.config, plan.n_splits)
    tiles = _tiles(idx, k.shape[0], q.shape[1], q.shape[2], plan.config.tile_m)
    assert tiles > plan.n_ctas and tiles % plan.n_ctas, (tiles, plan.n_ctas)  # whole rounds and a split tail
    ref, ref_lse = fp32_attention(q, k, v, idx)
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
def test_tail_split_againstfp32_attention(shape, dtype):
    B, U, S_q, H, H_kv, D, L, sort = shape
    q, kv, k, v, idx, _ = random_problem(B + S_q, "kv", B, U, S_q, H, H_kv, D, L, dtype, sort=sort, device="cuda")
    _check(q, kv, k, v, idx)


def test_the_same_results_as_without_it():
    # S_q 16, L 4096: the plan splits the last round instead of every row in pairs
    q, kv, k, v, idx, _ = random_problem(11, "kv", 1024, 16, 16, 2, 2, 128, 4096, torch.bfloat16, device="cuda")
    out, lse = _check(q, kv, k, v, idx, policy=ikbo_fa.AttentionPolicy(tail_split=True))
    out0, lse0, plan0 = run_with_policy(ikbo_fa.AttentionPolicy(tail_split=False), q, kv, idx)
    assert not plan0.config.tail_split
    assert ((out.float() - out0.float()).norm() / out0.float().norm()).item() < 1e-2
    torch.testing.assert_close(lse, lse0, rtol=1e-4, atol=1e-4)


def test_nan_and_out_of_range_stay_in_their_rows():
    # rows 7 and 990: near the first tiles (whole) and the last ones (split)
    q, kv, k, v, idx, _ = random_problem(3, "kv", 1000, 9, 10, 2, 1, 128, 700, torch.bfloat16, device="cuda")
    _check(q, kv, k, v, idx)
    check_nan_isolation(TAIL, q, kv, k, v, idx, nan_rows=(7, 990), nan_key=650, bad_rows=(5, 900))


def test_same_bits_every_run():
    # Shuffled idx: the work list's order within a user may change from run to run, and a user's
    # tiles are all whole or all split, so no row moves between the two.
    q, kv, k, v, idx, _ = random_problem(8, "kv", 1000, 9, 10, 2, 1, 128, 700, torch.bfloat16, device="cuda")
    _check(q, kv, k, v, idx)
    first = ikbo_fa.attention(q, kv, idx, policy=TAIL)
    for _ in range(8):
        assert torch.equal(ikbo_fa.attention(q, kv, idx, policy=TAIL), first)


def test_graph_replay_with_new_idx():
    q, kv, k, v, idx, _ = random_problem(5, "kv", 1000, 9, 10, 2, 1, 128, 700, torch.bfloat16, device="cuda")
    _check(q, kv, k, v, idx)
    check_graph_replay(TAIL, q, kv, k, v, idx, 9)
