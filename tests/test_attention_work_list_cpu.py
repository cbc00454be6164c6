"""A work list built once (``ikbo_fa.work_list``) and passed to several attention calls on the
same idx, without a GPU: its arrays against the torch definition, the op's GPU path with the
kernels emulated (the calls launch no grouping of their own and read its arrays), the reference
path, the checks of a work list that does not fit the call or no longer fits idx, and torch.compile
(tests/test_attention_work_list_gpu.py runs the kernels)."""
import pytest
import torch

import ikbo_fa
from attention_emulation import install
from attention_inputs import random_jagged_problem, random_problem
from ikbo_fa.worklist import kv_tile_order, kv_worklist

TOL = dict(rtol=1e-2, atol=1e-2)


def _problem(seed, B=13, U=4, S_q=3, L=9, lengths=False, sort=False):
    q, kv, k, v, idx, kv_lengths = random_problem(seed, "kv", B, U, S_q, 2, 1, 64, L, torch.bfloat16,
                                                  jagged=lengths, sort=sort)
    return q, kv, idx, kv_lengths


@pytest.mark.parametrize("emulate", [True, False])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_arrays_are_the_torch_definition(monkeypatch, emulate, idx_dtype):
    """On the kernel path (emulated) and the torch path: the definition's arrays, perm by the keys."""
    if emulate:
        install(monkeypatch)
    g = torch.Generator().manual_seed(1)
    U, B, S_q = 6, 40, 5
    idx = torch.randint(-1, U + 1, (B,), generator=g).to(idx_dtype)  # out-of-range ones in group U
    wl = ikbo_fa.work_list(idx, U, S_q, validate=False)
    ref = kv_worklist(idx, U, S_q)
    for have, want in zip((wl.order, wl.cand_start, wl.tile_start, wl.grouped), ref):
        assert have.dtype == torch.int32 and torch.equal(have, want)
    assert wl.perm is None and (wl.batch, wl.num_users, wl.rows_per_cand) == (B, U, S_q)
    lengths = torch.randint(0, 2000, (U,), generator=g)
    wl = ikbo_fa.work_list(idx, U, S_q, kv_lengths=lengths, validate=False)
    perm, tile_start = kv_tile_order(ref[1], lengths, S_q)
    assert torch.equal(wl.perm[:U + 1], perm) and torch.equal(wl.tile_start, tile_start)
    assert wl.walk.tolist() == [0, 0] and wl.walk.data_ptr() == wl.perm[U + 1:].data_ptr()  # the tile counter
    assert "longest_first=True" in repr(wl)


@pytest.mark.parametrize("kind", ["padded", "kv_lengths", "jagged"])
def test_calls_share_one_work_list(monkeypatch, kind):
    """Three calls on one idx (two k/v of the same users, one S_q) read the work list's arrays and
    launch no grouping; their results are the reference's."""
    emulated = install(monkeypatch)
    if kind == "jagged":
        q, kv, _, _, idx, offsets = random_jagged_problem(2, "kv", 15, 4, 2, 2, 1, 64, [0, 5, 130, 7],
                                                          torch.bfloat16)
        extra, lengths = dict(kv_offsets=offsets), None
        wl = ikbo_fa.work_list(idx, 4, 2, kv_offsets=offsets)
        kv2 = tuple(t.flip(0) for t in kv)
    else:
        q, kv, idx, lengths = _problem(3, S_q=2, lengths=kind == "kv_lengths")
        extra = {} if lengths is None else dict(kv_lengths=lengths)
        wl = ikbo_fa.work_list(idx, 4, 2, **extra)
        kv2 = tuple(t.flip(1) for t in kv)
    assert emulated.worklist_calls == 1
    for keys in (kv, kv2, kv):
        out = ikbo_fa.attention(q, keys, idx, work_list=wl, **extra)
        torch.testing.assert_close(out, ikbo_fa.attention_reference(q, keys, idx, **extra), **TOL)
        call = emulated.fwd_calls[-1]
        assert call["cand"] is wl.order and call["perm"] is wl.perm
    assert emulated.worklist_calls == 1 and len(emulated.fwd_calls) == 3
    if kind == "kv_lengths":  # other lengths of the same kind: the same results, in another tile order
        other = lengths.flip(0)
        emulated.check_longest_first = False
        torch.testing.assert_close(ikbo_fa.attention(q, kv, idx, kv_lengths=other, work_list=wl),
                                   ikbo_fa.attention_reference(q, kv, idx, kv_lengths=other), **TOL)


