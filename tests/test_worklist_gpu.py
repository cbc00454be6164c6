"""GPU tests of the one-launch KV work list (ikbo_fa.worklist_sm90) against the torch
reference (ikbo_fa.worklist.kv_worklist), and of attention with either work list."""
import importlib

import pytest
import torch

import ikbo_fa
from ikbo_fa import AttentionPolicy
from ikbo_fa.fwd_args import FwdWorkList, WorkListScalars
from ikbo_fa.reference import jagged_rows
from ikbo_fa.worklist import key_bucket, kv_tile_order, kv_worklist, max_tiles_per_head
from ikbo_fa.worklist_sm90 import KvWorklistSm90, fits, kv_worklist_sm90, worklist_kernel

attention_mod = importlib.import_module("ikbo_fa.attention")

pytestmark = pytest.mark.gpu
TORCH_WORKLIST = AttentionPolicy(worklist_kernel=False)  # the work list by torch ops

POISON = -7


def _random_idx(B, U, dtype, seed, bad_fraction=0.05):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, U, (B,), generator=g, dtype=torch.int64)
    n_bad = int(B * bad_fraction)
    if n_bad:
        pos = torch.randperm(B, generator=g)[:n_bad]
        far = 2**40 if dtype == torch.int64 else 2**31 - 1
        choices = torch.tensor([-1, -2, U, U + 3, far, -far])
        idx[pos] = choices[torch.randint(0, len(choices), (n_bad,), generator=g)]
    return idx.to(dtype).cuda()


def _check_against_reference(idx, U, rows):
    B = idx.shape[0]
    kernel = worklist_kernel(idx.dtype).fn
    buf = torch.full((B + 2 * (U + 2) + 1,), POISON, dtype=torch.int32, device="cuda")
    order, cand_start, tile_start, grouped = buf.split_with_sizes([B, U + 2, U + 2, 1])
    kernel(idx, FwdWorkList(order, cand_start, tile_start, grouped, None, None), None, WorkListScalars(U, rows, 0, 0))
    ref_order, ref_cand_start, ref_tile_start, ref_grouped = kv_worklist(idx, U, rows)
    torch.testing.assert_close(cand_start, ref_cand_start, rtol=0, atol=0)
    torch.testing.assert_close(tile_start, ref_tile_start, rtol=0, atol=0)
    torch.testing.assert_close(grouped, ref_grouped, rtol=0, atol=0)
    if int(grouped):  # grouped idx: the stable order, exactly
        torch.testing.assert_close(order, ref_order, rtol=0, atol=0)
    # order: a permutation of 0..B-1 whose group keys run like the reference's (any order within a group).
    assert torch.equal(torch.sort(order).values, torch.arange(B, dtype=torch.int32, device="cuda"))
    key = torch.where((idx >= 0) & (idx < U), idx, torch.full_like(idx, U))
    assert torch.equal(key[order.long()], key[ref_order.long()])
    assert int(tile_start[-1]) <= max_tiles_per_head(B, U, rows)


