"""The attention tile scheduler's host twin (``AttentionTileScheduler.tile_info_host``, the mapping
the kernel's ``tile_info`` computes) against brute force, for the tile order of every shipped
configuration: every (head, split, candidate, query row) in exactly one tile, with its user's key
range and the right head of out; the longest-first walk by round; out-of-range indices in tiles
of no key. The emulated op runs every tile through the same twin (attention_emulation.py)."""
import pytest
import torch

import ikbo_fa
from ikbo_fa.tile_scheduler import AttentionTileScheduler, CounterTileScheduler, Schedule, tile_scheduler
from ikbo_fa.worklist import key_bucket, kv_tile_order, kv_worklist

ORDERS = sorted({(c.direction, c.s_q, c.has_kv_lengths, c.jagged, c.split_kv, c.split_pair, c.dynamic_walk)
                 for c in ikbo_fa.SHIPPED_CONFIGS}, key=str)


class Rows:
    """The work-list tensors the scheduler reads (fwd_args.GlobalTensors' names)."""

    def __init__(self, **kw):
        self.cand = self.cand_start = self.tile_start = self.perm = self.kv_lengths = self.kv_offsets = None
        self.__dict__.update(kw)


def _problem(direction, s_q, lengths, jagged, seed, B=37, U=6, L=700):
    g = torch.Generator().manual_seed(seed)
    n_rows = U if direction == "kv" else B
    keys = torch.randint(0, L + 1, (n_rows,), generator=g)
    keys[:2] = torch.tensor([0, L])
    idx = torch.randint(0, U, (B,), generator=g)
    idx[[3, 11]] = torch.tensor([-1, U])  # out of range: tiles that write NaN
    if direction == "q":
        rows = Rows(cand=idx.int(), kv_lengths=keys.int() if lengths else None)
        if jagged:
            rows.kv_offsets = torch.cat([torch.zeros(1), keys.cumsum(0)]).int()
        return rows, idx, keys, B, U, B * AttentionTileScheduler(_cfg(direction, s_q, lengths, jagged)).chunks
    order, cand_start, tile_start, _ = kv_worklist(idx, U, s_q)
    rows = Rows(cand=order, cand_start=cand_start, tile_start=tile_start)
    if lengths or jagged:
        rows.perm, rows.tile_start = kv_tile_order(cand_start, keys, s_q)
        if lengths:
            rows.kv_lengths = keys.int()
        else:
            rows.kv_offsets = torch.cat([torch.zeros(1), keys.cumsum(0)]).int()
    return rows, idx, keys, U, U, int(rows.tile_start[U + 1])


def _cfg(direction, s_q, lengths, jagged, split_kv=False, split_pair=False, dynamic_walk=False):
    return ikbo_fa.AttentionConfig(torch.bfloat16, 128, s_q, direction, lengths, True, jagged=jagged,
                                   split_kv=split_kv, split_pair=split_pair, dynamic_walk=dynamic_walk)


