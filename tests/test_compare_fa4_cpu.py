"""CPU checks of perf/compare_fa4.py: workload generation, FLOP count, the page-table and
varlen packings (run through a pure-torch stand-in with FA4's signature), provider wiring,
argument parsing and the no-GPU exit."""
import inspect
import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

from perf import compare_fa4 as cf


# --------------------------------------------------------------------------- stand-ins

def naive_attention(q, k, v, scale):
    """q [S, H, D], k/v [L, H, D] -> [S, H, D], float64."""
    s = torch.einsum("shd,lhd->hsl", q.double(), k.double()) * scale
    return torch.einsum("hsl,lhd->shd", torch.softmax(s, dim=-1), v.double())


def per_candidate_reference(q, k, v, idx, scale, broadcast="kv"):
    out = []
    for b, u in enumerate(idx.tolist()):
        if broadcast == "kv":
            out.append(naive_attention(q[b], k[u], v[u], scale))
        else:
            out.append(naive_attention(q[u], k[b], v[b], scale))
    return torch.stack(out)


def fa4_func(q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False,
             return_lse=False):
    """flash_attn_func's arguments (those the script may use) and layout: [B, S, H, D]."""
    assert q.dim() == 4 and k.shape == v.shape and k.shape[0] == q.shape[0]
    assert q.dtype == k.dtype == v.dtype and not causal
    out = torch.stack([naive_attention(q[b], k[b], v[b], softmax_scale).to(q.dtype)
                       for b in range(q.shape[0])])
    return out, None


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
            kb = k[page_table[b].long()].reshape(-1, H, D)
            vb = v[page_table[b].long()].reshape(-1, H, D)
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


def jagged_per_candidate_reference(q, k, v, idx, kv_offsets, scale, broadcast="kv"):
    """Jagged K/V: k, v [total keys, H, D], row r = rows kv_offsets[r]:kv_offsets[r + 1];
    candidate b attends over the rows of its user (K/V broadcast) or its own (Q broadcast)."""
    off = kv_offsets.tolist()
    out = []
    for b, u in enumerate(idx.tolist()):
        qb, r = (q[b], u) if broadcast == "kv" else (q[u], b)
        out.append(naive_attention(qb, k[off[r]:off[r + 1]], v[off[r]:off[r + 1]], scale))
    return torch.stack(out)


# Providers of K/V broadcast only (skipped with --broadcast q).
KV_ONLY = {"fa4 page table", "fa4 varlen packed", "ikbo, work list reused"}


def ikbo_work_list(idx, num_users, s_q=1, *, kv_lengths=None, kv_offsets=None, max_kv_len=None):
    """ikbo_fa.work_list's signature: what it was built for, for ikbo_attention to check."""
    return dict(idx=idx, num_users=num_users, s_q=s_q, kv_offsets=kv_offsets)


def ikbo_attention(q, kv, idx, *, scale=None, kv_lengths=None, kv_offsets=None, max_kv_len=None,
                   broadcast=None, return_lse=False, out=None, work_list=None):
    """ikbo_fa.attention's signature, jagged K/V (kv_offsets, max_kv_len) included."""
    k, v = kv
    if work_list is not None:  # built for this idx, U, S_q and kind of K/V
        assert (broadcast or "kv") == "kv" and work_list["idx"] is idx and work_list["s_q"] == q.shape[1]
        assert work_list["num_users"] == (k.shape[0] if kv_offsets is None else kv_offsets.shape[0] - 1)
        assert work_list["kv_offsets"] is kv_offsets
    if kv_offsets is not None:
        assert kv_offsets.dtype == torch.int32 and k.dim() == 3 and kv_offsets[-1] == k.shape[0]
        assert max_kv_len >= int((kv_offsets[1:] - kv_offsets[:-1]).max())
        return jagged_per_candidate_reference(q, k, v, idx, kv_offsets, scale, broadcast or "kv").to(q.dtype)
    return per_candidate_reference(q, k, v, idx, scale, broadcast or "kv").to(q.dtype)


def cpu_problem(B, ratio, S_q, L, H, D, broadcast="kv", order="sorted", seed=0, jagged=None):
    rng = np.random.default_rng(seed)
    p = cf.make_problem(B, ratio, S_q, L, H, D, torch.bfloat16, broadcast, order, rng, device="cpu",
                        jagged=jagged)
    p.dtype = torch.float64  # exact CPU arithmetic; make_inputs uses it
    gen = torch.Generator().manual_seed(seed)
    inp = cf.make_inputs(p, gen, device="cpu")
    for t in (inp.q, inp.k, inp.v):
        t.mul_(2.0)  # sharper softmax than N(0, 1) scores would give: a wrong key set shows
    return p, inp


# --------------------------------------------------------------------------- workload

def test_flops_match_the_published_figure():
    # 250 TFLOP/s at 0.550 ms for B 2048, H 2, S_q 64, L 1024, D 128 (the published FA4 baseline)
    flops = cf.attention_flops(2048, 2, 64, 1024, 128)
    assert flops == 4 * 2048 * 2 * 64 * 1024 * 128
    assert abs(flops / 0.550e-3 / 1e12 - 250) < 1
    assert cf.attention_flops(1, 1, 1, 1, 1) == 4


def test_user_counts_published_mix():
    counts = cf.user_counts(2048, 64, np.random.default_rng(1))
    assert sum(counts) == 2048
    assert set(counts[:-1]) == {64, 65}
    assert 1 <= counts[-1] <= 65
    assert 30 <= len(counts) <= 33


@pytest.mark.parametrize("B,ratio", [(1, 1), (7, 1), (1024, 10000), (4096, 1000), (256, 10), (3, 3)])
def test_user_counts_extremes(B, ratio):
    rng = np.random.default_rng(B + ratio)
    counts = cf.user_counts(B, ratio, rng)
    assert sum(counts) == B and all(c >= 1 for c in counts)
    assert all(c in (ratio, ratio + 1) for c in counts[:-1])
    if ratio >= B:
        assert counts == [B]
    exact = cf.user_counts(B, ratio)
    assert sum(exact) == B and all(c == ratio for c in exact[:-1]) and exact[-1] <= ratio


def test_user_counts_rejects_nonsense():
    with pytest.raises(ValueError):
        cf.user_counts(0, 64)
    with pytest.raises(ValueError):
        cf.user_counts(64, 0)


@pytest.mark.parametrize("order", ["sorted", "shuffled"])
def test_make_idx(order):
    rng = np.random.default_rng(3)
    counts = cf.user_counts(500, 7, rng)
    idx = cf.make_idx(counts, order, rng)
    assert idx.dtype == torch.int32 and idx.shape == (500,)
    assert torch.bincount(idx.long(), minlength=len(counts)).tolist() == counts
    is_sorted = bool((idx[1:] >= idx[:-1]).all())
    assert is_sorted == (order == "sorted")