def test_reference_and_cpu_path_take_it():
    q, kv, idx, _ = _problem(4)
    wl = ikbo_fa.work_list(idx, 4, 3)
    ref = ikbo_fa.attention_reference(q, kv, idx)
    for op in (ikbo_fa.attention, ikbo_fa.attention_reference):
        assert torch.equal(op(q, kv, idx, work_list=wl, validate=True), ref)
        with pytest.raises(ValueError, match="built for 4 query rows per candidate"):
            op(q[:, :2], kv, idx, work_list=ikbo_fa.work_list(idx, 4, 4))


def test_a_work_list_that_does_not_fit_the_call(monkeypatch):
    install(monkeypatch)
    q, kv, idx, lengths = _problem(5, lengths=True)
    wl = ikbo_fa.work_list(idx, 4, 3)
    with pytest.raises(ValueError, match=r"built for 13 candidates \(len\(idx\)\); this call has 12"):
        ikbo_fa.attention(q[:12], kv, idx[:12], work_list=wl)
    with pytest.raises(ValueError, match=r"built for 4 users \(U\); this call has 3"):
        ikbo_fa.attention(q, tuple(t[:3] for t in kv), idx.clamp(max=2), work_list=ikbo_fa.work_list(idx, 4, 3))
    with pytest.raises(ValueError, match="built for 3 query rows per candidate"):
        ikbo_fa.attention(q[:, :1], kv, idx, work_list=wl)
    with pytest.raises(ValueError, match="this call has kv_lengths or kv_offsets"):
        ikbo_fa.attention(q, kv, idx, kv_lengths=lengths, work_list=wl)
    with pytest.raises(ValueError, match="but this call has neither"):
        ikbo_fa.attention(q, kv, idx, work_list=ikbo_fa.work_list(idx, 4, 3, kv_lengths=lengths))
    with pytest.raises(TypeError, match="work_list must be an ikbo_fa.WorkList"):
        ikbo_fa.attention(q, kv, idx, work_list=wl.tensors())
    qb, kvb, idxb, _ = random_problem(6, "q", 8, 3, 2, 2, 1, 64, 5, torch.bfloat16)[:2] + random_problem(
        6, "q", 8, 3, 2, 2, 1, 64, 5, torch.bfloat16)[4:]
    with pytest.raises(ValueError, match="this call looks q up by idx"):
        ikbo_fa.attention(qb, kvb, idxb, work_list=ikbo_fa.work_list(idxb, 3, 2))


def test_idx_written_after_the_build_raises(monkeypatch):
    """An in-place write to the idx it was built from raises at the next call; another tensor of
    other values is caught by validation (the grouping compared on the device)."""
    emulated = install(monkeypatch)
    q, kv, idx, _ = _problem(7)
    wl = ikbo_fa.work_list(idx, 4, 3)
    ikbo_fa.attention(q, kv, idx, work_list=wl)
    idx[0] = (idx[0] + 1) % 4
    with pytest.raises(ValueError, match="idx was written in place after work_list was built"):
        ikbo_fa.attention(q, kv, idx, work_list=wl)
    with pytest.raises(ValueError, match="idx was written in place"):
        ikbo_fa.attention_reference(q, kv, idx, work_list=wl)
    other = idx.clone()
    n = len(emulated.fwd_calls)
    with pytest.raises(ValueError, match="does not group idx as idx holds now"):
        ikbo_fa.attention(q, kv, other, work_list=wl, validate=True)
    assert len(emulated.fwd_calls) == n  # nothing launched
    # the same values in another tensor: valid
    same = _problem(7)[2]
    torch.testing.assert_close(ikbo_fa.attention(q, kv, same, work_list=ikbo_fa.work_list(same.clone(), 4, 3),
                                                 validate=True), ikbo_fa.attention_reference(q, kv, same), **TOL)
    with torch.inference_mode():  # no versions counted: the caller keeps idx and the list in step
        fresh = same.clone()
        wl = ikbo_fa.work_list(fresh, 4, 3)
        fresh[0] = (fresh[0] + 1) % 4
        with pytest.raises(ValueError, match="does not group idx"):
            ikbo_fa.attention(q, kv, fresh, work_list=wl, validate=True)


