"""CPU checks of perf/operand_bits_lce.py: the mantissa rounding and a dry run of main()."""
import json
import math

import pytest
import torch

from perf import harness
from perf import operand_bits_lce as ob


def _rounded_reference(x: float, bits: int) -> float:
    """x rounded to ``bits`` fp16 mantissa bits, to nearest with ties away from zero, in float64."""
    if x == 0.0 or not math.isfinite(x):
        return x
    exponent = max(math.floor(math.log2(abs(x))), -14)  # fp16 subnormals share the exponent -14
    quantum = 2.0 ** (exponent - bits)
    r = math.floor(abs(x) / quantum + 0.5) * quantum
    return math.copysign(min(r, (2.0 - 2.0**-bits) * 2.0**15), x)


@pytest.mark.parametrize("bits", [0, 3, 7, 9])
def test_round_mantissa_matches_a_float64_rounding(bits):
    gen = torch.Generator().manual_seed(bits)
    x = torch.cat([
        torch.randn(4000, generator=gen) * 3,
        torch.randn(500, generator=gen) * 1e-6,  # fp16 subnormals
        torch.tensor([0.0, -0.0, 65504.0, -65504.0, 6.1e-5, 1.0, -1.0]),
    ]).to(torch.float16)
    r = ob.round_mantissa(x, bits)
    assert r.dtype == torch.float16 and r.shape == x.shape
    want = torch.tensor([_rounded_reference(v, bits) for v in x.double().tolist()], dtype=torch.float64)
    torch.testing.assert_close(r.double(), want, rtol=0, atol=0)
    assert torch.equal(ob.round_mantissa(r, bits), r)  # already rounded: unchanged
    assert int((r.view(torch.int16) & ((1 << (10 - bits)) - 1)).count_nonzero()) == 0


def test_round_mantissa_keeps_specials_and_all_bits():
    x = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.1, -3.3], dtype=torch.float16)
    r = ob.round_mantissa(x, 2)
    assert r[0] == float("inf") and r[1] == -float("inf") and torch.isnan(r[2])
    assert torch.equal(ob.round_mantissa(x[3:], 10), x[3:])


def test_parse_variant():
    assert ob.parse_variant("fp16") == (torch.float16, None)
    assert ob.parse_variant("bf16") == (torch.bfloat16, None)
    assert ob.parse_variant("fp16/7") == (torch.float16, 7)
    for bad in ("fp32", "bf16/3", "fp16/11", "fp16/x", "fp16/-1"):
        with pytest.raises(Exception):
            ob.parse_variant(bad)
    with pytest.raises(SystemExit) as e:
        ob.parse_args(["--variants", "fp16", "fp8"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        ob.parse_args(["--variants", "fp16", "bf16", "fp16"])
    assert e.value.code == 2


def test_main_dry_run(monkeypatch, tmp_path, capsys, cpu_timing, lce_benchmark_on_cpu):
    monkeypatch.setattr(harness, "l2_bytes", lambda: 2**20)
    monkeypatch.setattr(harness, "cublas_ceiling_tflops", lambda dtype: 700.0)
    argv = ["--B", "20", "--ratio", "3", "--variants", "fp16", "fp16/3", "bf16", "--warmup", "1", "--rep", "3",
            "--out-dir", str(tmp_path)]
    assert ob.main(argv) == 0
    data = json.loads((tmp_path / "operand_bits_lce-latest.json").read_text())
    rows = data["rows"]
    assert [(r["variant"], r["provider"]) for r in rows] == [
        (v, p) for v in ("fp16", "fp16/3", "bf16") for p in ob.PROVIDERS]
    for r in rows:
        assert r["status"] == "ok", r
        assert r["rel_err"] < 1e-2 and r["ms"] > 0 and r["x_decomp"] > 0 and r["x_mat_bmm"] > 0
        assert r["dtype"] == ("bf16" if r["variant"] == "bf16" else "fp16") and r["B"] == 20
    assert all(r["vs_first"] == 1.0 for r in rows if r["variant"] == "fp16")
    assert data["ceiling_tflops"] == {"bf16": 700.0, "fp16": 700.0}
    assert "operand_bits_lce: B=20 ratio=3" in capsys.readouterr().out


def test_main_sustained_beside_interleaved(monkeypatch, tmp_path, cpu_timing, lce_benchmark_on_cpu):
    monkeypatch.setattr(harness, "l2_bytes", lambda: 2**20)
    monkeypatch.setattr(harness, "cublas_ceiling_tflops", lambda dtype: 700.0)
    argv = ["--B", "12", "--ratio", "4", "--variants", "fp16", "bf16", "--warmup", "1", "--rep", "2",
            "--timing", "both", "--sustained-warmup-s", "0.01", "--sustained-s", "0.02", "--out-dir", str(tmp_path)]
    assert ob.main(argv) == 0
    data = json.loads((tmp_path / "operand_bits_lce-latest.json").read_text())
    assert data["settings"]["timing"] == "both"
    by = {(r["variant"], r["provider"]): r for r in data["rows"]}
    for (variant, provider), r in by.items():
        assert r["status"] == "ok" and r["ms"] > 0 and r["ms_sustained"] > 0, r
        assert r["x_decomp_sustained"] == pytest.approx(by[(variant, "torch decomposition")]["ms_sustained"]
                                                        / r["ms_sustained"])
        assert r["vs_first_sustained"] == pytest.approx(r["ms_sustained"] / by[("fp16", provider)]["ms_sustained"])
