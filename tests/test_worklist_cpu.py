"""The KV-broadcast work list without a GPU: the torch definition (ikbo_fa.worklist.kv_worklist)
against a Python count, which of the two work lists the op plans, and the sm_90a compile of the
one-launch work-list kernel (tests/test_worklist_gpu.py runs it against the torch definition)."""
import pytest
import torch

import ikbo_fa
from attention_emulation import attention_mod, install
from attention_inputs import random_problem
from ikbo_fa import AttentionPolicy
from ikbo_fa.worklist import key_bucket, kv_tile_order, kv_worklist, max_tiles_per_head


def test_worklist_groups_and_counts():
    idx = torch.tensor([2, 0, 5, 2, -3, 1, 2, 0, 2, 2])
    order, cand_start, tile_start, grouped = kv_worklist(idx, 3, 64)
    assert order.dtype == cand_start.dtype == tile_start.dtype == grouped.dtype == torch.int32
    assert cand_start.tolist() == [0, 2, 3, 8, 10]
    assert order.tolist() == [1, 7, 5, 0, 3, 6, 8, 9, 2, 4]
    # 64 rows per candidate: two candidates per 128-row tile
    assert tile_start.tolist() == [0, 1, 2, 5, 6] and grouped.tolist() == [0]
    assert tile_start[-1] <= max_tiles_per_head(10, 3, 64)
    # 200 rows: a candidate spans tiles, and two candidates share the tile between them
    _, _, tile_start, _ = kv_worklist(idx, 3, 200)
    assert tile_start.tolist() == [0, 4, 6, 14, 18]


def test_worklist_grouped_idx_keeps_its_order():
    """Grouped idx (keys never decrease, out-of-range ones last): order is 0 .. B - 1 and flagged."""
    idx = torch.tensor([0, 0, 1, 1, 1, 3, 3, 7, -1])  # U = 4: 7 and -1 out of range, in group 4
    order, cand_start, tile_start, grouped = kv_worklist(idx, 4, 1)
    assert grouped.tolist() == [1] and order.tolist() == list(range(9))
    assert cand_start.tolist() == [0, 2, 5, 5, 7, 9]
    assert tile_start.tolist() == [0, 1, 2, 2, 3, 4]
    _, _, _, grouped = kv_worklist(torch.tensor([0, 1, 0]), 2, 1)
    assert grouped.tolist() == [0]
    _, _, _, grouped = kv_worklist(torch.tensor([-1, 0]), 2, 1)  # an out-of-range index before a user
    assert grouped.tolist() == [0]


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_worklist_out_of_range_and_edges(idx_dtype):
    big = 2**40 if idx_dtype == torch.int64 else 2**31 - 1
    idx = torch.tensor([3, -1, 0, 7, big, 3, -big, 3, 1], dtype=idx_dtype)  # U = 4: 7, big, -1, -big invalid
    order, cand_start, tile_start, grouped = kv_worklist(idx, 4, 32)
    assert cand_start.tolist() == [0, 1, 2, 2, 5, 9]
    assert order.tolist() == [2, 8, 0, 5, 7, 1, 3, 4, 6]
    assert tile_start.tolist() == [0, 1, 2, 2, 3, 4] and grouped.tolist() == [0]
    # One user, one candidate.
    order, cand_start, tile_start, grouped = kv_worklist(torch.tensor([0], dtype=idx_dtype), 1, 1)
    assert order.tolist() == [0] and cand_start.tolist() == [0, 1, 1] and tile_start.tolist() == [0, 1, 1]
    assert grouped.tolist() == [1]
    order, cand_start, tile_start, _ = kv_worklist(torch.tensor([5], dtype=idx_dtype), 1, 256)
    assert order.tolist() == [0] and cand_start.tolist() == [0, 0, 1] and tile_start.tolist() == [0, 0, 2]


@pytest.mark.parametrize("U, B, rows, sort", [(37, 500, 16, False), (1, 300, 8, False), (10_000, 1000, 64, False),
                                             (5, 77, 300, False), (6, 1000, 1, True), (30, 2000, 17, True)])