@pytest.mark.parametrize("damage", ["cand_start", "grouped", "order", "tile_start", "perm"])
def test_validation_finds_each_array_off(monkeypatch, damage):
    install(monkeypatch)
    q, kv, idx, lengths = _problem(8, B=20, U=5, lengths=True)
    wl = ikbo_fa.work_list(idx, 5, 3, kv_lengths=lengths)
    ikbo_fa.attention(q, kv, idx, kv_lengths=lengths, work_list=wl, validate=True)
    arrays = dict(order=wl.order, cand_start=wl.cand_start, tile_start=wl.tile_start, grouped=wl.grouped,
                  perm=wl.perm)
    t = arrays[damage].clone()
    t[0] = 1 - t[0] if damage in ("grouped", "perm") else t[0] + 1
    if damage == "order":
        t[0], t[-1] = wl.order[-1], wl.order[-1]  # a candidate twice
    arrays[damage] = t
    bad = ikbo_fa.WorkList(**arrays, rows_per_cand=3)
    with pytest.raises(ValueError, match="does not group idx as idx holds now"):
        ikbo_fa.attention(q, kv, idx, kv_lengths=lengths, work_list=bad, validate=True)


def test_a_work_list_is_one_the_kernel_can_read():
    """Its arrays are contiguous int32 vectors of matching lengths on one device, whoever builds it."""
    idx = torch.tensor([0, 2, 1, 1])
    wl = ikbo_fa.work_list(idx, 3, kv_lengths=torch.tensor([3, 1, 2]))
    parts = dict(order=wl.order, cand_start=wl.cand_start, tile_start=wl.tile_start, grouped=wl.grouped,
                 perm=wl.perm, rows_per_cand=1)
    for name, bad, error, message in (
            ("order", wl.order.long(), TypeError, "WorkList.order must be a contiguous int32 vector"),
            ("cand_start", wl.cand_start.repeat(2)[::2], TypeError, "contiguous int32"),
            ("tile_start", wl.tile_start[:3], ValueError, "WorkList.tile_start has 3 entries; .* has 5"),
            ("perm", wl.perm[:2], ValueError, "WorkList.perm has 2 entries"),
            ("grouped", torch.zeros(2, dtype=torch.int32), ValueError, "WorkList.grouped has 2 entries"),
            ("rows_per_cand", 0, ValueError, "rows_per_cand must be an int >= 1")):
        with pytest.raises(error, match=message):
            ikbo_fa.WorkList(**{**parts, name: bad})


def test_builder_checks_its_arguments():
    idx = torch.tensor([0, 2, 1, 1])
    with pytest.raises(TypeError, match="num_users must be an int"):
        ikbo_fa.work_list(idx, True)
    with pytest.raises(ValueError, match="num_users must be >= 1"):
        ikbo_fa.work_list(idx, -1)
    with pytest.raises(ValueError, match="s_q must be >= 1"):
        ikbo_fa.work_list(idx, 3, 0)
    with pytest.raises(TypeError, match="idx must be int32 or int64"):
        ikbo_fa.work_list(idx.float(), 3)
    with pytest.raises(TypeError, match="idx must be a torch.Tensor"):
        ikbo_fa.work_list([0, 1], 3)
    with pytest.raises(ValueError, match="both given"):
        ikbo_fa.work_list(idx, 3, kv_lengths=torch.ones(3, dtype=torch.int32), kv_offsets=torch.arange(4))
    with pytest.raises(ValueError, match="max_kv_len = 5 goes with kv_offsets"):
        ikbo_fa.work_list(idx, 3, max_kv_len=5)
    with pytest.raises(ValueError, match=r"kv_offsets has shape \[3\]: expected \[U \+ 1\] = \[4\]"):
        ikbo_fa.work_list(idx, 3, kv_offsets=torch.arange(3))
    with pytest.raises(IndexError, match=r"idx\[1\] = 2 is out of range"):
        ikbo_fa.work_list(idx, 2, validate=True)
    wl = ikbo_fa.work_list(idx, 2, validate=False)  # unvalidated: candidate 1 in the out-of-range group
    assert wl.cand_start.tolist() == [0, 1, 3, 4]
    empty = ikbo_fa.work_list(idx[:0], 3)
    assert empty.batch == 0 and empty.cand_start.tolist() == [0] * 5


def test_library_op_with_a_work_list():
    """torch.compile traces a call with a work list as the one registered op; opcheck of its schema."""
    q, kv, idx, lengths = _problem(9, lengths=True)
    wl = ikbo_fa.work_list(idx, 4, 3, kv_lengths=lengths)
    args = (q, list(kv), idx, None, lengths, None, True, None, None, None, 3, wl.order, wl.cand_start,
            wl.tile_start, wl.grouped, wl.perm)
    torch.library.opcheck(torch.ops.ikbo_fa.attention.default, args)
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v, idx, lengths, wl: ikbo_fa.attention(q, (k, v), idx, kv_lengths=lengths,
                                                                          work_list=wl), fullgraph=True)
    torch.testing.assert_close(fn(q, *kv, idx, lengths, wl), ikbo_fa.attention_reference(q, kv, idx,
                                                                                        kv_lengths=lengths), **TOL)
    torch._dynamo.reset()


