"""GPU tests of ikbo_fa.attention on sm_90: against fp32 attention on materialized
tensors, with an error budget of 1.5x torch SDPA's error in the same dtype. The contract
attention shares with lce (layouts, out=, autograd, CUDA graphs, the disk cache) is in
test_op_contract_gpu.py."""
import dataclasses
import importlib
import math

import pytest
import torch
import torch.nn.functional as F

import ikbo_fa
from attention_inputs import materialize, random_problem

pytestmark = pytest.mark.gpu


def _make(direction, B, U, S_q, H, H_kv, D, L, dtype, *, jagged, packed, seed, sort=False):
    return random_problem(seed, direction, B, U, S_q, H, H_kv, D, L, dtype, packed=packed, jagged=jagged,
                          sort=sort, device="cuda")


def _attention_fp32(q, k, v, scale, lengths, chunk=64):
    """fp32 attention on materialized [B, *, H, D] tensors -> (out, lse)."""
    B, S_q, H, D = q.shape
    group = H // k.shape[2]
    out = torch.empty(B, S_q, H, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, H, S_q, dtype=torch.float32, device=q.device)
    for s in range(0, B, chunk):
        sl = slice(s, min(B, s + chunk))
        qb = q[sl].float().transpose(1, 2)
        kb = k[sl].float().repeat_interleave(group, dim=2).transpose(1, 2)
        vb = v[sl].float().repeat_interleave(group, dim=2).transpose(1, 2)
        sc = qb @ kb.transpose(-1, -2) * scale
        if lengths is not None:
            keep = torch.arange(k.shape[1], device=q.device)[None, :] < lengths[sl, None]
            sc = sc.masked_fill(~keep[:, None, None, :], float("-inf"))
        lse[sl] = torch.logsumexp(sc, dim=-1)
        p = torch.softmax(sc, dim=-1).nan_to_num(0.0)
        out[sl] = (p @ vb).transpose(1, 2)
    return out, lse


def _sdpa(q, k, v, scale, lengths, chunk=64):
    B, S_q, H, D = q.shape
    group = H // k.shape[2]
    out = torch.empty_like(q)
    for s in range(0, B, chunk):
        sl = slice(s, min(B, s + chunk))
        mask = None
        if lengths is not None:
            mask = (torch.arange(k.shape[1], device=q.device)[None, :] < lengths[sl, None])[:, None, None, :]
        kb = k[sl].repeat_interleave(group, dim=2)
        vb = v[sl].repeat_interleave(group, dim=2)
        out[sl] = F.scaled_dot_product_attention(
            q[sl].transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2), attn_mask=mask, scale=scale
        ).transpose(1, 2)
    return out


def _rel(a, b):
    return ((a.float() - b).norm() / b.norm().clamp_min(1e-30)).item()


