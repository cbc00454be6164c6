"""The attention kernel's docstring contracts against the code they describe: its pipeline table
is what ``contract_table`` makes of the kernel's ``PipelineSpec`` s (every shipped configuration),
and its named-barrier list names exactly the ``FwdBarrier`` ids, with ``+ wg`` on those that take
one id per consumer warpgroup."""
import inspect
import re

import pytest

import ikbo_fa
from cute_kernels.warp_specialized import contract_table
from ikbo_fa.fwd_sm90 import FwdBarrier, IkboAttentionFwdSm90

DOC = inspect.cleandoc(IkboAttentionFwdSm90.__doc__)


@pytest.mark.parametrize("cfg", ikbo_fa.SHIPPED_CONFIGS, ids=str)
def test_pipeline_table_is_the_specs(cfg):
    table = contract_table(IkboAttentionFwdSm90(cfg).pipelines.values())
    lines = [line.strip() for line in DOC.splitlines()]
    start = lines.index(table.splitlines()[0])
    documented = "\n".join(lines[start:start + len(table.splitlines())])
    assert documented == table
    assert not lines[start + len(table.splitlines())].startswith("|")  # no row beyond the specs


def test_barrier_list_is_the_enum():
    section = DOC.split("Named barriers (FwdBarrier")[1].split("\n\n")[0]
    listed = dict(re.findall(r"^  ([A-Z_]+)( \+ wg)? \(", section, flags=re.M))
    assert set(listed) == {b.name for b in FwdBarrier}
    per_wg = {name for name, wg in listed.items() if wg}
    spans = IkboAttentionFwdSm90.BARRIER_SPANS
    assert per_wg == set(spans) and all(n == 2 for n in spans.values())
