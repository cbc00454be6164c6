"""CPU checks of the attention benchmark (perf/compare_fa4.py and the workload, layouts and
providers it uses): workload and lengths, FLOPs, the fp32 reference, the peers' packings (run
through pure-torch stand-ins with FA4's and FA3's signatures), every provider against a naive
reference, argument parsing, presets, the no-GPU exit, and main() end to end on the CPU."""
import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from perf import attention_layouts as lay
from perf import attention_providers as ap
from perf import attention_workload as aw
from perf import compare_fa4 as cf
from perf import harness
from perf.providers import LIBS

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- stand-ins

def naive_attention(q, k, v, scale):
    """q [S, H, D], k/v [L, H, D] -> [S, H, D], float64."""
    s = torch.einsum("shd,lhd->hsl", q.double(), k.double()) * scale
    return torch.einsum("hsl,lhd->shd", torch.softmax(s, dim=-1), v.double())


def reference(q, k, v, idx, scale, broadcast="kv", kv_offsets=None):
    """Per candidate: its queries over its K/V row (the user's with K/V broadcast), float64; with
    ``kv_offsets``, k, v are packed [keys, H, D] and row r is kv_offsets[r]:kv_offsets[r + 1]."""
    out = []
    for b, u in enumerate(idx.tolist()):
        qb, r = (q[b], u) if broadcast == "kv" else (q[u], b)
        if kv_offsets is None:
            kr, vr = k[r], v[r]
        else:
            kr, vr = k[int(kv_offsets[r]):int(kv_offsets[r + 1])], v[int(kv_offsets[r]):int(kv_offsets[r + 1])]
        out.append(naive_attention(qb, kr, vr, scale))
    return torch.stack(out)


def fa4_func(q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False, return_lse=False):
    """flash_attn_func's arguments (those the script may use) and layout: [B, S, H, D]."""
    assert q.dim() == 4 and k.shape == v.shape and k.shape[0] == q.shape[0] and not causal
    return torch.stack([naive_attention(q[b], k[b], v[b], softmax_scale).to(q.dtype) for b in range(len(q))]), None


def fa4_varlen(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
               max_seqlen_k=None, min_seqlen_k=None, seqused_q=None, seqused_k=None,
               gather_kv_indices=None, page_table=None, softmax_scale=None, causal=False,
               return_lse=False):
    """flash_attn_varlen_func's arguments and layouts, with the asserts FA4 makes on them."""
    assert q.dtype == k.dtype == v.dtype and not causal
    for t in (cu_seqlens_q, cu_seqlens_k, seqused_k, page_table):
        assert t is None or t.dtype == torch.int32
    if page_table is not None:
        assert cu_seqlens_k is None and cu_seqlens_q is None
        assert page_table.stride(-1) == 1 and page_table.shape[0] == q.shape[0]
        num_pages, page_size, H, D = k.shape
        out = torch.empty_like(q)
        for b in range(q.shape[0]):
            kb, vb = (t[page_table[b].long()].reshape(-1, H, D) for t in (k, v))
            n = kb.shape[0] if seqused_k is None else int(seqused_k[b])
            out[b] = naive_attention(q[b], kb[:n], vb[:n], softmax_scale).to(q.dtype)
        return out, None
    assert q.dim() == 3 and k.dim() == 3 and cu_seqlens_q.shape == cu_seqlens_k.shape
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    assert cq[-1] == q.shape[0] and ck[-1] == k.shape[0]
    assert max_seqlen_q >= max(b - a for a, b in zip(cq, cq[1:]))
    assert max_seqlen_k >= max(b - a for a, b in zip(ck, ck[1:]))
    out = torch.empty_like(q)
    for i in range(len(cq) - 1):
        if cq[i + 1] > cq[i]:
            out[cq[i]:cq[i + 1]] = naive_attention(q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]],
                                                   v[ck[i]:ck[i + 1]], softmax_scale).to(q.dtype)
    return out, None


SPLITS = []  # num_splits of each FA3 call


def fa3_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None, seqused_k=None,
               softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None, v_descale=None,
               window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None,
               deterministic=False, sm_margin=0, return_attn_probs=False):
    """fa3_fwd_interface.flash_attn_varlen_func's signature: the output alone, no fp16."""
    assert q.dtype != torch.float16 and not return_attn_probs
    SPLITS.append(num_splits)
    return fa4_varlen(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                      max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale)[0]


def ikbo_work_list(idx, num_users, s_q=1, *, kv_lengths=None, kv_offsets=None, max_kv_len=None, validate=None,
                   policy=None, head_dim=None, heads=1):
    """ikbo_fa.work_list's signature: what it was built for, for ikbo_attention to check."""
    return dict(idx=idx, num_users=num_users, s_q=s_q, kv_offsets=kv_offsets, head_dim=head_dim)


def ikbo_attention(q, kv, idx, *, scale=None, kv_lengths=None, kv_offsets=None, max_kv_len=None,
                   broadcast=None, return_lse=False, out=None, validate=None, work_list=None, policy=None):
    """ikbo_fa.attention's signature, jagged K/V and a work list built beforehand included."""
    k, v = kv
    if work_list is not None:  # built for this idx, U, S_q and kind of K/V
        assert (broadcast or "kv") == "kv" and work_list["idx"] is idx and work_list["s_q"] == q.shape[1]
        assert work_list["head_dim"] == q.shape[3]  # built for the calls' D
        assert work_list["num_users"] == (k.shape[0] if kv_offsets is None else kv_offsets.shape[0] - 1)
        assert work_list["kv_offsets"] is kv_offsets
    if kv_offsets is not None:
        assert kv_offsets.dtype == torch.int32 and k.dim() == 3 and kv_offsets[-1] == k.shape[0]
        assert max_kv_len >= int((kv_offsets[1:] - kv_offsets[:-1]).max())
    return reference(q, k, v, idx, scale, broadcast or "kv", kv_offsets).to(q.dtype)


def cpu_problem(B, ratio, S_q, L, H, D, broadcast="kv", order="sorted", seed=0, jagged=None):
    rng = np.random.default_rng(seed)
    p = aw.make_problem(B, ratio, S_q, L, H, D, torch.bfloat16, broadcast, order, rng, device="cpu", jagged=jagged)
    p.dtype = torch.float64  # exact CPU arithmetic; make_inputs uses it
    inp = aw.make_inputs(p, torch.Generator().manual_seed(seed), device="cpu")
    for t in (inp.q, inp.k, inp.v):
        t.mul_(2.0)  # sharper softmax than N(0, 1) scores would give: a wrong key set shows
    return p, inp