def test_check_candidates_include_ends():
    rng = np.random.default_rng(0)
    c = cf.check_candidates(2048, rng, n=10)
    assert c[0] == 0 and c[-1] == 2047 and len(c) <= 12 and bool((c[1:] > c[:-1]).all())
    assert cf.check_candidates(1, rng).tolist() == [0]
    assert cf.check_candidates(5, rng, n=32).tolist() == [0, 1, 2, 3, 4]


# --------------------------------------------------------------------------- reference

@pytest.mark.parametrize("broadcast", ["kv", "q"])
@pytest.mark.parametrize("order", ["sorted", "shuffled"])
def test_reference_outputs_match_naive(broadcast, order):
    p, inp = cpu_problem(B=13, ratio=3, S_q=5, L=11, H=2, D=8, broadcast=broadcast, order=order)
    cand = torch.tensor([0, 2, 3, 7, 12])
    got = cf.reference_outputs(p, inp, cand, chunk=2)
    want = per_candidate_reference(inp.q, inp.k, inp.v, p.idx_cpu, p.scale, broadcast)[cand]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- page table

@pytest.mark.parametrize("L", [8, 10, 3])
@pytest.mark.parametrize("order", ["sorted", "shuffled"])
def test_page_table_attention_matches_per_candidate(L, order):
    p, inp = cpu_problem(B=9, ratio=2, S_q=3, L=L, H=2, D=8, order=order)
    page = 4
    table = cf.build_page_table(p.idx, L, page_size=page)
    n = -(-L // page)
    assert table.pages.shape == (9, n) and table.pages.dtype == torch.int32
    assert (table.seqused_k is None) == (L % page == 0)
    kp, vp = cf.to_pages(inp.k, page), cf.to_pages(inp.v, page)
    assert kp.shape == (p.U * n, page, 2, 8)
    if L % page == 0:
        assert kp.data_ptr() == inp.k.data_ptr()  # a view, no copy
    out = cf.run_paged(fa4_varlen, inp.q, kp, vp, table, p.scale)
    want = per_candidate_reference(inp.q, inp.k, inp.v, p.idx_cpu, p.scale)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)


# --------------------------------------------------------------------------- varlen packing

@pytest.mark.parametrize("order", ["sorted", "shuffled"])
@pytest.mark.parametrize("B,ratio", [(11, 3), (1, 1), (6, 100), (8, 1)])
@pytest.mark.parametrize("S_q", [3, 1, 17])
def test_varlen_packing_matches_per_candidate(order, B, ratio, S_q):
    p, inp = cpu_problem(B=B, ratio=ratio, S_q=S_q, L=7, H=2, D=8, order=order)
    pk = cf.build_varlen_packing(p.idx_cpu, p.U, p.S_q, p.L)
    counts = torch.tensor(p.counts)
    assert pk.cu_seqlens_q.dtype == pk.cu_seqlens_k.dtype == torch.int32
    assert pk.cu_seqlens_q.tolist() == [0] + torch.cumsum(counts * S_q, 0).tolist()
    assert pk.cu_seqlens_k.tolist() == [7 * u for u in range(p.U + 1)]
    assert pk.max_seqlen_q == max(p.counts) * S_q and pk.max_seqlen_k == 7
    is_sorted = bool((p.idx_cpu[1:] >= p.idx_cpu[:-1]).all())
    assert (pk.order is None) == is_sorted
    if pk.order is None:
        assert cf.pack_queries(inp.q, pk).data_ptr() == inp.q.data_ptr()  # no gather
    else:
        assert bool((p.idx_cpu[pk.order][1:] >= p.idx_cpu[pk.order][:-1]).all())
    out = cf.run_varlen(fa4_varlen, inp.q, inp.k, inp.v, pk, p.scale)
    want = per_candidate_reference(inp.q, inp.k, inp.v, p.idx_cpu, p.scale)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)


def test_varlen_packing_of_a_user_without_candidates():
    idx = torch.tensor([0, 0, 2, 2, 2], dtype=torch.int32)
    pk = cf.build_varlen_packing(idx, 3, 2, 5)
    assert pk.cu_seqlens_q.tolist() == [0, 4, 4, 10]
    q = torch.randn(5, 2, 1, 4, dtype=torch.float64)
    k = torch.randn(3, 5, 1, 4, dtype=torch.float64)
    v = torch.randn(3, 5, 1, 4, dtype=torch.float64)
    out = cf.run_varlen(fa4_varlen, q, k, v, pk, 0.5)
    torch.testing.assert_close(out, per_candidate_reference(q, k, v, idx, 0.5))


# --------------------------------------------------------------------------- provider wiring

@pytest.fixture
def fake_libs(monkeypatch, compile_eagerly):
    monkeypatch.setattr(cf.LIBS, "fa4", types.SimpleNamespace(flash_attn_func=fa4_func,
                                                             flash_attn_varlen_func=fa4_varlen))
    monkeypatch.setattr(cf.LIBS, "ikbo", types.SimpleNamespace(attention=ikbo_attention, work_list=ikbo_work_list))


@pytest.mark.parametrize("broadcast", ["kv", "q"])
@pytest.mark.parametrize("order", ["sorted", "shuffled"])
def test_every_provider_computes_the_same_attention(fake_libs, broadcast, order):
    p, inp = cpu_problem(B=10, ratio=3, S_q=4, L=8, H=2, D=8, broadcast=broadcast, order=order)
    want = per_candidate_reference(inp.q, inp.k, inp.v, p.idx_cpu, p.scale, broadcast)
    rotated = inp.clone()  # a rotation copy: same values, other storage
    ran = []
    for prov in cf.providers():
        try:
            st = prov.setup(p, inp)
        except cf.Skip as e:
            assert broadcast == "q" and prov.name in KV_ONLY, e
            continue
        for x in (inp, rotated):
            out = prov.run(p, st, x)
            if not prov.attention:  # the materialization: check the copy itself
                side = (out.k, x.k) if broadcast == "kv" else (out.q, x.q)
                torch.testing.assert_close(side[0], side[1][p.idx.long()])
                continue
            assert out.shape == (p.B, p.S_q, p.H, p.D)
            torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-6)
        ran.append(prov.name)
    expected = set(cf.DISPLAY_ORDER) - (KV_ONLY if broadcast == "q" else set())
    assert set(ran) == expected


@pytest.mark.parametrize("broadcast", ["kv", "q"])
def test_compiled_materialize_sdpa_compiles_for_real(broadcast):
    """Inductor on the CPU, a tiny problem: one graph, the same attention, no recompile for a copy."""
    from torch._dynamo.utils import counters

    cf.harness.reset_compiled()
    p, inp = cpu_problem(B=6, ratio=3, S_q=4, L=8, H=2, D=8, broadcast=broadcast)
    want = per_candidate_reference(inp.q, inp.k, inp.v, p.idx_cpu, p.scale, broadcast)
    prov = next(pr for pr in cf.providers() if pr.name == "torch.compile materialize+sdpa")
    before = counters["stats"]["unique_graphs"]
    st = prov.setup(p, inp)
    with torch.no_grad():
        for x in (inp, inp.clone()):
            torch.testing.assert_close(prov.run(p, st, x).double(), want, rtol=1e-6, atol=1e-6)
    assert counters["stats"]["unique_graphs"] - before == 1
    cf.harness.reset_compiled()