def test_a_work_list_for_d64_calls_counts_their_tiles(monkeypatch):
    """``head_dim=64``: the work list counts the tiles D 64 calls run on their own (192 rows where
    the policy takes them), the calls run those (no grouping launch of their own) and match the
    reference, kv_lengths too, and validation finds it fits; without it, or for D 128, 128-row
    tiles. A D 128 call refuses a work list of 192-row tiles; head_dim is 64, 128 or None."""
    emulated = install(monkeypatch)
    configs = []
    attention_mod = __import__("importlib").import_module("ikbo_fa.attention")
    monkeypatch.setattr(attention_mod, "_fwd_kernel", lambda cfg: configs.append(cfg) or emulated.fwd_for(cfg))
    B, U, S_q = 700, 3, 16  # about 3,700 rows a user: 192-row tiles by default
    q, kv, idx, lengths = _problem(21, B=B, U=U, S_q=S_q, L=300, lengths=True)
    for extra in ({}, dict(kv_lengths=lengths)):
        wl = ikbo_fa.work_list(idx, U, S_q, head_dim=64, heads=2, **extra)
        assert wl.tile_rows == 192 and "tile_rows=192" in repr(wl)
        if not extra:
            assert torch.equal(wl.tile_start, kv_worklist(idx, U, S_q, 192)[2])
        launches = emulated.worklist_calls
        out = ikbo_fa.attention(q, kv, idx, work_list=wl, validate=True, **extra)
        assert configs[-1].tile_m == 192 and emulated.worklist_calls == launches
        torch.testing.assert_close(out, ikbo_fa.attention_reference(q, kv, idx, **extra), **TOL)
    for head_dim in (None, 128):
        wl128 = ikbo_fa.work_list(idx, U, S_q, head_dim=head_dim, heads=None if head_dim is None else 2)
        assert wl128.tile_rows == 128
        ikbo_fa.attention(q, kv, idx, work_list=wl128)
        assert configs[-1].tile_m == 128
    assert ikbo_fa.work_list(idx, U, S_q, head_dim=64, heads=2,
                             policy=ikbo_fa.AttentionPolicy(d64_tile_m=128)).tile_rows == 128
    assert ikbo_fa.work_list(idx, U, S_q, head_dim=64, heads=1).tile_rows == 128  # one head: both fit one round
    with pytest.raises(ValueError, match="head_dim goes with heads"):
        ikbo_fa.work_list(idx, U, S_q, head_dim=64)
    q128, kv128, _, _, _, _ = random_problem(22, "kv", B, U, S_q, 2, 1, 128, 40, torch.bfloat16)
    with pytest.raises(ValueError, match="only D 64 calls run; this call has D 128: build one with head_dim=128"):
        ikbo_fa.attention(q128, kv128, idx, work_list=ikbo_fa.work_list(idx, U, S_q, head_dim=64, heads=2))
    for bad in (96, True, "64"):
        with pytest.raises(ValueError, match="head_dim must be None or one of"):
            ikbo_fa.work_list(idx, U, S_q, head_dim=bad, heads=2)
    with pytest.raises(ValueError, match=r"WorkList.tile_rows must be one of \(128, 192\)"):
        ikbo_fa.WorkList(wl.order, wl.cand_start, wl.tile_start, wl.grouped, wl.perm, S_q, tile_rows=256)


def test_library_op_with_a_work_list_of_192_row_tiles():
    """The registered op takes the work list's tile rows (traced from a WorkList under torch.compile)."""
    q, kv, idx, _ = _problem(23, B=700, U=3, S_q=16, L=30)
    wl = ikbo_fa.WorkList(*kv_worklist(idx, 3, 16, 192), None, 16, tile_rows=192)
    args = (q, list(kv), idx, None, None, None, False, None, None, None, 16, wl.order, wl.cand_start,
            wl.tile_start, wl.grouped, None, 192)
    torch.library.opcheck(torch.ops.ikbo_fa.attention.default, args)
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v, idx, wl: ikbo_fa.attention(q, (k, v), idx, work_list=wl), fullgraph=True)
    torch.testing.assert_close(fn(q, *kv, idx, wl), ikbo_fa.attention_reference(q, kv, idx), **TOL)
    torch._dynamo.reset()
