"""Models the pass was not built on (tests/models_unseen.py: DCN-v2 with a user tower, BST over
[history, target], MMoE with user-side experts), as their papers write them: through
``compile(dynamic=True)`` and ``export`` (dynamic batches by default), each at two batch sizes
against eager, and the report: what was rewritten, and a reason for every broadcast left."""
from __future__ import annotations

import pytest
import torch

import ikbo_rewrite
from ikbo_rewrite import linear
from models_unseen import MODELS, make_inputs
from rewrite_helpers import check_close

SIZES = ((10, 3), (23, 4))  # (B, U): the example, then another size served by the same graph

# name -> (rewrites expected, a phrase of the reason each broadcast left has, in either graph)
EXPECTED = {
    # The user tower runs at U rows as written; the cross and deep layers' first linears take
    # [user, candidate]; x0 * (...) needs x0 itself, so its gather stays.
    "dcn_v2": ({"linear"}, "is not a linear over the concat"),
    # [history, target] mixes user and candidate rows along the sequence: self-attention over
    # it is not target attention, and no contraction over that concat exists.
    "bst": (set(), "is not a matmul over the concat"),
    # User-side experts move before the gather; the gates and shared experts take [user, cand];
    # the gathered user experts' outputs are stacked with the shared ones (no rewrite target).
    "mmoe": ({"linear", "hoist"}, ""),
}


def _model(name):
    torch.manual_seed(0)
    return MODELS[name]().bfloat16().eval()


def _check_report(name, report):
    kinds, why = EXPECTED[name]
    if not linear.available():
        kinds = kinds - {"linear"}
    assert set(report.kinds()) == kinds, str(report)
    assert report.broadcasts >= 1 and report.left, str(report)
    for left in report.left:
        assert left.reasons and all(r.strip() for r in left.reasons), str(report)
        if why and "linear: op not available" not in str(left):
            assert any(why in r for r in left.reasons), str(report)


@pytest.mark.parametrize("name", MODELS)
def test_unseen_model_through_export(name):
    model = _model(name)
    with torch.no_grad():
        module, report = ikbo_rewrite.export(model, make_inputs(name, *SIZES[0], seed=1))
        for B, U in SIZES:
            args = make_inputs(name, B, U, seed=B)
            check_close(module(*args), model, args)
    _check_report(name, report)


@pytest.mark.parametrize("name", MODELS)
def test_unseen_model_through_dynamic_compile(name):
    torch._dynamo.reset()
    model = _model(name)
    compiled = ikbo_rewrite.compile(model, dynamic=True)
    with torch.no_grad():
        for B, U in SIZES:
            args = make_inputs(name, B, U, seed=B + 1)
            check_close(compiled(*args), model, args)
    assert len(compiled.reports) == 1, [str(r) for r in compiled.reports]
    _check_report(name, compiled.report)
    torch._dynamo.reset()