def test_a_wrong_provider_fails_the_check():
    p, inp = cpu_problem(B=10, ratio=3, S_q=4, L=8, H=2, D=8)
    cand = cf.check_candidates(p.B, np.random.default_rng(0))
    ref = cf.reference_outputs(p, inp, cand)
    shifted_idx = (p.idx_cpu + 1) % p.U  # every candidate attends to the wrong user
    wrong = per_candidate_reference(inp.q, inp.k, inp.v, shifted_idx, p.scale)
    assert cf.harness.rel_error(wrong[cand].float(), ref) > 0.1
    right = per_candidate_reference(inp.q, inp.k, inp.v, p.idx_cpu, p.scale)
    assert cf.harness.rel_error(right[cand].float(), ref) < 1e-5


# --------------------------------------------------------------------------- arguments

def test_default_configuration_is_the_published_one():
    args = cf.parse_args([])
    keys, sweeps = cf.build_configs(args)
    assert keys == [(2048, 64, 64, L, "bf16", "kv", "sorted", None, 2, 128) for L in cf.PUBLISHED["L"]]
    assert list(sweeps) == ["L (bf16, kv, sorted)"]
    assert args.H == [2] and args.D == [128] and args.dtype == ["bf16"]
    assert args.jagged is None and args.preset is None
    assert (args.timing, args.sustained_warmup_s, args.sustained_s) == ("both", 2.0, 1.0)
    assert cf.parse_args(["--timing", "interleaved"]).timing == "interleaved"


def test_sweeps_share_the_published_point():
    args = cf.parse_args(["--sweep", "ratio", "B", "--order", "sorted", "shuffled"])
    keys, sweeps = cf.build_configs(args)
    assert all(k[3] == cf.SWEEP_L for k in keys)
    assert len(keys) == len(set(keys))
    point = (2048, 64, 64, cf.SWEEP_L, "bf16", "kv", "shuffled", None, 2, 128)
    assert point in sweeps["ratio (bf16, kv, shuffled)"] and point in sweeps["B (bf16, kv, shuffled)"]
    assert len(keys) == 2 * (len(cf.SWEEPS["ratio"].values) + len(cf.SWEEPS["B"].values) - 1)


def test_explicit_lists_and_flags():
    args = cf.parse_args(["--L", "1000", "3000", "--ratio", "10", "--B", "256", "--S-q", "32",
                          "--dtype", "fp16", "--broadcast", "q", "--order", "shuffled",
                          "--out-dir", "/tmp/x", "--providers", "ikbo", "fa4 materialized",
                          "--rep", "3", "--no-plot"])
    keys, _ = cf.build_configs(args)
    assert keys == [(256, 10, 32, 1000, "fp16", "q", "shuffled", None, 2, 128),
                    (256, 10, 32, 3000, "fp16", "q", "shuffled", None, 2, 128)]
    assert args.out_dir == Path("/tmp/x") and args.rep == 3 and args.no_plot
    assert args.providers == ["ikbo", "fa4 materialized"]


def test_h_and_d_lists_run_their_product():
    """--H and --D take lists: every point at each (H, D), like --dtype; the labels name H and D
    only when several of either are given."""
    args = cf.parse_args(["--sweep", "S_q_fine", "--H", "1", "2", "4", "8", "--D", "64", "128",
                          "--dtype", "bf16", "fp16"])
    keys, sweeps = cf.build_configs(args)
    s_q = cf.SWEEPS["S_q_fine"].values
    assert len(keys) == len(set(keys)) == 2 * len(s_q) * 2 * 4 * 2
    assert {(k[8], k[9]) for k in keys} == {(H, D) for H in (1, 2, 4, 8) for D in (64, 128)}
    assert len(sweeps) == 2 * 2 * 4 * 2
    label = "S_q_fine at L=8192 (fp16, kv, sorted, H=4 D=64)"
    assert sweeps[label] == [(2048, 64, S, 8192, "fp16", "kv", "sorted", None, 4, 64) for S in s_q]
    assert cf.sweep_var(label) == "S_q"
    assert (cf.run_settings(args)["H"], cf.run_settings(args)["D"]) == ([1, 2, 4, 8], [64, 128])
    # one H and one D: plain labels, the key still carries them
    keys, sweeps = cf.build_configs(cf.parse_args(["--H", "4", "--D", "64", "--L", "1024"]))
    assert keys == [(2048, 64, 64, 1024, "bf16", "kv", "sorted", None, 4, 64)]
    assert list(sweeps) == ["L (bf16, kv, sorted)"]
    # several D alone name H too; jagged keeps its place before them
    _, sweeps = cf.build_configs(cf.parse_args(["--D", "64", "128", "--jagged", "zipf", "--L", "1024"]))
    assert list(sweeps) == [f"L (bf16, kv, sorted, jagged zipf, H=2 D={D})" for D in (64, 128)]
    # a preset's H and D are lists too; given ones win
    args = cf.parse_args(["--preset", "gr-cross", "--D", "64", "128"])
    assert (args.H, args.D) == ([6], [64, 128])
    assert [k[8:] for k in cf.build_configs(args)[0]] == [(6, 64), (6, 128)]


