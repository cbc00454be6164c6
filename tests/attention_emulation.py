"""The GPU path of ``ikbo_fa.attention`` on CPU tensors: its host side runs as on an H200, the
compiled kernels (work list and forward) replaced by stand-ins that check what they receive."""
from __future__ import annotations

import functools
import importlib

import pytest
import torch

from ikbo_fa.checks import LOG2E
from ikbo_fa.config import WHOLE_ROW
from ikbo_fa.fwd_args import FwdScalars, FwdTensors, FwdWorkList, GlobalTensors, WorkListScalars
from ikbo_fa.reference import jagged_rows, naive_attention
from ikbo_fa.tile_scheduler import Schedule, tile_scheduler
from ikbo_fa.worklist import key_bucket, kv_tile_order, kv_worklist

attention_mod = importlib.import_module("ikbo_fa.attention")  # the module, not the function


class EmulatedKernels:
    """Stand-ins for the compiled kernels: the work list from the torch reference, the forward
    pass from naive attention over exactly the arrays the kernel reads. Calls are recorded
    (``fwd_calls``, ``worklist_calls``; ``builds``: full checks of a signature); each callable
    in ``hooks`` is called at every launch with the kernel's name."""

    def __init__(self):
        self.fwd_calls = []
        self.worklist_calls = 0
        self.merge_calls = 0
        self.builds = []
        self.hooks = []
        # The fwd stand-in checks that perm puts the call's longest histories first (off for a
        # work list built from other lengths: the same results in another order).
        self.check_longest_first = True

    def worklist(self, idx, work_list, rows, scalars, tile_rows=128):
        """The work-list kernel on its bundles (ikbo_fa.fwd_args), compiled for tiles of ``tile_rows``
        query rows."""
        assert (type(work_list), type(scalars)) == (FwdWorkList, WorkListScalars)
        order, cand_start, tile_start, grouped, perm, walk = work_list
        n_users, rows_per_cand, total_keys, max_keys = scalars
        for hook in self.hooks:
            hook("worklist")
        self.worklist_calls += 1
        for t, n in ((order, idx.shape[0]), (cand_start, n_users + 2), (tile_start, n_users + 2), (grouped, 1)):
            assert t.dtype == torch.int32 and t.is_contiguous() and t.shape == (n,)
        assert idx.is_contiguous()
        assert (perm is None) == (rows is None) == (walk is None)
        self.worklist_tile_rows = tile_rows
        ref = kv_worklist(idx, n_users, rows_per_cand, tile_rows)
        for t, r in zip((order, cand_start, tile_start, grouped), ref):
            t.copy_(r)
        if perm is not None:  # ordered: the keys the kernel counts (offsets clamped, lengths as given)
            assert perm.dtype == rows.dtype == torch.int32 and perm.shape == (n_users + 1,)
            assert walk.dtype == torch.int32 and walk.shape == (2,)
            assert rows.is_contiguous() and rows.shape[0] in (n_users, n_users + 1)
            keys = rows if rows.shape[0] == n_users else jagged_rows(rows, total_keys, max_keys)[1]
            new_perm, new_start = kv_tile_order(cand_start, keys, rows_per_cand, tile_rows)
            perm.copy_(new_perm[:n_users + 1])
            walk.zero_()
            tile_start.copy_(new_start)
            self.last_keys = keys

    def merge(self, ws_o, ws_lse, out, lse, n_splits):
        self.merge_calls += 1
        assert ws_lse.dtype == torch.float32 and out.shape[2] * n_splits == ws_o.shape[2]
        attention_mod.merge_splits(ws_o, ws_lse, n_splits, out, lse)

    def fwd_for(self, cfg):
        """The stand-in of the compiled kernel of configuration ``cfg``."""
        return functools.partial(self.fwd, cfg)

    def fwd(self, cfg, tensors, work_list, scalars, n_ctas):
        """The forward kernel of ``cfg`` on its bundles (ikbo_fa.fwd_args)."""
        assert (type(tensors), type(work_list), type(scalars)) == (FwdTensors, FwdWorkList, FwdScalars)
        q, k, v, out, lse, kvl, offsets, final_out, final_lse = tensors
        # whole_rows_out: the op's out and lse beside the workspace, exactly where the config says
        # (the compiled kernel takes both as tensors, lse too when the caller asks for none)
        assert (final_out is not None) == cfg.whole_rows_out == (final_lse is not None)
        cand, cand_start, tile_start, grouped, perm, walk = work_list
        q_flat, max_keys, n_splits, split_keys, prefetch_blocks, scale_log2, scale = scalars
        for hook in self.hooks:
            hook("fwd")
        self.fwd_calls.append(dict(cand=cand, kvl=kvl, scale=scale, n_ctas=n_ctas, q=q, k=k, out=out,
                                   grouped=grouped, q_flat=q_flat, offsets=offsets, max_keys=max_keys,
                                   n_splits=n_splits, split_keys=split_keys, perm=perm,
                                   prefetch_blocks=prefetch_blocks, whole_rows_out=cfg.whole_rows_out))
        # L2 prefetch (a count of each row's first blocks) in KV broadcast only
        own_lengths = cand_start is not None and (kvl is not None or offsets is not None)
        assert own_lengths == (cfg.direction == "kv" and cfg.own_lengths)
        assert 0 <= prefetch_blocks <= 32
        assert prefetch_blocks == 0 or cand_start is not None
        # The tiles run longest first exactly where the config orders them (histories of their own
        # lengths that may be long, KV broadcast); otherwise in user order, as over padded K/V.
        assert (perm is not None) == cfg.ordered and (not cfg.ordered or own_lengths)
        # The tile counter: perm's last two words, zero at launch, where the walk is dynamic.
        assert (walk is not None) == cfg.dynamic_walk
        if walk is not None:
            assert walk.shape == (2,) and walk.tolist() == [0, 0] and walk.data_ptr() == perm[-2:].data_ptr()
        if perm is not None:
            assert perm.shape[0] == (k.shape[0] if offsets is None else offsets.shape[0] - 1) + 3
            perm = perm[:-2]
            U = perm.shape[0] - 1
            assert sorted(perm.tolist()) == list(range(U + 1))
            keys = kvl if kvl is not None else jagged_rows(offsets, k.shape[1], max_keys)[1]
            blocks = torch.cat([(keys.long() + 127) // 128, torch.zeros(1, dtype=torch.long)])
            if self.check_longest_first:
                assert (key_bucket(blocks)[perm.long()].diff() <= 0).all()  # longest first
            counts = (cand_start[1:] - cand_start[:-1]).long()
            tiles = (counts * q.shape[1] + cfg.tile_m - 1) // cfg.tile_m
            starts = torch.cat([torch.zeros(1, dtype=torch.long), tiles[perm.long()].cumsum(0)])
            assert tile_start.tolist() == starts.tolist()
        H = q.shape[2]
        # split_pair: two splits merged in the kernel, written as one (out has the H heads)
        pair = cfg.split_pair
        assert pair == (n_splits == 2 and out.shape[2] == H)
        if pair:
            assert split_keys % 128 == 0 and split_keys > 0 and n_ctas % 2 == 0 and cand_start is not None
        heads = n_splits * H if cfg.split_kv else H
        assert out.shape[2] == heads and (lse is None or lse.shape[1] == heads)
        if cfg.split_kv:  # split i holds keys i * split_keys : (i + 1) * split_keys of a row
            assert cand_start is not None and lse is not None and split_keys % 128 == 0 and split_keys > 0
        assert scale_log2 == pytest.approx(scale * LOG2E)
        assert q_flat in (0, 1)
        if q_flat and q.shape[1] > 1:  # the one-box path reads q and out as B * S_q rows
            assert q.stride(0) == q.shape[1] * q.stride(1) and out.stride(0) == out.shape[1] * out.stride(1)
        if grouped is not None:
            assert grouped.shape == (1,) and (int(grouped) == 0 or cand.tolist() == list(range(len(cand))))
        assert scale > 0  # the kernel's running max assumes it
        assert cand.dtype == torch.int32 and cand.is_contiguous() and 1 <= n_ctas <= 132
        # What the TMA descriptors need (the launcher checks no stride of a size-1 dim).
        for t in (q, k, v, out):
            assert t.stride(-1) == 1 and all(s % 8 == 0 for s in t.stride()[:-1]), t.stride()
            assert t.data_ptr() % 16 == 0
        if offsets is not None:  # jagged: one packed batch row, int32 offsets the kernel clamps
            assert k.shape[0] == 1 and offsets.dtype == torch.int32 and offsets.is_contiguous()
        if kvl is not None:
            assert kvl.dtype == torch.int32 and kvl.is_contiguous()
            assert ((kvl >= 0) & (kvl <= k.shape[1])).all()
        B = out.shape[0]
        if cand_start is not None:  # KV broadcast: groups of the work list
            U = k.shape[0] if offsets is None else offsets.shape[0] - 1
            assert cand_start.shape == (U + 2,) and tile_start.shape == (U + 2,)
            assert sorted(cand.tolist()) == list(range(B)) and int(cand_start[-1]) == B
        self.run_tiles(cfg, q, k, v, out, lse, GlobalTensors(None, cand, cand_start, tile_start, kvl, grouped,
                                                             offsets, perm, walk, k, v, None), scalars, n_ctas,
                                   scale, final_out, final_lse)

    def run_tiles(self, cfg, q, k, v, out, lse, g, scalars, n_ctas, scale, final_out=None, final_lse=None):
        """Every tile of the launch as the kernel's tile scheduler hands it out (its host twin),
        each by naive attention over exactly that tile's rows, head and keys; every (row, head) of
        out must be written exactly once."""
        B, S_q, H, D = out.shape[0], q.shape[1], q.shape[2], q.shape[3]
        sc = tile_scheduler(cfg)
        n_kv_batch = k.shape[0] if g.kv_offsets is None else g.kv_offsets.shape[0] - 1
        tiles_per_head = int(g.tile_start[n_kv_batch + 1]) if sc.dense else B * sc.chunks
        n_splits = scalars.n_splits if cfg.split_kv else 1
        parts = 2 if cfg.split_pair else 1
        heads = out.shape[2]
        ws_o = torch.zeros(B, S_q, parts * heads, D)
        ws_lse = torch.zeros(B, parts * heads, S_q)
        written = torch.zeros(B, S_q, parts * heads, dtype=torch.int32)
        whole_rows = []  # whole_rows_out: (cands, rows, head, o, lse) written to the op's out directly
        # tail_split: the first tiles whole (to a group's first tile), the rest once per split
        whole = (sc.whole_tiles_host(tiles_per_head, H, g.tile_start[:n_kv_batch + 2].tolist(), n_ctas)
                 if cfg.tail_split else 0)
        total = whole + (tiles_per_head * H - whole) * n_splits
        for rank in range(parts):
            sched = Schedule(total, tiles_per_head, q.shape[0], n_kv_batch, H, k.shape[2], k.shape[1],
                             scalars.max_keys, False, scalars.n_splits, scalars.split_keys, rank, whole)
            for t in range(sched.total_tiles):
                info = sc.tile_info_host(t, g, sched, n_ctas)
                if sc.dense:
                    run = torch.arange(info.row0, info.row0 + info.n_valid)
                    cands = g.cand[info.first + run // S_q].long()
                    rows = run % S_q
                    q_b = cands
                else:
                    rows = torch.arange(info.chunk * 128, min(S_q, info.chunk * 128 + 128))
                    cands = torch.full_like(rows, info.first)
                    q_b = torch.full_like(rows, info.q_coord)
                kv_row = 0 if cfg.jagged else info.kv_coord
                lo = info.kv_base
                n = max(info.n_keys, 1)  # a key read (never used) where there is none
                kw = k[kv_row, lo:lo + n, info.head // sched.group()].float()
                vw = v[kv_row, lo:lo + n, info.head // sched.group()].float()
                if kw.shape[0] < n:  # past the row's storage: the kernel masks it
                    kw, vw = k[kv_row, :1, 0].float(), v[kv_row, :1, 0].float()
                o, l = naive_attention(q[q_b, rows, info.head].float()[None, :, None], kw[None, :, None],
                                       vw[None, :, None], scale, torch.tensor([info.n_keys]))
                o, l = o[0, :, 0], l[0, 0]
                if info.invalid:
                    o, l = o.fill_(float("nan")), l.fill_(float("nan"))
                head = rank * heads + info.out_head
                if info.whole:  # split 0 of a row of one split: out directly, the mark in the workspace
                    assert cfg.whole_rows_out and info.out_head == info.head
                    whole_rows.append((cands, rows, info.head, o, l))
                    l = torch.full_like(l, 0.0).view(torch.int32).fill_(WHOLE_ROW).view(torch.float32)
                ws_o[cands, rows, head] = o
                ws_lse[cands, head, rows] = l
                written[cands, rows, head] += 1
        # tail_split: a whole tile's rows leave their other splits' slots unwritten (the merge
        # reads only their split-0 mark)
        unread = torch.zeros_like(written, dtype=torch.bool)
        if cfg.tail_split:
            marked = (ws_lse[:, :H].view(torch.int32) == WHOLE_ROW).transpose(1, 2)  # [B, S_q, H]
            unread[:, :, H:] = marked.repeat(1, 1, heads // H - 1)
        assert ((written == 1) | (unread & (written == 0))).all(), "a row of out written other than once"
        if parts == 2:
            merged = torch.empty(B, S_q, H, D)
            merged_lse = torch.empty(B, H, S_q)
            attention_mod.merge_splits(ws_o, ws_lse, 2, merged, merged_lse)
            ws_o, ws_lse = merged, merged_lse
        out.data.copy_(ws_o.to(out.dtype))  # through the pointer, as the kernel: autograd sees no write
        if lse is not None:
            lse.data.copy_(ws_lse)
        for cands, rows, head, o, l in whole_rows:
            final_out.data[cands, rows, head] = o.to(final_out.dtype)
            if final_lse is not None:
                final_lse.data[cands, head, rows] = l


def install(monkeypatch) -> EmulatedKernels:
    """Route ``ikbo_fa.attention`` on CPU tensors through its GPU path, with the kernels emulated."""
    kernels = EmulatedKernels()
    attention_mod._plans.clear()  # plans hold the kernels: none from another test's stand-ins
    monkeypatch.setattr(attention_mod, "on_gpu", lambda q: isinstance(q, torch.Tensor))
    monkeypatch.setattr(attention_mod, "sm_count", lambda device: 132)
    monkeypatch.setattr(attention_mod, "max_active_clusters", lambda device, size: 132 // size)
    monkeypatch.setattr(attention_mod, "_fwd_kernel", kernels.fwd_for)
    monkeypatch.setattr(attention_mod, "_worklist_kernel",
                        lambda dtype, keys, tile_rows=128: functools.partial(kernels.worklist, tile_rows=tile_rows))
    monkeypatch.setattr(attention_mod, "_merge_kernel", lambda dtype, with_lse: kernels.merge)
    real_resolve = attention_mod.resolve_problem

    def counting_resolve(*args, **kwargs):
        kernels.builds.append(1)
        return real_resolve(*args, **kwargs)

    monkeypatch.setattr(attention_mod, "resolve_problem", counting_resolve)
    return kernels
