"""hoist: row-wise work after a broadcast runs at U rows where that pays (a matmul, a
reduction, or work leading to an IKBO op), and is put back where it does not."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rewrite_helpers import FakeCudaGraph, check_close, exported

E = 8


def _rows_of(module, op: str) -> list:
    """Leading size of the first input of every ``op`` node."""
    return [n.args[0].meta["val"].shape[0] for n in module.graph.nodes
            if n.op == "call_function" and op in str(n.target)]


class UserTower(nn.Module):
    """A user MLP (layer norm, linear, GELU, linear) written after the gather."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(E)
        self.fc1, self.fc2 = nn.Linear(E, 16), nn.Linear(16, E)

    def forward(self, user, cand, idx):
        u = self.fc2(F.gelu(self.fc1(self.norm(user[idx] * 2.0))))
        return u * cand


def _inputs(B=10, U=3, seed=0, shape=(E,)):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(U, *shape, generator=g).bfloat16(), torch.randn(B, *shape, generator=g).bfloat16(),
            torch.randint(0, U, (B,), generator=g))


def test_a_user_mlp_after_the_gather_runs_at_user_rows():
    model = UserTower().bfloat16().eval()
    args = _inputs()
    module, report = exported(model, args)
    assert report.kinds() == ["hoist"] * 5, str(report)
    assert _rows_of(module, "aten.linear") == [3, 3]  # U, not B
    assert _rows_of(module, "aten.layer_norm") == [3]
    assert len(report.left) == 1 and "mul" in str(report.left[0])  # the product with cand stays after it
    check_close(module(*args), model, args)


class Sequence3d(nn.Module):
    """Per-item projections of a gathered sequence and a masked mean over it."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(E, E)

    def forward(self, seq, lengths, idx):
        s = self.proj(seq[idx])  # [B, L, E]
        keep = torch.arange(seq.shape[1])[None, :] < lengths[idx][:, None]
        return (s * keep[..., None]).sum(1) / lengths[idx][:, None]


def test_a_projection_and_a_masked_mean_over_a_sequence():
    g = torch.Generator().manual_seed(1)
    seq = torch.randn(3, 5, E, generator=g).bfloat16()
    lengths = torch.randint(1, 6, (3,), generator=g)
    args = (seq, lengths, torch.randint(0, 3, (11,), generator=g))
    model = Sequence3d().bfloat16().eval()
    module, report = exported(model, args)
    assert "hoist" in report.kinds() and _rows_of(module, "aten.linear") == [3]
    assert _rows_of(module, "aten.sum") == [3]
    check_close(module(*args), model, args)


class PointwiseOnly(nn.Module):
    def forward(self, user, cand, idx):
        return torch.relu(user[idx] + 1.0) * cand


def test_pointwise_work_that_leads_nowhere_stays_after_the_gather():
    """Inductor fuses the gather into it: moving it would add a kernel and save nothing."""
    args = _inputs(seed=2)
    module, report = exported(PointwiseOnly(), args)
    assert report.rewrites == [] and len(report.left) == 1
    assert _rows_of(module, "aten.relu") == [10]
    check_close(module(*args), PointwiseOnly(), args)


class MixesCandidates(nn.Module):
    """The linear reads the gathered rows plus candidate rows: not row-wise in the user alone."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(E, E)

    def forward(self, user, cand, idx):
        return self.fc(user[idx] + cand)


def test_work_that_mixes_in_candidate_rows_is_not_hoisted():
    args = _inputs(seed=3)
    model = MixesCandidates().bfloat16().eval()
    module, report = exported(model, args)
    assert report.rewrites == [] and _rows_of(module, "aten.linear") == [10]
    check_close(module(*args), model, args)


class Dropout(nn.Module):
    def forward(self, user, cand, idx):
        return F.dropout(user[idx], 0.5, training=True).sum(1) + cand.sum(1)


def test_random_ops_are_not_hoisted():
    module, report = exported(Dropout(), _inputs(seed=4))
    assert not any("dropout" in str(r) or "bernoulli" in str(r) for r in report.rewrites), str(report)


class PaddedUserExpert(nn.Module):
    """A user-side expert over K 20 as the GPU runs it after Inductor's pad_mm: the gathered
    activation and the weight zero-padded to K 24, then concatenated with the candidates."""

    def __init__(self, k: int = 20, pad: int = 4):
        super().__init__()
        self.fc, self.pad = nn.Linear(k, 16), pad

    def forward(self, user, cand, idx):
        u = user[idx]
        w = F.pad(self.fc.weight, (0, self.pad))
        h = torch.relu(torch.addmm(self.fc.bias, F.pad(u, (0, self.pad)), w.t()))
        return torch.cat([h, cand], dim=1)


@pytest.mark.parametrize("B, U", [(10, 3), (1, 1), (37, 37)])
def test_zero_padded_k_columns_move_with_the_matmul_before_the_gather(B, U):
    model = PaddedUserExpert().bfloat16().eval()
    args = _inputs(B, U, seed=B, shape=(20,))
    module, report = exported(model, args)
    assert "hoist" in report.kinds() and not any("constant_pad_nd" in str(x) for x in report.left), str(report)
    act = [n.args[1] for n in module.graph.nodes if n.target is torch.ops.aten.addmm.default]
    assert [a.meta["val"].shape[0] for a in act] == [U] and "pad" in str(act[0].target), str(module.graph)
    check_close(module(*args), model, args)


def _padded_expert_gpu_graph(pad, value=0.0):
    """The post-grad graph ``compile(dynamic=True)`` makes on the GPU of an MMoE user expert
    (K 20) beside a concat of the gathered rows: pad_mm pads the activation with ``pad`` (rows
    too where it has 4 entries: then the expert alone, its rows not sliced back)."""
    aten, bf = torch.ops.aten, torch.bfloat16
    f = FakeCudaGraph()
    user, cand = f.input("user", (("U", 5), 20), bf), f.input("cand", (("B", 9), 12), bf)
    idx = f.input("idx", (("B", 9),), torch.int64)
    w, bias = f.input("w", (32, 20), bf), f.input("bias", (32,), bf)
    u = f.op(aten.index.Tensor, user, [idx])
    x = f.op(aten.cat.default, [u, cand], 1)
    w24 = f.op(aten.constant_pad_nd.default, f.op(aten.permute.default, w, [1, 0]), [0, 0, 0, 4])
    h = f.op(aten.relu.default, f.op(aten.addmm.default, bias, f.op(aten.constant_pad_nd.default, u, pad, value), w24))
    return f.module(f.op(aten.cat.default, [h, x], 1) if len(pad) == 2 else h)


def test_the_gpu_graphs_k_padding_of_a_gathered_activation_is_hoisted():
    from ikbo_rewrite.passes import run

    gm = _padded_expert_gpu_graph([0, 4])
    report = run(gm, guards=True)
    assert set(report.kinds()) == {"hoist"} and not any("constant_pad_nd" in str(x) for x in report.left), str(report)
    (mm,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.addmm.default]
    assert str(mm.args[1].meta["val"].shape[0]) == str(gm.graph.find_nodes(op="placeholder", target="user")[0]
                                                       .meta["val"].shape[0])  # U rows


def test_a_padding_of_the_rows_is_not_hoisted():
    from ikbo_rewrite.passes import run

    report = run(_padded_expert_gpu_graph([0, 4, 0, 3]), guards=True)
    assert "hoist" not in report.kinds() and any("constant_pad_nd" in str(x) for x in report.left), str(report)