def test_bad_arguments_exit_2():
    with pytest.raises(SystemExit) as e:
        cf.parse_args(["--providers", "fa5"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        cf.parse_args(["--dtype", "fp8"])
    with pytest.raises(SystemExit):
        cf.parse_args(["--H", "two"])


# --------------------------------------------------------------------------- no GPU

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
@pytest.mark.parametrize("module", ["perf.compare_fa4", "perf.bench_lce"])
def test_without_a_gpu_one_line_and_exit_2(module):
    res = subprocess.run([sys.executable, "-m", module], cwd=ROOT, capture_output=True, text=True, timeout=120)
    text = (res.stdout + res.stderr).strip()
    assert res.returncode == 2, text
    assert len(text.splitlines()) == 1, text
    assert "Traceback" not in text and "Hopper" in text and "pip install -e '.[bench]'" in text


# --------------------------------------------------------------------------- CPU dry run of main()

@pytest.fixture
def dry_run(monkeypatch, fake_libs, cpu_timing):
    """main() end to end on the CPU: timing by perf_counter, FA4 and ikbo replaced by stand-ins."""
    h = cf.harness
    monkeypatch.setattr(cf, "DEVICE", "cpu")
    monkeypatch.setattr(h, "require_hopper_or_exit", lambda *a, **k: None)
    monkeypatch.setattr(cf, "load_fa4", lambda: None)
    monkeypatch.setattr(cf, "load_ikbo", lambda: None)
    real_host_overhead = h.host_overhead_us
    monkeypatch.setattr(h, "host_overhead_us", lambda fn, iters=100: real_host_overhead(fn, 2, 1))
    monkeypatch.setattr(h, "l2_bytes", lambda: 2**20)
    monkeypatch.setattr(h, "cublas_ceiling_tflops", lambda dtype: 700.0)
    monkeypatch.setattr(h, "copy_bandwidth_tbps", lambda: 4.0)


def _run_main(tmp_path, extra):
    argv = ["--L", "8", "128", "--B", "6", "--ratio", "2", "--S-q", "4", "--D", "8", "--warmup", "1", "--rep", "3",
            "--sustained-warmup-s", "0.01", "--sustained-s", "0.02", "--graph-below-ms", "1e9",
            "--out-dir", str(tmp_path)] + extra
    assert cf.main(argv) == 0
    return json.loads((tmp_path / "compare_fa4-latest.json").read_text())


def test_main_dry_run(dry_run, tmp_path, capsys):
    data = _run_main(tmp_path, ["--broadcast", "kv", "q", "--order", "sorted", "shuffled"])
    rows = data["rows"]
    assert len(rows) == 2 * 2 * 2 * len(cf.DISPLAY_ORDER)
    assert data["settings"]["timing"] == "both"  # the default
    for r in rows:
        q_only_skip = r["broadcast"] == "q" and r["provider"] in KV_ONLY
        assert r["status"] == ("skipped" if q_only_skip else "ok"), r
        if r["status"] == "ok":
            assert r["ms"] > 0 and r["ms_sustained"] > 0 and r["W"] == 700.0 and r["MHz"] == 1500.0
        if r["status"] == "ok" and r["provider"] != "materialize":
            assert r["rel_err"] < 1e-2 and r["tflops"] > 0 and r["graph_ms"] > 0 and r["tflops_sustained"] > 0
            assert "graph_ms_sustained" not in r
            if r["provider"] != "ikbo":
                assert r["ikbo_speedup"] > 0 and r["ikbo_speedup_sustained"] > 0
    assert set(data["host_overhead_us"]) >= {"ikbo", "fa4 materialized", "sdpa materialized",
                                             "torch.compile materialize+sdpa"}
    assert data["environment"]["torch"] == torch.__version__
    out = capsys.readouterr().out
    assert "TFLOP/s (eager, interleaved)" in out and "TFLOP/s (eager, sustained)" in out
    assert "host time per call" in out
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "plot skipped" in out
    else:
        assert (tmp_path / "compare_fa4-latest.png").stat().st_size > 0


def test_main_dry_run_variants(dry_run, tmp_path, monkeypatch):
    """--variant: one more ikbo provider per spec, run with the op's launch flags set (and put back
    after each call), listed right after ikbo, timed against it."""
    import importlib

    mod = importlib.import_module("ikbo_fa.attention")
    seen = []

    def recording(q, kv, idx, **kw):
        seen.append((mod._SPLIT_PAIR, mod._SPLIT_MIN_KEYS))
        return ikbo_attention(q, kv, idx, **kw)

    monkeypatch.setattr(cf.LIBS, "ikbo", types.SimpleNamespace(attention=recording))
    before = (mod._SPLIT_PAIR, mod._SPLIT_MIN_KEYS)
    data = _run_main(tmp_path, ["--no-plot", "--L", "8", "--providers", "ikbo", "sdpa materialized",
                                "--variant", "_SPLIT_PAIR=0", "_SPLIT_PAIR=0,_SPLIT_MIN_KEYS=1024"])
    names = [r["provider"] for r in data["rows"]]
    assert names == ["ikbo", "ikbo _SPLIT_PAIR=0", "ikbo _SPLIT_PAIR=0,_SPLIT_MIN_KEYS=1024", "sdpa materialized"]
    assert all(r["status"] == "ok" for r in data["rows"])
    assert all(r["ikbo_speedup"] > 0 for r in data["rows"][1:])
    assert {before, (False, before[1]), (False, 1024)} <= set(seen)
    assert (mod._SPLIT_PAIR, mod._SPLIT_MIN_KEYS) == before
    assert data["argv"][-2:] == ["_SPLIT_PAIR=0", "_SPLIT_PAIR=0,_SPLIT_MIN_KEYS=1024"]


@pytest.mark.parametrize("spec", ["_NO_SUCH_FLAG=1", "_SPLIT_PAIR", "_SPLIT_PAIR=yes", "attention=1"])
def test_bad_variant_names_the_pair(spec):
    with pytest.raises(ValueError, match="not NAME=INTEGER for a flag of ikbo_fa.attention"):
        cf.parse_variant(spec)


def test_main_dry_run_wrong_and_missing(dry_run, tmp_path, monkeypatch):
    def wrong(q, kv, idx, **kw):
        return ikbo_attention(q, kv, (idx + 1) % kv[0].shape[0], **kw)

    monkeypatch.setattr(cf.LIBS, "ikbo", types.SimpleNamespace(attention=wrong))
    monkeypatch.setattr(cf.LIBS, "fa4", None)
    data = _run_main(tmp_path, ["--no-plot"])
    by = {(r["L"], r["provider"]): r for r in data["rows"]}
    assert by[(8, "ikbo")]["status"] == "wrong" and "ms" not in by[(8, "ikbo")]
    assert by[(8, "fa4 materialized")]["status"] == "skipped"
    assert by[(8, "sdpa materialized")]["status"] == "ok"
    assert "ikbo_speedup" not in by[(8, "sdpa materialized")]


def test_main_dry_run_not_implemented(dry_run, tmp_path, monkeypatch):
    def not_yet(*a, **k):
        raise NotImplementedError("attention: coming soon")

    monkeypatch.setattr(cf.LIBS, "ikbo", types.SimpleNamespace(attention=not_yet))
    data = _run_main(tmp_path, ["--no-plot", "--providers", "ikbo", "fa4 varlen packed"])
    statuses = {r["provider"]: r["status"] for r in data["rows"]}
    assert statuses == {"ikbo": "skipped", "fa4 varlen packed": "ok"}


def test_main_dry_run_each_timing(dry_run, tmp_path, compile_eagerly):
    data = _run_main(tmp_path, ["--no-plot", "--timing", "sustained"])
    by = {(r["L"], r["provider"]): r for r in data["rows"]}
    ours, sdpa = by[(8, "ikbo")], by[(8, "sdpa materialized")]
    assert "ms" not in ours and "graph_ms" not in ours and ours["ms_sustained"] > 0  # graphs: interleaved only
    assert sdpa["ikbo_speedup_sustained"] == pytest.approx(sdpa["ms_sustained"] / ours["ms_sustained"])
    compiled = by[(128, "torch.compile materialize+sdpa")]
    assert compiled["status"] == "ok" and compiled["rel_err"] < 1e-2
    data = _run_main(tmp_path, ["--no-plot", "--timing", "interleaved"])
    assert all("ms_sustained" not in r and "W" not in r for r in data["rows"])
    data = _run_main(tmp_path, ["--no-plot", "--timing", "graph", "--providers", "ikbo", "sdpa materialized"])
    by = {(r["L"], r["provider"]): r for r in data["rows"]}
    ours, sdpa = by[(8, "ikbo")], by[(8, "sdpa materialized")]
    assert "ms" not in ours and "graph_ms" not in ours and ours["ms_graph"] > 0  # one graph timing, not two
    assert sdpa["ikbo_speedup_graph"] == pytest.approx(sdpa["ms_graph"] / ours["ms_graph"])
    # a fresh compile per problem (two L), and one for the host-time problem, each run
    assert len([c for c in compile_eagerly if c["mode"] is None and c["dynamic"] is False]) == 2 * 3


# --------------------------------------------------------------------------- S_q sweep

def test_s_q_fine_sweep_runs_at_both_L():
    args = cf.parse_args(["--sweep", "S_q_fine"])
    keys, sweeps = cf.build_configs(args)
    s_q = [1, 2, 4, 8, 16, 17, 32, 48, 64, 100, 128]
    assert list(cf.SWEEPS["S_q_fine"].values) == s_q
    assert keys == [(2048, 64, S, L, "bf16", "kv", "sorted", None, 2, 128) for L in (1024, 8192) for S in s_q]
    assert list(sweeps) == ["S_q_fine at L=1024 (bf16, kv, sorted)", "S_q_fine at L=8192 (bf16, kv, sorted)"]
    assert all(cf.sweep_var(label) == "S_q" for label in sweeps)
    # --L replaces the sweep's L; one L keeps the plain label
    keys, sweeps = cf.build_configs(cf.parse_args(["--sweep", "S_q_fine", "--L", "2048"]))
    assert {k[3] for k in keys} == {2048} and list(sweeps) == ["S_q_fine (bf16, kv, sorted)"]
    # beside the coarse S_q sweep: shared points run once
    keys, sweeps = cf.build_configs(cf.parse_args(["--sweep", "S_q", "S_q_fine"]))
    assert len(keys) == len(set(keys)) == 2 * len(s_q)
    assert cf.sweep_var("S_q (bf16, kv, sorted)") == "S_q" and cf.sweep_var("L (bf16, kv, sorted)") == "L"


@pytest.mark.parametrize("S_q", [1, 2, 17, 100])
@pytest.mark.parametrize("order", ["sorted", "shuffled"])
def test_varlen_packing_is_one_dense_sequence_per_user(S_q, order):
    """Sequence u holds the S_q queries of each of u's candidates, back to back, in candidate order."""
    p, inp = cpu_problem(B=12, ratio=4, S_q=S_q, L=5, H=2, D=4, order=order)
    pk = cf.build_varlen_packing(p.idx_cpu, p.U, p.S_q, p.L)
    packed = cf.pack_queries(inp.q, pk)
    assert packed.shape == (p.B * S_q, 2, 4) and packed.is_contiguous()
    cu = pk.cu_seqlens_q.tolist()
    for u in range(p.U):
        mine = [b for b in range(p.B) if int(p.idx_cpu[b]) == u]
        want = torch.cat([inp.q[b] for b in mine]) if mine else packed[:0]
        assert torch.equal(packed[cu[u]:cu[u + 1]], want)
    out = cf.run_varlen(fa4_varlen, inp.q, inp.k, inp.v, pk, p.scale)
    want = per_candidate_reference(inp.q, inp.k, inp.v, p.idx_cpu, p.scale)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)


# --------------------------------------------------------------------------- jagged: lengths

@pytest.mark.parametrize("dist", sorted(cf.LENGTHS))
@pytest.mark.parametrize("L", [1, 2, 7, 1000, 32768])
def test_lengths_seeded_within_1_L(dist, L):
    a = cf.draw_lengths(dist, 500, L, np.random.default_rng(5))
    b = cf.draw_lengths(dist, 500, L, np.random.default_rng(5))
    assert a.dtype == torch.int64 and a.shape == (500,)
    assert torch.equal(a, b)  # deterministic for a seed
    assert int(a.min()) >= 1 and int(a.max()) <= L
    if L >= 1000:
        assert not torch.equal(a, cf.draw_lengths(dist, 500, L, np.random.default_rng(6)))
        assert len(set(a.tolist())) > 50  # spread, not constant


def test_length_distributions_have_their_shape():
    L, n = 32768, 20000
    draw = {d: cf.draw_lengths(d, n, L, np.random.default_rng(0)).double() for d in cf.LENGTHS}
    assert abs(draw["uniform"].mean() / ((L + 1) / 2) - 1) < 0.02
    med = draw["lognormal"].median()
    assert 0.85 * L / 8 < med < 1.15 * L / 8
    at_cap = float((draw["lognormal"] == L).double().mean())
    assert 0.01 < at_cap < 0.03  # the clipped heavy tail
    assert draw["lognormal"].mean() > 1.4 * med  # right-skewed
    assert abs(draw["exponential"].mean() / (L / 4) - 1) < 0.05
    assert 0.5 * L ** 0.5 < draw["zipf"].median() < 2 * L ** 0.5
    assert float((draw["zipf"] <= 10).double().mean()) > 0.2


def test_kv_offsets():
    off = cf.kv_offsets_of(torch.tensor([3, 1, 5]))
    assert off.dtype == torch.int32 and off.tolist() == [0, 3, 4, 9]
    with pytest.raises(ValueError):
        cf.kv_offsets_of(torch.tensor([2**30, 2**30]))
    with pytest.raises(ValueError):
        cf.draw_lengths("uniform", 3, 0, np.random.default_rng(0))


@pytest.mark.parametrize("broadcast", ["kv", "q"])
def test_jagged_problem_draws_a_length_per_kv_row(broadcast):
    def make(seed):
        return cf.make_problem(40, 6, 2, 50, 2, 8, torch.bfloat16, broadcast, "shuffled",
                               np.random.default_rng(seed), device="cpu", jagged="lognormal")

    p, again = make(3), make(3)
    rows = p.U if broadcast == "kv" else p.B
    assert p.kv_rows == rows and p.kv_lengths_cpu.shape == (rows,)
    assert torch.equal(p.kv_lengths_cpu, again.kv_lengths_cpu) and torch.equal(p.idx_cpu, again.idx_cpu)
    assert p.kv_offsets_cpu.tolist() == [0] + torch.cumsum(p.kv_lengths_cpu, 0).tolist()
    assert p.total_keys == int(p.kv_lengths_cpu.sum()) and p.max_len == int(p.kv_lengths_cpu.max()) <= 50
    inp = cf.make_inputs(p, torch.Generator().manual_seed(0), device="cpu")
    assert inp.k.shape == inp.v.shape == (p.total_keys, 2, 8)
    assert inp.q.shape == ((p.B if broadcast == "kv" else p.U), 2, 2, 8)
    f = p.fields()
    assert f["jagged"] == "lognormal" and f["total_keys"] == p.total_keys and f["max_len"] == p.max_len
    assert f["S_q"] == 2 and f["L"] == 50 and f["gflop"] == pytest.approx(p.flops / 1e9)
    dense = cf.make_problem(40, 6, 2, 50, 2, 8, torch.bfloat16, broadcast, "shuffled",
                            np.random.default_rng(3), device="cpu")
    assert torch.equal(dense.idx_cpu, p.idx_cpu)  # lengths are drawn after the users
    assert dense.fields()["jagged"] is None and dense.total_keys == rows * 50 and dense.max_len == 50


# --------------------------------------------------------------------------- jagged: FLOPs

def test_jagged_flops():
    assert cf.jagged_flops([3, 1, 5], H=2, S_q=4, D=8) == 4 * 2 * 4 * 8 * 9
    for broadcast in ("kv", "q"):
        p, _ = cpu_problem(B=10, ratio=3, S_q=4, L=9, H=2, D=8, broadcast=broadcast, jagged="uniform")
        per_cand = [int(p.kv_lengths_cpu[int(u)]) for u in p.idx_cpu] if broadcast == "kv" \
            else p.kv_lengths_cpu.tolist()
        assert p.cand_lengths.tolist() == per_cand
        assert p.flops == sum(4 * 4 * n * 8 * 2 for n in per_cand)
    # every row of length L: the dense count
    p, _ = cpu_problem(B=10, ratio=3, S_q=4, L=1, H=2, D=8, jagged="zipf")
    assert p.flops == cf.attention_flops(10, 2, 4, 1, 8)


# --------------------------------------------------------------------------- jagged: packing

@pytest.mark.parametrize("order", ["sorted", "shuffled"])
@pytest.mark.parametrize("S_q", [1, 3])
@pytest.mark.parametrize("dist", ["uniform", "lognormal"])
def test_jagged_varlen_packing_uses_the_offsets(order, S_q, dist):
    p, inp = cpu_problem(B=14, ratio=3, S_q=S_q, L=9, H=2, D=8, order=order, jagged=dist)
    pk = cf.build_varlen_packing(p.idx_cpu, p.U, p.S_q, p.L, kv_offsets=p.kv_offsets_cpu)
    assert pk.cu_seqlens_k.dtype == pk.cu_seqlens_q.dtype == torch.int32
    assert torch.equal(pk.cu_seqlens_k, p.kv_offsets_cpu)  # the same offsets as ikbo gets
    assert pk.cu_seqlens_q.tolist() == [0] + torch.cumsum(torch.tensor(p.counts) * S_q, 0).tolist()
    assert pk.max_seqlen_k == p.max_len and pk.max_seqlen_q == max(p.counts) * S_q
    out = cf.run_varlen(fa4_varlen, inp.q, inp.k, inp.v, pk, p.scale)
    want = jagged_per_candidate_reference(inp.q, inp.k, inp.v, p.idx_cpu, p.kv_offsets_cpu, p.scale)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("order", ["sorted", "shuffled"])
def test_jagged_candidate_packing_for_q_broadcast(order):
    p, inp = cpu_problem(B=9, ratio=2, S_q=3, L=6, H=2, D=8, broadcast="q", order=order, jagged="uniform")
    pk = cf.build_candidate_packing(p.idx_cpu, p.kv_offsets_cpu, p.S_q)
    assert pk.cu_seqlens_q.tolist() == [3 * b for b in range(p.B + 1)]
    assert torch.equal(pk.cu_seqlens_k, p.kv_offsets_cpu) and pk.max_seqlen_k == p.max_len
    out = cf.run_varlen(fa4_varlen, inp.q, inp.k, inp.v, pk, p.scale)
    assert out.shape == (p.B, 3, 2, 8)
    want = jagged_per_candidate_reference(inp.q, inp.k, inp.v, p.idx_cpu, p.kv_offsets_cpu, p.scale, "q")
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)


