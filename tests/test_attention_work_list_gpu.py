"""GPU tests of a work list built once (``ikbo_fa.work_list``) and passed to attention calls: the
same results, bit for bit, as the calls that group idx themselves (padded, kv_lengths, jagged; no
split, split pairs, the workspace split; sorted and shuffled idx), its arrays against the torch
definition, and a CUDA graph of one work list and two calls replayed after new idx values.
"""
import importlib

import pytest
import torch

import ikbo_fa
from attention_inputs import capture_graph, random_jagged_problem, user_groups
from cute_kernels.arch import sm_count
from ikbo_fa.worklist import key_bucket, kv_tile_order, kv_worklist

attention_module = importlib.import_module("ikbo_fa.attention")  # the module (ikbo_fa.attention is the op)

pytestmark = pytest.mark.gpu
NAN = float("nan")


def _both(q, kv, idx, wl, **kw):
    """(out, lse) of the call with the work list and of the call without; outs poisoned."""
    results = []
    for given in (wl, None):
        out = torch.full((idx.shape[0], *q.shape[1:]), NAN, dtype=q.dtype, device=q.device)
        _, lse = ikbo_fa.attention(q, kv, idx, out=out, return_lse=True, work_list=given, **kw)
        results.append((out, lse))
    return results


# (U, ratio, S_q, L): split pairs (S_q 1, L 1024), no split (S_q 2), the workspace split (few
# tiles, long rows), several rounds of the grid and a partial last block (S_q 64)
SHAPES = [(32, 64, 1, 1024), (32, 64, 2, 2048), (4, 16, 1, 8192), (16, 20, 64, 1000)]