CASES = [
    # direction, B, U, S_q, H, H_kv, D, L, dtype, jagged, packed, lse
    ("kv", 2048, 32, 64, 2, 2, 128, 1024, torch.bfloat16, False, False, True),
    ("kv", 512, 51, 32, 4, 1, 128, 500, torch.bfloat16, True, True, False),
    ("kv", 3, 3, 1, 1, 1, 64, 1, torch.float16, False, False, True),
    ("kv", 2048, 2, 100, 6, 6, 64, 100, torch.float16, True, False, True),
    ("kv", 1, 1, 128, 2, 1, 128, 4096, torch.bfloat16, False, False, False),
    ("kv", 512, 8, 64, 2, 1, 64, 2048, torch.bfloat16, True, False, True),
    ("kv", 512, 8, 64, 4, 4, 128, 512, torch.float16, False, True, False),
    ("q", 512, 8, 64, 2, 2, 128, 512, torch.bfloat16, False, False, True),
    ("q", 3, 1, 100, 4, 1, 64, 1000, torch.float16, True, False, False),
    ("q", 2048, 2, 32, 1, 1, 128, 100, torch.bfloat16, True, True, False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
def test_matches_fp32_within_sdpa_error(case):
    direction, B, U, S_q, H, H_kv, D, L, dtype, jagged, packed, want_lse = case
    q, kv, k, v, idx, lengths = _make(direction, B, U, S_q, H, H_kv, D, L, dtype, jagged=jagged,
                                      packed=packed, seed=B + 7 * S_q + L)
    scale = 1.0 / math.sqrt(D)
    out = torch.full((B, S_q, H, D), float("nan"), dtype=dtype, device="cuda")
    broadcast = direction if B == U else None
    res = ikbo_fa.attention(q, kv, idx, kv_lengths=lengths, broadcast=broadcast, out=out, return_lse=want_lse)
    if want_lse:
        res, lse = res
    assert res is out
    qm, km, vm, lm = materialize(q, k, v, idx, direction, lengths)
    ref, ref_lse = _attention_fp32(qm, km, vm, scale, lm)
    assert not out.isnan().any()
    if lm is not None:
        empty = lm == 0
        assert (out[empty] == 0).all()
        if want_lse:
            assert torch.isneginf(lse[empty]).all()
        keep = ~empty
    else:
        keep = torch.ones(B, dtype=torch.bool, device="cuda")
    err = _rel(out[keep], ref[keep])
    sdpa_err = _rel(_sdpa(qm, km, vm, scale, lm)[keep], ref[keep])
    assert err <= 1.5 * sdpa_err + 1e-6, (err, sdpa_err)
    if want_lse:
        torch.testing.assert_close(lse[keep], ref_lse[keep], rtol=1e-4, atol=1e-4)


Q_CASES = [
    # B, U, S_q, H, H_kv, D, L, dtype, jagged, broadcast (None: told by the batches)
    (300, 7, 1, 4, 2, 64, 300, torch.float16, True, None),  # 8-row slots, eight to a warpgroup
    (300, 7, 17, 2, 1, 128, 257, torch.bfloat16, True, None),  # 32-row slots, partly filled
    (64, 64, 200, 2, 2, 128, 129, torch.bfloat16, False, "q"),  # a candidate over two tiles; B = U
    (40, 3, 200, 4, 1, 64, 300, torch.float16, True, None),
]


@pytest.mark.parametrize("case", Q_CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
def test_q_broadcast_short_and_long_s_q(case):
    """Q broadcast at S_q 1, 17 and 200 with idx in no order: against fp32 attention_reference,
    within 1.5x SDPA's error."""
    B, U, S_q, H, H_kv, D, L, dtype, jagged, broadcast = case
    q, kv, k, v, idx, lengths = _make("q", B, U, S_q, H, H_kv, D, L, dtype, jagged=jagged, packed=False,
                                      seed=B + 7 * S_q + L)
    assert not bool((idx[1:] >= idx[:-1]).all())  # shuffled
    out = torch.full((B, S_q, H, D), float("nan"), dtype=dtype, device="cuda")
    _, lse = ikbo_fa.attention(q, kv, idx, kv_lengths=lengths, broadcast=broadcast, out=out, return_lse=True)
    ref, ref_lse = ikbo_fa.attention_reference(q.float(), (k.float(), v.float()), idx, kv_lengths=lengths,
                                               broadcast=broadcast, return_lse=True)
    assert not out.isnan().any() and not lse.isnan().any()
    keep = torch.ones(B, dtype=torch.bool, device="cuda") if lengths is None else lengths > 0
    assert (out[~keep] == 0).all() and torch.isneginf(lse[~keep]).all()
    qm, km, vm, lm = materialize(q, k, v, idx, "q", lengths)
    err = _rel(out[keep], ref[keep])
    sdpa_err = _rel(_sdpa(qm, km, vm, 1.0 / math.sqrt(D), lm)[keep], ref[keep])
    assert err <= 1.5 * sdpa_err + 1e-6, (err, sdpa_err)
    torch.testing.assert_close(lse[keep], ref_lse[keep], rtol=1e-4, atol=1e-4)


JUMP_CASES = [
    # direction, B, U, S_q, H, H_kv, D, L, dtype, jagged
    ("kv", 96, 3, 64, 2, 2, 128, 1000, torch.bfloat16, False),
    ("q", 64, 4, 100, 4, 1, 64, 1000, torch.float16, True),
]


@pytest.mark.parametrize("case", JUMP_CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
@pytest.mark.parametrize("factor", [4.0, 60.0])
@pytest.mark.parametrize("keys", [(0, 200), (300, 420)])
def test_scores_jump_in_a_later_block(keys, factor, case):
    # Blocks run from the last keys to the first; keys scaled up here make the row max jump
    # in a later block. Factor 4: by about 2^13 in the exponent (P and O rescaled in the
    # loop); factor 60: by more than float32's range (the rows recomputed exactly).
    direction, B, U, S_q, H, H_kv, D, L, dtype, jagged = case
    q, kv, k, v, idx, lengths = _make(direction, B, U, S_q, H, H_kv, D, L, dtype, jagged=jagged, packed=False,
                                      seed=keys[0] + int(factor) + D)
    k[:, keys[0]:keys[1]] *= factor
    scale = 1.0 / math.sqrt(D)
    out = torch.full((B, S_q, H, D), float("nan"), dtype=dtype, device="cuda")
    _, lse = ikbo_fa.attention(q, kv, idx, kv_lengths=lengths, out=out, return_lse=True)
    qm, km, vm, lm = materialize(q, k, v, idx, direction, lengths)
    ref, ref_lse = _attention_fp32(qm, km, vm, scale, lm)
    assert not out.isnan().any()
    keep = torch.ones(B, dtype=torch.bool, device="cuda") if lm is None else lm > 0
    err = _rel(out[keep], ref[keep])
    sdpa_err = _rel(_sdpa(qm, km, vm, scale, lm)[keep], ref[keep])
    assert err <= 1.5 * sdpa_err + 1e-6, (err, sdpa_err)
    torch.testing.assert_close(lse[keep], ref_lse[keep], rtol=1e-4, atol=1e-4)


def test_result_does_not_depend_on_the_warp_neighbour():
    """S_q <= 8 puts two candidates in one consumer warp: the rescale and the exact recompute that
    one of them needs must leave the other's rows alone (else the one-launch work list, whose
    order within a user varies, makes results vary from run to run)."""
    g = torch.Generator().manual_seed(0)
    S_q, H, D, L = 8, 1, 64, 256
    k = torch.randn(1, L, H, D, generator=g)
    k[0, 5, 0, :32], k[0, 5, 0, 32:] = 30.0, 0.0  # in the block processed last
    v = torch.randn(1, L, H, D, generator=g)
    x = torch.randn(S_q, H, D, generator=g)
    x[..., :32] = 0.0  # ordinary scores
    a = torch.zeros(S_q, H, D)
    a[..., :32] = 1.0  # key 5 scores 960: its max jumps past REDO_MAX (exact recompute)
    b = torch.randn(S_q, H, D, generator=g)
    b[..., :32] = 0.0
    cast = lambda t: t.to(torch.bfloat16).cuda()  # noqa: E731
    k, v = cast(k), cast(v)
    idx = torch.zeros(2, dtype=torch.int32, device="cuda")
    with_a = ikbo_fa.attention(cast(torch.stack([x, a])), (k, v), idx)
    with_b = ikbo_fa.attention(cast(torch.stack([x, b])), (k, v), idx)
    assert torch.equal(with_a[0], with_b[0])
    ref = ikbo_fa.attention_reference(cast(torch.stack([x, a])), (k, v), idx)
    assert _rel(with_a[1], ref[1].float()) < 1e-2


@pytest.mark.parametrize("direction", ["kv", "q"])
def test_out_of_range_index_gives_nan_rows_only(direction):
    B, U, S_q, H, D, L = 64, 4, 64, 2, 128, 300
    q, kv, k, v, idx, _ = _make(direction, B, U, S_q, H, H, D, L, torch.bfloat16, jagged=False, packed=False, seed=3)
    idx[5] = U
    idx[9] = -1
    idx[10] = 1 << 20
    with pytest.raises(IndexError, match=r"idx\[5\]"):
        ikbo_fa.attention(q, kv, idx, validate=True)
    out, lse = ikbo_fa.attention(q, kv, idx, validate=False, return_lse=True)
    ref, ref_lse = ikbo_fa.attention_reference(q, kv, idx, validate=False, return_lse=True)
    bad = torch.zeros(B, dtype=torch.bool, device="cuda")
    bad[[5, 9, 10]] = True
    assert out[bad].isnan().all() and lse[bad].isnan().all()
    assert not out[~bad].isnan().any()
    assert _rel(out[~bad], ref[~bad].float()) < 1e-2
    torch.testing.assert_close(lse[~bad], ref_lse[~bad], rtol=1e-4, atol=1e-4)


def test_nan_in_one_user_stays_in_that_user():
    B, U, S_q, H, D, L = 256, 4, 64, 2, 128, 700
    q, kv, k, v, idx, _ = _make("kv", B, U, S_q, H, H, D, L, torch.bfloat16, jagged=False, packed=False, seed=4)
    k[2, 13, 1, 5] = float("nan")
    v[1, 650, 0, 0] = float("inf")
    out = ikbo_fa.attention(q, (k, v), idx)
    clean = (idx != 2) & (idx != 1)
    assert not out[clean].isnan().any()
    assert out[idx == 2][:, :, 1].isnan().all()


def test_jagged_padding_not_finite_is_ignored():
    B, U, S_q, H, D, L = 128, 4, 32, 2, 64, 300
    q, kv, k, v, idx, _ = _make("kv", B, U, S_q, H, 1, D, L, torch.bfloat16, jagged=False, packed=False, seed=5)
    lengths = torch.tensor([17, 300, 129, 0], device="cuda")
    for u in range(U):
        k[u, lengths[u]:] = float("nan")
        v[u, lengths[u]:] = float("nan")
    out = ikbo_fa.attention(q, (k, v), idx, kv_lengths=lengths)
    assert torch.isfinite(out).all()
    ref = ikbo_fa.attention_reference(q, (k, v), idx, kv_lengths=lengths)
    assert _rel(out, ref.float()) < 1e-2


@pytest.mark.parametrize("scale", [0.0, -0.05, 0.5])
def test_scale_zero_negative_and_large(scale):
    # scale 0: every valid key weighs the same (O = mean of V); the rescale of the tile's
    # first block must not produce exp2(-inf * 0).
    B, U, S_q, H, D, L = 300, 5, 64, 2, 128, 700
    q, kv, k, v, idx, lengths = _make("kv", B, U, S_q, H, H, D, L, torch.bfloat16, jagged=True, packed=False,
                                      seed=8)
    out = torch.full((B, S_q, H, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    ikbo_fa.attention(q, kv, idx, kv_lengths=lengths, scale=scale, out=out)
    qm, km, vm, lm = materialize(q, k, v, idx, "kv", lengths)
    ref, _ = _attention_fp32(qm, km, vm, scale, lm)
    keep = lm != 0
    assert (out[~keep] == 0).all()
    err = _rel(out[keep], ref[keep])
    sdpa_err = _rel(_sdpa(qm, km, vm, scale, lm)[keep], ref[keep])
    assert err <= 1.5 * sdpa_err + 1e-6, (err, sdpa_err)


@pytest.mark.parametrize("scale", [1e-300, -1e-300, 1e-45])
def test_scale_below_float32_normal_range(scale):
    """scale * log2(e) under float32's normal range: the scaled scores are 0 (O = mean of V)."""
    B, U, S_q, H, D, L = 300, 5, 64, 2, 128, 300
    q, kv, k, v, idx, lengths = _make("kv", B, U, S_q, H, H, D, L, torch.bfloat16, jagged=True, packed=False,
                                      seed=9)
    out = ikbo_fa.attention(q, kv, idx, kv_lengths=lengths, scale=scale)
    qm, km, vm, lm = materialize(q, k, v, idx, "kv", lengths)
    ref, _ = _attention_fp32(qm, km, vm, 0.0, lm)
    assert torch.isfinite(out).all() and _rel(out, ref) < 1e-2


@pytest.mark.parametrize("L, inf_keys", [(300, None), (257, (0, 256)), (257, (256,)), (700, (5, 640))])
def test_scores_of_minus_inf_on_valid_keys(L, inf_keys):
    """An inf in K (or q.k overflowing fp32) gives keys a score of -inf: they weigh 0, and a row
    whose keys all score -inf gives 0 and lse -inf, as in the reference; other users unaffected."""
    B, U, S_q, H, D = 48, 3, 64, 2, 128
    q, kv, k, v, idx, _ = _make("kv", B, U, S_q, H, H, D, L, torch.bfloat16, jagged=False, packed=False, seed=10)
    q[..., 0] = q[..., 0].abs() + 0.5  # so that +inf in k[..., 0] scores +inf, -inf scores -inf
    if inf_keys is None:
        k[0, :, :, 0] = float("-inf")
    else:
        for j in inf_keys:
            k[0, j, :, 0] = float("-inf")
    out, lse = ikbo_fa.attention(q, (k, v), idx, return_lse=True)
    ref, ref_lse = ikbo_fa.attention_reference(q, (k, v), idx, return_lse=True)
    assert torch.isfinite(ref).all()
    assert torch.isfinite(out).all() and _rel(out, ref.float()) < 1e-2
    if inf_keys is None:
        assert (out[idx == 0] == 0).all() and torch.isneginf(lse[idx == 0]).all()
    keep = torch.isfinite(ref_lse)
    assert torch.equal(keep, torch.isfinite(lse)) and torch.allclose(lse[keep], ref_lse[keep], atol=1e-3)


def test_unsorted_equals_sorted():
    B, U, S_q, H, D, L = 1000, 16, 64, 2, 128, 333
    q, kv, k, v, idx, _ = _make("kv", B, U, S_q, H, H, D, L, torch.bfloat16, jagged=False, packed=False, seed=6)
    out = ikbo_fa.attention(q, kv, idx)
    perm = torch.argsort(idx, stable=True)
    out_sorted = ikbo_fa.attention(q[perm], kv, idx[perm])
    torch.testing.assert_close(out[perm], out_sorted, rtol=0, atol=0)


@pytest.mark.parametrize("rows", ["kv_lengths", "jagged"])
def test_serial_main_loop(monkeypatch, fresh_attention_plans, rows):
    """The serial main loop (``overlap=False``: a diagnostic configuration the op never picks) on
    histories of their own lengths: none, one key, block edges (the V tail zeroed); fp16, D 64."""
    attention_mod = importlib.import_module("ikbo_fa.attention")
    kernel_config = attention_mod.kernel_config
    monkeypatch.setattr(attention_mod, "kernel_config",
                        lambda *a, **kw: dataclasses.replace(kernel_config(*a, **kw), overlap=False))
    U, ratio, S_q, H, D, L = 9, 50, 1, 2, 64, 400
    idx = torch.arange(U).repeat_interleave(ratio).cuda()
    q = torch.randn(U * ratio, S_q, H, D, dtype=torch.float16, device="cuda")
    lengths = torch.tensor([0, 1, 127, 128, 129, 400, 255, 256, 3])
    if rows == "kv_lengths":
        k, v = (torch.randn(U, L, H, D, dtype=torch.float16, device="cuda") for _ in range(2))
        kw = dict(kv_lengths=lengths.cuda())
    else:
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).cuda()
        k, v = (torch.randn(int(offsets[-1]), H, D, dtype=torch.float16, device="cuda") for _ in range(2))
        kw = dict(kv_offsets=offsets)
    out, lse = ikbo_fa.attention(q, (k, v), idx, return_lse=True, **kw)
    plan = attention_mod.launch_plan(q, (k, v), idx, return_lse=True, **kw)
    assert not plan.config.overlap and plan.config.jagged == (rows == "jagged")
    ref, ref_lse = ikbo_fa.attention_reference(q.float(), (k.float(), v.float()), idx, return_lse=True, **kw)
    keep = ~torch.isneginf(ref_lse)
    assert torch.isneginf(lse[~keep]).all() and not out.isnan().any()
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
    torch.testing.assert_close(lse[keep], ref_lse[keep], rtol=1e-4, atol=1e-4)