def test_padded_gather():
    off = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    gather, mask = cf.padded_gather(off, torch.tensor([2, 0, 1, 2]), 5)
    assert gather.tolist() == [[4, 5, 6, 7, 8], [0, 1, 2, 2, 2], [3, 3, 3, 3, 3], [4, 5, 6, 7, 8]]
    assert mask.tolist() == [[True] * 5, [True] * 3 + [False] * 2, [True] + [False] * 4, [True] * 5]


def test_materialized_bytes():
    p, _ = cpu_problem(B=10, ratio=3, S_q=4, L=8, H=2, D=8)  # float64: 8 bytes an element
    assert cf.materialized_bytes(p) == 10 * 2 * 8 * 2 * 8 * 8
    p, _ = cpu_problem(B=10, ratio=3, S_q=4, L=8, H=2, D=8, jagged="uniform")
    assert cf.materialized_bytes(p) == 10 * p.max_len * (2 * 2 * 8 * 8 + 9)
    p, _ = cpu_problem(B=10, ratio=3, S_q=4, L=8, H=2, D=8, broadcast="q", jagged="uniform")
    assert cf.materialized_bytes(p) == 10 * p.max_len * (2 * 2 * 8 * 8 + 9) + 10 * 4 * 2 * 8 * 8


# --------------------------------------------------------------------------- jagged: reference check