@pytest.mark.parametrize("order", ["sorted", "shuffled"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_same_bits_as_grouping_in_the_call(shape, order):
    U, ratio, S_q, L = shape
    q, k, v, idx = user_groups(20 + S_q, U, ratio, S_q, L, order=order)
    wl = ikbo_fa.work_list(idx, U, S_q)
    (out, lse), (base, base_lse) = _both(q, (k, v), idx, wl)
    assert torch.equal(out, base) and torch.equal(lse, base_lse)
    ref = ikbo_fa.attention_reference(q.float(), (k.float(), v.float()), idx)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


def test_kv_lengths_and_jagged():
    q, k, v, idx = user_groups(30, 24, 40, 1, 3000, order="shuffled")
    lengths = torch.randint(0, 3001, (24,), device="cuda")
    lengths[:3] = torch.tensor([0, 1, 3000])
    wl = ikbo_fa.work_list(idx, 24, 1, kv_lengths=lengths)
    (out, lse), (base, base_lse) = _both(q, (k, v), idx, wl, kv_lengths=lengths)
    assert torch.equal(out, base) and torch.equal(lse, base_lse)
    other = lengths.flip(0)  # lengths of the same kind: the same results, in another tile order
    (out, _), (base, _) = _both(q, (k, v), idx, wl, kv_lengths=other)
    assert torch.equal(out, base)

    q, kv, k, v, idx, offsets = random_jagged_problem(31, "kv", 500, 5, 3, 2, 2, 128, [0, 1, 129, 4000, 300],
                                                      torch.bfloat16, device="cuda", offsets_dtype=torch.int64)
    wl = ikbo_fa.work_list(idx, 5, 3, kv_offsets=offsets, max_kv_len=4000)
    (out, lse), (base, base_lse) = _both(q, kv, idx, wl, kv_offsets=offsets, max_kv_len=4000)
    assert torch.equal(out, base) and torch.equal(lse, base_lse)


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_arrays_are_the_torch_definition(idx_dtype):
    g = torch.Generator().manual_seed(32)
    U, B, S_q = 300, 5000, 3
    idx = torch.randint(-1, U + 1, (B,), generator=g).to(idx_dtype).cuda()
    wl = ikbo_fa.work_list(idx, U, S_q, validate=False)
    order, cand_start, tile_start, grouped = kv_worklist(idx, U, S_q)
    assert torch.equal(wl.cand_start, cand_start) and torch.equal(wl.tile_start, tile_start)
    assert torch.equal(wl.grouped, grouped)
    key = torch.remainder(idx.clamp(-1, U), U + 1).long()
    assert torch.equal(key[wl.order.long()], key[order.long()])  # grouped alike; order within a user open
    lengths = torch.randint(0, 10_000, (U,), generator=g).cuda()
    wl = ikbo_fa.work_list(idx, U, S_q, kv_lengths=lengths, validate=False)
    _, tile_start = kv_tile_order(cand_start, lengths, S_q)
    perm = wl.perm[:U + 1].long()
    assert sorted(perm.tolist()) == list(range(U + 1)) and wl.walk.tolist() == [0, 0]
    blocks = torch.cat([(lengths + 127) // 128, torch.zeros(1, dtype=torch.long, device="cuda")])
    assert (key_bucket(blocks)[perm].diff() <= 0).all()  # longest first; the order within a bucket open
    counts = (cand_start[1:] - cand_start[:-1]).long()
    tiles = (counts * S_q + 127) // 128
    assert wl.tile_start[1:].tolist() == tiles[perm].cumsum(0).tolist()
    assert wl.tile_start[-1] == tile_start[-1]


def test_graph_of_one_work_list_and_two_calls():
    q, k, v, idx = user_groups(33, 32, 64, 2, 1024, order="shuffled")
    k2, v2 = k.flip(1).contiguous(), v.flip(1).contiguous()
    outs = [torch.empty_like(q) for _ in range(2)]

    def step():
        wl = ikbo_fa.work_list(idx, 32, 2)
        ikbo_fa.attention(q, (k, v), idx, out=outs[0], work_list=wl)
        ikbo_fa.attention(q, (k2, v2), idx, out=outs[1], work_list=wl)

    step()  # compiled and planned outside the capture
    graph = capture_graph(step)
    g = torch.Generator().manual_seed(34)
    for _ in range(2):
        idx.copy_(torch.randint(0, 32, idx.shape, generator=g).cuda())
        for o in outs:
            o.fill_(NAN)
        graph.replay()
        for o, (kk, vv) in zip(outs, ((k, v), (k2, v2))):
            ref = ikbo_fa.attention_reference(q.float(), (kk.float(), vv.float()), idx)
            torch.testing.assert_close(o.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("order", ["sorted", "shuffled"])
@pytest.mark.parametrize("S_q", [1, 16])
def test_d64_work_list_runs_the_calls_own_tiles(order, S_q):
    # head_dim=64: the tiles of the call's own plan (192 rows at S_q 16, 128 at S_q 1), the same bits
    q, k, v, idx = user_groups(40 + S_q, 16, 40, S_q, 900, D=64, order=order)
    wl = ikbo_fa.work_list(idx, 16, S_q, head_dim=64, heads=q.shape[2])
    assert wl.tile_rows == _call_tile_rows(idx, S_q)
    (out, lse), (base, base_lse) = _both(q, (k, v), idx, wl)
    assert torch.equal(out, base) and torch.equal(lse, base_lse)
    ref = ikbo_fa.attention_reference(q.float(), (k.float(), v.float()), idx)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("S_q", [1, 16])
def test_registered_ops_with_the_calls_tile_rows(S_q):
    # What the rewrite pass builds for D 64 calls on one idx: torch.ops.ikbo_fa.work_list given
    # the calls' D and H, and attention calls passing tile rows 0 (those the list chose); the same
    # bits as the call that groups idx itself
    q, k, v, idx = user_groups(50 + S_q, 16, 40, S_q, 900, D=64, order="shuffled")
    arrays = torch.ops.ikbo_fa.work_list(idx, 16, S_q, None, None, None, None, 64, q.shape[2])
    tiles = _call_tile_rows(idx, S_q)
    _, cand_start, tile_start, _ = kv_worklist(idx, 16, S_q, tiles)
    assert torch.equal(arrays[1], cand_start) and torch.equal(arrays[2], tile_start)
    out, _ = torch.ops.ikbo_fa.attention(q, [k, v], idx, None, None, "kv", False, None, None, None, S_q,
                                         *arrays[:4], None, 0)
    base = ikbo_fa.attention(q, (k, v), idx)
    assert torch.equal(out, base)
    ref = ikbo_fa.attention_reference(q.float(), (k.float(), v.float()), idx)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


def _call_tile_rows(idx, S_q):
    """The tile rows a D 64, H 2 call over 16 users chooses on this GPU (192 at S_q 16 on 132 SMs)."""
    sms = sm_count(idx.device)
    rows = attention_module.problem_tile_rows(idx.shape[0], 16, S_q, 2, sms)
    assert sms != 132 or rows == (192 if S_q == 16 else 128)
    return rows
