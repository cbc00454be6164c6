"""GPU tests of the attention kernel's variants that the op does not pick yet, each against the
default kernel (the same bits) and fp32 attention:
- lane search (``AttentionConfig.lane_search``): every tile finds its user with the 32 lanes of
  the producer warp, in one to three rounds, over users without candidates (repeated entries of
  tile_start), an out-of-range group, longest-first order and splits;
- solo tiles (``AttentionConfig.solo``): a tile of at most 64 query rows runs on consumer
  warpgroup 0 alone, warpgroup 1 passing the K/V stages on; tiles of 1 to 64 rows next to full
  ones, with kv_lengths (the V tail zeroed by both), jagged, split and serial;
- polynomial exp2 (``AttentionConfig.poly_exp2``): some score columns exponentiated on the FMA
  units; not the same bits, so against fp32 with SDPA's error budget, in both directions, with
  masked keys (kv_lengths), a NaN key and scores that move the running max far;
- grouping in the kernel (``AttentionConfig.group_idx``): every CTA groups the candidates itself
  and waits for the work list only where idx is not grouped; the same bits as the default,
  grouped and shuffled, int32 and int64 idx, out-of-range indices, users without candidates,
  up to the scratch's capacity, split, and graph replays that switch between grouped and not;
- split pairs (``AttentionConfig.split_pair``): two splits of a row's keys on the two CTAs of a
  cluster, merged there; against fp32 and the workspace split, S_q 1 to 64, sorted and shuffled,
  kv_lengths with empty splits and users, jagged, NaN rows, a small grid of many tiles per
  cluster, and graph replay.
"""
import importlib

import pytest
import torch

import ikbo_fa
from cute_kernels.plans import PlanCache

pytestmark = pytest.mark.gpu
attention_mod = importlib.import_module("ikbo_fa.attention")
NAN = float("nan")


@pytest.fixture(autouse=True)
def fresh_plans(monkeypatch):
    monkeypatch.setattr(attention_mod, "_plans", PlanCache())


def _run(monkeypatch, value, q, kv, idx, flag="_LANE_SEARCH", **kw):
    """The op with one launch flag set to ``value`` -> (out, lse, the config it compiled); out
    poisoned with NaN before the call."""
    with monkeypatch.context() as m:
        m.setattr(attention_mod, flag, value)
        m.setattr(attention_mod, "_plans", PlanCache())
        out = torch.full((idx.shape[0], *q.shape[1:]), NAN, dtype=q.dtype, device=q.device)
        _, lse = ikbo_fa.attention(q, kv, idx, out=out, return_lse=True, validate=False, **kw)
        (plan,) = attention_mod._plans.values()
        return out, lse, plan.config


