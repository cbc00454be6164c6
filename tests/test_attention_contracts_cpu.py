"""The attention kernel's docstring contracts against the code they describe: its pipeline table
is what ``contract_table`` makes of the kernel's ``PipelineSpec`` s (every shipped configuration),
and its named-barrier list names exactly the ``FwdBarrier`` ids, with ``+ wg`` on those that take
one id per consumer warpgroup."""
import inspect
import re

import pytest
import torch

import ikbo_fa
from cute_kernels.warp_specialized import contract_table
from ikbo_fa.fwd_sm90 import FwdBarrier, IkboAttentionFwdSm90

DOC = inspect.cleandoc(IkboAttentionFwdSm90.__doc__)


@pytest.mark.parametrize("cfg", ikbo_fa.SHIPPED_CONFIGS, ids=str)
def test_pipeline_table_is_the_specs(cfg):
    """One of the docstring's tables (by consumer warpgroups) is the configuration's, row for row."""
    table = contract_table(IkboAttentionFwdSm90(cfg).pipelines.values()).splitlines()
    lines = [line.strip() for line in DOC.splitlines()]
    starts = [i for i, line in enumerate(lines) if line == table[0]]
    documented = [lines[i:i + len(table)] for i in starts if not lines[i + len(table)].startswith("|")]
    assert table in documented  # and no row beyond the specs


def test_barrier_list_is_the_enum():
    section = DOC.split("Named barriers (FwdBarrier")[1].split("\n\n")[0]
    listed = dict(re.findall(r"^  ([A-Z_]+)( \+ wg)? \(", section, flags=re.M))
    assert set(listed) == {b.name for b in FwdBarrier}
    per_wg = {name for name, wg in listed.items() if wg}
    spans = IkboAttentionFwdSm90.BARRIER_SPANS
    assert per_wg == set(spans) and all(n == 3 for n in spans.values())  # up to three consumer warpgroups


@pytest.mark.parametrize("tile_m", [128, 192])
def test_every_q_slot_is_loaded(tile_m):
    """The producer's Q slot groups cover every slot of a tile once (a slot left out would leave
    the stage's transaction bytes short and hang the consumers): every S_q from 1 to 200."""
    from ikbo_fa.fwd_sm90 import Q_SLOTS_UNROLLED

    for s_q in range(1, 201):
        k = IkboAttentionFwdSm90(ikbo_fa.AttentionConfig(torch.bfloat16, 64, s_q, "kv", False, False, tile_m=tile_m))
        assert k.slots * k.slot_rows == tile_m
        per = k.q_slot_group
        assert k.slots % per == 0 and (per == k.slots or per <= Q_SLOTS_UNROLLED), (s_q, k.slots, per)
