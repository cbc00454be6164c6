"""GPU tests of KV-broadcast attention's dense row packing: a user's query rows run candidate
after candidate through 128-row tiles, for any S_q, whether idx is grouped (a tile's rows are
consecutive rows of q: two boxes) or shuffled (one box per run of gcd(S_q, 64) rows)."""
import math

import pytest
import torch

import ikbo_fa
from attention_inputs import materialize

pytestmark = pytest.mark.gpu

S_QS = [1, 2, 3, 7, 8, 17, 33, 48, 64, 65, 100, 128, 129, 200]


def _problem(seed, counts, S_q, H=2, H_kv=1, D=64, L=300, dtype=torch.bfloat16, order="sorted"):
    """q per candidate, K/V per user, idx with ``counts[u]`` candidates of user u."""
    g = torch.Generator().manual_seed(seed)
    U, B = len(counts), sum(counts)
    idx = torch.repeat_interleave(torch.arange(U), torch.tensor(counts))
    if order == "shuffled":
        idx = idx[torch.randperm(B, generator=g)]
    q = torch.randn(B, S_q, H, D, generator=g).to(dtype).cuda()
    k = torch.randn(U, L, H_kv, D, generator=g).to(dtype).cuda()
    v = torch.randn(U, L, H_kv, D, generator=g).to(dtype).cuda()
    return q, k, v, idx.cuda()


def _reference(q, k, v, idx, scale):
    """fp32 attention on the materialized K/V -> (out, lse)."""
    qm, km, vm, _ = materialize(q, k, v, idx, "kv", None)
    group = q.shape[2] // k.shape[2]
    qf = qm.float().transpose(1, 2)
    kf = km.float().repeat_interleave(group, dim=2).transpose(1, 2)
    vf = vm.float().repeat_interleave(group, dim=2).transpose(1, 2)
    s = qf @ kf.transpose(-1, -2) * scale
    return (torch.softmax(s, dim=-1) @ vf).transpose(1, 2), torch.logsumexp(s, dim=-1)


def _check(q, k, v, idx, *, out=None, **kw):
    scale = 1.0 / math.sqrt(q.shape[-1])
    if out is None:
        out = torch.full_like(q, float("nan"))
    o, lse = ikbo_fa.attention(q, (k, v), idx, out=out, return_lse=True, **kw)
    ref, ref_lse = _reference(q, k, v, idx, scale)
    assert not o.isnan().any()
    err = ((o.float() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, err
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)
    return o


@pytest.mark.parametrize("order", ["sorted", "shuffled"])
@pytest.mark.parametrize("S_q", S_QS)
def test_every_s_q(S_q, order):
    # 1 candidate, 1000 candidates, and counts whose runs end anywhere in a tile
    counts = [1, 1000, 3, 64, 65] if S_q <= 8 else [1, 130, 3, 7, 5]
    q, k, v, idx = _problem(S_q, counts, S_q, order=order)
    _check(q, k, v, idx)


@pytest.mark.parametrize("order", ["sorted", "shuffled"])
@pytest.mark.parametrize("S_q", [17, 65])
def test_a_user_of_1000_candidates_at_longer_s_q(S_q, order):
    """A user's 1000 candidates as one run of 17000 or 65000 query rows over many tiles, its ends
    inside tiles; shuffled, each query row is a box of its own (gcd(S_q, 64) = 1)."""
    q, k, v, idx = _problem(1000 + S_q, [3, 1000, 1, 64], S_q, order=order)
    _check(q, k, v, idx)


@pytest.mark.parametrize("S_q", [1, 17, 100])
def test_fp16_d128_grouped_heads(S_q):
    q, k, v, idx = _problem(5 + S_q, [40, 1, 77], S_q, H=4, H_kv=2, D=128, L=1000, dtype=torch.float16)
    _check(q, k, v, idx)


@pytest.mark.parametrize("S_q", [1, 3, 48])
def test_strides_the_one_box_path_cannot_take(S_q):
    """q with a batch stride that is not S_q rows: the kernel moves boxes per candidate."""
    q, k, v, idx = _problem(11, [70, 30, 5], S_q)
    wide = torch.randn(q.shape[0], S_q + 2, *q.shape[2:], device="cuda").to(q.dtype)
    wide[:, :S_q] = q
    _check(wide[:, :S_q], k, v, idx)


@pytest.mark.parametrize("S_q", [1, 17])
def test_nan_in_one_candidate_stays_in_that_candidate(S_q):
    """Candidates share a tile (with S_q = 17 also a box); a NaN query row changes no other
    candidate's rows, bit for bit."""
    q, k, v, idx = _problem(21, [50, 50], S_q)
    clean = ikbo_fa.attention(q, (k, v), idx)
    q[7, S_q - 1, 1] = float("nan")
    o = ikbo_fa.attention(q, (k, v), idx)
    other = torch.ones_like(o, dtype=torch.bool)
    other[7, S_q - 1, 1] = False
    assert torch.equal(o[other], clean[other])
    assert not torch.equal(o[7, S_q - 1, 1], clean[7, S_q - 1, 1])


def test_nan_in_one_user_stays_in_that_user():
    q, k, v, idx = _problem(23, [65, 63, 70], 1)
    k[1, 5, 0, 3] = float("nan")
    o = ikbo_fa.attention(q, (k, v), idx)
    assert o[idx == 1].isnan().all() and not o[idx != 1].isnan().any()


@pytest.mark.parametrize("S_q", [1, 17])
def test_out_of_range_index_gives_nan_rows_only(S_q):
    q, k, v, idx = _problem(25, [40, 90], S_q)
    idx[[3, 50, 51]] = torch.tensor([-1, 2, 99], device="cuda")
    o = ikbo_fa.attention(q, (k, v), idx, validate=False)
    bad = torch.zeros(idx.shape[0], dtype=torch.bool, device="cuda")
    bad[[3, 50, 51]] = True
    assert o[bad].isnan().all() and not o[~bad].isnan().any()


@pytest.mark.parametrize("S_q", [1, 33])
def test_graph_replay_with_new_idx(S_q):
    """Captured once; replays after grouped and shuffled idx values are written into the captured
    tensor give each their own result (the one-box path is chosen on the device)."""
    q, k, v, idx = _problem(31, [100, 28, 200], S_q)
    out = torch.empty_like(q)
    ikbo_fa.attention(q, (k, v), idx, out=out)  # compile and plan outside the capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        ikbo_fa.attention(q, (k, v), idx, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.Generator().manual_seed(S_q)
    for new in (idx[torch.randperm(idx.shape[0], generator=g).cuda()], idx.sort().values.flip(0),
                torch.randint(0, 3, idx.shape, generator=g).sort().values.cuda()):
        idx.copy_(new)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, _ = _reference(q, k, v, idx, 1.0 / math.sqrt(q.shape[-1]))
        assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
