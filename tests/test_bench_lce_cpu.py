"""CPU checks of perf/bench_lce.py: workload, FLOP count, reference, torch baselines,
arguments and a dry run of main()."""
import json
from pathlib import Path

import pytest
import torch

from perf import bench_lce as bl
from perf import gemm_bench, harness
from perf.providers import LIBS


def test_lce_flops_published():
    p = bl.PUBLISHED
    flops = bl.lce_flops(p["M"], p["N"], 1024, 15, p["K_user"], p["K_cand"])
    assert flops == 2 * 433 * 256 * (1024 * 872 + 15 * 1184)
    assert abs(flops / 1e9 - 202) < 1  # "about 202 GFLOP"


def test_lce_problem_published_counts():
    p = bl.make_problem(1024, 70, torch.float16, device="cpu")
    assert p.counts == [70] * 14 + [44] and p.U == 15
    assert p.idx.dtype == torch.int32 and torch.bincount(p.idx.long()).tolist() == p.counts


@pytest.mark.parametrize("B,ratio", [(1024, 10000), (7, 1), (9, 4)])
def test_lce_problem_extremes(B, ratio):
    p = bl.make_problem(B, ratio, torch.float16, device="cpu")
    assert sum(p.counts) == B and p.U == -(-B // ratio)


SMALL = {"M": 9, "N": 6, "K_user": 5, "K_cand": 7}


def small_lce(B=11, ratio=3, seed=0):
    p = bl.make_problem(B, ratio, torch.float32, shape=SMALL, device="cpu")
    inp = bl.make_inputs(p, torch.Generator().manual_seed(seed), device="cpu")
    return p, inp


def materialized_definition(p, inp):
    """out[b] = [w_user, w_cand] @ [e_user[idx[b]]; e_cand[b]], in float64, one candidate at a time."""
    w = torch.cat([inp.w_user, inp.w_cand], dim=1).double()
    return torch.stack([w @ torch.cat([inp.e_user[u], inp.e_cand[b]], dim=0).double()
                        for b, u in enumerate(p.idx.tolist())])


def test_lce_reference_matches_the_definition():
    p, inp = small_lce()
    ref = bl.reference_output(p, inp, chunk=4)
    assert ref.dtype == torch.float32 and ref.shape == (p.B, p.M, p.N)
    torch.testing.assert_close(ref.double(), materialized_definition(p, inp), rtol=1e-5, atol=1e-5)


def test_lce_torch_providers_match_the_reference(compile_eagerly):
    p, inp = small_lce(B=10, ratio=4)
    ref = bl.reference_output(p, inp)
    rotated = inp.clone_activations()
    assert rotated.w_cand is inp.w_cand and rotated.e_cand.data_ptr() != inp.e_cand.data_ptr()
    for prov in bl.providers():
        if prov.ours:
            continue
        st = prov.setup(p, inp)
        for x in (inp, rotated):
            out = prov.run(p, st, x)
            assert out.shape == (p.B, p.M, p.N)
            assert harness.rel_error(out, ref) < 1e-5, prov.name
    # a provider that adds the wrong user's result fails the check
    wrong = bl.reference_output(p, inp).clone()
    wrong -= torch.matmul(inp.w_user, inp.e_user)[p.idx.long()]
    wrong += torch.matmul(inp.w_user, inp.e_user)[(p.idx.long() + 1) % p.U]
    assert harness.rel_error(wrong, ref) > 0.05


def test_lce_ours_calls_the_op(monkeypatch):
    p, inp = small_lce()
    seen = []

    def lce(w_cand, w_user, e_cand, e_user, idx, *, out=None, validate=None, schedule="fused"):
        seen.append((schedule, validate))
        return torch.matmul(w_cand, e_cand) + torch.matmul(w_user, e_user)[idx.long()]

    monkeypatch.setitem(LIBS.modules, bl.IKBO[0], type("M", (), {"lce": staticmethod(lce)}))
    ref = bl.reference_output(p, inp)
    for prov in [pr for pr in bl.providers() if pr.ours]:
        assert harness.rel_error(prov.run(p, prov.setup(p, inp), inp), ref) < 1e-5
    assert seen == [("two_launch", False), ("fused", False)]


def test_lce_default_configs():
    args = bl.parse_args([])
    keys, groups = bl.build_configs(args)
    assert groups["published"] == [(1024, 70, "fp16"), (1024, 70, "bf16")]
    assert [k[0] for k in groups["B sweep (fp16)"]] == bl.SWEEPS["B"]
    assert [k[1] for k in groups["ratio sweep (fp16)"]] == bl.SWEEPS["ratio"]
    assert len(keys) == len(set(keys)) == 2 + len(bl.SWEEPS["B"]) + len(bl.SWEEPS["ratio"]) - 2
    assert keys[:2] == groups["published"]  # the published shape runs first


def test_lce_arguments():
    args = bl.parse_args(["--configs", "ratio", "--ratio", "2", "10000", "--sweep-dtype", "bf16",
                          "--out-dir", "o", "--providers", "ikbo fused", "torch bmm"])
    keys, groups = bl.build_configs(args)
    assert keys == [(1024, 2, "bf16"), (1024, 10000, "bf16")]
    assert args.out_dir == Path("o") and args.providers == ["ikbo fused", "torch bmm"]


# --------------------------------------------------------------------------- CPU dry run of main()

def _lce_main(monkeypatch, tmp_path, extra):
    """bench_lce.main() on the CPU at a small shape (two_launch not implemented); its JSON."""
    def lce(w_cand, w_user, e_cand, e_user, idx, *, out=None, validate=None, schedule="fused"):
        if schedule == "two_launch":
            raise NotImplementedError("two_launch: not yet")
        return torch.matmul(w_cand, e_cand) + torch.matmul(w_user, e_user)[idx.long()]

    monkeypatch.setitem(LIBS.modules, bl.IKBO[0], type("M", (), {"lce": staticmethod(lce)}))
    argv = ["--M", "9", "--N", "6", "--K-user", "5", "--K-cand", "7", "--warmup", "1", "--rep", "3",
            "--out-dir", str(tmp_path)] + extra
    # CPU half-precision matmul may be missing on old torch; the dry run needs it
    torch.matmul(torch.ones(2, 2, dtype=torch.float16), torch.ones(2, 2, dtype=torch.float16))
    assert bl.main(argv) == 0
    return json.loads((tmp_path / "bench_lce-latest.json").read_text())


AUTOTUNED = "torch.compile decomposition max-autotune"


def test_lce_main_dry_run(monkeypatch, tmp_path, capsys, gemm_benchmarks_on_cpu, compile_eagerly):
    data = _lce_main(monkeypatch, tmp_path, ["--dtype", "fp16", "--sweep-dtype", "bf16", "--B", "16", "70",
                                             "--ratio", "3", "10000"])
    rows = data["rows"]
    keys = {(r["B"], r["ratio"], r["dtype"]) for r in rows}
    assert keys == {(1024, 70, "fp16"), (16, 70, "bf16"), (70, 70, "bf16"), (1024, 3, "bf16"),
                    (1024, 10000, "bf16")}
    for r in rows:
        published = (r["B"], r["ratio"]) == (1024, 70)
        if r["provider"] == "ikbo two_launch":
            assert r["status"] == "skipped"
        elif r["provider"] == AUTOTUNED and not published:  # at the published shape only
            assert r["status"] == "skipped" and "--max-autotune all" in r["note"]
        else:
            assert r["status"] == "ok", r
            assert r["rel_err"] < 1e-2 and r["x_decomp"] > 0 and r["x_compiled"] > 0 and r["pct_ceiling"] > 0
            assert r["compile_s"] >= 0 and "ms_sustained" not in r
    out = capsys.readouterr().out
    assert "ratio sweep (bf16): TFLOP/s" in out
    # one compile per compiled provider and problem, with static shapes and a whole graph
    modes = [c["mode"] for c in compile_eagerly]
    assert modes.count(bl.AUTOTUNE_MODE) == 1 and modes.count(None) == 2 * len(keys)
    assert all(c["dynamic"] is False and c["fullgraph"] is True for c in compile_eagerly)


@pytest.mark.parametrize("timing", ["sustained", "both"])
def test_lce_main_dry_run_sustained(monkeypatch, tmp_path, capsys, gemm_benchmarks_on_cpu, compile_eagerly, timing):
    data = _lce_main(monkeypatch, tmp_path, ["--configs", "published", "--dtype", "bf16", "--timing", timing,
                                             "--sustained-warmup-s", "0.01", "--sustained-s", "0.02",
                                             "--max-autotune", "all"])
    assert data["settings"]["timing"] == timing and data["settings"]["sustained_s"] == 0.02
    rows = {r["provider"]: r for r in data["rows"]}
    assert set(rows) == {pr.name for pr in bl.providers()}
    decomp = rows["torch decomposition"]
    for r in rows.values():
        if r["provider"] == "ikbo two_launch":
            assert r["status"] == "skipped"
            continue
        assert r["status"] == "ok", r
        assert r["ms_sustained"] > 0 and r["W"] == 700.0 and r["MHz"] == 1500.0 and r["power_capped"] is True
        assert r["compile_s"] >= 0 and r["tflops_sustained"] > 0 and r["pct_ceiling_sustained"] > 0
        # ratios within the sustained mode
        assert r["x_decomp_sustained"] == pytest.approx(decomp["ms_sustained"] / r["ms_sustained"])
        assert ("ms" in r) == (timing == "both") and ("x_decomp" in r) == (timing == "both")
        if timing == "both":
            assert r["x_decomp"] == pytest.approx(decomp["ms"] / r["ms"])
    out = capsys.readouterr().out
    table = out.split("in the same timing]")[1]
    assert ("interleaved" in table) == (timing == "both") and "sustained" in table and "MHz" in table


def test_lce_compiled_providers_are_listed_and_checked(compile_eagerly):
    names = [pr.name for pr in bl.providers()]
    compiled = ["torch.compile decomposition", AUTOTUNED, "torch.compile materialize+bmm"]
    assert all(n in names for n in compiled) and names.index(compiled[-1]) < names.index("ikbo fused")
    assert [pr.name for pr in bl.providers() if pr.max_autotune] == [AUTOTUNED]
    assert bl.SPEEDUP_COLUMNS["torch.compile decomposition"] == "x_compiled"
    p = bl.make_problem(10, 4, torch.float16, shape=SMALL, device="cpu")
    inp = bl.make_inputs(p, torch.Generator().manual_seed(0), device="cpu")
    provs = [pr for pr in bl.providers() if pr.name in compiled]
    rows, timed = gemm_bench.check_providers(p, inp, provs, 1e-2, skip={AUTOTUNED: "not here"},
                                             device="cpu", reference=bl.reference_output,
                                             cat_reference=bl.fp8_cat_reference)
    assert [r["status"] for r in rows] == ["ok", "skipped", "ok"] and rows[1]["note"] == "not here"
    assert set(timed) == {compiled[0], compiled[2]} and all(r["rel_err"] < 1e-2 for r in (rows[0], rows[2]))
    assert [(c["fn"], c["mode"]) for c in compile_eagerly] == [(bl.decomposition, None), (bl.materialize_bmm, None)]


def test_lce_compiled_providers_compile_for_real():
    """Inductor on the CPU, a tiny problem: each compiled provider builds one graph and matches."""
    from torch._dynamo.utils import counters

    harness.reset_compiled()
    p, inp = small_lce(B=10, ratio=4)
    ref = bl.reference_output(p, inp)
    before = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        for prov in [pr for pr in bl.providers() if pr.name.startswith("torch.compile")]:
            st = prov.setup(p, inp)
            for x in (inp, inp.clone_activations()):  # a rotated copy: no recompile
                assert harness.rel_error(prov.run(p, st, x), ref) < 1e-5, prov.name
    assert counters["stats"]["unique_graphs"] - before == 3
    harness.reset_compiled()


def test_lce_arguments_and_their_errors():
    args = bl.parse_args([])
    assert (args.timing, args.max_autotune, args.budget_s) == ("interleaved", "published", 240.0)
    for bad in (["--timing", "burst"], ["--max-autotune", "never"], ["--providers", "cutlass"]):
        with pytest.raises(SystemExit) as e:
            bl.parse_args(bad)
        assert e.value.code == 2