@pytest.mark.parametrize("broadcast", ["kv", "q"])
@pytest.mark.parametrize("order", ["sorted", "shuffled"])
@pytest.mark.parametrize("dist", ["uniform", "lognormal", "zipf"])
def test_jagged_reference_outputs_match_naive(broadcast, order, dist):
    p, inp = cpu_problem(B=13, ratio=3, S_q=5, L=11, H=2, D=8, broadcast=broadcast, order=order, jagged=dist)
    cand = torch.tensor([0, 2, 3, 7, 12])
    got = cf.reference_outputs(p, inp, cand, chunk=2)
    want = jagged_per_candidate_reference(inp.q, inp.k, inp.v, p.idx_cpu, p.kv_offsets_cpu, p.scale,
                                          broadcast)[cand]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_jagged_reference_sees_a_wrong_key_range():
    p, inp = cpu_problem(B=12, ratio=3, S_q=2, L=16, H=2, D=8, jagged="uniform")
    cand = cf.check_candidates(p.B, np.random.default_rng(0))
    ref = cf.reference_outputs(p, inp, cand)
    # every candidate over the first max_len packed keys instead of its user's own
    wrong = torch.stack([naive_attention(inp.q[b], inp.k[:p.max_len], inp.v[:p.max_len], p.scale)
                         for b in range(p.B)])
    assert cf.harness.rel_error(wrong[cand].float(), ref) > 0.1