def want(p, inp):
    return reference(inp.q, inp.k, inp.v, p.idx_cpu, p.scale, p.broadcast, p.kv_offsets_cpu)


def has_policies() -> bool:
    import ikbo_fa
    return hasattr(ikbo_fa, "AttentionPolicy")


needs_policies = pytest.mark.skipif(not has_policies(), reason="ikbo_fa.AttentionPolicy is not on this tree")


# --------------------------------------------------------------------------- workload

def test_flops_match_the_published_figure():
    # 250 TFLOP/s at 0.550 ms for B 2048, H 2, S_q 64, L 1024, D 128 (the published FA4 baseline)
    flops = aw.attention_flops(2048, 2, 64, 1024, 128)
    assert flops == 4 * 2048 * 2 * 64 * 1024 * 128 and abs(flops / 0.550e-3 / 1e12 - 250) < 1
    assert aw.jagged_flops([3, 1, 5], H=2, S_q=4, D=8) == 4 * 2 * 4 * 8 * 9
    for broadcast in ("kv", "q"):
        p, _ = cpu_problem(B=10, ratio=3, S_q=4, L=9, H=2, D=8, broadcast=broadcast, jagged="uniform")
        per_cand = [int(p.kv_lengths_cpu[int(u)]) for u in p.idx_cpu] if broadcast == "kv" \
            else p.kv_lengths_cpu.tolist()
        assert p.cand_lengths.tolist() == per_cand and p.flops == sum(4 * 4 * n * 8 * 2 for n in per_cand)


@pytest.mark.parametrize("B,ratio", [(1, 1), (7, 1), (1024, 10000), (4096, 512), (2048, 64), (3, 3)])
def test_user_counts(B, ratio):
    counts = harness.user_counts(B, ratio, np.random.default_rng(B + ratio))
    assert sum(counts) == B and all(c >= 1 for c in counts)
    assert all(c in (ratio, ratio + 1) for c in counts[:-1])
    if ratio >= B:
        assert counts == [B]
    with pytest.raises(ValueError):
        harness.user_counts(0, ratio)


@pytest.mark.parametrize("order", ["sorted", "shuffled"])
def test_make_idx(order):
    rng = np.random.default_rng(3)
    counts = harness.user_counts(500, 7, rng)
    idx = harness.make_idx(counts, order, rng)
    assert idx.dtype == torch.int32 and torch.bincount(idx.long(), minlength=len(counts)).tolist() == counts
    assert bool((idx[1:] >= idx[:-1]).all()) == (order == "sorted")


def test_check_candidates_include_ends():
    rng = np.random.default_rng(0)
    c = aw.check_candidates(2048, rng, n=10)
    assert c[0] == 0 and c[-1] == 2047 and len(c) <= 12 and bool((c[1:] > c[:-1]).all())
    assert aw.check_candidates(1, rng).tolist() == [0]
    assert aw.check_candidates(5, rng, n=32).tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("broadcast", ["kv", "q"])
@pytest.mark.parametrize("order", ["sorted", "shuffled"])
@pytest.mark.parametrize("jagged", [None, "uniform", "lognormal", "equal"])
def test_reference_outputs_match_naive(broadcast, order, jagged):
    p, inp = cpu_problem(B=13, ratio=3, S_q=5, L=11, H=2, D=8, broadcast=broadcast, order=order, jagged=jagged)
    cand = torch.tensor([0, 2, 3, 7, 12])
    got = aw.reference_outputs(p, inp, cand, chunk=2)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want(p, inp)[cand], rtol=1e-5, atol=1e-5)


def test_reference_sees_a_wrong_user_or_key_range():
    p, inp = cpu_problem(B=12, ratio=3, S_q=2, L=16, H=2, D=8, jagged="uniform")
    cand = aw.check_candidates(p.B, np.random.default_rng(0))
    ref = aw.reference_outputs(p, inp, cand)
    assert harness.rel_error(want(p, inp)[cand].float(), ref) < 1e-5
    shifted = reference(inp.q, inp.k, inp.v, (p.idx_cpu + 1) % p.U, p.scale, kv_offsets=p.kv_offsets_cpu)
    assert harness.rel_error(shifted[cand].float(), ref) > 0.1
    first_keys = torch.stack([naive_attention(inp.q[b], inp.k[:p.max_len], inp.v[:p.max_len], p.scale)
                              for b in range(p.B)])
    assert harness.rel_error(first_keys[cand].float(), ref) > 0.1


@pytest.mark.parametrize("broadcast", ["kv", "q"])
def test_ikbo_provider_calls_ikbo_fa(monkeypatch, broadcast):
    """The ikbo provider against ikbo_fa.attention itself (on the CPU: its reference), bf16, jagged."""
    import ikbo_fa

    monkeypatch.setitem(LIBS.modules, "ikbo_fa", ikbo_fa)
    p = aw.make_problem(11, 3, 3, 40, 2, 64, torch.bfloat16, broadcast, "shuffled", np.random.default_rng(0),
                        device="cpu", jagged="lognormal")
    inp = aw.make_inputs(p, torch.Generator().manual_seed(0), device="cpu")
    prov = next(pr for pr in ap.providers() if pr.name == "ikbo")
    out = prov.run(p, prov.setup(p, inp), inp)
    assert out.shape == (p.B, p.S_q, p.H, p.D)
    assert harness.rel_error(out.float(), aw.reference_outputs(p, inp, torch.arange(p.B))) < 1e-2


# --------------------------------------------------------------------------- key lengths

@pytest.mark.parametrize("dist", sorted(aw.LENGTHS) + ["lognormal:64"])
@pytest.mark.parametrize("L", [1, 7, 1000, 32768])
def test_lengths_seeded_within_1_L(dist, L):
    a = aw.draw_lengths(dist, 500, L, np.random.default_rng(5))
    assert a.dtype == torch.int64 and a.shape == (500,)
    assert torch.equal(a, aw.draw_lengths(dist, 500, L, np.random.default_rng(5)))  # deterministic for a seed
    assert int(a.min()) >= 1 and int(a.max()) <= L
    if dist == "equal":
        assert a.tolist() == [L] * 500
    elif L >= 1000:
        assert len(set(a.tolist())) > 50  # spread, not constant


