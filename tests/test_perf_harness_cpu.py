"""CPU checks of perf/harness.py and perf/bench_lce.py (workload, FLOP count, reference,
torch baselines, arguments)."""
import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from perf import bench_lce as bl  # noqa: E402
from perf import harness  # noqa: E402


# --------------------------------------------------------------------------- harness

def test_rel_error():
    ref = torch.randn(4, 5, dtype=torch.float64)
    assert harness.rel_error(ref.clone(), ref) == 0.0
    noisy = ref + 1e-3 * torch.randn_like(ref)
    want = float(torch.linalg.vector_norm(noisy - ref) / torch.linalg.vector_norm(ref))
    assert harness.rel_error(noisy, ref) == pytest.approx(want, rel=1e-12)
    assert harness.rel_error(noisy.to(torch.bfloat16), ref) > 0  # any dtype
    bad = ref.clone()
    bad[1, 2] = float("nan")
    assert harness.rel_error(bad, ref) == math.inf
    bad[1, 2] = float("inf")
    assert harness.rel_error(bad, ref) == math.inf
    assert harness.rel_error(ref[:3], ref) == math.inf
    zero = torch.zeros(3)
    assert harness.rel_error(zero, zero) == 0.0
    assert harness.rel_error(torch.ones(3), zero) == math.inf


def test_tflops_and_rotation_count():
    assert harness.tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert harness.tflops(1e12, None) is None
    l2 = 50 * 2**20
    assert harness.rotation_count(457 * 2**20, l2) == 1  # bigger than the cache: no copies
    assert harness.rotation_count(10 * 2**20, l2) == 8  # capped
    assert harness.rotation_count(60 * 2**20, l2) == 3
    assert harness.rotation_count(0, l2) == 8


