"""GPU tests of the 192-key main-loop block at D 64 over padded K/V (``AttentionPolicy.d64_key_block``,
``d64_wide_min_keys``; ``AttentionConfig.key_block``): both directions against fp32, keys that end
anywhere in a block, scores that jump in a later block, NaN isolation, graph replay, and where the
op keeps 128-key blocks."""
import math

import pytest
import torch

import ikbo_fa
from attention_inputs import (check_graph_replay, check_nan_isolation, check_scores_jump, fp32_attention, materialize,
                              random_problem, run_with_policy)

pytestmark = pytest.mark.gpu

# 192-key blocks at any L (on 128-row tiles: 192-row ones take 128-key blocks)
WIDE = ikbo_fa.AttentionPolicy(d64_wide_min_keys=0, split_kv=False, d64_tile_m=128)


def _check(q, kv, k, v, idx, direction, lengths=None, policy=WIDE, **kw):
    out, lse, plan = run_with_policy(policy, q, kv, idx, kv_lengths=lengths, **kw)
    assert plan.config.key_block == 192, plan.config
    ref, ref_lse = fp32_attention(q, k, v, idx, direction, lengths)
    keep = torch.ones(idx.shape[0], dtype=torch.bool, device=q.device)
    if lengths is not None:
        keep = materialize(q, k, v, idx, direction, lengths)[3] > 0
    assert not out.isnan().any()
    err = ((out[keep].float() - ref[keep]).norm() / ref[keep].norm()).item()
    assert err < 1e-2, err
    torch.testing.assert_close(lse[keep], ref_lse[keep], rtol=1e-4, atol=1e-4)
    assert (out[~keep] == 0).all() and (lse[~keep] == -math.inf).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("L", [1, 191, 192, 193, 700])
@pytest.mark.parametrize("S_q", [1, 17, 64])
@pytest.mark.parametrize("direction", ["kv", "q"])
def test_padded_every_block_end(direction, S_q, L, dtype):
    q, kv, k, v, idx, _ = random_problem(L + S_q, direction, 70, 5, S_q, 4, 2, 64, L, dtype, device="cuda")
    _check(q, kv, k, v, idx, direction)


@pytest.mark.parametrize("direction", ["kv", "q"])
def test_rows_of_their_own_lengths_keep_128_key_blocks(direction):
    # kv_lengths and kv_offsets: rows may be far shorter than L, where a 192-key block pads more.
    q, kv, k, v, idx, lengths = random_problem(4, direction, 90, 7, 4, 2, 1, 64, 2500, torch.bfloat16,
                                               jagged=True, device="cuda")
    out, lse, plan = run_with_policy(WIDE, q, kv, idx, kv_lengths=lengths)
    assert plan.config.key_block == 128, plan.config
    ref, _ = fp32_attention(q, k, v, idx, direction, lengths)
    keep = materialize(q, k, v, idx, direction, lengths)[3] > 0
    assert ((out[keep].float() - ref[keep]).norm() / ref[keep].norm()).item() < 1e-2
    if direction == "kv":
        offsets = torch.tensor([0, 100, 2600], device="cuda")
        kj, vj = (torch.randn(2600, 1, 64, device="cuda").bfloat16() for _ in range(2))
        _, _, plan = run_with_policy(WIDE, q[:8], (kj, vj), torch.tensor([0, 1] * 4, device="cuda"),
                                     kv_offsets=offsets)
        assert plan.config.key_block == 128, plan.config


def test_default_takes_192_from_2048_keys():
    # on 128-row tiles (the default's 192-row ones, here at S_q 64, take 128-key blocks)
    for L, block in ((1024, 128), (2048, 192)):
        q, kv, k, v, idx, _ = random_problem(L, "kv", 2048, 32, 64, 2, 2, 64, L, torch.bfloat16, sort=True,
                                             device="cuda")
        out, lse, plan = run_with_policy(ikbo_fa.AttentionPolicy(d64_tile_m=128), q, kv, idx)
        assert plan.config.key_block == block, (L, plan.config)
        assert not out.isnan().any()


@pytest.mark.parametrize("factor", [4.0, 60.0])
def test_scores_jump_in_a_later_block(factor):
    assert check_scores_jump(WIDE, factor, 96).config.key_block == 192


def test_nan_and_out_of_range_stay_in_their_rows():
    q, kv, k, v, idx, _ = random_problem(3, "kv", 64, 4, 17, 2, 1, 64, 400, torch.bfloat16, device="cuda")
    check_nan_isolation(WIDE, q, kv, k, v, idx, nan_rows=(7,), nan_key=250, bad_rows=(5, 40))


def test_graph_replay_with_new_idx():
    q, kv, k, v, idx, _ = random_problem(5, "kv", 200, 6, 4, 2, 1, 64, 600, torch.bfloat16, device="cuda")
    check_graph_replay(WIDE, q, kv, k, v, idx, 6)


def test_split_keys_keep_128_key_blocks():
    # Few tiles over long rows: the default split goes over the keys, and the key block stays 128.
    q, kv, k, v, idx, _ = random_problem(9, "kv", 4, 2, 1, 1, 1, 64, 8192, torch.bfloat16, device="cuda")
    out, lse, plan = run_with_policy(ikbo_fa.AttentionPolicy(d64_wide_min_keys=0), q, kv, idx)
    cfg = plan.config
    assert (cfg.split_kv or cfg.split_pair) and cfg.key_block == 128, cfg
    ref, _ = fp32_attention(q, k, v, idx, "kv", None)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
