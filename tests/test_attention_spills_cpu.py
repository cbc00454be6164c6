"""tools/attention_spills.py: the configurations it enumerates, and one compile through it."""
import importlib.util
import json
from pathlib import Path

import torch

from ikbo_fa.config import AttentionConfig

_spec = importlib.util.spec_from_file_location(
    "attention_spills", Path(__file__).resolve().parent.parent / "tools" / "attention_spills.py")
spills = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(spills)


def _args(*argv):
    return spills.parser().parse_args(list(argv))


def test_the_product_less_what_the_config_rejects():
    ns = _args("--variants", "plain", "split", "pair", "--S-q", "1", "17", "--D", "128")
    cfgs = list(spills.configs(ns))
    assert len(cfgs) == len(set(cfgs))
    # split_kv only with the lse; split pairs over every kind of history, with and without it
    assert all(c.return_lse for c in cfgs if c.split_kv)
    assert len([c for c in cfgs if c.split_kv]) == 2 * 3  # S_q x rows
    assert len([c for c in cfgs if c.split_pair]) == 2 * 3 * 2  # S_q x rows x lse
    plain = [c for c in cfgs if not (c.split_kv or c.split_pair)]
    assert len(plain) == 2 * 3 * 2
    assert AttentionConfig(torch.bfloat16, 128, 17, "kv", True, False) in cfgs


def test_q_broadcast_takes_no_kv_variant():
    ns = _args("--direction", "q", "--variants", "plain", "split", "pair", "--rows", "none")
    cfgs = list(spills.configs(ns))
    assert {c.direction for c in cfgs} == {"q"}
    assert not any(c.split_kv or c.split_pair for c in cfgs)
    assert len(cfgs) == 13 * 2 * 2  # S_q x D x lse


def test_one_compile_reported(tmp_path, capsys):
    out = tmp_path / "spills.jsonl"
    status = spills.main(["--S-q", "64", "--D", "64", "--rows", "none", "--jobs", "1", "--out", str(out)])
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["config"] for r in recs) == ["bfloat16-d64-sq64-kv", "bfloat16-d64-sq64-kv-lse"]
    assert all(r["spill_bytes"] == 0 and r["wgmma_notes"] == [] for r in recs)
    assert status == 0
    assert "2 of 2 compiled without spills" in capsys.readouterr().out