def _reference_takes_offsets() -> bool:
    try:
        import ikbo_fa
        return "kv_offsets" in inspect.signature(ikbo_fa.attention_reference).parameters
    except Exception:  # not importable (being edited), or no signature
        return False


@pytest.mark.skipif(not _reference_takes_offsets(),
                    reason="ikbo_fa.attention_reference takes no kv_offsets yet")
@pytest.mark.parametrize("broadcast", ["kv", "q"])
@pytest.mark.parametrize("dist", ["uniform", "lognormal"])
def test_jagged_reference_agrees_with_ikbo_fa(broadcast, dist):
    """The script's check against the library's own reference, called as the ikbo provider calls
    ikbo_fa.attention (kv_offsets, max_kv_len = the longest row)."""
    import ikbo_fa

    p, inp = cpu_problem(B=11, ratio=3, S_q=3, L=20, H=2, D=16, broadcast=broadcast, order="shuffled",
                         jagged=dist)
    inp = cf.Inputs(inp.q.float(), inp.k.float(), inp.v.float())
    p.dtype = torch.float32
    cand = torch.arange(p.B)
    got = ikbo_fa.attention_reference(inp.q, (inp.k, inp.v), p.idx, scale=p.scale, broadcast=p.broadcast,
                                      kv_offsets=p.kv_offsets, max_kv_len=p.max_len)
    torch.testing.assert_close(got, cf.reference_outputs(p, inp, cand), rtol=1e-4, atol=1e-4)


def _attention_takes_offsets() -> bool:
    try:
        import ikbo_fa
        return "kv_offsets" in inspect.signature(ikbo_fa.attention).parameters
    except Exception:
        return False


@pytest.mark.skipif(not _attention_takes_offsets(), reason="ikbo_fa.attention takes no kv_offsets yet")
@pytest.mark.parametrize("broadcast", ["kv", "q"])
def test_ikbo_provider_calls_the_jagged_api(monkeypatch, broadcast):
    """The ikbo provider against ikbo_fa.attention itself (on the CPU: its reference path), bf16."""
    import ikbo_fa

    monkeypatch.setattr(cf.LIBS, "ikbo", ikbo_fa)
    p = cf.make_problem(11, 3, 3, 40, 2, 64, torch.bfloat16, broadcast, "shuffled",
                        np.random.default_rng(0), device="cpu", jagged="lognormal")
    inp = cf.make_inputs(p, torch.Generator().manual_seed(0), device="cpu")
    out = cf._ikbo_run(p, cf._ikbo_setup(p, inp), inp)
    assert out.shape == (p.B, p.S_q, p.H, p.D)
    assert cf.harness.rel_error(out.float(), cf.reference_outputs(p, inp, torch.arange(p.B))) < 1e-2


# --------------------------------------------------------------------------- jagged: providers

@pytest.mark.parametrize("broadcast", ["kv", "q"])
@pytest.mark.parametrize("order", ["sorted", "shuffled"])
def test_every_provider_on_jagged_inputs(fake_libs, broadcast, order):
    p, inp = cpu_problem(B=10, ratio=3, S_q=4, L=9, H=2, D=8, broadcast=broadcast, order=order,
                         jagged="lognormal")
    want = jagged_per_candidate_reference(inp.q, inp.k, inp.v, p.idx_cpu, p.kv_offsets_cpu, p.scale,
                                          broadcast)
    rotated = inp.clone()
    ran, skipped = [], []
    for prov in cf.providers():
        try:
            st = prov.setup(p, inp)
        except cf.Skip as e:
            skipped.append(prov.name)
            assert "jagged" in str(e) or "K/V broadcast only" in str(e), e
            continue
        for x in (inp, rotated):
            out = prov.run(p, st, x)
            if not prov.attention:  # the padded copy
                gather, mask = cf.padded_gather(p.kv_offsets_cpu, p.idx_cpu.long() if broadcast == "kv"
                                                else torch.arange(p.B), p.max_len)
                torch.testing.assert_close(out.k, x.k[gather])
                assert torch.equal(out.key_mask, mask)
                continue
            assert out.shape == (p.B, p.S_q, p.H, p.D), prov.name
            torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-6, msg=prov.name)
        ran.append(prov.name)
    reused = {"ikbo, work list reused"}
    assert set(skipped) == {"fa4 page table", "fa4 materialized", "fa4 materialize+kernel"} | (
        reused if broadcast == "q" else set())
    assert set(ran) == {"materialize", "fa4 varlen packed", "sdpa materialized",
                        "torch.compile materialize+sdpa", "ikbo"} | (reused if broadcast == "kv" else set())


def test_ikbo_without_kv_offsets_is_skipped_on_jagged_inputs(monkeypatch):
    def old_attention(q, kv, idx, *, scale=None, kv_lengths=None, broadcast=None):
        raise AssertionError("not to be called")

    monkeypatch.setattr(cf.LIBS, "ikbo", types.SimpleNamespace(attention=old_attention))
    p, inp = cpu_problem(B=4, ratio=2, S_q=1, L=8, H=2, D=8, jagged="uniform")
    with pytest.raises(cf.Skip, match="kv_offsets"):
        cf._ikbo_setup(p, inp)
    p, inp = cpu_problem(B=4, ratio=2, S_q=1, L=8, H=2, D=8)
    assert cf._ikbo_setup(p, inp) is None  # dense inputs: the old API serves


# --------------------------------------------------------------------------- jagged and preset arguments

def test_jagged_arguments():
    args = cf.parse_args(["--jagged", "uniform", "zipf", "--L", "4096", "--S-q", "1"])
    keys, sweeps = cf.build_configs(args)
    assert keys == [(2048, 64, 1, 4096, "bf16", "kv", "sorted", d, 2, 128) for d in ("uniform", "zipf")]
    assert list(sweeps) == ["L (bf16, kv, sorted, jagged uniform)", "L (bf16, kv, sorted, jagged zipf)"]
    settings = cf.run_settings(args)
    assert settings["preset"] is None and set(settings["jagged"]) == {"uniform", "zipf"}
    assert settings["jagged"]["uniform"] == cf.LENGTHS["uniform"][1]
    keys, _ = cf.build_configs(cf.parse_args(["--sweep", "S_q_fine", "--jagged", "exponential"]))
    assert len(keys) == 22 and {k[7] for k in keys} == {"exponential"}
    with pytest.raises(SystemExit) as e:
        cf.parse_args(["--jagged", "pareto"])
    assert e.value.code == 2


