"""The providers of the attention benchmarks (perf/compare_fa4.py, tools/attention_timeline.py),
all fed the same inputs; what each computes: docs/benchmarks.md. Index metadata (page table,
cu_seqlens, the grouping permutation, the padding gather) is built once, untimed; a provider
whose materialized tensors would not fit in 80% of the free memory is skipped.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import torch

from perf import harness
from perf.attention_layouts import (
    PAGE_SIZE, build_candidate_packing, build_page_table, build_varlen_packing, padded_gather, run_paged,
    run_varlen, to_pages,
)
from perf.attention_workload import Inputs, Problem
from perf.harness import Skip, per_problem
from perf.providers import LIBS, Provider

PEER = "peer"  # tag of the FA varlen providers: a row's best peer is the fastest of them


def materialized_bytes(p: Problem) -> int:
    """Bytes of the per-candidate copy the materializing providers make: the broadcast side, or
    (jagged) K/V padded to the longest length with its gather index (int64) and key mask (bool),
    and Q too with Q broadcast."""
    row = p.H * p.D * torch.empty((), dtype=p.dtype).element_size()  # one key (or query) row
    if p.jagged is None:
        return p.B * row * (2 * p.L if p.broadcast == "kv" else p.S_q)
    q_copy = p.B * p.S_q * row if p.broadcast == "q" else 0
    return p.B * p.max_len * (2 * row + 8 + 1) + q_copy


def _check_room(p: Problem, inp: Inputs) -> None:
    """Raise Skip unless the materialized tensors fit in 80% of the free memory."""
    need = materialized_bytes(p)
    if inp.q.is_cuda:
        free, _ = torch.cuda.mem_get_info(inp.q.device)
        if need > 0.8 * free:
            raise Skip(f"materialized tensors need {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")


@per_problem
def _padding(p: Problem) -> tuple:
    """Jagged: (gather [B, max_len], key mask [B, max_len]) on the device."""
    rows = p.idx.long() if p.broadcast == "kv" else torch.arange(p.B, device=p.idx.device)
    return padded_gather(p.kv_offsets, rows, p.max_len)


@per_problem
def _materialized(p: Problem, inp: Inputs) -> Inputs:
    """Per-candidate q, k, v: the broadcast side copied with idx; jagged, K/V padded to the
    longest length, with the key mask."""
    _check_room(p, inp)
    idx = p.idx.long()
    if p.jagged is not None:
        gather, mask = _padding(p)
        q = inp.q if p.broadcast == "kv" else inp.q[idx]
        return Inputs(q, inp.k[gather], inp.v[gather], key_mask=mask)
    if p.broadcast == "kv":
        return Inputs(inp.q, inp.k[idx], inp.v[idx])
    return Inputs(inp.q[idx], inp.k, inp.v)


def _materialize_into(p: Problem, buf: Inputs, inp: Inputs) -> Inputs:
    """The timed copy: broadcast side of ``inp`` gathered into the buffers of ``buf`` (jagged:
    the padded K/V, and Q with Q broadcast)."""
    if p.jagged is not None:
        gather = _padding(p)[0].flatten()
        torch.index_select(inp.k, 0, gather, out=buf.k.view(-1, *inp.k.shape[1:]))
        torch.index_select(inp.v, 0, gather, out=buf.v.view(-1, *inp.v.shape[1:]))
        q = inp.q if p.broadcast == "kv" else torch.index_select(inp.q, 0, p.idx, out=buf.q)
        return Inputs(q, buf.k, buf.v, key_mask=buf.key_mask)
    if p.broadcast == "kv":
        torch.index_select(inp.k, 0, p.idx, out=buf.k)
        torch.index_select(inp.v, 0, p.idx, out=buf.v)
        return Inputs(inp.q, buf.k, buf.v)
    torch.index_select(inp.q, 0, p.idx, out=buf.q)
    return Inputs(buf.q, inp.k, inp.v)


def _dense_args(p: Problem, st: Inputs, inp: Inputs) -> Inputs:
    """Kernel-only providers: the candidate side from ``inp`` (rotated), the copy from ``st``
    (jagged with Q broadcast: all from ``st``, both sides being copies)."""
    if p.jagged is not None:
        return dataclasses.replace(st, q=inp.q) if p.broadcast == "kv" else st
    return Inputs(inp.q, st.k, st.v) if p.broadcast == "kv" else Inputs(st.q, inp.k, inp.v)


def _kv_only(p: Problem, what: str) -> None:
    if p.broadcast != "kv":
        raise Skip(f"{what} applies to K/V broadcast only")


def _dense_only(p: Problem, what: str) -> None:
    if p.jagged is not None:
        raise Skip(f"{what} takes no per-candidate key lengths here (jagged K/V: see fa4 varlen packed)")


def _fa4_materialized_setup(p: Problem, inp: Inputs) -> Inputs:
    _dense_only(p, "FA4's dense kernel")
    return _materialized(p, inp)


def _fa4_dense(x: Inputs, scale: float):
    return LIBS.get("fa4").flash_attn_func(x.q, x.k, x.v, softmax_scale=scale)[0]


def sdpa(q, k, v, key_mask, scale: float):
    """SDPA on [B, S, H, D] tensors; a key mask [B, L] (jagged, padded) hides the padding."""
    mask = None if key_mask is None else key_mask[:, None, None, :]
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale)
    return o.transpose(1, 2)


def _sdpa_materialized(p: Problem, st: Inputs, inp: Inputs):
    x = _dense_args(p, st, inp)
    return sdpa(x.q, x.k, x.v, x.key_mask, p.scale)


def materialize_sdpa(broadcast: str, scale: float) -> Callable:
    """The copy and SDPA on plain tensors (q, k, v, idx) -> [B, S_q, H, D], for torch.compile.
    Jagged: also (gather, key mask) of ``padded_gather``; k, v are then packed [keys, H, D]."""
    def run(q, k, v, idx, gather=None, key_mask=None):
        if gather is not None:
            B, n = gather.shape
            k = k.index_select(0, gather.flatten()).view(B, n, *k.shape[1:])
            v = v.index_select(0, gather.flatten()).view(B, n, *v.shape[1:])
            if broadcast == "q":
                q = q.index_select(0, idx)
        elif broadcast == "kv":
            k, v = k.index_select(0, idx), v.index_select(0, idx)
        else:
            q = q.index_select(0, idx)
        return sdpa(q, k, v, key_mask, scale)
    return run


def _compiled_sdpa_setup(p: Problem, inp: Inputs):
    _check_room(p, inp)  # each call makes the copy
    padding = _padding(p) if p.jagged is not None else ()
    return harness.torch_compiled(materialize_sdpa(p.broadcast, p.scale)), padding


def _paged_setup(p: Problem, inp: Inputs):
    _kv_only(p, "the page table")
    _dense_only(p, "the page table")
    pages = None if p.L % PAGE_SIZE == 0 else (to_pages(inp.k), to_pages(inp.v))  # padded copy
    return build_page_table(p.idx, p.L), pages


def _paged_run(p: Problem, st, inp: Inputs):
    table, pages = st
    kp, vp = pages if pages is not None else (to_pages(inp.k), to_pages(inp.v))
    return run_paged(LIBS.get("fa4").flash_attn_varlen_func, inp.q, kp, vp, table, p.scale)


def _fa_varlen_setup(lib: str, **kw) -> Callable:
    """The setup of FA varlen of library ``lib`` ("fa4" or "fa3", with its keywords ``kw``): the
    function and the packing, built once, untimed."""
    def setup(p: Problem, inp: Inputs):
        if lib == "fa3" and p.dtype == torch.float16:
            raise Skip("FA3's forward (fa3-fwd) takes bf16 only, no fp16")
        fn = functools.partial(LIBS.get(lib).flash_attn_varlen_func, **kw)
        if p.jagged is not None and p.broadcast == "q":
            return fn, build_candidate_packing(p.idx_cpu, p.kv_offsets_cpu, p.S_q).to(inp.q.device)
        _kv_only(p, "varlen packing")
        packing = build_varlen_packing(p.idx_cpu, p.U, p.S_q, p.L, kv_offsets=p.kv_offsets_cpu)
        return fn, packing.to(inp.q.device)
    return setup


def _fa_varlen_run(p: Problem, st, inp: Inputs):
    return run_varlen(st[0], inp.q, inp.k, inp.v, st[1], p.scale)


def _ikbo_setup(policy=None, work_list: bool = False) -> Callable:
    """The keywords of ikbo's calls, set once: jagged K/V's offsets, a work list built beforehand
    (untimed, as FA varlen's packing is) and an attention policy, where asked for."""
    def setup(p: Problem, inp: Inputs) -> dict:
        jagged = {} if p.jagged is None else {"kv_offsets": p.kv_offsets, "max_kv_len": p.max_len}
        kw = {"scale": p.scale, "broadcast": p.broadcast, **jagged}
        if work_list:
            _kv_only(p, "a work list (it groups the candidates by user)")
            # for the calls' D: at D 64 it counts the tiles the calls' own plan runs (192-row ones)
            kw["work_list"] = LIBS.get("ikbo_fa").work_list(p.idx, p.U, p.S_q, head_dim=p.D, heads=p.H, policy=policy,
                                                            **jagged)
        if policy is not None:
            kw["policy"] = policy
        return kw
    return setup


def _ikbo_run(p: Problem, kw: dict, inp: Inputs):
    return LIBS.get("ikbo_fa").attention(inp.q, (inp.k, inp.v), p.idx, **kw)


def parse_policy(spec: str):
    """``ikbo_fa.AttentionPolicy.parse(spec)``: the launch choices of an ``ikbo SPEC`` provider."""
    import ikbo_fa

    if not hasattr(ikbo_fa, "AttentionPolicy"):
        raise ValueError("ikbo_fa has no AttentionPolicy")
    return ikbo_fa.AttentionPolicy.parse(spec)


def variant(spec: str, policy) -> Provider:
    """ikbo under an attention policy, named ``ikbo SPEC``: an A/B of the op's launch choices in
    the same run as the default and the peers."""
    return Provider(f"ikbo {spec}", _ikbo_setup(policy), _ikbo_run, needs=("ikbo_fa",))


def providers() -> list:
    """In check order: peers first, ikbo last (a failure there cannot spoil the peers' checks)."""
    peer = frozenset({PEER})
    return [
        Provider("materialize", _materialized, _materialize_into, checked=False),
        Provider("fa4 varlen packed", _fa_varlen_setup("fa4"), _fa_varlen_run, needs=("fa4",), tags=peer),
        Provider("fa3 varlen packed", _fa_varlen_setup("fa3", num_splits=0), _fa_varlen_run, needs=("fa3",),
                 tags=peer),
        Provider("fa3 varlen packed, no split", _fa_varlen_setup("fa3", num_splits=1), _fa_varlen_run,
                 needs=("fa3",), tags=peer),
        Provider("fa4 page table", _paged_setup, _paged_run, needs=("fa4",)),
        Provider("fa4 materialized", _fa4_materialized_setup,
                 lambda p, st, i: _fa4_dense(_dense_args(p, st, i), p.scale), needs=("fa4",)),
        Provider("fa4 materialize+kernel", _fa4_materialized_setup,
                 lambda p, st, i: _fa4_dense(_materialize_into(p, st, i), p.scale), needs=("fa4",)),
        Provider("sdpa materialized", _materialized, _sdpa_materialized),
        Provider("torch.compile materialize+sdpa", _compiled_sdpa_setup,
                 lambda p, st, i: st[0](i.q, i.k, i.v, p.idx, *st[1])),
        Provider("ikbo", _ikbo_setup(), _ikbo_run, needs=("ikbo_fa",)),
        Provider("ikbo, work list reused", _ikbo_setup(work_list=True), _ikbo_run, needs=("ikbo_fa",)),
    ]


DISPLAY_ORDER = ["ikbo", "ikbo, work list reused", "fa4 varlen packed", "fa3 varlen packed",
                 "fa3 varlen packed, no split", "fa4 page table", "fa4 materialized", "fa4 materialize+kernel",
                 "sdpa materialized", "torch.compile materialize+sdpa", "materialize"]


def display_index(name: str) -> int:
    """A provider's place in tables: DISPLAY_ORDER, variants of ikbo right after ikbo."""
    return DISPLAY_ORDER.index("ikbo" if name.startswith("ikbo ") else name)
