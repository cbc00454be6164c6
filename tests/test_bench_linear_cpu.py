"""CPU checks of perf/bench_linear.py: FLOP count, activations, the fp32 reference against the
un-decomposed cat formula, the torch providers, configuration groups, arguments and dry runs
of main() with ``ikbo_gemm.linear`` stood in for by torch."""
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import ikbo_gemm

from perf import bench_linear as bli
from perf import harness
from perf.providers import LIBS

ROOT = Path(__file__).resolve().parents[1]


def torch_linear(x_cand, x_user, idx, w_cand, w_user, bias=None, *, activation=None, out=None, validate=None,
                 rules=None):
    """ikbo_gemm.linear's signature, computed by torch (the op may not exist yet)."""
    y = x_cand @ w_cand.T + (x_user @ w_user.T)[idx.long()]
    if bias is not None:
        y = y + bias
    return bli.activate(y, activation or "none")


@pytest.fixture
def linear_on_cpu(monkeypatch, gemm_benchmarks_on_cpu, compile_eagerly):
    """bench_linear's main() on the CPU, the op stood in for by torch."""
    monkeypatch.setitem(LIBS.modules, bli.IKBO[0], type("M", (), {"linear": staticmethod(torch_linear),
                                                                 "PlanRules": ikbo_gemm.PlanRules}))
    return compile_eagerly


def small(B=10, ratio=4, K_user=5, K_cand=7, N=6, dtype=torch.float32, activation="relu", seed=0):
    p = bli.make_problem(B, ratio, K_user, K_cand, N, dtype, activation, device="cpu")
    return p, bli.make_inputs(p, torch.Generator().manual_seed(seed), device="cpu")


# --------------------------------------------------------------------------- workload

def test_flops_count_the_user_side_once_per_user():
    assert bli.linear_flops(B=2048, U=30, N=1024, K_user=1024, K_cand=2048) == 2 * 1024 * (2048 * 2048 + 30 * 1024)
    p, _ = small(B=10, ratio=4)
    assert p.U == 3 and p.flops == 2 * 6 * (10 * 7 + 3 * 5)


def test_activations_match_their_definitions():
    x = torch.linspace(-4, 4, 101, dtype=torch.float64)
    want = {"none": x, "relu": x.clamp(min=0), "sigmoid": 1 / (1 + torch.exp(-x)), "silu": x / (1 + torch.exp(-x)),
            "gelu": 0.5 * x * (1 + torch.erf(x / math.sqrt(2))),
            "gelu_tanh": 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))}
    assert set(want) == set(bli.ACTIVATIONS)
    for name, w in want.items():
        torch.testing.assert_close(bli.activate(x, name), w, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="activation must be one of"):
        bli.activate(x, "tanh")