@pytest.mark.parametrize("order", ORDERS, ids=lambda o: "-".join(map(str, o)))
@pytest.mark.parametrize("grid", [7, 132])
def test_every_row_once_with_its_keys(order, grid):
    direction, s_q, lengths, jagged, split_kv, split_pair, dynamic = order
    cfg = _cfg(direction, s_q, lengths, jagged, split_kv, split_pair, dynamic)
    sc = tile_scheduler(cfg)
    assert type(sc) is (CounterTileScheduler if dynamic else AttentionTileScheduler)
    rows, idx, keys, n_kv, U, tiles_per_head = _problem(direction, s_q, lengths, jagged, seed=s_q + grid)
    B, H, H_kv, L = idx.shape[0], 4, 2, 700
    n_splits, split_keys = (3, 256) if split_kv else (2, 384) if split_pair else (1, 0)
    ranks = 2 if split_pair else 1
    grid = grid - grid % 2 if split_pair else grid
    total_L = int(keys.sum()) if jagged else L
    seen = {}
    for rank in range(ranks):
        sched = Schedule(tiles_per_head * H * (n_splits if split_kv else 1), tiles_per_head, U, n_kv, H, H_kv,
                         total_L, L, False, n_splits, split_keys, rank)
        assert sched.group() == 2
        walk = [sc.tile_info_host(t, rows, sched, grid) for t in range(sched.total_tiles)]
        for info in walk:
            split = rank if split_pair else info.out_head // H
            if direction == "kv":
                run = range(info.row0, info.row0 + info.n_valid)
                members = [(int(rows.cand[info.first + j // s_q]), j % s_q) for j in run]
                assert info.q_coord == info.first * s_q + info.row0 and 1 <= info.n_valid <= 128
            else:
                members = [(info.first, r) for r in range(info.chunk * 128, min(s_q, info.chunk * 128 + 128))]
                assert info.q_coord == (0 if info.invalid else int(idx[info.first]))
            for b, r in members:
                key = (b, r, info.head, split)
                assert key not in seen, key
                seen[key] = info
        if dynamic:  # handed out in order: each row's tiles (all their pieces) no shorter than the next's
            rows_blocks = [key_bucket(torch.tensor([-(-int(keys[i.kv_coord]) // 128) if not i.invalid else 0])).item()
                           for i in walk]
            assert rows_blocks == sorted(rows_blocks, reverse=True)
        elif sc.ordered and not split_kv:  # longest first: each round's tiles no shorter than the next's
            G = grid // sc.cluster_size
            blocks = [key_bucket(torch.tensor([-(-i.n_keys // 128)])).item() for i in walk]
            logical = [None] * len(walk)
            for t, b in enumerate(blocks):  # undo the turn-back: position of tile t in the walk's order
                r, c = divmod(t, G)
                if r % 2:
                    c = min(G, len(walk) - r * G) - 1 - c
                logical[r * G + c] = b
            assert logical == sorted(logical, reverse=True)
    # every (candidate, row, head, split) once, with the keys of its user (Q broadcast: its own row)
    splits = n_splits if (split_kv or split_pair) else 1
    assert len(seen) == B * s_q * H * splits
    for (b, r, h, split), info in seen.items():
        u = int(idx[b])
        bad = not 0 <= u < U
        assert info.invalid == bad and info.head == h
        row = b if direction == "q" else (0 if bad else u)
        assert info.kv_coord == row
        n = 0 if bad else int(keys[row]) if (lengths or jagged) else L
        base = int(keys[:row].sum()) if jagged and not bad else 0
        if split_kv or split_pair:
            base += split * split_keys
            n = 0 if bad else min(max(n - split * split_keys, 0), split_keys)
        assert (info.n_keys, info.kv_base if info.n_keys else base) == (n, base)
        assert info.out_head == (split * H + h if split_kv else h)


@pytest.mark.parametrize("grid", [7, 13, 132])
@pytest.mark.parametrize("s_q", [1, 16, 64])
def test_tail_split_walk(grid, s_q):
    """tail_split: the tiles of the grid's full rounds, back to the first tile of a group, are whole
    (all L keys, out's head, whole), then the other tiles once per split, split slowest; every
    (candidate, row, head) gets its user's keys exactly once, whole or as the splits' partition of
    them, and a user's rows are all whole or all split."""
    cfg = ikbo_fa.AttentionConfig(torch.bfloat16, 128, s_q, "kv", False, True, split_kv=True, whole_rows_out=True,
                                  tail_split=True)
    sc = tile_scheduler(cfg)
    rows, idx, keys, n_kv, U, tiles_per_head = _problem("kv", s_q, False, False, seed=grid + s_q)
    B, H, H_kv, L, n_splits, split_keys = idx.shape[0], 4, 2, 700, 3, 256
    tiles = tiles_per_head * H
    starts = rows.tile_start.tolist()
    whole = sc.whole_tiles_host(tiles_per_head, H, starts, grid)
    full = tiles - tiles % grid
    h, rem = divmod(full, tiles_per_head)
    assert whole <= full and (rem == 0 and whole == full or whole - h * tiles_per_head in starts)
    assert full - whole < max(b - a for a, b in zip(starts, starts[1:]))  # back by less than a group
    total = whole + (tiles - whole) * n_splits
    sched = Schedule(total, tiles_per_head, U, n_kv, H, H_kv, L, L, False, n_splits, split_keys, 0, whole)
    covered = {}
    for t in range(total):
        info = sc.tile_info_host(t, rows, sched, grid)
        run = range(info.row0, info.row0 + info.n_valid)
        for j in run:
            key = (int(rows.cand[info.first + j // s_q]), j % s_q, info.head)
            covered.setdefault(key, []).append(info)
        if t < whole:
            assert info.whole == 1 and info.out_head == info.head and info.kv_base == 0
            assert info.n_keys == (0 if info.invalid else L)
    assert len(covered) == B * s_q * H
    split_users = set()
    for (b, r, h), infos in covered.items():
        bad = not 0 <= int(idx[b]) < U
        user = (h, int(idx[b]) if not bad else U)
        if len(infos) == 1:  # a whole tile
            assert infos[0].whole == 1 and user not in split_users
            continue
        split_users.add(user)
        assert len(infos) == n_splits
        spans = sorted((i.kv_base, i.kv_base + i.n_keys) for i in infos if i.n_keys)
        assert spans == ([] if bad else [(s * split_keys, min(L, (s + 1) * split_keys)) for s in range(n_splits)])
        for i in infos:
            split = 0 if i.whole else i.out_head // H
            assert i.out_head == (h if i.whole else split * H + h)
            assert i.whole == int(bad and split == 0)
    # a (head, user) pair is whole or split, never both
    assert not split_users & {(h, int(idx[b]) if 0 <= int(idx[b]) < U else U)
                              for (b, r, h), infos in covered.items() if len(infos) == 1}
