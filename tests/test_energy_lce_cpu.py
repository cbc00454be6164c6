"""CPU checks of perf/energy_lce.py and the power helpers in perf/harness.py."""
import json

import pytest
import torch

from perf import bench_lce as bl
from perf import energy_lce as el
from perf import harness


def test_parse_power_samples():
    text = "688.41, 1530, 0x0000000000000004\n[N/A], 1980, 0x0\n122.5, 1980, 0x0000000000000000\n\n1, 2\n"
    assert harness.parse_power_samples(text) == [(688.41, 1530.0, 4), (122.5, 1980.0, 0)]
    assert harness.parse_power_samples("") == []


def test_compulsory_bytes_published():
    p = bl.make_problem(1024, 70, torch.float16, device="cpu")
    elems = 433 * (872 + 1184) + 1024 * 872 * 256 + 15 * 1184 * 256 + 1024 * 433 * 256
    assert el.compulsory_bytes(p) == 2 * elems
    assert 0.68e9 < el.compulsory_bytes(p) < 0.70e9  # e_cand 457 MB + out 227 MB + the small rest


def test_summarize_energy_columns_and_estimates():
    flops, nbytes = 200e9, 0.7e9
    rows = [
        {"workload": "idle", "W": 100.0},
        {"workload": "device copy 1 GiB", "flops": 0, "ms": 0.5, "W": 600.0, "power_capped": False,
         "mJ": 300.0},
        {"workload": f"cuBLAS {el.GEMM_N}^3 GEMM", "flops": 1e12, "ms": 1.5, "W": 700.0, "power_capped": True,
         "mJ": 1050.0},
        {"workload": "torch decomposition", "flops": flops, "burst_ms": 0.56, "ms": 0.6, "W": 700.0,
         "power_capped": True, "mJ": 420.0},
        {"workload": "ikbo fused", "flops": flops, "burst_ms": 0.4, "ms": 0.45, "W": 680.0, "power_capped": True,
         "mJ": 306.0},
    ]
    est = el.summarize(rows, 100.0, flops, nbytes)
    copy, gemm, ours = rows[1], rows[2], rows[4]
    pj_byte = (600.0 - 100.0) / (2 * el.COPY_BYTES / 0.5e-3) * 1e12
    assert copy["pJ_per_byte"] == pytest.approx(pj_byte)
    assert gemm["pJ_per_flop"] == pytest.approx(1.05)
    assert ours["x_decomp"] == pytest.approx(0.6 / 0.45)
    assert ours["x_decomp_burst"] == pytest.approx(0.56 / 0.4)
    assert ours["x_decomp_energy"] == pytest.approx(420.0 / 306.0)
    assert ours["tflops"] == pytest.approx(200e9 / 0.45e-3 / 1e12)
    assert "x_decomp" not in rows[3] and "x_decomp" not in gemm
    want = (flops * 1.05 + nbytes * pj_byte) * 1e-9
    assert est["with_dram_mJ"] == pytest.approx(want)
    assert est["flops_only_mJ"] == pytest.approx(flops * 1.05e-9)
    assert est["cap_W"] == pytest.approx((700.0 + 700.0 + 680.0) / 3)
    assert est["ms_at_cap"] == pytest.approx(want / est["cap_W"])
    assert est["x_decomp_with_dram"] == pytest.approx(420.0 / want)
    assert est["x_decomp_flops_only"] == pytest.approx(420.0 / (flops * 1.05e-9))


def test_summarize_without_power_readings():
    rows = [{"workload": "idle", "W": None},
            {"workload": "ikbo fused", "flops": 10, "ms": 1.0, "W": None, "power_capped": None, "mJ": None}]
    est = el.summarize(rows, None, 10, 100)
    assert "with_dram_mJ" not in est and est["cap_W"] is None
    assert rows[1]["tflops"] == pytest.approx(10 / 1e-3 / 1e12)


def test_main_dry_run(monkeypatch, tmp_path, capsys, lce_benchmark_on_cpu):
    watts = iter(range(300, 400, 7))

    def sustained(fn, seconds):
        for _ in range(2):
            fn()
        w = float(next(watts))
        return {"ms": 2.0, "W": w, "MHz": 1500.0, "power_capped": True, "mJ": 2.0 * w, "samples": 9}

    monkeypatch.setattr(el, "COPY_BYTES", 1024)
    monkeypatch.setattr(el, "GEMM_N", 16)
    monkeypatch.setattr(harness, "idle_watts", lambda: 100.0)
    monkeypatch.setattr(harness, "sustained", sustained)
    monkeypatch.setattr(harness, "burst_ms", lambda fn: 1.5)
    argv = ["--B", "20", "--ratio", "3", "--providers", "torch decomposition", "ikbo fused",
            "--out-dir", str(tmp_path)]
    assert el.main(argv) == 0
    data = json.loads((tmp_path / "energy_lce-latest.json").read_text())
    names = [r["workload"] for r in data["rows"]]
    assert names == ["idle", "device copy 1 GiB", "cuBLAS 16^3 GEMM", "torch decomposition", "ikbo fused"]
    ours = data["rows"][-1]
    assert ours["x_decomp"] == pytest.approx(1.0) and ours["x_decomp_energy"] > 0
    assert ours["burst_ms"] == 1.5 and ours["x_decomp_burst"] == pytest.approx(1.0)
    assert data["estimate"]["with_dram_mJ"] > 0 and data["problem"]["B"] == 20
    out = capsys.readouterr().out
    assert "energy per call: FLOPs only" in out and "best x over torch decomposition" in out


class _FakeSmi:
    """Stands in for the nvidia-smi sampling process: canned CSV lines."""
    lines = ""

    def __init__(self, cmd, **kwargs):
        assert cmd[0] == "nvidia-smi" and "-lms" in cmd

    def kill(self):
        pass

    def communicate(self, timeout=None):
        return self.lines, None


def test_sustained_averages_the_samples(monkeypatch):
    _FakeSmi.lines = "".join(f"{w}, {mhz}, {bits}\n" for w, mhz, bits in
                             [(300, 1980, "0x0")] * 3 + [(690, 1500, "0x4"), (700, 1400, "0x4"),
                                                         (710, 1450, "0x0")] * 5 + [(200, 1980, "0x0")] * 3)
    monkeypatch.setattr(harness.subprocess, "Popen", _FakeSmi)
    monkeypatch.setattr(harness, "_run", lambda cmd, cwd=None: "1.0 W")
    calls = []
    r = harness.sustained(lambda: calls.append(1), 0.05, warm_s=0.01, trim=3, device="cpu")
    assert r["samples"] == 15 and r["W"] == pytest.approx(700.0) and r["MHz"] == 1450.0
    assert r["power_capped"] is True and r["ms"] > 0 and r["mJ"] == pytest.approx(700.0 * r["ms_mean"])
    assert len(calls) >= r["calls"] + 1 >= 2  # an untimed call sizes the chunks


def test_sustained_without_nvidia_smi(monkeypatch):
    def missing(cmd, **kwargs):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(harness.subprocess, "Popen", missing)
    monkeypatch.setattr(harness, "_run", lambda cmd, cwd=None: None)
    r = harness.sustained(lambda: None, 0.02, warm_s=0.0, device="cpu")
    assert r["W"] is None and r["mJ"] is None and r["power_capped"] is None and r["ms"] > 0
    assert harness.idle_watts(0.01) is None
