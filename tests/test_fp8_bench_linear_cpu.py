"""CPU checks of perf/bench_linear.py --dtype fp8: the FP8 providers (torch._scaled_mm, which runs
on the CPU too) against the fp32 layer on their dequantized operands, the padding to 16, and a
dry run of main() with ikbo_gemm itself (its FP8 call runs the reference on CPU tensors)."""
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ikbo_gemm  # noqa: E402
from perf import bench_linear as bli  # noqa: E402
from perf import fp8_peers, harness  # noqa: E402
from perf.providers import LIBS  # noqa: E402

FP8_NAMES = ["fp8 cat+scaled_mm", "fp8 decomposition", "torch.compile fp8 decomposition", "fp8 scaled_mm floor",
             bli.OURS_FP8, "ikbo linear fp8 + quantize"]


def small(B=12, ratio=5, K_user=5, K_cand=7, N=6, activation="relu", seed=0):
    """K and N not multiples of 16: _scaled_mm's operands are padded."""
    p = bli.make_problem(B, ratio, K_user, K_cand, N, torch.float8_e4m3fn, activation, device="cpu")
    return p, bli.make_inputs(p, torch.Generator().manual_seed(seed), device="cpu")


@pytest.fixture
def real_op(monkeypatch):
    monkeypatch.setitem(LIBS.modules, bli.IKBO[0], ikbo_gemm)


def test_pad16():
    x = torch.randn(3, 7)
    assert fp8_peers.pad16(x).shape == (3, 16) and torch.equal(fp8_peers.pad16(x)[:, :7], x)
    assert not fp8_peers.pad16(x)[:, 7:].any() and fp8_peers.pad16(x, 0).shape == (16, 7)
    x8 = x.to(torch.float8_e4m3fn)
    assert torch.equal(fp8_peers.pad16(x8).float()[:, :7], x8.float()) and fp8_peers.pad16(x8).shape == (3, 16)
    y = torch.randn(16, 32)
    assert fp8_peers.pad16(y) is y


def test_fp8_inputs_quantize_the_bf16_layer():
    p, inp = small()
    assert inp.x_cand.dtype == torch.bfloat16 and inp.fp8.x_cand.dtype == torch.float8_e4m3fn
    deq = inp.dequantized()
    for name in ("x_cand", "x_user", "w_cand", "w_user"):
        ref = getattr(inp, name).float()
        assert ((getattr(deq, name) - ref).abs() <= 2.0**-4 * ref.abs() + 1e-3).all(), name
    rotated = inp.clone_activations()
    assert rotated.fp8.x_cand.data_ptr() != inp.fp8.x_cand.data_ptr() and rotated.fp8.w_cand is inp.fp8.w_cand
    assert [pr.name for pr in bli.providers()] == [pr.name for pr in bli.providers(fp8=True) if not pr.fp8]


@pytest.mark.parametrize("activation", ["relu", "gelu_tanh", "none"])
def test_fp8_providers_match_their_references(compile_eagerly, real_op, activation):
    p, inp = small(activation=activation)
    deq = inp.dequantized()
    refs = {(False, "operands"): bli.reference_output(p, deq), (True, "operands"): bli.reference_output(p, deq, False),
            (False, "cat"): bli.fp8_cat_reference(p, inp)}
    bf16 = {False: bli.reference_output(p, inp), True: bli.reference_output(p, inp, False)}
    for prov in [pr for pr in bli.providers(fp8=True) if pr.fp8]:
        st = prov.setup(p, inp)
        for x in (inp, inp.clone_activations()):
            out = prov.run(p, st, x)
            assert out.shape == (p.B, p.N) and out.dtype == torch.bfloat16, prov.name
            # bf16 outputs (the eager peers round twice: the GEMM, then the epilogue)
            assert harness.rel_error(out, refs[prov.floor, prov.fp8]) < 1e-2, prov.name
            assert 1e-3 < harness.rel_error(out, bf16[prov.floor]) < 0.1, prov.name  # quantization error shows
    assert [c["fn"] for c in compile_eagerly] == [bli.fp8_decomposition]
    # scales of the wrong rows fail the check
    prov = next(pr for pr in bli.providers(fp8=True) if pr.name == "fp8 decomposition")
    flipped = inp.clone_activations()
    flipped.fp8.x_cand_scale = inp.fp8.x_cand_scale.flip(0)
    assert harness.rel_error(prov.run(p, prov.setup(p, inp), flipped), refs[False, "operands"]) > 0.05


def test_main_dry_run_fp8(gemm_benchmarks_on_cpu, compile_eagerly, real_op, tmp_path, capsys):
    argv = ["--configs", "headline", "--B", "12", "--K", "5,7", "--N", "6", "--dtype", "fp8", "bf16",
            "--warmup", "1", "--rep", "3", "--out-dir", str(tmp_path)]
    assert bli.main(argv) == 0
    data = json.loads((tmp_path / "bench_linear-latest.json").read_text())
    fp8_rows = {r["provider"]: r for r in data["rows"] if r["dtype"] == "fp8"}
    bf16_rows = {r["provider"]: r for r in data["rows"] if r["dtype"] == "bf16"}
    assert set(bf16_rows) == {pr.name for pr in bli.chosen_providers(None)}  # no FP8 provider on a bf16 point
    assert set(fp8_rows) == set(bf16_rows) | set(FP8_NAMES)
    for name, r in fp8_rows.items():
        assert r["status"] == "ok", r
        assert r["rel_err"] < 1e-2 and r["tflops"] > 0
        assert ("quant_err" in r) == (name in FP8_NAMES)
        assert r["x_fp8_compiled"] == pytest.approx(fp8_rows["torch.compile fp8 decomposition"]["ms"] / r["ms"])
        assert r["x_ikbo_bf16"] == pytest.approx(fp8_rows[bli.OURS]["ms"] / r["ms"])
    assert fp8_rows[bli.OURS_FP8]["pct_ceiling"] == pytest.approx(100 * fp8_rows[bli.OURS_FP8]["tflops"] / 1400.0)
    out = capsys.readouterr().out
    assert "at fp8 points ikbo linear fp8" in out and "x_fp8_cat" in out
