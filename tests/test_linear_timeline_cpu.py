"""tools/linear_timeline.py on the CPU: its arguments (PlanRules sets among them), its providers,
and its refusal to run without a GPU."""
from __future__ import annotations

import argparse

import pytest
import torch

from ikbo_gemm.linear import PlanRules
from tools import linear_timeline as timeline


def test_rules_argument_is_a_plan_rules_spec():
    assert timeline.rules_arg("wide_user=1,user_tile=64x128") == "wide_user=1,user_tile=64x128"
    for bad in ("no_such=1", "wide_user", "wide_user=2", "user_tile=32x128", "fp8_promote=1,split_k=1",
                "user_splits=x"):
        with pytest.raises(argparse.ArgumentTypeError):
            timeline.rules_arg(bad)


def test_plan_rules_spec_round_trip():
    """PlanRules.parse / spec (cute_kernels.policy_spec): bools, ints, none, tuples joined by x."""
    rules = PlanRules.parse("wide_user=1, user_tile=64x128,wide_user_min_n=none,cand_split=128x128x2")
    assert rules == PlanRules(wide_user=True, user_tile=(64, 128), wide_user_min_n=None, cand_split=((128, 128), 2))
    assert PlanRules.parse(rules.spec()) == rules and PlanRules.parse("") == PlanRules() and PlanRules().spec() == ""
    # an Optional[bool] field: 0 / 1 as bools, none as None
    assert PlanRules.parse("spare_by_time=1").spare_by_time is True
    assert PlanRules.parse("spare_by_time=0").spare_by_time is False
    assert PlanRules.parse("spare_by_time=1,spare_by_time=none").spare_by_time is None
    assert PlanRules.parse("fp8_promote=true") == PlanRules(fp8_promote=True)
    for bad, match in (("user_tile=64,128", "not NAME=VALUE"), ("user_tile=64xa", "integers joined by x"),
                       ("user_splits=x", "takes an integer"), ("split_k=yes", "takes 0, 1, true or false")):
        with pytest.raises(ValueError, match=match):
            PlanRules.parse(bad)


def test_arguments_and_providers():
    args = timeline.parse_args(["--B", "2048", "8192", "--K", "1024,2048", "--rules", "wide_user=1",
                                "--dtype", "fp8"])
    assert args.rules == ["wide_user=1"]
    assert (args.B, args.K, args.N, args.dtype) == ([2048, 8192], [(1024, 2048)], [1024], "fp8")
    names = [p.name for p in timeline.providers(args.dtype, args.rules)]
    assert names == ["ikbo linear fp8", "ikbo linear wide_user=1", "torch.compile fp8 decomposition",
                     "fp8 scaled_mm floor"]
    assert [p.name for p in timeline.providers("bf16", [])] == ["ikbo linear", "torch.compile decomposition",
                                                                 "torch addmm floor"]
    with pytest.raises(SystemExit):
        timeline.parse_args(["--rules", "split_k=maybe"])


def test_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        timeline.main([])


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_a_rules_provider_runs_the_op(monkeypatch, dtype):
    """On the CPU the op is its reference: the rules provider gives the op's result."""
    import ikbo_gemm
    from perf import bench_linear as bl
    from perf.gemm_bench import DTYPES
    from perf.providers import LIBS

    monkeypatch.setitem(LIBS.modules, bl.IKBO[0], ikbo_gemm)
    p = bl.make_problem(12, 5, 5, 7, 6, DTYPES[dtype], "relu", device="cpu")
    inp = bl.make_inputs(p, torch.Generator().manual_seed(0), device="cpu")
    ours, variant = timeline.providers(dtype, [timeline.rules_arg("wide_user=1")])[:2]
    expected = ours.run(p, ours.setup(p, inp), inp)
    assert torch.equal(variant.run(p, variant.setup(p, inp), inp), expected)
