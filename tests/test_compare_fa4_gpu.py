"""perf/compare_fa4.py end to end on a Hopper GPU, as it is run (``python -m perf.compare_fa4``
in a process of its own), at sizes that take seconds: every provider that applies passes its
fp32 check and is timed, the presets' layouts run, FA4 and FA3 run or are a note, and the
variants run under their attention policies."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

import ikbo_fa

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--warmup", "1", "--rep", "3", "--timing", "interleaved", "--no-plot"]
# why a provider may be skipped: it takes no jagged K/V or no Q broadcast, FA3 takes no fp16,
# a library is missing, or the per-candidate copy does not fit
SKIPS = ("jagged K/V", "K/V broadcast only", "bf16 only", "not importable", "does not exist", "GiB free")


def run(tmp_path, *argv) -> dict:
    res = subprocess.run([sys.executable, "-m", "perf.compare_fa4", *argv, *SMALL, "--out-dir", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads((tmp_path / "compare_fa4-latest.json").read_text())


def check_rows(data: dict) -> None:
    for r in data["rows"]:
        name = r["provider"]
        if r["status"] == "skipped":
            assert any(why in r["note"] for why in SKIPS) and name != "ikbo", r
            continue
        assert r["status"] == "ok", r
        if name != "materialize":
            assert r["rel_err"] < 1e-2 and r["ms"] > 0 and r["tflops"] > 0, r
        if name.startswith("ikbo") and any(o["status"] == "ok" and "varlen" in o["provider"] for o in data["rows"]
                                           if cf_key(o) == cf_key(r)):
            assert r["x_best_peer"] > 0 and "varlen" in r["best_peer"], r
    ikbo = [r for r in data["rows"] if r["provider"] == "ikbo"]
    assert ikbo and all(r["status"] == "ok" for r in ikbo)


def cf_key(r: dict) -> tuple:
    return tuple(r[k] for k in ("B", "ratio", "S_q", "L", "dtype", "broadcast", "order", "jagged", "H", "D"))


@pytest.mark.parametrize("preset", ["short-history", "long-history", "gr-cross"])
def test_presets_scaled_down(tmp_path, preset):
    data = run(tmp_path, "--preset", preset, "--B", "96", "--ratio", "12", "--L", "300")
    check_rows(data)
    assert data["settings"]["preset"]["name"] == preset
    fa3 = [r for r in data["rows"] if r["provider"].startswith("fa3")]
    assert fa3 and (all(r["status"] == "ok" for r in fa3) or any("fa3_fwd_interface" in n for n in data["notes"]))


def test_fp16_and_q_broadcast(tmp_path):
    data = run(tmp_path, "--S-q", "1", "17", "--L", "200", "--B", "64", "--ratio", "7", "--dtype", "fp16",
               "--broadcast", "kv", "q", "--order", "shuffled")
    check_rows(data)
    assert all(r["status"] == "skipped" for r in data["rows"] if r["provider"].startswith("fa3"))


@pytest.mark.skipif(not hasattr(ikbo_fa, "AttentionPolicy"), reason="ikbo_fa.AttentionPolicy is not on this tree")
def test_variants(tmp_path):
    data = run(tmp_path, "--S-q", "1", "--L", "1024", "--B", "256", "--ratio", "64", "--providers", "ikbo",
               "fa4 varlen packed", "--variant", "split_pair=0", "split_kv=0", "prefetch_blocks=2")
    check_rows(data)
    names = [r["provider"] for r in data["rows"]]
    assert names[:4] == ["ikbo", "ikbo split_pair=0", "ikbo split_kv=0", "ikbo prefetch_blocks=2"]
    assert all(r["status"] == "ok" and r["ikbo_speedup"] > 0 for r in data["rows"][1:4])