def test_worklist_random_against_python(U, B, rows, sort):
    g = torch.Generator().manual_seed(U + B)
    idx = torch.randint(-5, U + 5, (B,), generator=g)
    if sort:
        idx = torch.remainder(idx.clamp(-1, U), U + 1).sort().values
    order, cand_start, tile_start, grouped = kv_worklist(idx, U, rows)
    groups = [[] for _ in range(U + 1)]  # the users' candidates in order, then the out-of-range ones
    for b, i in enumerate(idx.tolist()):
        groups[i if 0 <= i < U else U].append(b)
    starts = [0]
    tiles = [0]
    for grp in groups:
        starts.append(starts[-1] + len(grp))
        tiles.append(tiles[-1] + -(-len(grp) * rows // 128))
    assert cand_start.tolist() == starts and tile_start.tolist() == tiles
    assert order.tolist() == [b for grp in groups for b in grp]
    assert grouped.tolist() == [int(sort)]
    assert tile_start[-1] <= max_tiles_per_head(B, U, rows)


@pytest.mark.parametrize("kernel_flag, fits, uses_kernel", [(True, True, True), (False, True, False),
                                                           (True, False, False)])
def test_the_op_plans_the_kernel_work_list_where_it_can(monkeypatch, kernel_flag, fits, uses_kernel):
    """The one-launch kernel builds the work list unless ``policy.worklist_kernel`` is off or the
    users exceed its shared memory; the torch work list then gives the same result."""
    emulated = install(monkeypatch)
    monkeypatch.setattr(attention_mod, "_worklist_fits", lambda n: fits)
    policy = AttentionPolicy(worklist_kernel=kernel_flag)
    q, kv, k, v, idx, lengths = random_problem(3, "kv", 13, 4, 3, 2, 1, 64, 9, torch.bfloat16, jagged=True)
    out = ikbo_fa.attention(q, kv, idx, kv_lengths=lengths, policy=policy)
    plan = attention_mod.launch_plan(q, kv, idx, kv_lengths=lengths, policy=policy)
    assert (plan.worklist is not None) == uses_kernel
    assert emulated.worklist_calls == int(uses_kernel) and len(emulated.fwd_calls) == 1
    torch.testing.assert_close(out, ikbo_fa.attention_reference(q, kv, idx, kv_lengths=lengths), rtol=1e-2,
                               atol=1e-2)


@pytest.mark.parametrize("keys", [None, "lengths", "offsets"])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_worklist_kernel_compiles_for_sm90a(idx_dtype, keys):
    from ikbo_fa.worklist_sm90 import compile_worklist

    ck = compile_worklist(idx_dtype, keys, keep_ptx=True, ptxas_report=True)
    for instr in (".target sm_90a", "match.any.sync", "atom.shared.add", "bar.sync",
                  "griddepcontrol.launch_dependents", "griddepcontrol.wait"):
        assert instr in ck.ptx, instr
    # Launched with programmatic dependent launch: no global access before the wait for the
    # kernel before it (which may still write idx or read the arrays this one writes).
    wait = ck.ptx.index("griddepcontrol.wait")
    assert all(ck.ptx.find(op) in (-1,) or ck.ptx.find(op) > wait for op in ("ld.global", "st.global")), \
        "global memory touched before griddepcontrol.wait"
    assert ("clz.b32" in ck.ptx) == (keys is not None)  # the key buckets only where the groups are ordered
    assert ck.spill_bytes == 0, ck.ptxas_log


def test_key_bucket_is_monotone_and_exact_below_16():
    blocks = torch.arange(0, 1 << 21)
    b = key_bucket(blocks)
    assert (b.diff() >= 0).all() and b[:16].tolist() == list(range(16))
    assert key_bucket(torch.tensor([16, 19, 20, 31, 32, 2**24, 2**25 - 1])).tolist() == [16, 16, 17, 19, 20, 96, 99]
    powers = torch.tensor([2**k for k in range(4, 25)])  # exact at every power of two (no float log2)
    assert key_bucket(powers).tolist() == [16 + 4 * (k - 4) for k in range(4, 25)]
    assert key_bucket(powers - 1).tolist() == [15] + [16 + 4 * (k - 4) - 1 for k in range(5, 25)]


def test_kv_tile_order_puts_the_longest_histories_first():
    idx = torch.tensor([0, 0, 1, 2, 2, 2, 3, -1, 5] * 50)  # U 5: user 4 has no candidate
    keys = torch.tensor([300, 5000, 0, 5000, 129])
    _, cand_start, _, _ = kv_worklist(idx, 5, 64)
    perm, tile_start = kv_tile_order(cand_start, keys, 64)
    # blocks 3, 40, 0, 40, 2 (and the out-of-range group: 0): 40 first (stable), then 3, 2, 0.
    assert perm.tolist() == [1, 3, 0, 4, 2, 5] and perm.dtype == tile_start.dtype == torch.int32
    counts = (cand_start[1:] - cand_start[:-1]).long()
    tiles = (counts * 64 + 127) // 128
    assert tile_start.tolist() == [0] + tiles[perm.long()].cumsum(0).tolist()
    assert int(tile_start[-1]) == int(tiles.sum())
