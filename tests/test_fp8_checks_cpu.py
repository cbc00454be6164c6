"""CPU tests of the FP8 argument checks of ikbo_gemm.linear and ikbo_gemm.lce (and their
references, which share them): every error names the argument."""
from __future__ import annotations

import pytest
import torch

import ikbo_gemm
from fp8_inputs import lce_fp8_problem, linear_fp8_problem

BF16 = torch.bfloat16
E5M2 = torch.float8_e5m2
LINEAR_SCALES = ("x_cand_scale", "x_user_scale", "w_cand_scale", "w_user_scale")
LCE_SCALES = ("w_cand_scale", "w_user_scale", "e_cand_scale", "e_user_scale")


def _linear(**kw):
    return linear_fp8_problem(6, 2, 5, 4, 3, seed=1) | kw


def _lce(**kw):
    return lce_fp8_problem(6, 2, 5, 4, 3, 7, seed=1) | kw


def _bf16(kw, names):
    """``kw`` with 16-bit operands (and bias; e back in its 16-bit layout [B, K, N]) and no scales."""
    out = {k: v for k, v in kw.items() if not k.endswith("_scale")}
    for n in names + (("bias",) if kw.get("bias") is not None else ()):
        out[n] = kw[n].float().to(BF16)
        if n.startswith("e_"):
            out[n] = out[n].transpose(1, 2).contiguous()
    return out


OPS = {"linear": (ikbo_gemm.linear, ikbo_gemm.linear_reference, _linear, LINEAR_SCALES,
                  ("x_cand", "x_user", "w_cand", "w_user")),
       "lce": (ikbo_gemm.lce, ikbo_gemm.lce_reference, _lce, LCE_SCALES, ("w_cand", "w_user", "e_cand", "e_user"))}


@pytest.fixture(params=[(op, fn) for op in OPS for fn in ("op", "reference")], ids=lambda p: "-".join(p))
def case(request):
    op, fn = request.param
    call, reference, problem, scales, operands = OPS[op]
    return (call if fn == "op" else reference), problem, scales, operands


def _raises(fn, kw, err, *words):
    with pytest.raises(err) as info:
        fn(**kw)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_each_fp8_operand_needs_its_scale(case):
    fn, problem, scales, _ = case
    for name in scales:
        _raises(fn, problem(**{name: None}), ValueError, name, "required", "quantize_fp8")


def test_scales_of_wrong_shape(case):
    fn, problem, scales, _ = case
    for name in scales:
        good = problem()[name]
        for bad in (good[:-1] if len(good) > 1 else good.repeat(2), good[:, None], torch.ones(1, 1)):
            _raises(fn, problem(**{name: bad}), ValueError, name, "has shape", "0-d")


def test_scales_of_wrong_dtype_or_type(case):
    fn, problem, scales, _ = case
    for name in scales:
        good = problem()[name]
        _raises(fn, problem(**{name: good.double()}), TypeError, name, "float32", "float64")
        _raises(fn, problem(**{name: good.to(BF16)}), TypeError, name, "float32")
        _raises(fn, problem(**{name: 1.0}), TypeError, name, "torch.Tensor")


def test_scales_on_another_device(case):
    fn, problem, scales, _ = case
    for name in scales:
        _raises(fn, problem(**{name: problem()[name].to("meta")}), ValueError, name, "meta")


def test_scales_with_16_bit_operands(case):
    fn, problem, scales, operands = case
    plain = _bf16(problem(), operands)
    fn(**plain)  # no scales: fine
    for name in scales:
        _raises(fn, plain | {name: problem()[name]}, ValueError, name, "FP8", "only")


def test_fp8_and_16_bit_operands_mixed(case):
    fn, problem, _, operands = case
    for name in operands[1:]:
        kw = problem()
        kw[name] = kw[name].float().to(BF16)
        _raises(fn, kw, TypeError, name, "bfloat16", "float8_e4m3fn", "mixed")


def test_e5m2_refused(case):
    fn, problem, _, operands = case
    for name in operands:
        kw = problem()
        kw[name] = kw[name].float().to(E5M2)
        _raises(fn, kw, TypeError, name, "float8_e5m2", "float8_e4m3fn")


def test_out_dtype(case):
    fn, problem, _, operands = case
    _raises(fn, problem(out_dtype=torch.float32), TypeError, "out_dtype", "bfloat16 or float16", "float32")
    _raises(fn, problem(out_dtype="bf16"), TypeError, "out_dtype", "torch.dtype")
    assert fn(**problem(out_dtype=torch.float16)).dtype == torch.float16
    assert fn(**problem()).dtype == BF16
    plain = _bf16(problem(), operands)
    assert fn(**plain, out_dtype=BF16).dtype == BF16
    _raises(fn, plain | {"out_dtype": torch.float16}, TypeError, "out_dtype", "bfloat16")


def test_out_of_the_output_dtype(case):
    fn, problem, _, _ = case
    kw = problem()
    out = fn(**kw)
    _raises(fn, kw | {"out": torch.empty_like(out, dtype=torch.float16)}, TypeError, "out", "bfloat16")
    fn(**kw, out=torch.empty_like(out, dtype=torch.float16), out_dtype=torch.float16)


def test_linear_bias_dtypes():
    for dtype in (torch.float32, BF16, torch.float16):
        ikbo_gemm.linear(**_linear(bias=torch.randn(5).to(dtype)))
    _raises(ikbo_gemm.linear, _linear(bias=torch.randn(5).to(torch.float8_e4m3fn)), TypeError, "bias")
    _raises(ikbo_gemm.linear, _linear(bias=torch.randn(5, dtype=torch.float64)), TypeError, "bias", "float64")
    _raises(ikbo_gemm.linear, _bf16(_linear(), OPS["linear"][4]) | {"bias": torch.randn(5)}, TypeError, "bias")


def test_lce_e_in_the_16_bit_layout():
    """FP8 e is K-major, [B, N, K]: e given as [B, K, N] is refused, naming the dimension."""
    kw = _lce()
    kw["e_cand"] = kw["e_cand"].transpose(1, 2).contiguous()
    _raises(ikbo_gemm.lce, kw, ValueError, "e_cand", "[B, N, K_cand]", "K_cand")