CASES = [
    # B, U, query rows per candidate
    (1, 1, 8),
    (1, 7, 64),
    (5, 1, 384),
    (2048, 200, 8),
    (2048, 2048, 16),
    (3000, 1, 8),  # every candidate in one group: the warp-aggregated atomics
    (10_000, 1000, 1),
    (4097, 33, 129),
    (1000, 10, 17),
    (100_000, KvWorklistSm90.CAPACITY - 1, 8),  # the largest U in shared memory
    (1_000_000, 50_000, 8),
    (1_000_003, 7, 64),
]


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_worklist_kernel_matches_reference(case, idx_dtype):
    B, U, rows = case
    idx = _random_idx(B, U, idx_dtype, seed=B + U)
    _check_against_reference(idx, U, rows)


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_worklist_kernel_all_out_of_range_and_sorted(idx_dtype):
    U = 9
    idx = torch.tensor([-1, U, -5, U + 1] * 300, dtype=idx_dtype, device="cuda")
    _check_against_reference(idx, U, 8)  # all in group U: grouped
    idx = torch.arange(0, 5000, device="cuda", dtype=idx_dtype) // 25  # sorted, U = 200
    _check_against_reference(idx, 200, 1)
    big = torch.arange(0, 300_000, device="cuda", dtype=idx_dtype) // 7  # sorted, many sweeps
    _check_against_reference(big, 300_000 // 7 + 1, 3)
    big[150_001] = 0  # one descent, deep inside: not grouped
    _check_against_reference(big, 300_000 // 7 + 1, 3)


ORDERED_CASES = [
    # B, U, query rows per candidate
    (1, 1, 1),
    (10_400, 8, 1),  # the gr-cross preset's shape
    (5000, 700, 64),
    (100_000, KvWorklistSm90.CAPACITY - 1, 8),
]


@pytest.mark.parametrize("keys_from", ["lengths", "offsets"])
@pytest.mark.parametrize("case", ORDERED_CASES, ids=lambda c: "-".join(map(str, c)))
def test_worklist_kernel_orders_groups_longest_first(case, keys_from):
    """perm: every group once, buckets non-increasing and as kv_tile_order's (the order within a
    bucket is open); tile_start by position through the kernel's own perm."""
    B, U, rows = case
    g = torch.Generator().manual_seed(B + U)
    idx = _random_idx(B, U, torch.int64, seed=B)
    lengths = torch.randint(0, 40_000, (U,), generator=g)
    lengths[torch.randint(0, U, (max(1, U // 10),), generator=g)] = 0
    total, max_keys = int(lengths.sum()), 20_000
    if keys_from == "lengths":
        src = lengths.to(torch.int32).cuda()
        keys = src
    else:  # offsets as given (unvalidated: a decrease and one past the end), clamped like the kernel
        off = torch.zeros(U + 1, dtype=torch.int64)
        off[1:] = lengths.cumsum(0)
        if U > 2:
            off[U // 2] += 5
            off[-2] = total + 100
        src = off.to(torch.int32).cuda()
        keys = jagged_rows(src, total, max_keys)[1]
    buf = torch.full((B + 3 * (U + 2) + 2,), POISON, dtype=torch.int32, device="cuda")
    order, cand_start, tile_start, grouped, perm, walk = buf.split_with_sizes([B, U + 2, U + 2, 1, U + 1, 2])
    worklist_kernel(idx.dtype, keys_from).fn(idx, FwdWorkList(order, cand_start, tile_start, grouped, perm, walk),
                                             src, WorkListScalars(U, rows, total, max_keys))
    assert walk.tolist() == [0, 0]  # the attention kernel's tile counter, zeroed
    ref = kv_worklist(idx, U, rows)
    torch.testing.assert_close(cand_start, ref[1], rtol=0, atol=0)
    ref_perm, _ = kv_tile_order(cand_start, keys, rows)
    assert torch.equal(torch.sort(perm).values, torch.arange(U + 1, dtype=torch.int32, device="cuda"))
    blocks = torch.cat([(keys.long().cuda() + 127) // 128, torch.zeros(1, dtype=torch.long, device="cuda")])
    assert torch.equal(key_bucket(blocks)[perm.long()], key_bucket(blocks)[ref_perm.long()])
    counts = (cand_start[1:] - cand_start[:-1]).long()
    tiles = (counts * rows + 127) // 128
    starts = torch.zeros(U + 2, dtype=torch.long, device="cuda")
    starts[1:] = tiles[perm.long()].cumsum(0)
    assert torch.equal(tile_start.long(), starts)


def test_worklist_kernel_wrapper_and_capacity():
    idx = _random_idx(777, 12, torch.int32, seed=3)
    order, cand_start, tile_start, grouped = kv_worklist_sm90(idx, 12, 32)
    ref = kv_worklist(idx, 12, 32)
    torch.testing.assert_close(cand_start, ref[1], rtol=0, atol=0)
    torch.testing.assert_close(tile_start, ref[2], rtol=0, atol=0)
    assert int(grouped) == 0
    assert fits(KvWorklistSm90.CAPACITY - 1) and not fits(KvWorklistSm90.CAPACITY)
    with pytest.raises(ValueError, match="users exceed"):
        kv_worklist_sm90(idx, KvWorklistSm90.CAPACITY, 32)


def test_worklist_kernel_is_graph_capturable():
    idx = _random_idx(4096, 100, torch.int64, seed=5)
    kv_worklist_sm90(idx, 100, 8)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        order, cand_start, tile_start, grouped = kv_worklist_sm90(idx, 100, 8)
    torch.cuda.current_stream().wait_stream(stream)
    for new in (_random_idx(4096, 100, torch.int64, seed=6), torch.arange(4096, device="cuda") // 41):
        idx.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        ref = kv_worklist(idx, 100, 8)
        torch.testing.assert_close(cand_start, ref[1], rtol=0, atol=0)
        torch.testing.assert_close(tile_start, ref[2], rtol=0, atol=0)
        torch.testing.assert_close(grouped, ref[3], rtol=0, atol=0)


# Attention with the kernel's work list equals attention with the torch work list, bit for bit
# (a candidate's rows do not depend on the slot it lands in).
@pytest.mark.parametrize("S_q", [1, 64, 130])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_attention_same_with_either_worklist(S_q, idx_dtype):
    B, U, H, D, L = 300, 17, 2, 64, 200
    g = torch.Generator().manual_seed(S_q)
    q = torch.randn(B, S_q, H, D, generator=g).to(torch.bfloat16).cuda()
    k = torch.randn(U, L, 1, D, generator=g).to(torch.bfloat16).cuda()
    v = torch.randn(U, L, 1, D, generator=g).to(torch.bfloat16).cuda()
    idx = _random_idx(B, U, idx_dtype, seed=S_q, bad_fraction=0.03)
    lengths = torch.randint(0, L + 1, (U,), generator=g).cuda()
    out = torch.full((B, S_q, H, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    ikbo_fa.attention(q, (k, v), idx, kv_lengths=lengths, out=out, validate=False)
    assert attention_mod.launch_plan(q, (k, v), idx, kv_lengths=lengths, out=out).worklist is not None
    ref = ikbo_fa.attention(q, (k, v), idx, kv_lengths=lengths, validate=False, policy=TORCH_WORKLIST)
    assert attention_mod.launch_plan(q, (k, v), idx, kv_lengths=lengths, policy=TORCH_WORKLIST).worklist is None
    assert torch.equal(out.isnan(), ref.isnan())
    assert torch.equal(torch.nan_to_num(out), torch.nan_to_num(ref))
    bad = (idx < 0) | (idx >= U)
    assert out[bad].isnan().all() and not out[~bad].isnan().any()


def test_torch_worklist_first_built_during_graph_capture(fresh_attention_plans):
    """An eager call right after the capture that first saw its user count (no replay yet)
    gets the right work list; the replay then gives the same output."""
    B, U, S_q, H, D, L = 300, 7, 64, 1, 64, 128
    g = torch.Generator().manual_seed(11)
    q = torch.randn(B, S_q, H, D, generator=g).to(torch.bfloat16).cuda()
    k = torch.randn(U, L, H, D, generator=g).to(torch.bfloat16).cuda()
    v = torch.randn(U, L, H, D, generator=g).to(torch.bfloat16).cuda()
    idx = _random_idx(B, U, torch.int64, seed=11, bad_fraction=0)
    # compiled outside the capture, for another U
    ikbo_fa.attention(q, (k[:5], v[:5]), idx % 5, validate=False, policy=TORCH_WORKLIST)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ikbo_fa.attention(q, (k, v), idx, validate=False, policy=TORCH_WORKLIST)
    eager = ikbo_fa.attention(q, (k, v), idx, validate=False, policy=TORCH_WORKLIST)
    ref = ikbo_fa.attention_reference(q, (k, v), idx)
    assert (eager.float() - ref.float()).norm() / ref.float().norm() < 1e-2
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
