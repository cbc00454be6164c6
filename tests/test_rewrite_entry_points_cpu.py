"""``export``'s dynamic batches by default, and ``validate`` of ``export`` and ``compile``: an index
out of range gives NaN rows from the new ops, or with validate=True raises IndexError as eager's
gather does."""
from __future__ import annotations

import pytest
import torch

import ikbo_rewrite
from rewrite_helpers import TwoSequences, check_close

H, D, L = 2, 64, 7


def _inputs(B, U, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 3, H, D, generator=g).bfloat16()
    k1, v1 = (torch.randn(U, L, H, D, generator=g).bfloat16() for _ in range(2))
    k2, v2 = (torch.randn(U, L + 4, H, D, generator=g).bfloat16() for _ in range(2))
    idx = torch.randint(0, U, (B,), generator=g)
    return [q, k1, v1, k2, v2, idx, torch.randint(1, L + 1, (U,), generator=g)]


def test_export_makes_the_batches_dynamic_by_default():
    model = TwoSequences(mask=True)
    with torch.no_grad():
        module, report = ikbo_rewrite.export(model, _inputs(9, 3, seed=1))
        for B, U in ((9, 3), (14, 5), (2, 1)):
            args = _inputs(B, U, seed=B)
            check_close(module(*args), model, args)
        assert report.kinds().count("attention") == 2 and report.left == [], str(report)
        assert str(report).count("one work list for the calls on this index") == 2, str(report)
        # The lengths and K/V carry two symbols; the rewrite took them as one user batch and checks it.
        args = _inputs(9, 3, seed=2)
        args[-1] = torch.cat([args[-1], args[-1]])
        with pytest.raises(RuntimeError, match="the mask's lengths and k/v have one row per user"):
            module(*args)


def test_export_with_the_examples_sizes_and_bad_arguments():
    model = TwoSequences()
    with torch.no_grad():
        module, _ = ikbo_rewrite.export(model, _inputs(9, 3, seed=3), dynamic_shapes=None)
        with pytest.raises(Exception, match="9"):  # torch.export's check of the example's batch
            module(*_inputs(10, 3, seed=4))
    with pytest.raises(ValueError, match="dynamic_shapes must be 'batch', None or torch.export's"):
        ikbo_rewrite.export(model, _inputs(9, 3, seed=3), dynamic_shapes="dynamic")


def _out_of_range(seed):
    args = _inputs(8, 3, seed)
    args[5] = args[5].clone()
    args[5][2] = 3  # U = 3
    return args


def test_an_index_out_of_range_through_export(monkeypatch):
    monkeypatch.setenv("IKBO_VALIDATE", "0")  # the tests' default is on
    model = TwoSequences()
    with torch.no_grad():
        module, report = ikbo_rewrite.export(model, _inputs(8, 3, seed=5))
        assert report.kinds().count("attention") == 2
        with pytest.raises(IndexError):  # eager
            model(*_out_of_range(6))
        out = module(*_out_of_range(6))
        bad = torch.zeros(8, dtype=torch.bool)
        bad[2] = True
        assert out[bad].isnan().all() and not out[~bad].isnan().any()
        checked, _ = ikbo_rewrite.export(model, _inputs(8, 3, seed=5), validate=True)
        with pytest.raises(IndexError, match=r"idx\[2\] = 3 is out of range"):
            checked(*_out_of_range(6))
        args = _inputs(8, 3, seed=7)
        check_close(checked(*args), model, args)


def test_an_index_out_of_range_through_compile_with_validate(monkeypatch):
    monkeypatch.setenv("IKBO_VALIDATE", "0")
    torch._dynamo.reset()
    model = TwoSequences()
    compiled = ikbo_rewrite.compile(model, dynamic=True, validate=True)
    with torch.no_grad():
        args = _inputs(8, 3, seed=8)
        check_close(compiled(*args), model, args)
        assert compiled.report.kinds().count("attention") == 2, str(compiled.report)
        with pytest.raises(IndexError, match="is out of range"):
            compiled(*_out_of_range(9))
    torch._dynamo.reset()