def test_help_lists_the_new_options(capsys):
    with pytest.raises(SystemExit) as e:
        cf.parse_args(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--jagged DIST" in out and "--preset {gr-cross}" in out and "S_q_fine" in out
    assert "2% at L" in out


def test_preset_gr_cross():
    args = cf.parse_args(["--preset", "gr-cross"])
    keys, sweeps = cf.build_configs(args)
    assert keys == [(10400, 1300, 1, 32768, "bf16", "kv", "sorted", "lognormal", 6, 128)]
    assert (args.H, args.D) == ([6], [128])
    settings = cf.run_settings(args)
    assert settings["preset"]["name"] == "gr-cross" and settings["preset"]["jagged"] == ["lognormal"]
    assert settings["jagged"] == {"lognormal": cf.LENGTHS["lognormal"][1]}
    assert (settings["H"], settings["D"]) == ([6], [128])
    counts = cf.user_counts(10400, 1300, np.random.default_rng(0))
    assert len(counts) == 8 and sum(counts) == 10400
    # options given beside the preset win
    args = cf.parse_args(["--preset", "gr-cross", "--B", "2600", "--H", "2", "--jagged", "uniform",
                          "--timing", "sustained"])
    keys, _ = cf.build_configs(args)
    assert keys == [(2600, 1300, 1, 32768, "bf16", "kv", "sorted", "uniform", 2, 128)] and args.H == [2]
    assert args.timing == "sustained"
    with pytest.raises(SystemExit):
        cf.parse_args(["--preset", "gr-self"])


# --------------------------------------------------------------------------- jagged dry runs of main()

def test_main_dry_run_jagged(dry_run, tmp_path, capsys):
    data = _run_main(tmp_path, ["--jagged", "lognormal", "--broadcast", "kv", "q", "--order", "shuffled"])
    rows = data["rows"]
    assert data["settings"]["jagged"] == {"lognormal": cf.LENGTHS["lognormal"][1]}
    jagged_skips = {"fa4 page table", "fa4 materialized", "fa4 materialize+kernel"}
    for r in rows:
        assert r["jagged"] == "lognormal" and r["S_q"] == 4 and 1 <= r["max_len"] <= r["L"]
        assert r["total_keys"] >= r["max_len"]
        kv_only = r["broadcast"] == "q" and r["provider"] == "ikbo, work list reused"
        assert r["status"] == ("skipped" if r["provider"] in jagged_skips or kv_only else "ok"), r
        if r["status"] == "ok" and r["provider"] != "materialize":
            assert r["rel_err"] < 1e-2 and r["ms"] > 0 and r["ms_sustained"] > 0
            assert r["tflops"] == pytest.approx(r["gflop"] * 1e9 / (r["ms"] * 1e-3) / 1e12)
            if r["provider"] == "fa4 varlen packed":
                assert r["ikbo_speedup"] > 0 and r["ikbo_speedup_sustained"] > 0
    out = capsys.readouterr().out
    assert "jagged=lognormal" in out and "max_len=" in out and "keys=" in out
    assert "L (bf16, kv, shuffled, jagged lognormal)" in out and "total_keys" in out


def test_main_dry_run_preset_scaled_down(dry_run, tmp_path, capsys):
    """The gr-cross preset with its sizes overridden to fit a CPU: S_q 1, H 6, lognormal lengths."""
    argv = ["--preset", "gr-cross", "--B", "26", "--ratio", "13", "--L", "64", "--D", "8",
            "--warmup", "1", "--rep", "3", "--timing", "interleaved", "--graph-below-ms", "1e9",
            "--providers", "ikbo", "fa4 varlen packed", "sdpa materialized", "--no-plot",
            "--out-dir", str(tmp_path)]
    assert cf.main(argv) == 0
    data = json.loads((tmp_path / "compare_fa4-latest.json").read_text())
    assert data["settings"]["preset"]["name"] == "gr-cross"
    rows = data["rows"]
    assert {r["provider"] for r in rows} == {"ikbo", "fa4 varlen packed", "sdpa materialized"}
    for r in rows:
        shape = (r["S_q"], r["H"], r["D"], r["jagged"], r["B"], r["ratio"], r["U"])
        assert shape == (1, 6, 8, "lognormal", 26, 13, 2)
        assert r["status"] == "ok" and r["rel_err"] < 1e-2 and "ms_sustained" not in r
    assert "jagged lognormal" in capsys.readouterr().out


def test_main_dry_run_s_q_sweep(dry_run, tmp_path, capsys):
    data = _run_main(tmp_path, ["--sweep", "S_q_fine", "--S-q", "1", "17", "--timing", "interleaved",
                                "--providers", "ikbo", "fa4 varlen packed", "fa4 page table"])
    got = {(r["L"], r["S_q"], r["provider"]): r for r in data["rows"]}
    assert set(got) == {(L, S, n) for L in (8, 128) for S in (1, 17)
                        for n in ("ikbo", "fa4 varlen packed", "fa4 page table")}
    for r in got.values():
        assert r["status"] == "ok" and r["rel_err"] < 1e-2 and r["jagged"] is None
        assert r["total_keys"] == r["U"] * r["L"] and r["max_len"] == r["L"]
    out = capsys.readouterr().out
    assert "sweep S_q_fine at L=8 (bf16, kv, sorted)" in out and "sweep S_q_fine at L=128 (bf16, kv, sorted)" in out


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
        assert r["status"] == "ok" and r["rel_err"] < 1e-2 and r["ms"] > 0
        assert r["gflop"] == pytest.approx(4 * r["B"] * H * r["S_q"] * L * D / 1e9)
    assert set(data["host_overhead_us"]) == {"ikbo", "fa4 varlen packed", "sdpa materialized"}
    out = capsys.readouterr().out
    for H in (1, 2):
        for D in (8, 16):
            assert f"sweep L (bf16, kv, sorted, H={H} D={D})" in out
            assert f"H={H} D={D} bf16 broadcast=kv" in out  # the problem's title
    assert "host time per call, tiny problem (B=4, ratio 2, L=128, H=1 D=8)" in out


def test_plot_wraps_many_sweeps(tmp_path):
    pytest.importorskip("matplotlib")
    rows, sweeps = [], {}
    for H in range(1, 2 * cf.PLOT_COLUMNS + 2):  # three rows of panels, the last one partial
        label = f"S_q (bf16, kv, sorted, H={H} D=128)"
        for S_q in (1, 17):
            key = (2048, 64, S_q, 1024, "bf16", "kv", "sorted", None, H, 128)
            sweeps.setdefault(label, []).append(key)
            for prov, tflops in (("ikbo", 100.0 + H), ("sdpa materialized", 50.0)):
                rows.append(dict(zip(("B", "ratio", "S_q", "L", "dtype", "broadcast", "order", "jagged", "H", "D"),
                                     key), provider=prov, status="ok", tflops=tflops,
                                 ikbo_speedup=None if prov == "ikbo" else (100.0 + H) / 50.0))
    path = tmp_path / "wrapped.png"
    assert cf.plot(rows, sweeps, {"bf16": 700.0}, path) is None
    from PIL import Image

    width, height = Image.open(path).size
    assert width == 6 * cf.PLOT_COLUMNS * 120 and height == 3 * 8 * 120
