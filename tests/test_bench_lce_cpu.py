"""CPU checks of perf/bench_lce.py: workload, FLOP count, reference, torch baselines,
arguments and a dry run of main()."""
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from perf import bench_lce as bl  # noqa: E402
from perf import harness  # noqa: E402


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


def test_lce_torch_providers_match_the_reference():
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

    monkeypatch.setattr(bl.LIB, "ikbo_gemm", type("M", (), {"lce": staticmethod(lce)}))
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
    with pytest.raises(SystemExit) as e:
        bl.parse_args(["--providers", "cutlass"])
    assert e.value.code == 2


# --------------------------------------------------------------------------- CPU dry run of main()

def test_lce_main_dry_run(monkeypatch, tmp_path, capsys, cpu_timing):
    def lce(w_cand, w_user, e_cand, e_user, idx, *, out=None, validate=None, schedule="fused"):
        if schedule == "two_launch":
            raise NotImplementedError("two_launch: not yet")
        return torch.matmul(w_cand, e_cand) + torch.matmul(w_user, e_user)[idx.long()]

    monkeypatch.setattr(bl, "DEVICE", "cpu")
    monkeypatch.setattr(harness, "require_hopper_or_exit", lambda *a, **k: None)
    monkeypatch.setattr(bl, "load_ikbo_gemm", lambda: None)
    monkeypatch.setattr(bl.LIB, "ikbo_gemm", type("M", (), {"lce": staticmethod(lce)}))
    monkeypatch.setattr(harness, "l2_bytes", lambda: 2**20)
    monkeypatch.setattr(harness, "cublas_ceiling_tflops", lambda dtype: 700.0)
    argv = ["--M", "9", "--N", "6", "--K-user", "5", "--K-cand", "7", "--dtype", "fp16",
            "--sweep-dtype", "bf16", "--B", "16", "70", "--ratio", "3", "10000",
            "--warmup", "1", "--rep", "3", "--out-dir", str(tmp_path)]
    # CPU half-precision matmul may be missing on old torch; the dry run needs it
    torch.matmul(torch.ones(2, 2, dtype=torch.float16), torch.ones(2, 2, dtype=torch.float16))
    assert bl.main(argv) == 0
    data = json.loads((tmp_path / "bench_lce-latest.json").read_text())
    rows = data["rows"]
    keys = {(r["B"], r["ratio"], r["dtype"]) for r in rows}
    assert keys == {(1024, 70, "fp16"), (16, 70, "bf16"), (70, 70, "bf16"), (1024, 3, "bf16"),
                    (1024, 10000, "bf16")}
    for r in rows:
        if r["provider"] == "ikbo two_launch":
            assert r["status"] == "skipped"
        else:
            assert r["status"] == "ok", r
            assert r["rel_err"] < 1e-2 and r["x_decomp"] > 0 and r["pct_ceiling"] > 0
            assert r["compile_s"] >= 0
    out = capsys.readouterr().out
    assert "ratio sweep (bf16): TFLOP/s" in out
