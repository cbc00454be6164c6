"""The KV-broadcast work list without a GPU: the torch definition (ikbo_fa.worklist.kv_worklist)
against a Python count, which of the two work lists the op plans, and the sm_90a compile of the
one-launch work-list kernel (tests/test_worklist_gpu.py runs it against the torch definition)."""
import pytest
import torch

import ikbo_fa
from attention_emulation import attention_mod, install
from attention_inputs import random_problem
from ikbo_fa.worklist import kv_worklist, max_tiles_per_head


def test_worklist_groups_and_counts():
    idx = torch.tensor([2, 0, 5, 2, -3, 1, 2, 0, 2, 2])
    order, cand_start, tile_start = kv_worklist(idx, 3, 2, 1)
    assert order.dtype == cand_start.dtype == tile_start.dtype == torch.int32
    assert cand_start.tolist() == [0, 2, 3, 8, 10]
    assert order.tolist() == [1, 7, 5, 0, 3, 6, 8, 9, 2, 4]
    assert tile_start.tolist() == [0, 1, 2, 5, 6]
    assert tile_start[-1] <= max_tiles_per_head(10, 3, 2, 1)
    _, _, tile_start = kv_worklist(idx, 3, 1, 3)
    assert tile_start.tolist() == [0, 6, 9, 24, 30]


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_worklist_out_of_range_and_edges(idx_dtype):
    big = 2**40 if idx_dtype == torch.int64 else 2**31 - 1
    idx = torch.tensor([3, -1, 0, 7, big, 3, -big, 3, 1], dtype=idx_dtype)  # U = 4: 7, big, -1, -big invalid
    order, cand_start, tile_start = kv_worklist(idx, 4, 4, 1)
    assert cand_start.tolist() == [0, 1, 2, 2, 5, 9]
    assert order.tolist() == [2, 8, 0, 5, 7, 1, 3, 4, 6]
    assert tile_start.tolist() == [0, 1, 2, 2, 3, 4]
    # One user, one candidate.
    order, cand_start, tile_start = kv_worklist(torch.tensor([0], dtype=idx_dtype), 1, 8, 1)
    assert order.tolist() == [0] and cand_start.tolist() == [0, 1, 1] and tile_start.tolist() == [0, 1, 1]
    order, cand_start, tile_start = kv_worklist(torch.tensor([5], dtype=idx_dtype), 1, 1, 2)
    assert order.tolist() == [0] and cand_start.tolist() == [0, 0, 1] and tile_start.tolist() == [0, 0, 2]


@pytest.mark.parametrize("U, B, per_tile, chunks", [(37, 500, 4, 1), (1, 300, 16, 1), (10_000, 1000, 2, 1),
                                                    (5, 77, 1, 3)])
def test_worklist_random_against_python(U, B, per_tile, chunks):
    g = torch.Generator().manual_seed(U + B)
    idx = torch.randint(-5, U + 5, (B,), generator=g)
    order, cand_start, tile_start = kv_worklist(idx, U, per_tile, chunks)
    groups = [[] for _ in range(U + 1)]  # the users' candidates in order, then the out-of-range ones
    for b, i in enumerate(idx.tolist()):
        groups[i if 0 <= i < U else U].append(b)
    starts = [0]
    tiles = [0]
    for grp in groups:
        starts.append(starts[-1] + len(grp))
        tiles.append(tiles[-1] + (len(grp) * chunks if chunks > 1 else -(-len(grp) // per_tile)))
    assert cand_start.tolist() == starts and tile_start.tolist() == tiles
    assert order.tolist() == [b for grp in groups for b in grp]
    assert tile_start[-1] <= max_tiles_per_head(B, U, per_tile, chunks)


@pytest.mark.parametrize("kernel_flag, fits, uses_kernel", [(True, True, True), (False, True, False),
                                                           (True, False, False)])
def test_the_op_plans_the_kernel_work_list_where_it_can(monkeypatch, kernel_flag, fits, uses_kernel):
    """The one-launch kernel builds the work list unless ``_WORKLIST_KERNEL`` is off or the users
    exceed its shared memory; the torch work list then gives the same result."""
    emulated = install(monkeypatch)
    monkeypatch.setattr(attention_mod, "_WORKLIST_KERNEL", kernel_flag)
    monkeypatch.setattr(attention_mod, "_worklist_fits", lambda n: fits)
    q, kv, k, v, idx, lengths = random_problem(3, "kv", 13, 4, 3, 2, 1, 64, 9, torch.bfloat16, jagged=True)
    out = ikbo_fa.attention(q, kv, idx, kv_lengths=lengths)
    (plan,) = attention_mod._plans.values()
    assert (plan.worklist is not None) == uses_kernel
    assert emulated.worklist_calls == int(uses_kernel) and len(emulated.fwd_calls) == 1
    torch.testing.assert_close(out, ikbo_fa.attention_reference(q, kv, idx, kv_lengths=lengths), rtol=1e-2,
                               atol=1e-2)


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_worklist_kernel_compiles_for_sm90a(idx_dtype):
    from ikbo_fa.worklist_sm90 import compile_worklist

    ck = compile_worklist(idx_dtype, keep_ptx=True, ptxas_report=True)
    for instr in (".target sm_90a", "match.any.sync", "atom.shared.add", "bar.sync",
                  "griddepcontrol.launch_dependents"):
        assert instr in ck.ptx, instr
    assert ck.spill_bytes == 0, ck.ptxas_log