def test_round_robin_rotates_the_start():
    calls = []
    harness._round_robin(["a", "b", "c"], 4, lambda name, i: calls.append((i, name)))
    assert calls == [(0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a"),
                     (2, "c"), (2, "a"), (2, "b"), (3, "a"), (3, "b"), (3, "c")]
    harness._round_robin([], 3, lambda name, i: calls.append(name))  # nothing to time: no call
    assert len(calls) == 12


def test_record_failure_kinds():
    rows = [{"provider": "p"}]
    harness.record_failure(rows[0], harness.Skip("no page table"), rows, device="cpu")
    assert rows[0]["status"] == "skipped" and rows[0]["note"] == "no page table"
    harness.record_failure(rows[0], NotImplementedError("later"), rows, device="cpu")
    assert rows[0]["status"] == "skipped" and "not available yet" in rows[0]["note"]
    harness.record_failure(rows[0], RuntimeError("boom"), rows, device="cpu")
    assert rows[0]["status"] == "error" and "boom" in rows[0]["note"]


def test_time_checked_keeps_the_timed_and_marks_the_failed(monkeypatch):
    monkeypatch.setattr(harness, "bench_interleaved",
                        lambda fns, **k: {"a": 1.5, "b": RuntimeError("illegal instruction")})
    rows = [{"provider": "a", "status": "ok"}, {"provider": "b", "status": "ok"}]
    timed = {"a": (rows[0], lambda x: None), "b": (rows[1], lambda x: None)}
    done = harness.time_checked(timed, rows, warmup=1, rep=1, device="cpu")
    assert list(done) == ["a"] and rows[0]["ms"] == 1.5
    assert rows[1]["status"] == "error" and "illegal instruction" in rows[1]["note"] and "ms" not in rows[1]


def test_print_table_aligns(capsys):
    rows = [{"provider": "ikbo", "ms": 0.123456, "tflops": 594.2, "n": 3},
            {"provider": "fa4 materialized", "ms": 12.5, "tflops": None, "status": "wrong"}]
    text = harness.print_table(rows, ["provider", "ms", "tflops", "n", "status"])
    lines = text.splitlines()
    assert capsys.readouterr().out.strip() == text
    assert len(lines) == 4 and len({len(line) for line in lines}) == 1
    assert "0.123" in lines[2] and "594" in lines[2] and "-" in lines[3] and "wrong" in lines[3]
    assert lines[0].startswith("provider")


def test_fmt():
    assert harness.fmt(None) == "-"
    assert harness.fmt(1234.5) == "1234" or harness.fmt(1234.5) == "1235"
    assert harness.fmt(0.000123) == "0.000123"
    assert harness.fmt(math.inf) == "inf"
    assert harness.fmt(True) == "yes"


def test_write_results(tmp_path):
    payload = {"rows": [{"provider": "ikbo", "ms": 0.5, "rel_err": math.inf}], "dtype": torch.float16}
    path = harness.write_results("unit", payload, out_dir=tmp_path / "r", stamp="20260101T000000Z")
    assert path == tmp_path / "r" / "unit-20260101T000000Z.json"
    latest = tmp_path / "r" / "unit-latest.json"
    assert latest.read_text() == path.read_text()
    data = json.loads(path.read_text())
    assert data["rows"][0]["rel_err"] == "inf" and data["dtype"] == "torch.float16"
    assert "date_utc" in data["environment"] and "torch" in data["environment"]
    harness.write_results("unit", {"rows": []}, out_dir=tmp_path / "r", stamp="20260101T000001Z")
    assert json.loads(latest.read_text())["rows"] == []  # latest overwritten


def test_environment_without_gpu():
    env = harness.environment()
    assert env["torch"] == torch.__version__
    assert env["date_utc"].endswith("+00:00")
    for key in ("nvidia-cutlass-dsl", "flash-attn-4", "git_commit", "python"):
        assert key in env
    if not torch.cuda.is_available():
        assert env["gpu"] is None


def test_environment_commit_can_be_named(monkeypatch):
    monkeypatch.setenv("IKBO_GIT_COMMIT", "0123abc")
    env = harness.environment()
    assert env["git_commit"] == "0123abc" and "git_dirty" not in env


def test_require_hopper_exits_2_with_one_line(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        harness.require_hopper_or_exit(name="bench")
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("bench: needs a Hopper (sm_90) GPU")
    assert "pip install -e '.[bench]'" in err


def test_require_hopper_names_the_wrong_gpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100")
    with pytest.raises(SystemExit):
        harness.require_hopper_or_exit(name="bench")
    assert "NVIDIA A100 (sm_80)" in capsys.readouterr().err


def test_require_hopper_and_fa4(monkeypatch, capsys):
    monkeypatch.setattr(harness, "hopper_missing", lambda: None)
    monkeypatch.setattr(harness, "fa4_import_error", lambda: "ImportError: no flash_attn")
    harness.require_hopper_or_exit(need_fa4=False, name="x")  # FA4 optional: returns
    with pytest.raises(SystemExit) as e:
        harness.require_hopper_or_exit(need_fa4=True, name="x")
    assert e.value.code == 2 and "flash-attn-4" in capsys.readouterr().err


def test_out_dir_argument():
    import argparse
    ap = argparse.ArgumentParser()
    harness.add_common_args(ap)
    assert ap.parse_args([]).out_dir == harness.RESULTS_DIR
    assert ap.parse_args(["--out-dir", "elsewhere"]).out_dir == Path("elsewhere")


# --------------------------------------------------------------------------- bench_lce

def test_lce_flops_published():
    p = bl.PUBLISHED
    flops = bl.lce_flops(p["M"], p["N"], 1024, 15, p["K_user"], p["K_cand"])
    assert flops == 2 * 433 * 256 * (1024 * 872 + 15 * 1184)
    assert abs(flops / 1e9 - 202) < 1  # "about 202 GFLOP"


def test_lce_problem_published_counts():
    p = bl.make_problem(1024, 70, torch.float16, device="cpu")
    assert p.counts == [70] * 14 + [44] and p.U == 15
    assert p.idx.dtype == torch.int32 and torch.bincount(p.idx.long()).tolist() == p.counts


@pytest.mark.parametrize("B,ratio", [(1024, 10000), (7, 1), (9, 4)])
def test_lce_problem_extremes(B, ratio):
    p = bl.make_problem(B, ratio, torch.float16, device="cpu")
    assert sum(p.counts) == B and p.U == -(-B // ratio)


SMALL = {"M": 9, "N": 6, "K_user": 5, "K_cand": 7}


def small_lce(B=11, ratio=3, seed=0):
    p = bl.make_problem(B, ratio, torch.float32, shape=SMALL, device="cpu")
    inp = bl.make_inputs(p, torch.Generator().manual_seed(seed), device="cpu")
    return p, inp


def materialized_definition(p, inp):
    """out[b] = [w_user, w_cand] @ [e_user[idx[b]]; e_cand[b]], in float64, one candidate at a time."""
    w = torch.cat([inp.w_user, inp.w_cand], dim=1).double()
    return torch.stack([w @ torch.cat([inp.e_user[u], inp.e_cand[b]], dim=0).double()
                        for b, u in enumerate(p.idx.tolist())])


def test_lce_reference_matches_the_definition():
    p, inp = small_lce()
    ref = bl.reference_output(p, inp, chunk=4)
    assert ref.dtype == torch.float32 and ref.shape == (p.B, p.M, p.N)
    torch.testing.assert_close(ref.double(), materialized_definition(p, inp), rtol=1e-5, atol=1e-5)


def test_lce_torch_providers_match_the_reference():
    p, inp = small_lce(B=10, ratio=4)
    ref = bl.reference_output(p, inp)
    rotated = inp.clone_activations()
    assert rotated.w_cand is inp.w_cand and rotated.e_cand.data_ptr() != inp.e_cand.data_ptr()
    for prov in bl.providers():
        if prov.ours:
            continue
        st = prov.setup(p, inp)
        for x in (inp, rotated):
            out = prov.run(p, st, x)
            assert out.shape == (p.B, p.M, p.N)
            assert harness.rel_error(out, ref) < 1e-5, prov.name
    # a provider that adds the wrong user's result fails the check
    wrong = bl.reference_output(p, inp).clone()
    wrong -= torch.matmul(inp.w_user, inp.e_user)[p.idx.long()]
    wrong += torch.matmul(inp.w_user, inp.e_user)[(p.idx.long() + 1) % p.U]
    assert harness.rel_error(wrong, ref) > 0.05


def test_lce_ours_calls_the_op(monkeypatch):
    p, inp = small_lce()
    seen = []

    def lce(w_cand, w_user, e_cand, e_user, idx, *, out=None, validate=None, schedule="fused"):
        seen.append((schedule, validate))
        return torch.matmul(w_cand, e_cand) + torch.matmul(w_user, e_user)[idx.long()]

    monkeypatch.setattr(bl.LIB, "ikbo_gemm", type("M", (), {"lce": staticmethod(lce)}))
    ref = bl.reference_output(p, inp)
    for prov in [pr for pr in bl.providers() if pr.ours]:
        assert harness.rel_error(prov.run(p, prov.setup(p, inp), inp), ref) < 1e-5
    assert seen == [("two_launch", False), ("fused", False)]


def test_lce_default_configs():
    args = bl.parse_args([])
    keys, groups = bl.build_configs(args)
    assert groups["published"] == [(1024, 70, "fp16"), (1024, 70, "bf16")]
    assert [k[0] for k in groups["B sweep (fp16)"]] == bl.SWEEPS["B"]
    assert [k[1] for k in groups["ratio sweep (fp16)"]] == bl.SWEEPS["ratio"]
    assert len(keys) == len(set(keys)) == 2 + len(bl.SWEEPS["B"]) + len(bl.SWEEPS["ratio"]) - 2
    assert keys[:2] == groups["published"]  # the published shape runs first


def test_lce_arguments():
    args = bl.parse_args(["--configs", "ratio", "--ratio", "2", "10000", "--sweep-dtype", "bf16",
                          "--out-dir", "o", "--providers", "ikbo fused", "torch bmm"])
    keys, groups = bl.build_configs(args)
    assert keys == [(1024, 2, "bf16"), (1024, 10000, "bf16")]
    assert args.out_dir == Path("o") and args.providers == ["ikbo fused", "torch bmm"]
    with pytest.raises(SystemExit) as e:
        bl.parse_args(["--providers", "cutlass"])
    assert e.value.code == 2


# --------------------------------------------------------------------------- CPU dry run of main()

def test_lce_main_dry_run(monkeypatch, tmp_path, capsys, cpu_timing):
    def lce(w_cand, w_user, e_cand, e_user, idx, *, out=None, validate=None, schedule="fused"):
        if schedule == "two_launch":
            raise NotImplementedError("two_launch: not yet")
        return torch.matmul(w_cand, e_cand) + torch.matmul(w_user, e_user)[idx.long()]

    monkeypatch.setattr(bl, "DEVICE", "cpu")
    monkeypatch.setattr(harness, "require_hopper_or_exit", lambda *a, **k: None)
    monkeypatch.setattr(bl, "load_ikbo_gemm", lambda: None)
    monkeypatch.setattr(bl.LIB, "ikbo_gemm", type("M", (), {"lce": staticmethod(lce)}))
    monkeypatch.setattr(harness, "l2_bytes", lambda: 2**20)
    monkeypatch.setattr(harness, "cublas_ceiling_tflops", lambda dtype: 700.0)
    argv = ["--M", "9", "--N", "6", "--K-user", "5", "--K-cand", "7", "--dtype", "fp16",
            "--sweep-dtype", "bf16", "--B", "16", "70", "--ratio", "3", "10000",
            "--warmup", "1", "--rep", "3", "--out-dir", str(tmp_path)]
    # CPU half-precision matmul may be missing on old torch; the dry run needs it
    torch.matmul(torch.ones(2, 2, dtype=torch.float16), torch.ones(2, 2, dtype=torch.float16))
    assert bl.main(argv) == 0
    data = json.loads((tmp_path / "bench_lce-latest.json").read_text())
    rows = data["rows"]
    keys = {(r["B"], r["ratio"], r["dtype"]) for r in rows}
    assert keys == {(1024, 70, "fp16"), (16, 70, "bf16"), (70, 70, "bf16"), (1024, 3, "bf16"),
                    (1024, 10000, "bf16")}
    for r in rows:
        if r["provider"] == "ikbo two_launch":
            assert r["status"] == "skipped"
        else:
            assert r["status"] == "ok", r
            assert r["rel_err"] < 1e-2 and r["x_decomp"] > 0 and r["pct_ceiling"] > 0
            assert r["compile_s"] >= 0
    out = capsys.readouterr().out
    assert "ratio sweep (bf16): TFLOP/s" in out


def test_import_op_says_what_is_missing():
    mod, note = harness.import_op("math", "sqrt")
    assert mod is not None and note is None
    mod, note = harness.import_op("math", "no_such_op")
    assert mod is None and note == "math.no_such_op does not exist yet"
    mod, note = harness.import_op("no_such_module_for_ikbo", "f")
    assert mod is None and "not importable" in note
