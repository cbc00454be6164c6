"""The launch policy of ``ikbo_fa.attention``: every launch choice and cost constant the op reads
when it builds a plan, as one frozen value (part of the plan's key, not of the compile key).

The op uses ``DEFAULT_POLICY``; a benchmark or test times or checks a variant by passing another
(``attention(..., policy=AttentionPolicy(split_pair=False))`` or ``AttentionPolicy.parse(spec)``).
"""
from __future__ import annotations

import dataclasses

from cute_kernels.policy_spec import parse_spec, spec_of

from .config import KEY_BLOCKS, MAX_PREFETCH_BLOCKS, TILE_M_CHOICES


@dataclasses.dataclass(frozen=True)
class AttentionPolicy:
    """Every launch choice and cost constant of ikbo_fa.attention (not the compile key)."""

    # KV broadcast groups candidates by user with the one-launch work-list kernel; False builds
    # the same arrays with torch ops (kv_worklist, the definition the kernel is tested against).
    worklist_kernel: bool = True
    # KV broadcast over few tiles splits each row's keys over several CTAs; False never splits.
    split_kv: bool = True
    # Keys per split at least. The merge is a second launch on the critical path; with its 16-byte
    # loads (2.9 us at S_q 1, L 8192, two splits) splits of 512 keys gained at L 1024 and 2048 on
    # the H200 (S_q 1, ratio 64, H 2, CUDA graphs: 21.0 against 22.9 us, 30.7 against 34.4 us):
    # docs/perf/2026-12-03-attention-longest-first.md.
    split_min_keys: int = 512
    # Two splits of a row's keys run on the two CTAs of a cluster and merge there
    # (AttentionConfig.split_pair), with no workspace and no merge launch. On the H200 (S_q 1,
    # B 2048, ratio 64, H 2, CUDA graphs) 20.2 against 22.3 us at L 1024 and 30.0 against 30.9 at
    # L 2048, the same from L 4096 and over the S_q sweep: docs/perf/2026-12-05-attention-variants-timed.md.
    split_pair: bool = True
    # The split count of least split_cost (filling the grid's last round too), not only splits where
    # the tiles leave half the SMs idle. With the costs below, on the H100 (CUDA graphs, against the
    # rule alone): long histories of few users (B 4096, U 8, H 4) 570 against 392 TFLOP/s padded and
    # 309 against 248 with lognormal lengths; S_q 4 to 16 at L 8192 6-12% faster; the S_q sweep at
    # L 1024 and the rest of it at L 8192 within 1%: docs/perf/2026-12-06-attention-split-by-cost.md.
    split_by_cost: bool = True
    # With split_by_cost over jagged K/V (kv_offsets), also cost the splits from the rows' total
    # keys (the packed K/V's first dimension, known without a sync), not only as if every row had
    # max_kv_len keys, and take the fewer splits. On the H100 (B 2048, ratio 64, H 2, L 8192,
    # CUDA graphs): S_q 4 to 16 1.21x to 1.47x faster, eight users of lognormal histories (B 4096,
    # H 4) 340 against 306 TFLOP/s, the same counts at L 1024: docs/perf/2026-12-06-attention-uneven-splits.md.
    split_by_total_keys: bool = True
    # KV broadcast over histories of their own lengths (kv_lengths or kv_offsets, tiles longest
    # first): each CTA takes its next tile from a counter as it frees up, not every G-th tile, and
    # a row's splits run next to each other (AttentionConfig.dynamic_walk; split pairs keep the
    # static walk). The splits are then costed by uneven_split_cost alone.
    dynamic_walk: bool = True
    # Rows of fewer keys than this (the longest a row may have: L, or max_kv_len) keep the static
    # walk: tiles of two key blocks at most cost about the same, and the counter's round trips
    # cost more than they balance (H100, short-history preset, L 256: 22.8 against 21.8 us at
    # S_q 4): docs/perf/2026-12-06-attention-dynamic-walk.md.
    dynamic_min_keys: int = 257
    # Histories of their own lengths run longest first (the work list orders its groups by key
    # count) only where a row may hold this many keys (L, or max_kv_len; a work list built without
    # max_kv_len orders always). Shorter rows cost a tile about the same whatever their length, so
    # their groups stay in user order, and the work list is the one of padded K/V (H100, short-history
    # preset: 128-key kv_offsets 12.1 against 13.8 us at S_q 1, 1.06x the padded time instead of
    # 1.21x): docs/perf/2026-12-06-attention-short-rows-user-order.md.
    order_min_keys: int = 257
    # Split-KV over histories of their own lengths: rows whose keys fit one split go to out
    # directly, not through the workspace and the merge (AttentionConfig.whole_rows_out).
    whole_rows_out: bool = True
    # KV broadcast: K/V blocks per CTA that the forward kernel prefetches into L2 while the work
    # list runs (each row's first blocks the tiles read, from the shapes or from the row lengths;
    # 0: none; at most MAX_PREFETCH_BLOCKS). 2: on the H100 (S_q sweep, B 2048, ratio 64, H 2, graph) 21.0 against
    # 22.1 us at S_q 1, L 1024 and 100.0 against 101.1 at L 8192, within 1% at every other point
    # of the sweep: docs/perf/2026-12-06-attention-h100-presets.md.
    prefetch_blocks: int = 2
    # KV broadcast over histories of their own lengths (kv_lengths or kv_offsets): where K and V
    # together take at most this many bytes, every CTA prefetches MAX_PREFETCH_BLOCKS blocks, not
    # prefetch_blocks (the rows' last blocks first: all of K and V where the grid's lanes reach).
    prefetch_kv_bytes: int = 16 << 20
    # split_cost's costs, in key blocks (128 keys) of a busy SM: a tile's fixed part, the merge in
    # the cluster (split_pair) and the merge launch. Fitted to the H100's timings of the split by
    # cost against the rule alone (the same document); unit costs (1, 1, 2) split S_q 2 at L 8192
    # four ways and lost 20% there.
    tile_blocks: int = 2
    pair_merge_blocks: int = 3
    merge_blocks: int = 14
    # KV broadcast over padded K/V whose tiles fill some rounds of the persistent grid and part of
    # one more: the tiles of the whole rounds run whole and only the last round's split
    # (AttentionConfig.tail_split), where tail_split_cost is below the cost of the plan above and
    # that plan splits every row at least tail_split_from ways. The last round's split goes
    # through a merge launch that skips every whole row (tail_merge_blocks, in key blocks of a
    # busy SM); its workspace holds every row of out once a split, so the split count keeps it
    # within tail_split_bytes. On the H100 (B 2048, ratio 64, H 2, CUDA graphs, the build whose
    # whole tiles end at a user's first tile) it ran up to 9% faster than the split pair or four
    # splits at L 2048 to 8192, S_q 4 to 17, level at a few points (D 64 S_q 4 at L 2048 and 4096:
    # 4-6% slower), and a first build 7-10% slower than no split at L 1024, S_q 4 and 16 (the
    # merge launch and a lse and mark per row cost more there than the last round's idle SMs),
    # hence tail_split_from:
    # docs/perf/2026-12-07-attention-tail-split-h100.md.
    tail_split: bool = True
    tail_split_from: int = 2
    tail_merge_blocks: int = 4
    tail_split_bytes: int = 256 << 20
    # ... taken only where it costs at least this many percent less than the plan without it (the
    # cost is coarse, and the split brings a workspace and a merge launch)
    tail_split_min_gain: int = 3
    # ... on 192-row tiles too (d64_tile_m below). On the H100 (D 64, L 8192, bf16, graph) where it
    # changes the plan (H 1 S_q 16 and 64, H 2 S_q 32) 1.02x, 1.08x and 1.05x faster, the same
    # elsewhere: docs/perf/2026-12-07-attention-tall-tail-split-h100.md.
    tail_split_tall: bool = True
    # At D 64 over padded K/V of at least d64_wide_min_keys keys, with no split, the main loop runs
    # blocks of d64_key_block keys (AttentionConfig.key_block: 128 or 192). On the H100 (published
    # shape, B 2048, ratio 64, H 2, S_q 64, bf16, CUDA graphs) 192-key blocks ran 485 against 462
    # TFLOP/s at L 2048 and 490 against 474 at L 4096: about 8% more keys a second, less the keys
    # the last block pads. At L 512 and 1024 that padding is 12.5% and they lost 4%, and on short
    # histories (128 to 256 keys) 13 to 20%: docs/perf/2026-12-07-attention-d64-key-block-h100.md.
    # From L 2048 on a 192-key block pads at most 6% more keys than 128-key ones.
    d64_key_block: int = 192
    d64_wide_min_keys: int = 2048
    # Percent more key blocks a second with 192-key blocks than with 128 (no split), as above: what
    # a plan that would run them gives up for the last round's split (tail_split).
    d64_wide_gain: int = 8
    # Query rows of a tile at D 64 in KV broadcast (AttentionConfig.tile_m): 192 runs three consumer
    # warpgroups on 128-key blocks and no split pair, taken where they cost less: rounds of the
    # grid (the split plan's mean tile count) times a tile's rows, 192-row tiles d64_tall_gain
    # percent faster a row. On the H100 (B 2048, ratio 64, H 2, bf16, CUDA graphs) 192-row tiles
    # ran 1.04x to 1.36x faster at S_q 4 to 64, L 1024 to 8192, and 0.70x to 0.94x at S_q 1 and
    # 0.84x to 0.86x at S_q 3, where both fit one round and the shorter tiles finish first:
    # docs/perf/2026-12-07-attention-d64-tall-tiles-h100.md. Calls given a work list run the
    # tiles it counts (ikbo_fa.work_list's head_dim).
    d64_tile_m: int = 192
    d64_tall_gain: int = 15

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "bool":
                if not isinstance(value, bool):
                    raise TypeError(f"AttentionPolicy.{f.name} must be a bool, got {value!r}")
            elif not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"AttentionPolicy.{f.name} must be an int, got {value!r}")
            elif value < 0:
                raise ValueError(f"AttentionPolicy.{f.name} must be >= 0, got {value}")
        if self.split_min_keys < 1:
            raise ValueError(f"AttentionPolicy.split_min_keys must be >= 1, got {self.split_min_keys}")
        if self.d64_key_block not in KEY_BLOCKS:
            raise ValueError(f"AttentionPolicy.d64_key_block must be one of {KEY_BLOCKS}, got {self.d64_key_block}")
        if self.d64_tile_m not in TILE_M_CHOICES:
            raise ValueError(f"AttentionPolicy.d64_tile_m must be one of {TILE_M_CHOICES}, got {self.d64_tile_m}")
        if self.prefetch_blocks > MAX_PREFETCH_BLOCKS:
            raise ValueError(f"AttentionPolicy.prefetch_blocks must be at most {MAX_PREFETCH_BLOCKS} (one lane of "
                             f"warp 0 each), got {self.prefetch_blocks}")

    def orders(self, keys: int) -> bool:
        """Whether tiles over rows of their own lengths, up to ``keys`` keys, run longest first."""
        return keys >= self.order_min_keys

    def walks_dynamically(self, keys: int) -> bool:
        """Whether tiles of rows of up to ``keys`` keys come from the counter (ordered ones only)."""
        return self.dynamic_walk and keys >= self.dynamic_min_keys and self.orders(keys)

    @classmethod
    def parse(cls, spec: str) -> "AttentionPolicy":
        """``'split_pair=0,prefetch_blocks=2'`` -> DEFAULT_POLICY with those fields replaced
        (``cute_kernels.policy_spec``: bools from 0/1/true/false, ints in decimal)."""
        return parse_spec(DEFAULT_POLICY, spec)

    def spec(self) -> str:
        """The fields that differ from DEFAULT_POLICY as ``parse`` reads them ('' for the default)."""
        return spec_of(self, DEFAULT_POLICY)


DEFAULT_POLICY = AttentionPolicy()
