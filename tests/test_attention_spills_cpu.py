"""tools/attention_spills.py: the configurations it enumerates, and one compile through it."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from ikbo_fa.config import AttentionConfig

_spec = importlib.util.spec_from_file_location(
    "attention_spills", Path(__file__).resolve().parent.parent / "tools" / "attention_spills.py")
spills = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(spills)


def _args(*argv):
    return spills.parser().parse_args(list(argv))


def test_the_product_less_what_the_config_rejects():
    ns = _args("--variants", "plain", "split", "group32", "all", "--S-q", "1", "17", "--D", "128")
    cfgs = list(spills.configs(ns))
    assert len(cfgs) == len(set(cfgs))
    # split_kv only with the lse; group_idx only over padded K/V without kv_lengths
    assert all(c.return_lse for c in cfgs if c.split_kv)
    assert all(not c.ordered for c in cfgs if c.group_idx is not None)
    # "all" keeps its other variants where grouping does not apply
    jagged_all = [c for c in cfgs if c.jagged and c.split_pair]
    assert jagged_all and all(c.lane_search and c.solo and c.poly_exp2 == 3 and c.group_idx is None
                              for c in jagged_all)
    plain = [c for c in cfgs if not (c.split_kv or c.split_pair or c.group_idx is not None)]
    assert len(plain) == 2 * 3 * 2  # S_q x rows x lse
    assert AttentionConfig(torch.bfloat16, 128, 17, "kv", True, False) in cfgs


def test_q_broadcast_takes_no_kv_variant():
    ns = _args("--direction", "q", "--variants", "plain", "lanes", "solo", "pair", "poly3", "--rows", "none")
    cfgs = list(spills.configs(ns))
    assert {c.direction for c in cfgs} == {"q"}
    assert not any(c.lane_search or c.solo or c.split_pair for c in cfgs)
    assert {c.poly_exp2 for c in cfgs} == {0, 3}


def test_one_compile_reported(tmp_path, capsys):
    out = tmp_path / "spills.jsonl"
    status = spills.main(["--S-q", "64", "--D", "64", "--rows", "none", "--jobs", "1", "--out", str(out)])
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["config"] for r in recs) == ["bfloat16-d64-sq64-kv", "bfloat16-d64-sq64-kv-lse"]
    assert all(r["spill_bytes"] == 0 and r["wgmma_notes"] == [] for r in recs)
    assert status == 0
    assert "2 of 2 compiled without spills" in capsys.readouterr().out