@pytest.mark.parametrize("activation", bli.ACTIVATIONS)
def test_reference_matches_the_cat_formula(activation):
    p, inp = small(B=11, ratio=3, activation=activation)
    x = torch.cat([inp.x_user[p.idx.long()], inp.x_cand], dim=1).double()
    w = torch.cat([inp.w_user, inp.w_cand], dim=1).double()
    want = bli.activate(x @ w.T + inp.bias.double(), activation)
    ref = bli.reference_output(p, inp)
    assert ref.dtype == torch.float32 and ref.shape == (p.B, p.N)
    torch.testing.assert_close(ref.double(), want, rtol=1e-5, atol=1e-5)
    floor = bli.reference_output(p, inp, user_side=False)
    torch.testing.assert_close(floor.double(), bli.activate(inp.x_cand.double() @ inp.w_cand.double().T
                                                            + inp.bias.double(), activation), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activation", ["relu", "gelu_tanh", "none"])
def test_torch_providers_match_the_reference(compile_eagerly, activation):
    p, inp = small(activation=activation)
    refs = {False: bli.reference_output(p, inp), True: bli.reference_output(p, inp, user_side=False)}
    rotated = inp.clone_activations()
    assert rotated.w_cand is inp.w_cand and rotated.x_cand.data_ptr() != inp.x_cand.data_ptr()
    for prov in [pr for pr in bli.providers() if not pr.ours]:
        st = prov.setup(p, inp)
        for x in (inp, rotated):
            out = prov.run(p, st, x)
            assert out.shape == (p.B, p.N) and harness.rel_error(out, refs[prov.floor]) < 1e-5, prov.name
    assert [pr.name for pr in bli.providers() if pr.floor] == ["torch addmm floor"]
    assert [c["fn"] for c in compile_eagerly] == [bli.decomposition]
    # the wrong user's features fail the check
    shifted = torch_linear(inp.x_cand, inp.x_user, (p.idx + 1) % p.U, inp.w_cand, inp.w_user, inp.bias,
                           activation=None if activation == "none" else activation)
    assert harness.rel_error(shifted, refs[False]) > 0.05


def test_ours_calls_the_op(monkeypatch):
    seen = []

    def linear(*a, activation=None, validate=None, **k):
        seen.append((activation, validate))
        return torch_linear(*a, activation=activation, **k)

    monkeypatch.setitem(LIBS.modules, bli.IKBO[0], type("M", (), {"linear": staticmethod(linear)}))
    ours = next(pr for pr in bli.providers() if pr.name == bli.OURS)
    assert ours.ours
    for activation in ("none", "gelu"):
        p, inp = small(activation=activation)
        assert harness.rel_error(ours.run(p, ours.setup(p, inp), inp), bli.reference_output(p, inp)) < 1e-5
    assert seen == [(None, False), ("gelu", False)]


def test_compiled_decomposition_compiles_for_real():
    """Inductor on the CPU, a tiny problem: one graph, the reference's result, no recompile for a copy."""
    from torch._dynamo.utils import counters

    harness.reset_compiled()
    p, inp = small(activation="silu")
    prov = next(pr for pr in bli.providers() if pr.name == "torch.compile decomposition")
    before = counters["stats"]["unique_graphs"]
    st = prov.setup(p, inp)
    with torch.no_grad():
        for x in (inp, inp.clone_activations()):
            assert harness.rel_error(prov.run(p, st, x), bli.reference_output(p, x)) < 1e-5
    assert counters["stats"]["unique_graphs"] - before == 1
    harness.reset_compiled()


# --------------------------------------------------------------------------- configurations

def test_configuration_groups():
    keys, groups = bli.build_configs(bli.parse_args(["--configs", "grid"]))
    assert len(keys) == len(groups["grid"]) == 3 * 3 * 3 * 3 * 2 * 2 == 324
    assert {(k[2], k[3]) for k in keys} == set(bli.K_PAIRS)
    keys, groups = bli.build_configs(bli.parse_args([]))
    assert list(groups) == ["headline", "ratio"] and len(groups["headline"]) == 24 and len(groups["ratio"]) == 6
    assert len(keys) == 29 and keys[:24] == groups["headline"]  # one ratio point is a headline point
    assert (8192, 70, 4096, 4096, 4096, "fp16", "relu") in keys


def test_axis_arguments_replace_that_axis():
    args = bli.parse_args(["--configs", "headline", "ratio", "--K", "64,32", "--N", "8", "--dtype", "fp16",
                           "--activation", "gelu", "--B", "16", "--providers", "ikbo linear", "torch cat+linear"])
    keys, groups = bli.build_configs(args)
    assert groups["headline"] == [(16, 70, 64, 32, 8, "fp16", "gelu")]
    assert [k[1] for k in groups["ratio"]] == [10, 70, 1000] and len(keys) == 3
    assert args.providers == ["ikbo linear", "torch cat+linear"]
    assert (args.timing, args.budget_s) == ("interleaved", 240.0)


@pytest.mark.parametrize("bad", [["--K", "64"], ["--K", "0,8"], ["--activation", "tanh"], ["--configs", "all"],
                                 ["--providers", "cutlass"], ["--timing", "burst"]])
def test_bad_arguments_exit_2(bad):
    with pytest.raises(SystemExit) as e:
        bli.parse_args(bad)
    assert e.value.code == 2


# --------------------------------------------------------------------------- dry runs of main()

SMALL_ARGV = ["--configs", "headline", "ratio", "--B", "12", "--K", "8,16", "4,4", "--N", "8",
              "--warmup", "1", "--rep", "3"]


def _run_main(tmp_path, extra):
    assert bli.main(SMALL_ARGV + ["--out-dir", str(tmp_path)] + extra) == 0
    return json.loads((tmp_path / "bench_linear-latest.json").read_text())


def test_main_dry_run(linear_on_cpu, tmp_path, capsys):
    data = _run_main(tmp_path, [])
    rows = data["rows"]
    keys = {bli._key(r) for r in rows}
    # headline: 2 K x 2 dtypes; ratio: 3 ratios x 2 K x 2 activations (bf16), 2 of them headline points
    assert len(keys) == 2 * 2 + 3 * 2 * 2 - 2
    assert len(rows) == len(keys) * len(bli.chosen_providers(None))
    for r in rows:
        assert r["status"] == "ok", r
        assert r["rel_err"] < 1e-2 and r["us"] == pytest.approx(r["ms"] * 1e3) and r["compile_s"] >= 0
        assert r["tflops"] > 0 and r["pct_ceiling"] > 0 and r["x_floor"] > 0 and r["x_compiled"] > 0
        assert "ms_sustained" not in r
    by = {(bli._key(r), r["provider"]): r for r in rows}
    for (key, name), r in by.items():
        assert r["x_decomp"] == pytest.approx(by[(key, "torch decomposition")]["ms"] / r["ms"])
    assert data["settings"]["timing"] == "interleaved" and data["groups"] == {"headline": 4, "ratio": 12}
    out = capsys.readouterr().out
    assert "headline: us per call (x_* and pct_ceiling: ikbo linear)" in out
    assert len([c for c in linear_on_cpu if c["fn"] is bli.decomposition]) == len(keys)  # one compile per point


def test_main_dry_run_both_timings(linear_on_cpu, tmp_path, capsys):
    data = _run_main(tmp_path, ["--configs", "headline", "--dtype", "bf16", "--K", "8,16", "--timing", "both",
                                "--sustained-warmup-s", "0.01", "--sustained-s", "0.02"])
    rows = {r["provider"]: r for r in data["rows"]}
    assert set(rows) == {pr.name for pr in bli.chosen_providers(None)}
    floor = rows["torch addmm floor"]
    for r in rows.values():
        assert r["us"] > 0 and r["us_sustained"] == pytest.approx(r["ms_sustained"] * 1e3)
        assert r["W"] == 700.0 and r["MHz"] == 1500.0 and r["tflops_sustained"] > 0
        assert r["x_floor_sustained"] == pytest.approx(floor["ms_sustained"] / r["ms_sustained"])
    out = capsys.readouterr().out
    assert "us per call, sustained" in out and "interleaved" in out


def test_main_dry_run_without_the_op(linear_on_cpu, tmp_path, monkeypatch):
    monkeypatch.setitem(LIBS.modules, bli.IKBO[0], None)
    monkeypatch.setitem(LIBS.notes, bli.IKBO[0], "ikbo_gemm.linear does not exist yet")
    data = _run_main(tmp_path, ["--configs", "headline", "--dtype", "fp16", "--K", "4,4"])
    ours = [r for r in data["rows"] if r["provider"] == bli.OURS]
    assert len(ours) == 1 and ours[0]["status"] == "skipped" and "does not exist yet" in ours[0]["note"]
    assert all(r["status"] == "ok" for r in data["rows"] if r["provider"] != bli.OURS)
    assert data["notes"] == ["ikbo_gemm.linear does not exist yet"]


def test_a_wrong_op_is_reported_not_timed(linear_on_cpu, tmp_path, monkeypatch):
    def wrong(x_cand, x_user, idx, *a, **k):
        return torch_linear(x_cand, x_user, (idx + 1) % x_user.shape[0], *a, **k)

    monkeypatch.setitem(LIBS.modules, bli.IKBO[0], type("M", (), {"linear": staticmethod(wrong)}))
    data = _run_main(tmp_path, ["--configs", "headline", "--dtype", "fp16", "--K", "8,16", "--ratio", "4"])
    ours = next(r for r in data["rows"] if r["provider"] == bli.OURS)
    assert ours["status"] == "wrong" and "ms" not in ours and "x_floor" not in ours


def test_f_linear_in_half_precision_on_the_cpu():
    # the dry runs need CPU fp16/bf16 GEMMs; old torch builds lack them
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.ones(2, 3, dtype=dtype)
        assert F.linear(x, x, x[0, :2]).tolist() == [[4.0, 4.0], [4.0, 4.0]]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_without_a_gpu_one_line_and_exit_2():
    import subprocess

    res = subprocess.run([sys.executable, "-m", "perf.bench_linear"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    text = (res.stdout + res.stderr).strip()
    assert res.returncode == 2 and len(text.splitlines()) == 1, text
    assert "Hopper" in text and "Traceback" not in text


def test_plan_rules_run_only_when_named(linear_on_cpu, tmp_path):
    """The op under each other set of launch-plan rules is an extra provider: timed
    beside the op when named, its ratio in a column of the op's row."""
    variants = list(bli.PLAN_VARIANTS)
    assert not set(variants) & {pr.name for pr in bli.chosen_providers(None)}
    assert [pr.name for pr in bli.chosen_providers([*variants, bli.OURS])] == [*variants, bli.OURS]
    data = _run_main(tmp_path, ["--configs", "headline", "--dtype", "bf16", "--K", "8,16",
                                "--providers", "torch decomposition", *variants, bli.OURS])
    rows = {r["provider"]: r for r in data["rows"]}
    assert set(rows) == {"torch decomposition", *variants, bli.OURS}
    for name, (_, column) in bli.PLAN_VARIANTS.items():
        assert rows[name]["status"] == "ok" and rows[bli.OURS][column] > 0
    # each variant's spec is one of ikbo_gemm.linear's named rule sets
    from ikbo_gemm.linear import (COLUMN_WALK_RULES, NO_SHARED_TILE_RULES, NO_USER_CLUSTER_SPLIT_RULES,
                                  ROW_GROUP_RASTER_RULES, SMALL_GRID_RULES, SPARE_BY_MACS_RULES,
                                  SHARED_TILE_RULES, SPLIT_WIDE_USER_RULES, WIDE_USER_RULES, CLUSTER_2X2_RULES,
                                  PlanRules)
    named = {SMALL_GRID_RULES, WIDE_USER_RULES, SPLIT_WIDE_USER_RULES, NO_SHARED_TILE_RULES,
             NO_USER_CLUSTER_SPLIT_RULES, SPARE_BY_MACS_RULES, ROW_GROUP_RASTER_RULES, COLUMN_WALK_RULES,
             SHARED_TILE_RULES, CLUSTER_2X2_RULES}
    assert {PlanRules.parse(spec) for spec, _ in bli.PLAN_VARIANTS.values()} == named
