"""The GPU path of ``ikbo_fa.attention`` on CPU tensors: its host side runs as on an H200, the
compiled kernels (work list and forward) replaced by stand-ins that check what they receive."""
from __future__ import annotations

import importlib

import pytest
import torch

from ikbo_fa.checks import LOG2E
from ikbo_fa.fwd_args import FwdScalars, FwdTensors, FwdWorkList
from ikbo_fa.reference import jagged_rows, naive_attention
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

    def worklist(self, idx, order, cand_start, tile_start, grouped, perm, rows, n_users, rows_per_cand,
                 total_keys, max_keys):
        for hook in self.hooks:
            hook("worklist")
        self.worklist_calls += 1
        for t, n in ((order, idx.shape[0]), (cand_start, n_users + 2), (tile_start, n_users + 2), (grouped, 1)):
            assert t.dtype == torch.int32 and t.is_contiguous() and t.shape == (n,)
        assert idx.is_contiguous()
        assert (perm is None) == (rows is None)
        ref = kv_worklist(idx, n_users, rows_per_cand)
        for t, r in zip((order, cand_start, tile_start, grouped), ref):
            t.copy_(r)
        if perm is not None:  # ordered: the keys the kernel counts (offsets clamped, lengths as given)
            assert perm.dtype == rows.dtype == torch.int32 and perm.shape == (n_users + 1,)
            assert rows.is_contiguous() and rows.shape[0] in (n_users, n_users + 1)
            keys = rows if rows.shape[0] == n_users else jagged_rows(rows, total_keys, max_keys)[1]
            new_perm, new_start = kv_tile_order(cand_start, keys, rows_per_cand)
            perm.copy_(new_perm)
            tile_start.copy_(new_start)
            self.last_keys = keys

    def merge(self, ws_o, ws_lse, out, lse, n_splits):
        self.merge_calls += 1
        assert ws_lse.dtype == torch.float32 and out.shape[2] * n_splits == ws_o.shape[2]
        attention_mod.merge_splits(ws_o, ws_lse, n_splits, out, lse)

    def fwd(self, tensors, work_list, scalars, n_ctas):
        """The forward kernel on its bundles (ikbo_fa.fwd_args)."""
        assert (type(tensors), type(work_list), type(scalars)) == (FwdTensors, FwdWorkList, FwdScalars)
        q, k, v, out, lse, kvl, offsets = tensors
        cand, cand_start, tile_start, grouped, perm = work_list
        q_flat, max_keys, n_splits, split_keys, prefetch_blocks, scale_log2, scale = scalars
        for hook in self.hooks:
            hook("fwd")
        self.fwd_calls.append(dict(cand=cand, kvl=kvl, scale=scale, n_ctas=n_ctas, q=q, k=k, out=out,
                                   grouped=grouped, q_flat=q_flat, offsets=offsets, max_keys=max_keys,
                                   n_splits=n_splits, split_keys=split_keys, perm=perm,
                                   prefetch_blocks=prefetch_blocks))
        # L2 prefetch only where the first blocks follow from the shapes: KV broadcast, padded K/V
        assert 0 <= prefetch_blocks <= 32
        assert prefetch_blocks == 0 or (cand_start is not None and perm is None)
        # The tiles run longest first exactly where histories have their own lengths (KV broadcast).
        assert (perm is not None) == (cand_start is not None and (kvl is not None or offsets is not None))
        if perm is not None:
            U = perm.shape[0] - 1
            assert sorted(perm.tolist()) == list(range(U + 1))
            keys = kvl if kvl is not None else jagged_rows(offsets, k.shape[1], max_keys)[1]
            blocks = torch.cat([(keys.long() + 127) // 128, torch.zeros(1, dtype=torch.long)])
            if self.check_longest_first:
                assert (key_bucket(blocks)[perm.long()].diff() <= 0).all()  # longest first
            counts = (cand_start[1:] - cand_start[:-1]).long()
            tiles = (counts * q.shape[1] + 127) // 128
            starts = torch.cat([torch.zeros(1, dtype=torch.long), tiles[perm.long()].cumsum(0)])
            assert tile_start.tolist() == starts.tolist()
        H = q.shape[2]
        # split_pair: two splits merged in the kernel, written as one (out has the H heads)
        pair = n_splits == 2 and out.shape[2] == H
        if pair:
            assert split_keys % 128 == 0 and split_keys > 0 and n_ctas % 2 == 0 and cand_start is not None
            n_splits, split_keys = 1, 0
        assert out.shape[2] == n_splits * H and (lse is None or lse.shape[1] == n_splits * H)
        if n_splits > 1:  # split_kv: split i holds keys i * split_keys : (i + 1) * split_keys of a row
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
        L = k.shape[1]
        rows = None
        if offsets is not None:  # jagged: one packed batch row, int32 offsets the kernel clamps
            assert k.shape[0] == 1 and offsets.dtype == torch.int32 and offsets.is_contiguous()
            rows = jagged_rows(offsets, L, max_keys)
        if kvl is not None:
            assert kvl.dtype == torch.int32 and kvl.is_contiguous()
            assert ((kvl >= 0) & (kvl <= L)).all()
        B = out.shape[0]
        if cand_start is not None:  # KV broadcast: groups of the work list
            U = k.shape[0] if rows is None else offsets.shape[0] - 1
            assert cand_start.shape == (U + 2,) and tile_start.shape == (U + 2,)
            assert sorted(cand.tolist()) == list(range(B)) and int(cand_start[-1]) == B
            runs = [(cand[cand_start[u]:cand_start[u + 1]].long(), u) for u in range(U + 1)]
        else:  # Q broadcast: one candidate per run, Q looked up
            runs = [(torch.tensor([b]), b) for b in range(B)]
        for members, r in runs:
            if len(members) == 0:
                continue
            if cand_start is not None:
                bad = r == U
                qs = q[members]
                ks, vs = (k[:1], v[:1]) if bad else (k[r:r + 1], v[r:r + 1])
            else:
                c = int(cand[r])
                bad = not 0 <= c < q.shape[0]
                qs = q[0:1] if bad else q[c:c + 1]
                ks, vs = k[r:r + 1], v[r:r + 1]
            n = len(members)
            lengths = None if kvl is None else kvl[r if not bad else 0].expand(n)
            if rows is not None:
                start, length = (int(t[0 if bad else r]) for t in rows)
                ks, vs = k[:, start:start + max(length, 1)], v[:, start:start + max(length, 1)]
                lengths = torch.full((n,), length)
            ks = ks.expand(n, *ks.shape[1:])
            vs = vs.expand(n, *vs.shape[1:])
            full = torch.full((n,), ks.shape[1]) if lengths is None else lengths
            for i in range(n_splits):
                lo, hi = (i * split_keys, (i + 1) * split_keys) if n_splits > 1 else (0, ks.shape[1])
                part = (full - lo).clamp(0, hi - lo)
                kw, vw = ks[:, lo:hi], vs[:, lo:hi]
                if kw.shape[1] == 0:  # a split past every key of this row's storage
                    kw, vw = ks[:, :1], vs[:, :1]
                o, l = naive_attention(qs.float(), kw.float(), vw.float(), scale,
                                       part if n_splits > 1 or lengths is not None else None)
                if bad:
                    o.fill_(float("nan"))
                    l.fill_(float("nan"))
                heads = slice(i * H, (i + 1) * H)
                out.data[members, :, heads] = o.to(out.dtype)  # through the pointer, as the kernel: autograd sees no write
                if lse is not None:
                    lse.data[members, heads] = l


def install(monkeypatch) -> EmulatedKernels:
    """Route ``ikbo_fa.attention`` on CPU tensors through its GPU path, with the kernels emulated."""
    kernels = EmulatedKernels()
    attention_mod._plans.clear()  # plans hold the kernels: none from another test's stand-ins
    monkeypatch.setattr(attention_mod, "on_gpu", lambda q: isinstance(q, torch.Tensor))
    monkeypatch.setattr(attention_mod, "sm_count", lambda device: 132)
    monkeypatch.setattr(attention_mod, "max_active_clusters", lambda device, size: 132 // size)
    monkeypatch.setattr(attention_mod, "_fwd_kernel", lambda cfg: kernels.fwd)
    monkeypatch.setattr(attention_mod, "_worklist_kernel", lambda dtype, keys: kernels.worklist)
    monkeypatch.setattr(attention_mod, "_merge_kernel", lambda dtype, with_lse: kernels.merge)
    real_resolve = attention_mod.resolve_problem

    def counting_resolve(*args, **kwargs):
        kernels.builds.append(1)
        return real_resolve(*args, **kwargs)

    monkeypatch.setattr(attention_mod, "resolve_problem", counting_resolve)
    return kernels