def test_length_distributions_have_their_shape():
    L, n = 32768, 20000
    draw = {d: aw.draw_lengths(d, n, L, np.random.default_rng(0)).double() for d in aw.LENGTHS}
    assert abs(draw["uniform"].mean() / ((L + 1) / 2) - 1) < 0.02
    med = draw["lognormal"].median()
    assert 0.85 * L / 8 < med < 1.15 * L / 8 and draw["lognormal"].mean() > 1.4 * med  # right-skewed
    assert 0.01 < float((draw["lognormal"] == L).double().mean()) < 0.03  # the clipped heavy tail
    assert abs(draw["exponential"].mean() / (L / 4) - 1) < 0.05
    assert 0.5 * L ** 0.5 < draw["zipf"].median() < 2 * L ** 0.5
    short = aw.draw_lengths("lognormal:64", n, 256, np.random.default_rng(0)).double()
    assert 58 < short.median() < 70 and short.max() == 256  # the short-history preset's lengths


def test_length_specs_and_offsets():
    assert aw.length_spec("lognormal:64") == ("lognormal", 64.0) and aw.length_spec("zipf") == ("zipf", None)
    for bad in ("pareto", "zipf:3", "lognormal:", "lognormal:-1", "lognormal:x"):
        with pytest.raises(ValueError, match="length distribution"):
            aw.length_spec(bad)
    off = aw.kv_offsets_of(torch.tensor([3, 1, 5]))
    assert off.dtype == torch.int32 and off.tolist() == [0, 3, 4, 9]
    with pytest.raises(ValueError):
        aw.kv_offsets_of(torch.tensor([2**30, 2**30]))
    with pytest.raises(ValueError):
        aw.draw_lengths("uniform", 3, 0, np.random.default_rng(0))


@pytest.mark.parametrize("broadcast", ["kv", "q"])
def test_jagged_problem_draws_a_length_per_kv_row(broadcast):
    def make(seed, jagged="lognormal"):
        return aw.make_problem(40, 6, 2, 50, 2, 8, torch.bfloat16, broadcast, "shuffled",
                               np.random.default_rng(seed), device="cpu", jagged=jagged)

    p, again, dense = make(3), make(3), make(3, None)
    rows = p.U if broadcast == "kv" else p.B
    assert p.kv_rows == rows and p.kv_lengths_cpu.shape == (rows,)
    assert torch.equal(p.kv_lengths_cpu, again.kv_lengths_cpu) and torch.equal(p.idx_cpu, again.idx_cpu)
    assert p.kv_offsets_cpu.tolist() == [0] + torch.cumsum(p.kv_lengths_cpu, 0).tolist()
    assert p.total_keys == int(p.kv_lengths_cpu.sum()) and p.max_len == int(p.kv_lengths_cpu.max()) <= 50
    inp = aw.make_inputs(p, torch.Generator().manual_seed(0), device="cpu")
    assert inp.k.shape == inp.v.shape == (p.total_keys, 2, 8)
    f = p.fields()
    assert f["jagged"] == "lognormal" and f["total_keys"] == p.total_keys and f["max_len"] == p.max_len
    assert f["gflop"] == pytest.approx(p.flops / 1e9)
    assert torch.equal(dense.idx_cpu, p.idx_cpu)  # lengths are drawn after the users
    assert dense.fields()["jagged"] is None and dense.total_keys == rows * 50 and dense.max_len == 50
    equal = make(3, "equal")  # the padded layout's keys, as kv_offsets
    assert equal.total_keys == dense.total_keys and equal.flops == dense.flops and equal.max_len == 50


# --------------------------------------------------------------------------- the peers' layouts