def _counts(U, seed):
    """Candidates per user: some users without any (their tile_start entries repeat), one with
    many (a long run of tiles), the rest a few."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 4, (U,), generator=g)
    counts[torch.randperm(U, generator=g)[: max(1, U // 4)]] = 0
    counts[torch.randint(0, U, (1,), generator=g)] = 300
    return counts


@pytest.mark.parametrize("U", [1, 2, 30, 31, 32, 33, 1000, 1023, 1500])
@pytest.mark.parametrize("S_q", [1, 17])
def test_same_bits_as_the_binary_search(monkeypatch, U, S_q):
    counts = _counts(U, U + S_q)
    idx = torch.repeat_interleave(torch.arange(U), counts)
    idx = idx[torch.randperm(idx.shape[0])]
    idx[:3] = torch.tensor([-1, U, 2**31 - 1])  # out of range: NaN rows, group U
    B, H, D, L = idx.shape[0], 2, 64, 200
    q = torch.randn(B, S_q, H, D, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(U, L, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    idx = idx.cuda()
    out, lse, cfg = _run(monkeypatch, True, q, (k, v), idx)
    base, base_lse, base_cfg = _run(monkeypatch, False, q, (k, v), idx)
    assert cfg.lane_search and not base_cfg.lane_search
    bad = (idx < 0) | (idx >= U)
    assert out[bad].isnan().all() and not out[~bad].isnan().any()
    assert torch.equal(out[~bad], base[~bad]) and torch.equal(lse[~bad], base_lse[~bad])
    ref, ref_lse = ikbo_fa.attention_reference(q[~bad].float(), (k.float(), v.float()), idx[~bad], return_lse=True)
    assert ((out[~bad].float() - ref).norm() / ref.norm()).item() < 1e-2
    torch.testing.assert_close(lse[~bad], ref_lse, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("split", [False, True])
def test_longest_first_and_split(monkeypatch, split):
    """Jagged histories longest first (the search over positions of perm), and with splits of 512
    keys on a plain layout; on a grid of 7 CTAs, so every CTA walks many tiles."""
    monkeypatch.setattr(attention_mod, "sm_count", lambda device: 7 if not split else 132)
    monkeypatch.setattr(attention_mod, "_SPLIT_MIN_KEYS", 512)
    U, S_q, H, D = 37, 1, 2, 128
    counts = _counts(U, 5)
    idx = torch.repeat_interleave(torch.arange(U), counts)
    idx = idx[torch.randperm(idx.shape[0])].cuda()
    B = idx.shape[0]
    q = torch.randn(B, S_q, H, D, dtype=torch.bfloat16, device="cuda")
    if split:
        k, v = (torch.randn(U, 3000, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        kw = {}
    else:
        lengths = torch.randint(0, 3000, (U,))
        lengths[:3] = torch.tensor([0, 1, 129])
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).cuda()
        k, v = (torch.randn(int(offsets[-1]), H, D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        kw = dict(kv_offsets=offsets)
    out, lse, cfg = _run(monkeypatch, True, q, (k, v), idx, **kw)
    base, base_lse, _ = _run(monkeypatch, False, q, (k, v), idx, **kw)
    assert cfg.split_kv == split and cfg.ordered == (not split)
    assert torch.equal(out, base) and torch.equal(lse, base_lse)
    ref, ref_lse = ikbo_fa.attention_reference(q.float(), (k.float(), v.float()), idx, return_lse=True, **kw)
    keep = ~torch.isneginf(ref_lse)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
    torch.testing.assert_close(lse[keep], ref_lse[keep], rtol=1e-4, atol=1e-4)


def _solo(monkeypatch, q, kv, idx, **kw):
    """The op with and without solo tiles: the same bits, and the solo one against fp32."""
    out, lse, cfg = _run(monkeypatch, True, q, kv, idx, flag="_SOLO_TILES", **kw)
    base, base_lse, base_cfg = _run(monkeypatch, False, q, kv, idx, flag="_SOLO_TILES", **kw)
    assert cfg.solo and not base_cfg.solo
    assert not out.isnan().any()
    assert torch.equal(out, base) and torch.equal(lse, base_lse)
    k, v = kv
    ref, ref_lse = ikbo_fa.attention_reference(q.float(), (k.float(), v.float()), idx, return_lse=True, **kw)
    keep = ~torch.isneginf(ref_lse)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
    torch.testing.assert_close(lse[keep], ref_lse[keep], rtol=1e-4, atol=1e-4)
    return cfg


@pytest.mark.parametrize("S_q", [1, 2, 17, 64])
@pytest.mark.parametrize("order", ["sorted", "shuffled"])
def test_solo_tiles_same_bits(monkeypatch, S_q, order):
    """Users whose runs end anywhere in a tile: 1 to 64 rows (solo), 65 to 128 (both), and long
    runs whose last tile is solo or not; a grid of 7 CTAs, so solo and full tiles follow one
    another in every CTA (the turns of the two warpgroups stay in step)."""
    monkeypatch.setattr(attention_mod, "sm_count", lambda device: 7)
    rows = [1, 63, 64, 65, 127, 128, 129, 192, 193, 300, 1000]
    counts = torch.tensor([max(1, r // S_q) for r in rows])
    idx = torch.repeat_interleave(torch.arange(len(rows)), counts)
    if order == "shuffled":
        idx = idx[torch.randperm(idx.shape[0])]
    U, B, H, D, L = len(rows), idx.shape[0], 2, 128, 700
    q = torch.randn(B, S_q, H, D, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(U, L, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    _solo(monkeypatch, q, (k, v), idx.cuda())


def test_solo_tiles_with_lengths_and_serial(monkeypatch):
    """kv_lengths (both warpgroups zero a V tail, one of them idle), fp16, D 64; then the serial
    main loop on jagged K/V."""
    U, ratio, S_q, H, L = 9, 50, 1, 2, 400
    idx = torch.arange(U).repeat_interleave(ratio).cuda()
    q = torch.randn(U * ratio, S_q, H, 64, dtype=torch.float16, device="cuda")
    k, v = (torch.randn(U, L, H, 64, dtype=torch.float16, device="cuda") for _ in range(2))
    lengths = torch.tensor([0, 1, 127, 128, 129, 400, 255, 256, 3], device="cuda")
    _solo(monkeypatch, q, (k, v), idx, kv_lengths=lengths)

    monkeypatch.setattr(attention_mod, "kernel_config", _serial(attention_mod.kernel_config))
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cpu().cumsum(0)]).cuda()
    kj, vj = (torch.randn(int(offsets[-1]), H, 64, dtype=torch.float16, device="cuda") for _ in range(2))
    cfg = _solo(monkeypatch, q, (kj, vj), idx, kv_offsets=offsets)
    assert not cfg.overlap and cfg.jagged


def _serial(kernel_config):
    """kernel_config that builds the serial main loop (a diagnostic configuration)."""
    import dataclasses

    return lambda *a, **kw: dataclasses.replace(kernel_config(*a, **kw), overlap=False)


def test_solo_tiles_split(monkeypatch):
    """Users of 40 candidates at S_q 1 (one solo tile each), their keys over several CTAs."""
    monkeypatch.setattr(attention_mod, "_SPLIT_MIN_KEYS", 512)
    U, ratio, H, L = 20, 40, 2, 3000
    idx = torch.arange(U).repeat_interleave(ratio)
    idx = idx[torch.randperm(idx.shape[0])].cuda()
    q = torch.randn(U * ratio, 1, H, 128, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(U, L, H, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    assert _solo(monkeypatch, q, (k, v), idx).split_kv


@pytest.mark.parametrize("poly", [3, 8])
@pytest.mark.parametrize("direction, D, dtype", [("kv", 64, torch.bfloat16), ("kv", 128, torch.float16),
                                                 ("q", 64, torch.bfloat16)])
def test_poly_exp2_within_sdpa_error(monkeypatch, poly, direction, D, dtype):
    from attention_inputs import materialize
    from test_attention_gpu import _attention_fp32, _rel, _sdpa

    g = torch.Generator().manual_seed(poly + D)
    B, U, S_q, H, L = 300, 7, 64, 2, 700
    idx = torch.randint(0, U, (B,), generator=g)
    q_rows, kv_rows = (B, U) if direction == "kv" else (U, B)
    q = torch.randn(q_rows, S_q, H, D, generator=g).to(dtype).cuda()
    k, v = (torch.randn(kv_rows, L, H, D, generator=g).to(dtype).cuda() for _ in range(2))
    lengths = torch.randint(1, L + 1, (kv_rows,), generator=g)
    lengths[:2] = torch.tensor([1, 129])
    lengths = lengths.cuda()
    idx = idx.cuda()
    out, lse, cfg = _run(monkeypatch, poly, q, (k, v), idx, flag="_POLY_EXP2", kv_lengths=lengths,
                         broadcast=direction)
    assert cfg.poly_exp2 == poly
    qm, km, vm, lm = materialize(q, k, v, idx, direction, lengths)
    scale = D ** -0.5
    ref, ref_lse = _attention_fp32(qm, km, vm, scale, lm)
    err, sdpa_err = _rel(out, ref), _rel(_sdpa(qm, km, vm, scale, lm), ref)
    assert err <= 1.5 * sdpa_err + 1e-6, (err, sdpa_err)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)


def test_poly_exp2_nan_key_and_far_max(monkeypatch):
    """A NaN key makes its user's rows NaN and no other's (whichever column it lands in); a
    block whose scores jump far above the running max still gives the exact result."""
    U, ratio, S_q, H, D, L = 4, 8, 16, 2, 64, 1000
    idx = torch.arange(U).repeat_interleave(ratio).cuda()
    q = torch.randn(U * ratio, S_q, H, D, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(U, L, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    k[0, 5:13, 0] = float("nan")  # eight neighbouring keys: every column class of a thread
    k[1, :128] *= 40.0  # the first block processed last: its scores far above the rest
    out, lse, _ = _run(monkeypatch, 3, q, (k, v), idx, flag="_POLY_EXP2")
    user0 = idx == 0
    assert out[user0][:, :, 0].isnan().all() and not out[user0][:, :, 1].isnan().any()
    assert not out[~user0].isnan().any()
    ref, ref_lse = ikbo_fa.attention_reference(q.float(), (k.float(), v.float()), idx, return_lse=True)
    keep = ~user0
    assert ((out[keep].float() - ref[keep]).norm() / ref[keep].norm()).item() < 1e-2
    torch.testing.assert_close(lse[keep], ref_lse[keep], rtol=1e-4, atol=1e-4)


def _group(monkeypatch, q, kv, idx, **kw):
    """The op with and without grouping in the kernel: the same bits (and not NaN but where idx is
    out of range)."""
    out, lse, cfg = _run(monkeypatch, True, q, kv, idx, flag="_GROUP_IN_KERNEL", **kw)
    base, base_lse, base_cfg = _run(monkeypatch, False, q, kv, idx, flag="_GROUP_IN_KERNEL", **kw)
    assert cfg.group_idx == idx.dtype and base_cfg.group_idx is None
    U = kv[0].shape[0]
    bad = (idx < 0) | (idx >= U)
    assert out[bad].isnan().all() and not out[~bad].isnan().any()
    assert torch.equal(out[~bad], base[~bad]) and torch.equal(lse[~bad], base_lse[~bad])
    return out, lse, cfg


@pytest.mark.parametrize("order", ["sorted", "shuffled"])
@pytest.mark.parametrize("S_q, U, idx_dtype", [(1, 32, torch.int32), (1, 1, torch.int64), (17, 300, torch.int32),
                                               (64, 5, torch.int64)])
def test_group_in_kernel_same_bits(monkeypatch, order, S_q, U, idx_dtype):
    g = torch.Generator().manual_seed(S_q + U)
    counts = torch.randint(0, 40, (U,), generator=g)  # B stays below _GROUP_MAX_BATCH
    counts[torch.randint(0, U, (1,), generator=g)] = 1000
    if U > 2:
        counts[:2] = 0  # users without candidates
    idx = torch.repeat_interleave(torch.arange(U), counts)
    idx = torch.cat([idx, torch.tensor([-1, U, U + 7])])  # out of range: group U, after the users
    if order == "shuffled":
        idx = idx[torch.randperm(idx.shape[0], generator=g)]
    idx = idx.to(idx_dtype).cuda()
    B, H, D = idx.shape[0], 2, 64
    q = torch.randn(B, S_q, H, D, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(U, 600, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    out, _, _ = _group(monkeypatch, q, (k, v), idx)
    keep = (idx >= 0) & (idx < U)
    ref = ikbo_fa.attention_reference(q[keep].float(), (k.float(), v.float()), idx[keep])
    assert ((out[keep].float() - ref).norm() / ref.norm()).item() < 1e-2


def test_group_in_kernel_at_its_bounds(monkeypatch):
    """As many users as the scratch holds (D 64: the smaller K stages), and the largest batch."""
    from ikbo_fa.fwd_sm90 import IkboAttentionFwdSm90

    U = IkboAttentionFwdSm90.group_capacity(torch.bfloat16, 64) - 1
    B = attention_mod._GROUP_MAX_BATCH
    idx = torch.randint(0, U, (B,)).sort().values.cuda()
    q = torch.randn(B, 1, 1, 64, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(U, 130, 1, 64, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    _group(monkeypatch, q, (k, v), idx)


def test_group_in_kernel_split(monkeypatch):
    monkeypatch.setattr(attention_mod, "_SPLIT_MIN_KEYS", 512)
    U, ratio = 20, 64
    idx = torch.arange(U).repeat_interleave(ratio).cuda()
    q = torch.randn(U * ratio, 1, 2, 128, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(U, 2000, 2, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    _, _, cfg = _group(monkeypatch, q, (k, v), idx)
    assert cfg.split_kv


def test_group_in_kernel_graph_replay_switches_order(monkeypatch):
    """A captured call replayed with idx grouped, then shuffled, then grouped again: the kernel
    decides on the device whether it waits for the work list's order."""
    monkeypatch.setattr(attention_mod, "_GROUP_IN_KERNEL", True)
    U, ratio, S_q, H, D = 16, 50, 2, 2, 64
    grouped = torch.arange(U).repeat_interleave(ratio)
    B = grouped.shape[0]
    idx = grouped.clone().cuda()
    q = torch.randn(B, S_q, H, D, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(U, 300, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    out = torch.empty_like(q)
    ikbo_fa.attention(q, (k, v), idx, out=out)  # compile and plan outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ikbo_fa.attention(q, (k, v), idx, out=out)
    (plan,) = attention_mod._plans.values()
    assert plan.config.group_idx == torch.int64
    for new in (grouped, grouped[torch.randperm(B)], grouped.flip(0), grouped):
        idx.copy_(new)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = ikbo_fa.attention_reference(q.float(), (k.float(), v.float()), idx)
        assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


def _pair_problem(seed, U, ratio, S_q, L, H=2, D=128, order="sorted", dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    idx = torch.arange(U).repeat_interleave(ratio)
    if order == "shuffled":
        idx = idx[torch.randperm(idx.shape[0], generator=g)]
    q = torch.randn(idx.shape[0], S_q, H, D, generator=g).to(dtype).cuda()
    k, v = (torch.randn(U, L, H, D, generator=g).to(dtype).cuda() for _ in range(2))
    return q, k, v, idx.cuda()


def _pair(monkeypatch, q, kv, idx, **kw):
    """The op with split pairs and with the workspace split: both two splits, both against fp32."""
    monkeypatch.setattr(attention_mod, "_SPLIT_MIN_KEYS", 512)
    out, lse, cfg = _run(monkeypatch, True, q, kv, idx, flag="_SPLIT_PAIR", **kw)
    ws, ws_lse, ws_cfg = _run(monkeypatch, False, q, kv, idx, flag="_SPLIT_PAIR", **kw)
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
def test_split_pair_matches_fp32(monkeypatch, order, S_q, U, ratio, L):
    """Tiles of at most 64 rows (only warpgroup 0's rows exchanged) and of more, splits ending
    inside a key block. Every shape has at most 66 (tile, head) pairs and fewer than 1536 keys:
    two splits of at least 512."""
    q, k, v, idx = _pair_problem(S_q + U, U, ratio, S_q, L, order=order)
    _pair(monkeypatch, q, (k, v), idx)


def test_split_pair_lengths_nan_and_small_grid(monkeypatch):
    """kv_lengths with users of no key and of keys in the first split only (the second split has
    none); an out-of-range index; 3 clusters, so each walks many tiles (the exchange's barriers
    change phase many times); fp16, D 64, grouped heads."""
    monkeypatch.setattr(attention_mod, "max_active_clusters", lambda device, size: 3)
    q, k, v, idx = _pair_problem(3, 8, 10, 17, 1400, H=4, D=64, order="shuffled", dtype=torch.float16)
    k, v = k[:, :, :2].contiguous(), v[:, :, :2].contiguous()
    idx[5] = 8
    lengths = torch.randint(0, 1401, (8,))
    lengths[:4] = torch.tensor([0, 1, 511, 512])
    _pair(monkeypatch, q, (k, v), idx, kv_lengths=lengths.cuda())


def test_split_pair_jagged(monkeypatch):
    U, ratio, S_q, H, D = 30, 60, 1, 2, 128
    lens = torch.randint(0, 2000, (U,))
    lens[:3] = torch.tensor([0, 700, 1999])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).cuda()
    idx = torch.arange(U).repeat_interleave(ratio).cuda()
    q = torch.randn(U * ratio, S_q, H, D, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(int(offsets[-1]), H, D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    _pair(monkeypatch, q, (k, v), idx, kv_offsets=offsets, max_kv_len=2000)


def test_split_pair_graph_replay(monkeypatch):
    monkeypatch.setattr(attention_mod, "_SPLIT_MIN_KEYS", 512)
    monkeypatch.setattr(attention_mod, "_SPLIT_PAIR", True)
    q, k, v, idx = _pair_problem(9, 32, 64, 1, 1024)
    out = torch.empty_like(q)
    ikbo_fa.attention(q, (k, v), idx, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ikbo_fa.attention(q, (k, v), idx, out=out)
    (plan,) = attention_mod._plans.values()
    assert plan.config.split_pair
    for _ in range(3):
        idx.copy_(idx[torch.randperm(idx.shape[0], device="cuda")])
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = ikbo_fa.attention_reference(q.float(), (k.float(), v.float()), idx)
        assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("order", ["sorted", "shuffled"])
@pytest.mark.parametrize("S_q, U, ratio, L", [(1, 32, 64, 1024), (1, 31, 65, 4096), (17, 6, 30, 1100)])
def test_every_variant_at_once(monkeypatch, order, S_q, U, ratio, L):
    """Lane search, grouping in the kernel, split pairs, solo tiles and polynomial exp2 together,
    against fp32 and the default kernel."""
    q, k, v, idx = _pair_problem(7 + S_q, U, ratio, S_q, L, order=order)
    idx[3] = -1
    monkeypatch.setattr(attention_mod, "_SPLIT_MIN_KEYS", 512)
    with monkeypatch.context() as m:
        for flag, value in (("_LANE_SEARCH", True), ("_GROUP_IN_KERNEL", True), ("_SPLIT_PAIR", True),
                            ("_SOLO_TILES", True), ("_POLY_EXP2", 3)):
            m.setattr(attention_mod, flag, value)
        out, lse, cfg = _run(m, True, q, (k, v), idx, flag="_LANE_SEARCH")
    base, base_lse, base_cfg = _run(monkeypatch, False, q, (k, v), idx, flag="_LANE_SEARCH")
    assert cfg.group_idx == torch.int64 and cfg.solo and cfg.poly_exp2 == 3 and not base_cfg.solo
    assert cfg.split_pair == (base_cfg.split_kv or base_cfg.split_pair)  # two splits where the default splits
    keep = idx >= 0
    assert out[~keep].isnan().all() and not out[keep].isnan().any()
    ref, ref_lse = ikbo_fa.attention_reference(q[keep].float(), (k.float(), v.float()), idx[keep], return_lse=True)
    for o in (out, base):
        assert ((o[keep].float() - ref).norm() / ref.norm()).item() < 1e-2
    torch.testing.assert_close(lse[keep], ref_lse, rtol=1e-4, atol=1e-4)
