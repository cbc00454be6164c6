"""The view chains after an IKBO op: where they amount to a reshape of its result they become
that reshape (the copies go); where they rearrange it, or another node reads them, they stay."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import ikbo_rewrite
from examples import wukong
from ikbo_rewrite.views import _simplify
from rewrite_helpers import check_close, exported

M, N, KU, KC = 6, 5, 4, 7


class LceThenHead(nn.Module):
    """nn.Linear over the transposed concat (Wukong's spelling), then a head on the result."""

    def __init__(self, tail: str):
        super().__init__()
        self.tail = tail
        self.compress = nn.Linear(KU + KC, M, bias=False)
        self.head = nn.Linear(M * N, 3)

    def forward(self, user, cand, idx):
        e = torch.cat([user[idx], cand], dim=1)  # [B, K, N]
        y = self.compress(e.transpose(1, 2)).transpose(1, 2)  # [B, M, N]
        if self.tail == "flatten":
            return self.head(y.flatten(1))
        if self.tail == "transposed":  # [B, N, M] flattened: a real rearrangement
            return self.head(y.transpose(1, 2).flatten(1))
        if self.tail == "shared":  # a view in the chain read twice
            z = y.flatten(1)
            return self.head(z) + z.sum(1, keepdim=True)
        raise ValueError(self.tail)


def _inputs(B=9, U=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(U, KU, N, generator=g).bfloat16(), torch.randn(B, KC, N, generator=g).bfloat16(),
            torch.randint(0, U, (B,), generator=g))


def _between(module, start: str):
    """The ops from the first ``start`` node to the next matmul-like node."""
    nodes = [n for n in module.graph.nodes if n.op == "call_function"]
    i = next(k for k, n in enumerate(nodes) if start in str(n.target))
    out = []
    for n in nodes[i + 1:]:
        t = str(n.target)
        if any(s in t for s in ("linear", "addmm", "mm")):
            break
        out.append(t.replace("aten.", ""))
    return out


@pytest.mark.parametrize("tail", ["flatten", "transposed", "shared"])
def test_chains_after_lce_are_right(tail):
    model = LceThenHead(tail).bfloat16()
    args = _inputs(seed=len(tail))
    module, report = exported(model, args)
    assert report.kinds() == ["lce"], str(report)
    check_close(module(*args), model, args)
    between = _between(module, "ikbo_gemm.lce")
    if tail == "transposed":  # the transpose is the model's: it stays
        assert any("permute" in t or "transpose" in t for t in between), between
    if tail == "flatten":  # one reshape of lce's result
        assert len(between) == 1 and ("view" in between[0] or "reshape" in between[0]), between


@pytest.mark.parametrize("dynamic", [False, True])
def test_wukong_compiled_has_no_copy_after_lce(dynamic):
    cfg = wukong.WukongConfig(M=12, N=8, K_user=10, K_cand=6, mlp=(4, 1))
    torch.manual_seed(0)
    model = wukong.WukongBlock(cfg).bfloat16().eval()
    args = wukong.make_inputs(cfg, 10, 3, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    with torch.no_grad():
        fast = ikbo_rewrite.compile(model, dynamic=dynamic)
        out = fast(*args)
    report = str(fast.report)
    assert "rewrite lce" in report and "collapsed to a reshape" in report, report
    check_close(out, model, args)


def test_simplify_composes_and_cancels():
    s3 = (2, 3, 4)
    perm = ("permute", (0, 2, 1), (2, 4, 3))
    back = ("permute", (0, 2, 1), s3)
    assert _simplify([perm, back], s3) == []
    assert _simplify([("copy", None, s3), ("reshape", None, (6, 4)), ("reshape", None, s3)], s3) == []
    assert _simplify([perm, ("reshape", None, (8, 3)), ("reshape", None, (2, 4, 3)), back,
                      ("copy", None, s3), ("reshape", None, (2, 12))], s3) == [("reshape", None, (2, 12))]
    left = _simplify([perm, ("reshape", None, (2, 12))], s3)  # a transpose, then a flatten: stays
    assert [k for k, _, _ in left] == ["permute", "reshape"]
    cyc = [("permute", (1, 2, 0), (3, 4, 2)), ("permute", (1, 2, 0), (4, 2, 3)), ("permute", (1, 2, 0), s3)]
    assert _simplify(cyc, s3) == []