@pytest.mark.parametrize("L", [8, 10, 3])
@pytest.mark.parametrize("order", ["sorted", "shuffled"])
def test_page_table_attention_matches_per_candidate(L, order):
    p, inp = cpu_problem(B=9, ratio=2, S_q=3, L=L, H=2, D=8, order=order)
    table = lay.build_page_table(p.idx, L, page_size=4)
    n = -(-L // 4)
    assert table.pages.shape == (9, n) and table.pages.dtype == torch.int32
    assert (table.seqused_k is None) == (L % 4 == 0)
    kp, vp = lay.to_pages(inp.k, 4), lay.to_pages(inp.v, 4)
    assert kp.shape == (p.U * n, 4, 2, 8)
    if L % 4 == 0:
        assert kp.data_ptr() == inp.k.data_ptr()  # a view, no copy
    torch.testing.assert_close(lay.run_paged(fa4_varlen, inp.q, kp, vp, table, p.scale), want(p, inp),
                               rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("order", ["sorted", "shuffled"])
@pytest.mark.parametrize("B,ratio,S_q", [(11, 3, 3), (1, 1, 1), (6, 100, 17), (8, 1, 1), (12, 4, 100)])
@pytest.mark.parametrize("jagged", [None, "lognormal"])
def test_varlen_packing_is_one_dense_sequence_per_user(order, B, ratio, S_q, jagged):
    """Sequence u holds the S_q queries of each of u's candidates, back to back, in candidate
    order, against u's keys (jagged: kv_offsets, the offsets ikbo gets)."""
    p, inp = cpu_problem(B=B, ratio=ratio, S_q=S_q, L=7, H=2, D=4, order=order, jagged=jagged)
    pk = lay.build_varlen_packing(p.idx_cpu, p.U, p.S_q, p.L, kv_offsets=p.kv_offsets_cpu)
    assert pk.cu_seqlens_q.dtype == pk.cu_seqlens_k.dtype == torch.int32
    assert pk.cu_seqlens_q.tolist() == [0] + torch.cumsum(torch.tensor(p.counts) * S_q, 0).tolist()
    assert pk.cu_seqlens_k.tolist() == (p.kv_offsets_cpu.tolist() if jagged else [7 * u for u in range(p.U + 1)])
    assert pk.max_seqlen_q == max(p.counts) * S_q and pk.max_seqlen_k == p.max_len
    packed = lay.pack_queries(inp.q, pk)
    assert packed.shape == (B * S_q, 2, 4) and packed.is_contiguous()
    assert (pk.order is None) == bool((p.idx_cpu[1:] >= p.idx_cpu[:-1]).all())
    if pk.order is None:
        assert packed.data_ptr() == inp.q.data_ptr()  # no gather
    cu = pk.cu_seqlens_q.tolist()
    for u in range(p.U):
        mine = [inp.q[b] for b in range(B) if int(p.idx_cpu[b]) == u]
        assert torch.equal(packed[cu[u]:cu[u + 1]], torch.cat(mine) if mine else packed[:0])
    for fn in (fa4_varlen, fa3_varlen):  # FA4 returns (out, lse), FA3 the output alone
        torch.testing.assert_close(lay.run_varlen(fn, inp.q, inp.k, inp.v, pk, p.scale), want(p, inp),
                                   rtol=1e-10, atol=1e-10)


def test_varlen_packing_of_a_user_without_candidates():
    idx = torch.tensor([0, 0, 2, 2, 2], dtype=torch.int32)
    pk = lay.build_varlen_packing(idx, 3, 2, 5)
    assert pk.cu_seqlens_q.tolist() == [0, 4, 4, 10]
    q, k, v = torch.randn(5, 2, 1, 4, dtype=torch.float64), *torch.randn(2, 3, 5, 1, 4, dtype=torch.float64)
    torch.testing.assert_close(lay.run_varlen(fa4_varlen, q, k, v, pk, 0.5), reference(q, k, v, idx, 0.5))


@pytest.mark.parametrize("order", ["sorted", "shuffled"])
def test_jagged_candidate_packing_for_q_broadcast(order):
    p, inp = cpu_problem(B=9, ratio=2, S_q=3, L=6, H=2, D=8, broadcast="q", order=order, jagged="uniform")
    pk = lay.build_candidate_packing(p.idx_cpu, p.kv_offsets_cpu, p.S_q)
    assert pk.cu_seqlens_q.tolist() == [3 * b for b in range(p.B + 1)]
    assert torch.equal(pk.cu_seqlens_k, p.kv_offsets_cpu) and pk.max_seqlen_k == p.max_len
    torch.testing.assert_close(lay.run_varlen(fa4_varlen, inp.q, inp.k, inp.v, pk, p.scale), want(p, inp),
                               rtol=1e-10, atol=1e-10)


def test_padded_gather_and_materialized_bytes():
    off = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    gather, mask = lay.padded_gather(off, torch.tensor([2, 0, 1, 2]), 5)
    assert gather.tolist() == [[4, 5, 6, 7, 8], [0, 1, 2, 2, 2], [3, 3, 3, 3, 3], [4, 5, 6, 7, 8]]
    assert mask.tolist() == [[True] * 5, [True] * 3 + [False] * 2, [True] + [False] * 4, [True] * 5]
    p, _ = cpu_problem(B=10, ratio=3, S_q=4, L=8, H=2, D=8)  # float64: 8 bytes an element
    assert ap.materialized_bytes(p) == 10 * 2 * 8 * 2 * 8 * 8
    p, _ = cpu_problem(B=10, ratio=3, S_q=4, L=8, H=2, D=8, broadcast="q", jagged="uniform")
    assert ap.materialized_bytes(p) == 10 * p.max_len * (2 * 2 * 8 * 8 + 9) + 10 * 4 * 2 * 8 * 8


# --------------------------------------------------------------------------- providers

@pytest.fixture
def fake_libs(monkeypatch, compile_eagerly):
    monkeypatch.setitem(LIBS.modules, "fa4", types.SimpleNamespace(flash_attn_func=fa4_func,
                                                                  flash_attn_varlen_func=fa4_varlen))
    monkeypatch.setitem(LIBS.modules, "fa3", types.SimpleNamespace(flash_attn_varlen_func=fa3_varlen))
    monkeypatch.setitem(LIBS.modules, "ikbo_fa", types.SimpleNamespace(attention=ikbo_attention,
                                                                       work_list=ikbo_work_list))


KV_ONLY = {"fa4 page table", "fa4 varlen packed", "fa3 varlen packed", "fa3 varlen packed, no split",
           "ikbo, work list reused"}
DENSE_ONLY = {"fa4 page table", "fa4 materialized", "fa4 materialize+kernel"}


@pytest.mark.parametrize("broadcast", ["kv", "q"])
@pytest.mark.parametrize("order", ["sorted", "shuffled"])
@pytest.mark.parametrize("jagged", [None, "lognormal"])
def test_every_provider_computes_the_same_attention(fake_libs, broadcast, order, jagged):
    p, inp = cpu_problem(B=10, ratio=3, S_q=4, L=9, H=2, D=8, broadcast=broadcast, order=order, jagged=jagged)
    rotated = inp.clone()  # a rotation copy: same values, other storage
    ran, skipped = set(), set()
    SPLITS.clear()
    for prov in ap.providers():
        try:
            st = prov.setup(p, inp)
        except harness.Skip as e:
            skipped.add(prov.name)
            assert "jagged" in str(e) or "K/V broadcast only" in str(e), e
            continue
        for x in (inp, rotated):
            out = prov.run(p, st, x)
            if not prov.checked:  # the materialization: check the copy itself
                if jagged:
                    rows = p.idx_cpu.long() if broadcast == "kv" else torch.arange(p.B)
                    gather, mask = lay.padded_gather(p.kv_offsets_cpu, rows, p.max_len)
                    torch.testing.assert_close(out.k, x.k[gather])
                    assert torch.equal(out.key_mask, mask)
                else:
                    side = (out.k, x.k) if broadcast == "kv" else (out.q, x.q)
                    torch.testing.assert_close(side[0], side[1][p.idx.long()])
                continue
            assert out.shape == (p.B, p.S_q, p.H, p.D), prov.name
            torch.testing.assert_close(out.double(), want(p, inp), rtol=1e-6, atol=1e-6, msg=prov.name)
        ran.add(prov.name)
    # jagged Q broadcast: FA varlen takes one sequence per candidate (Q copied per candidate)
    kv_only = KV_ONLY - ({"fa4 varlen packed", "fa3 varlen packed", "fa3 varlen packed, no split"} if jagged else set())
    expect_skipped = (DENSE_ONLY if jagged else set()) | (kv_only if broadcast == "q" else set())
    assert skipped == expect_skipped and ran == set(ap.DISPLAY_ORDER) - expect_skipped
    if "fa3 varlen packed" in ran:
        assert sorted(set(SPLITS)) == [0, 1]  # FA3 choosing its splits, and not splitting


def test_fa3_skips_fp16(fake_libs):
    p, inp = cpu_problem(B=4, ratio=2, S_q=1, L=8, H=2, D=8)
    p.dtype = torch.float16
    for name in ("fa3 varlen packed", "fa3 varlen packed, no split"):
        prov = next(pr for pr in ap.providers() if pr.name == name)
        with pytest.raises(harness.Skip, match="bf16 only"):
            prov.setup(p, inp)


@pytest.mark.parametrize("broadcast", ["kv", "q"])
def test_compiled_materialize_sdpa_compiles_for_real(broadcast):
    """Inductor on the CPU, a tiny problem: one graph, the same attention, no recompile for a copy."""
    from torch._dynamo.utils import counters

    harness.reset_compiled()
    p, inp = cpu_problem(B=6, ratio=3, S_q=4, L=8, H=2, D=8, broadcast=broadcast)
    prov = next(pr for pr in ap.providers() if pr.name == "torch.compile materialize+sdpa")
    before = counters["stats"]["unique_graphs"]
    st = prov.setup(p, inp)
    with torch.no_grad():
        for x in (inp, inp.clone()):
            torch.testing.assert_close(prov.run(p, st, x).double(), want(p, inp), rtol=1e-6, atol=1e-6)
    assert counters["stats"]["unique_graphs"] - before == 1
    harness.reset_compiled()


# --------------------------------------------------------------------------- arguments

def test_default_configuration_is_the_published_one():
    args = cf.parse_args([])
    keys, sweeps = cf.build_configs(args)
    assert keys == [(2048, 64, 64, L, "bf16", "kv", "sorted", None, 2, 128) for L in cf.PUBLISHED["L"]]
    assert sweeps == {"L (bf16, kv, sorted)": ("L", keys)}
    assert (args.H, args.D, args.dtype, args.jagged, args.preset) == ([2], [128], ["bf16"], None, None)
    assert (args.timing, args.sustained_warmup_s, args.sustained_s) == ("both", 2.0, 1.0)


def test_sweeps():
    args = cf.parse_args(["--sweep", "ratio", "B", "--order", "sorted", "shuffled"])
    keys, sweeps = cf.build_configs(args)
    assert all(k[3] == cf.SWEEP_L for k in keys) and len(keys) == len(set(keys))
    point = (2048, 64, 64, cf.SWEEP_L, "bf16", "kv", "shuffled", None, 2, 128)
    assert point in sweeps["ratio (bf16, kv, shuffled)"].keys and point in sweeps["B (bf16, kv, shuffled)"].keys
    assert len(keys) == 2 * (len(cf.SWEEPS["ratio"].values) + len(cf.SWEEPS["B"].values) - 1)
    s_q = [1, 2, 4, 8, 16, 17, 32, 48, 64, 100, 128]
    keys, sweeps = cf.build_configs(cf.parse_args(["--sweep", "S_q_fine"]))
    assert keys == [(2048, 64, S, L, "bf16", "kv", "sorted", None, 2, 128) for L in (1024, 8192) for S in s_q]
    assert list(sweeps) == ["S_q_fine at L=1024 (bf16, kv, sorted)", "S_q_fine at L=8192 (bf16, kv, sorted)"]
    assert all(s.var == "S_q" for s in sweeps.values())
    keys, sweeps = cf.build_configs(cf.parse_args(["--sweep", "S_q_fine", "--L", "2048"]))  # --L replaces its L
    assert {k[3] for k in keys} == {2048} and list(sweeps) == ["S_q_fine (bf16, kv, sorted)"]
    keys, _ = cf.build_configs(cf.parse_args(["--sweep", "S_q", "S_q_fine"]))  # shared points run once
    assert len(keys) == len(set(keys)) == 2 * len(s_q)


def test_explicit_lists_and_flags():
    args = cf.parse_args(["--L", "1000", "3000", "--ratio", "10", "--B", "256", "--S-q", "32",
                          "--dtype", "fp16", "--broadcast", "q", "--order", "shuffled",
                          "--out-dir", "/tmp/x", "--providers", "ikbo", "fa3 varlen packed", "--rep", "3", "--no-plot"])
    keys, _ = cf.build_configs(args)
    assert keys == [(256, 10, 32, L, "fp16", "q", "shuffled", None, 2, 128) for L in (1000, 3000)]
    assert args.out_dir == Path("/tmp/x") and args.rep == 3 and args.no_plot
    assert args.providers == ["ikbo", "fa3 varlen packed"]


def test_h_and_d_lists_run_their_product():
    """--H and --D take lists: every point at each (H, D), like --dtype; the labels name H and D
    only when several of either are given."""
    args = cf.parse_args(["--sweep", "S_q_fine", "--H", "1", "2", "4", "8", "--D", "64", "128",
                          "--dtype", "bf16", "fp16"])
    keys, sweeps = cf.build_configs(args)
    s_q = cf.SWEEPS["S_q_fine"].values
    assert len(keys) == len(set(keys)) == 2 * len(s_q) * 2 * 4 * 2 and len(sweeps) == 2 * 2 * 4 * 2
    assert sweeps["S_q_fine at L=8192 (fp16, kv, sorted, H=4 D=64)"] == (
        "S_q", [(2048, 64, S, 8192, "fp16", "kv", "sorted", None, 4, 64) for S in s_q])
    assert (cf.run_settings(args)["H"], cf.run_settings(args)["D"]) == ([1, 2, 4, 8], [64, 128])
    keys, sweeps = cf.build_configs(cf.parse_args(["--H", "4", "--D", "64", "--L", "1024"]))
    assert keys == [(2048, 64, 64, 1024, "bf16", "kv", "sorted", None, 4, 64)]
    assert list(sweeps) == ["L (bf16, kv, sorted)"]
    _, sweeps = cf.build_configs(cf.parse_args(["--D", "64", "128", "--jagged", "zipf", "--L", "1024"]))
    assert list(sweeps) == [f"L (bf16, kv, sorted, jagged zipf, H=2 D={D})" for D in (64, 128)]


def test_jagged_arguments():
    args = cf.parse_args(["--jagged", "uniform", "lognormal:100", "--L", "4096", "--S-q", "1"])
    keys, sweeps = cf.build_configs(args)
    assert keys == [(2048, 64, 1, 4096, "bf16", "kv", "sorted", d, 2, 128) for d in ("uniform", "lognormal:100")]
    assert list(sweeps) == ["L (bf16, kv, sorted, jagged uniform)", "L (bf16, kv, sorted, jagged lognormal:100)"]
    settings = cf.run_settings(args)
    assert settings["preset"] is None and settings["jagged"] == {d: aw.LENGTHS[d][1] for d in ("lognormal", "uniform")}
    keys, _ = cf.build_configs(cf.parse_args(["--sweep", "S_q_fine", "--jagged", "exponential"]))
    assert len(keys) == 22 and {k[7] for k in keys} == {"exponential"}


@pytest.mark.parametrize("argv", [["--providers", "fa5"], ["--dtype", "fp8"], ["--H", "two"], ["--jagged", "pareto"],
                                  ["--jagged", "zipf:3"], ["--preset", "gr-self"], ["--variant", "no_such_field=1"]])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cf.parse_args(argv)
    assert e.value.code == 2 and argv[-1] in capsys.readouterr().err


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as e:
        cf.parse_args(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--jagged DIST" in out and "S_q_fine" in out and "2% at L" in out
    assert "--variant SPEC" in out and all(name in out for name in cf.PRESETS)


def test_presets():
    """Each preset's sweeps, as the issue of ranking-model shapes gives them; options given win."""
    def configs(*argv):
        args = cf.parse_args(list(argv))
        return args, *cf.build_configs(args)

    args, keys, sweeps = configs("--preset", "short-history")
    assert (args.H, args.D) == ([4], [64])
    assert {n: s.var for n, s in sweeps.items()} == {
        "short-history lognormal (bf16, kv, sorted, jagged lognormal:64)": "S_q",
        "short-history 128 padded (bf16, kv, sorted)": "S_q",
        "short-history 128 kv_offsets (bf16, kv, sorted, jagged equal)": "S_q"}
    assert keys == [(2048, 32, S, L, "bf16", "kv", "sorted", j, 4, 64)
                    for L, j in ((256, "lognormal:64"), (128, None), (128, "equal")) for S in (1, 4)]
    settings = cf.run_settings(args)
    assert settings["preset"]["name"] == "short-history" and set(settings["jagged"]) == {"lognormal", "equal"}

    args, keys, sweeps = configs("--preset", "long-history")
    assert keys == [(4096, 512, 1, 16384, "bf16", "kv", "sorted", None, 4, 128),
                    (4096, 512, 1, 32768, "bf16", "kv", "sorted", "lognormal", 4, 128)]
    assert len(harness.user_counts(4096, 512, np.random.default_rng(0))) == 8
    assert list(sweeps) == ["long-history 16384 padded (bf16, kv, sorted)",
                            "long-history lognormal (bf16, kv, sorted, jagged lognormal)"]

    args, keys, _ = configs("--preset", "gr-cross")
    assert keys == [(10400, 1300, 1, 32768, "bf16", "kv", "sorted", "lognormal", 6, 128)]
    assert len(harness.user_counts(10400, 1300, np.random.default_rng(0))) == 8
    args, keys, _ = configs("--preset", "gr-cross", "--B", "2600", "--H", "2", "--D", "64", "128",
                            "--jagged", "uniform", "--timing", "sustained")
    assert keys == [(2600, 1300, 1, 32768, "bf16", "kv", "sorted", "uniform", 2, D) for D in (64, 128)]
    assert args.timing == "sustained" and cf.run_settings(args)["jagged"] == {"uniform": aw.LENGTHS["uniform"][1]}


@needs_policies
def test_variants_parse_attention_policies():
    import ikbo_fa

    args = cf.parse_args(["--variant", "split_pair=0", "split_pair=0,prefetch_blocks=2"])
    assert args.variant == [("split_pair=0", ikbo_fa.AttentionPolicy.parse("split_pair=0")),
                            ("split_pair=0,prefetch_blocks=2",
                             ikbo_fa.AttentionPolicy(split_pair=False, prefetch_blocks=2))]
    assert cf.run_settings(args)["variants"] == ["split_pair=0", "split_pair=0,prefetch_blocks=2"]


# --------------------------------------------------------------------------- no GPU

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
@pytest.mark.parametrize("module", ["perf.compare_fa4", "perf.bench_lce"])
def test_without_a_gpu_one_line_and_exit_2(module):
    res = subprocess.run([sys.executable, "-m", module], cwd=ROOT, capture_output=True, text=True, timeout=120)
    text = (res.stdout + res.stderr).strip()
    assert res.returncode == 2 and len(text.splitlines()) == 1, text
    assert "Traceback" not in text and "Hopper" in text and "pip install -e '.[bench]'" in text


# --------------------------------------------------------------------------- CPU dry runs of main()

@pytest.fixture
def dry_run(monkeypatch, fake_libs, cpu_timing):
    """main() end to end on the CPU: timing by perf_counter, FA4, FA3 and ikbo replaced by stand-ins."""
    monkeypatch.setattr(cf, "DEVICE", "cpu")
    monkeypatch.setattr(harness, "require_hopper_or_exit", lambda *a, **k: None)
    real_host_overhead = harness.host_overhead_us
    monkeypatch.setattr(harness, "host_overhead_us", lambda fn, iters=100: real_host_overhead(fn, 2, 1))
    monkeypatch.setattr(harness, "l2_bytes", lambda: 2**20)
    monkeypatch.setattr(harness, "cublas_ceiling_tflops", lambda dtype: 700.0)
    monkeypatch.setattr(harness, "copy_bandwidth_tbps", lambda: 4.0)


def _run_main(tmp_path, extra, base=("--L", "8", "128", "--B", "6", "--ratio", "2", "--S-q", "4", "--D", "8")):
    argv = [*base, "--warmup", "1", "--rep", "3", "--sustained-warmup-s", "0.01", "--sustained-s", "0.02",
            "--graph-below-ms", "1e9", "--out-dir", str(tmp_path), *extra]
    assert cf.main(argv) == 0
    return json.loads((tmp_path / "compare_fa4-latest.json").read_text())


def test_main_dry_run(dry_run, tmp_path, capsys):
    data = _run_main(tmp_path, ["--broadcast", "kv", "q", "--order", "sorted", "shuffled"])
    rows = data["rows"]
    assert len(rows) == 2 * 2 * 2 * len(ap.DISPLAY_ORDER) and data["settings"]["timing"] == "both"
    for r in rows:
        assert r["status"] == ("skipped" if r["broadcast"] == "q" and r["provider"] in KV_ONLY else "ok"), r
        if r["status"] == "ok":
            assert r["ms"] > 0 and r["ms_sustained"] > 0 and r["W"] == 700.0 and r["MHz"] == 1500.0
        if r["status"] == "ok" and r["provider"] != "materialize":
            assert r["rel_err"] < 1e-2 and r["tflops"] > 0 and r["graph_ms"] > 0 and r["tflops_sustained"] > 0
            if r["provider"] != "ikbo":
                assert r["ikbo_speedup"] == pytest.approx(r["ms"] / next(
                    o["ms"] for o in rows if o["provider"] == "ikbo" and cf._key(o) == cf._key(r)))
        if r["status"] == "ok" and r["broadcast"] == "kv" and r["provider"] != "materialize":
            peers = {o["provider"]: o for o in rows if cf._key(o) == cf._key(r) and o["provider"] in KV_ONLY
                     and "varlen" in o["provider"]}
            for s in ("", "_sustained"):  # the fastest FA varlen peer, within each timing mode
                best = min(peers.values(), key=lambda o: o["ms" + s])
                assert r["best_peer" + s] == best["provider"]
                assert r["x_best_peer" + s] == pytest.approx(best["ms" + s] / r["ms" + s])
            best = min(peers.values(), key=lambda o: o["graph_ms"])  # and in the graph replays beside
            assert r["graph_x_best_peer"] == pytest.approx(best["graph_ms"] / r["graph_ms"])
        if r["broadcast"] == "q":
            assert "best_peer" not in r  # no varlen peer takes dense Q broadcast
    assert set(data["host_overhead_us"]) >= {"ikbo", "fa4 materialized", "fa3 varlen packed", "sdpa materialized"}
    assert data["environment"]["torch"] == torch.__version__ and "fa3-fwd" in data["environment"]
    out = capsys.readouterr().out
    assert "TFLOP/s (eager, interleaved)" in out and "TFLOP/s (eager, sustained)" in out
    assert "ikbo / best peer" in out and "ikbo / best peer, graph" in out and "host time per call" in out
    assert "best_peer  x_best_peer  graph_x_best_peer" in out  # the columns of each problem's table
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "plot skipped" in out
    else:
        assert (tmp_path / "compare_fa4-latest.png").stat().st_size > 0


@needs_policies
def test_main_dry_run_variants(dry_run, tmp_path, monkeypatch):
    """--variant: one more ikbo provider per spec, called with its policy, listed right after
    ikbo, timed against it; ikbo itself runs the op's default."""
    import ikbo_fa

    seen = []

    def recording(q, kv, idx, **kw):
        seen.append(kw.get("policy"))
        return ikbo_attention(q, kv, idx, **kw)

    monkeypatch.setitem(LIBS.modules, "ikbo_fa", types.SimpleNamespace(attention=recording))
    data = _run_main(tmp_path, ["--no-plot", "--L", "8", "--providers", "ikbo", "sdpa materialized",
                                "--variant", "split_pair=0", "split_pair=0,prefetch_blocks=2"])
    names = [r["provider"] for r in data["rows"]]
    assert names == ["ikbo", "ikbo split_pair=0", "ikbo split_pair=0,prefetch_blocks=2", "sdpa materialized"]
    assert all(r["status"] == "ok" for r in data["rows"]) and all(r["ikbo_speedup"] > 0 for r in data["rows"][1:])
    assert set(seen) == {None, ikbo_fa.AttentionPolicy(split_pair=False),
                         ikbo_fa.AttentionPolicy(split_pair=False, prefetch_blocks=2)}


def test_main_dry_run_wrong_missing_and_unavailable(dry_run, tmp_path, monkeypatch, capsys):
    """A wrong ikbo is not timed; without FA3 its providers are skipped with a note (printed and
    in the JSON); a not-implemented path is skipped; the rest run."""
    def wrong(q, kv, idx, **kw):
        return ikbo_attention(q, kv, (idx + 1) % kv[0].shape[0], **kw)

    monkeypatch.setitem(LIBS.modules, "ikbo_fa", types.SimpleNamespace(attention=wrong))
    monkeypatch.delitem(LIBS.modules, "fa3")
    monkeypatch.setitem(sys.modules, "fa3_fwd_interface", None)  # not importable, here or on a GPU machine
    data = _run_main(tmp_path, ["--no-plot", "--timing", "interleaved"])
    by = {(r["L"], r["provider"]): r for r in data["rows"]}
    assert by[(8, "ikbo")]["status"] == "wrong" and "ms" not in by[(8, "ikbo")]
    fa3 = by[(8, "fa3 varlen packed")]
    assert fa3["status"] == "skipped" and "fa3_fwd_interface" in fa3["note"]
    assert any("fa3_fwd_interface not importable" in n for n in data["notes"])
    assert "fa3_fwd_interface not importable" in capsys.readouterr().out
    sdpa = by[(8, "sdpa materialized")]
    assert sdpa["status"] == "ok" and "ikbo_speedup" not in sdpa and sdpa["best_peer"] == "fa4 varlen packed"

    def not_yet(*a, **k):
        raise NotImplementedError("attention: coming soon")

    monkeypatch.setitem(LIBS.modules, "ikbo_fa", types.SimpleNamespace(attention=not_yet))
    data = _run_main(tmp_path, ["--no-plot", "--providers", "ikbo", "fa4 varlen packed"])
    assert {r["provider"]: r["status"] for r in data["rows"]} == {"ikbo": "skipped", "fa4 varlen packed": "ok"}


def test_main_dry_run_each_timing(dry_run, tmp_path, compile_eagerly):
    data = _run_main(tmp_path, ["--no-plot", "--timing", "sustained"])
    by = {(r["L"], r["provider"]): r for r in data["rows"]}
    ours, sdpa = by[(8, "ikbo")], by[(8, "sdpa materialized")]
    assert "ms" not in ours and "graph_ms" not in ours and ours["ms_sustained"] > 0  # graphs: interleaved only
    assert sdpa["ikbo_speedup_sustained"] == pytest.approx(sdpa["ms_sustained"] / ours["ms_sustained"])
    assert by[(128, "torch.compile materialize+sdpa")]["status"] == "ok"
    data = _run_main(tmp_path, ["--no-plot", "--timing", "interleaved"])
    assert all("ms_sustained" not in r and "W" not in r for r in data["rows"])
    data = _run_main(tmp_path, ["--no-plot", "--timing", "graph", "--providers", "ikbo", "sdpa materialized"])
    by = {(r["L"], r["provider"]): r for r in data["rows"]}
    ours, sdpa = by[(8, "ikbo")], by[(8, "sdpa materialized")]
    assert "ms" not in ours and "graph_ms" not in ours and ours["ms_graph"] > 0  # one graph timing, not two
    assert sdpa["ikbo_speedup_graph"] == pytest.approx(sdpa["ms_graph"] / ours["ms_graph"])
    # a fresh compile per problem (two L), and one for the host-time problem, each run
    assert len([c for c in compile_eagerly if c["mode"] is None and c["dynamic"] is False]) == 2 * 3


def test_main_dry_run_jagged(dry_run, tmp_path, capsys):
    data = _run_main(tmp_path, ["--jagged", "lognormal", "--broadcast", "kv", "q", "--order", "shuffled"])
    assert data["settings"]["jagged"] == {"lognormal": aw.LENGTHS["lognormal"][1]}
    for r in data["rows"]:
        assert r["jagged"] == "lognormal" and r["S_q"] == 4 and 1 <= r["max_len"] <= min(r["L"], r["total_keys"])
        kv_only = r["broadcast"] == "q" and r["provider"] == "ikbo, work list reused"
        assert r["status"] == ("skipped" if r["provider"] in DENSE_ONLY or kv_only else "ok"), r
        if r["status"] == "ok" and r["provider"] != "materialize":
            assert r["rel_err"] < 1e-2 and r["ms"] > 0 and r["ms_sustained"] > 0 and r["x_best_peer"] > 0
            assert r["tflops"] == pytest.approx(r["gflop"] * 1e9 / (r["ms"] * 1e-3) / 1e12)
    out = capsys.readouterr().out
    assert "jagged=lognormal" in out and "max_len=" in out and "L (bf16, kv, shuffled, jagged lognormal)" in out


def test_main_dry_run_preset_scaled_down(dry_run, tmp_path, capsys):
    """The short-history preset with its sizes overridden to fit a CPU: its three parts, S_q 1
    and 4, H 4, the lognormal:64, padded and equal-length layouts."""
    data = _run_main(tmp_path, ["--preset", "short-history", "--B", "26", "--ratio", "13", "--D", "8",
                                "--timing", "interleaved", "--no-plot", "--providers", "ikbo", "fa4 varlen packed",
                                "fa3 varlen packed", "sdpa materialized"], base=())
    assert data["settings"]["preset"]["name"] == "short-history"
    got = {(r["L"], r["jagged"], r["S_q"], r["provider"]) for r in data["rows"]}
    assert got == {(L, j, S, n) for L, j in ((256, "lognormal:64"), (128, None), (128, "equal")) for S in (1, 4)
                   for n in ("ikbo", "fa4 varlen packed", "fa3 varlen packed", "sdpa materialized")}
    for r in data["rows"]:
        assert (r["H"], r["D"], r["B"], r["U"]) == (4, 8, 26, 2)
        assert r["status"] == "ok" and r["rel_err"] < 1e-2 and "ms_sustained" not in r
        assert r["max_len"] == 128 or r["jagged"] == "lognormal:64"
    out = capsys.readouterr().out
    assert "sweep short-history 128 padded (bf16, kv, sorted)" in out
    assert "sweep short-history 128 kv_offsets (bf16, kv, sorted, jagged equal)" in out


def test_main_dry_run_h_and_d_lists(dry_run, tmp_path, capsys):
    """Two H and two D in one run: a problem per (L, H, D), rows of their own shape, a sweep
    label per (H, D), and the settings' lists."""
    data = _run_main(tmp_path, ["--H", "1", "2", "--D", "8", "16", "--timing", "interleaved",
                                "--providers", "ikbo", "fa4 varlen packed", "sdpa materialized"])
    assert (data["settings"]["H"], data["settings"]["D"]) == ([1, 2], [8, 16])
    got = {(r["L"], r["H"], r["D"], r["provider"]): r for r in data["rows"]}
    assert set(got) == {(L, H, D, n) for L in (8, 128) for H in (1, 2) for D in (8, 16)
                        for n in ("ikbo", "fa4 varlen packed", "sdpa materialized")}
    for (L, H, D, _), r in got.items():
        assert r["status"] == "ok" and r["rel_err"] < 1e-2
        assert r["gflop"] == pytest.approx(4 * r["B"] * H * r["S_q"] * L * D / 1e9)
    out = capsys.readouterr().out
    assert all(f"sweep L (bf16, kv, sorted, H={H} D={D})" in out for H in (1, 2) for D in (8, 16))
    assert "host time per call, tiny problem (B=4, ratio 2, L=128, H=1 D=8)" in out


def test_main_dry_run_two_lists_print_both(dry_run, tmp_path, capsys):
    """--L and --S-q lists: one table whose lines name both (L slowest, S_q fastest)."""
    _run_main(tmp_path, ["--L", "8", "16", "--S-q", "1", "2", "--timing", "interleaved", "--no-plot",
                         "--providers", "ikbo", "sdpa materialized"])
    out = capsys.readouterr().out
    table = out[out.index("sweep L (bf16, kv, sorted)"):].splitlines()
    assert table[1].split()[:3] == ["L", "S_q", "ikbo"]
    assert [line.split()[:2] for line in table[3:7]] == [["8", "1"], ["8", "2"], ["16", "1"], ["16", "2"]]


def test_plot_wraps_many_sweeps(tmp_path):
    pytest.importorskip("matplotlib")
    rows, sweeps = [], {}
    for H in range(1, 2 * cf.PLOT_COLUMNS + 2):  # three rows of panels, the last one partial
        series = sweeps.setdefault(f"S_q (bf16, kv, sorted, H={H} D=128)", cf.Series("S_q", []))
        for S_q in (1, 17):
            key = (2048, 64, S_q, 1024, "bf16", "kv", "sorted", None, H, 128)
            series.keys.append(key)
            for prov, tflops in (("ikbo", 100.0 + H), ("sdpa materialized", 50.0)):
                rows.append(dict(zip(("B", "ratio", "S_q", "L", "dtype", "broadcast", "order", "jagged", "H", "D"),
                                     key), provider=prov, status="ok", tflops=tflops,
                                 ikbo_speedup=None if prov == "ikbo" else (100.0 + H) / 50.0))
    path = tmp_path / "wrapped.png"
    assert cf.plot(rows, sweeps, {"bf16": 700.0}, path) is None
    from PIL import Image

    assert Image.open(path).size == (6 * cf.PLOT_COLUMNS * 120, 3 * 8 * 120)
