"""CPU checks of perf/bench_lce.py --dtype fp8: the FP8 providers (torch._scaled_mm runs on the
CPU too) against the fp32 formula on their dequantized operands, with N and K not multiples of
16, and a dry run of main() with ikbo_gemm itself (its FP8 call runs the reference on CPU)."""
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ikbo_gemm  # noqa: E402
from perf import bench_lce as bl  # noqa: E402
from perf import harness  # noqa: E402
from perf.providers import LIBS  # noqa: E402

SMALL = {"M": 9, "N": 6, "K_user": 5, "K_cand": 7}
FP8_NAMES = ["fp8 materialize+scaled_mm", "fp8 decomposition", "torch.compile fp8 decomposition",
             "fp8 scaled_mm floor", "fp8 scaled_mm floor, per-tensor", "ikbo fp8", "ikbo fp8 + quantize"]


def small(B=12, ratio=5, seed=0):
    p = bl.make_problem(B, ratio, torch.float8_e4m3fn, SMALL, device="cpu")
    return p, bl.make_inputs(p, torch.Generator().manual_seed(seed), device="cpu")


@pytest.fixture
def real_op(monkeypatch):
    monkeypatch.setitem(LIBS.modules, bl.IKBO[0], ikbo_gemm)


def test_fp8_inputs_quantize_the_bf16_problem():
    p, inp = small()
    q = inp.fp8
    assert q.e_cand.shape == (p.B, p.N, p.K_cand) and q.e_cand16.shape == (p.B, 16, 16)
    assert q.e_cand16_scale.shape == (p.B * 16,) and torch.equal(q.e_cand16_scale[16:32], q.e_cand_scale[1].expand(16))
    deq = inp.dequantized()
    for name in ("w_cand", "w_user", "e_cand", "e_user"):
        ref = getattr(inp, name).float()
        assert ((getattr(deq, name) - ref).abs() <= 2.0**-4 * ref.abs() + 1e-3).all(), name
    rotated = inp.clone_activations()
    assert rotated.fp8.e_cand16.data_ptr() != q.e_cand16.data_ptr() and rotated.fp8.w_cand is q.w_cand
    assert [pr.name for pr in bl.providers()] == [pr.name for pr in bl.providers(fp8=True) if not pr.fp8]


def test_fp8_providers_match_their_references(compile_eagerly, real_op):
    p, inp = small()
    deq = inp.dequantized()
    refs = {(False, "operands"): bl.reference_output(p, deq),
            (True, "operands"): bl.reference_output(p, deq, user_side=False),
            (True, "per_tensor"): bl.reference_output(p, inp.dequantized(per_tensor=True), user_side=False),
            (False, "cat"): bl.fp8_cat_reference(p, inp)}
    bf16 = {False: bl.reference_output(p, inp), True: bl.reference_output(p, inp, user_side=False)}
    for prov in [pr for pr in bl.providers(fp8=True) if pr.fp8]:
        st = prov.setup(p, inp)
        for x in (inp, inp.clone_activations()):
            out = prov.run(p, st, x)
            assert out.shape == (p.B, p.M, p.N) and out.dtype == torch.bfloat16, prov.name
            assert harness.rel_error(out, refs[prov.floor, prov.fp8]) < 1e-2, prov.name
            assert 1e-3 < harness.rel_error(out, bf16[prov.floor]) < 0.1, prov.name
    assert [c["fn"] for c in compile_eagerly] == [bl.fp8_decomposition]
    # scales of the wrong batch entries fail the check
    prov = next(pr for pr in bl.providers(fp8=True) if pr.name == "fp8 decomposition")
    flipped = inp.clone_activations()
    flipped.fp8.e_cand16_scale = inp.fp8.e_cand16_scale.flip(0)
    assert harness.rel_error(prov.run(p, prov.setup(p, inp), flipped), refs[False, "operands"]) > 0.05


def test_main_dry_run_fp8(gemm_benchmarks_on_cpu, compile_eagerly, real_op, tmp_path, capsys):
    argv = ["--configs", "published", "ratio", "--ratio", "4", "--dtype", "fp8", "--sweep-dtype", "bf16",
            "--M", "9", "--N", "6", "--K-user", "5", "--K-cand", "7", "--warmup", "1", "--rep", "3",
            "--out-dir", str(tmp_path)]
    assert bl.main(argv) == 0
    data = json.loads((tmp_path / "bench_lce-latest.json").read_text())
    fp8_rows = {r["provider"]: r for r in data["rows"] if r["dtype"] == "fp8"}
    bf16_rows = {r["provider"]: r for r in data["rows"] if r["dtype"] == "bf16"}
    assert set(bf16_rows) == {pr.name for pr in bl.providers()}  # no FP8 provider on a bf16 point
    assert set(fp8_rows) == set(bf16_rows) | set(FP8_NAMES)
    for name, r in fp8_rows.items():
        if name.endswith("max-autotune"):
            continue
        assert r["status"] == "ok", r
        assert r["rel_err"] < 1e-2 and r["tflops"] > 0
        assert ("quant_err" in r) == (name in FP8_NAMES)
        assert r["x_fp8_compiled"] == pytest.approx(fp8_rows["torch.compile fp8 decomposition"]["ms"] / r["ms"])
        assert r["x_ikbo_bf16"] == pytest.approx(fp8_rows["ikbo fused"]["ms"] / r["ms"])
    assert fp8_rows["ikbo fp8"]["pct_ceiling"] == pytest.approx(100 * fp8_rows["ikbo fp8"]["tflops"] / 1400.0)
