"""The warp-specialized skeleton's host-side checks (cute_kernels.warp_specialized): a register
budget, pipeline arrive counts or named-barrier ids that would hang or fail on the GPU raise a
ValueError with the arithmetic when the kernel object is built; the kernels pass them."""
import enum

import pytest
import torch

import ikbo_fa
import ikbo_gemm
from cute_kernels.warp_specialized import (
    Barrier,
    PipelineSpec,
    RegisterSplit,
    check_barriers,
    contract_differences,
    contract_table,
)
from ikbo_fa.fwd_sm90 import FwdBarrier, IkboAttentionFwdSm90
from ikbo_gemm.config import LINEAR_SHIPPED_CONFIGS
from ikbo_gemm.config import SHIPPED_CONFIGS as LCE_SHIPPED_CONFIGS
from ikbo_gemm.lce_sm90 import LceBarrier, LceSm90
from ikbo_gemm.linear_sm90 import LinearBarrier, LinearSm90


def test_register_split_budget():
    split = RegisterSplit(producer=24, consumer=240)
    assert split.threads == 384
    RegisterSplit(producer=40, consumer=232)  # 128 x (40 + 2 x 232) = 64512
    with pytest.raises(ValueError, match=r"^RegisterSplit: 128 x \(40 x 1 \+ 240 x 2\) = 66560 registers exceed the "
                                         r"SM's 65536$"):
        RegisterSplit(producer=40, consumer=240)
    with pytest.raises(ValueError, match=r"128 x \(24 x 1 \+ 168 x 3\) = 67584 registers exceed"):
        RegisterSplit(producer=24, consumer=168, consumer_warpgroups=3)


@pytest.mark.parametrize("field, regs", [("producer", 20), ("producer", 28), ("consumer", 264), ("consumer", 250)])
def test_register_split_takes_what_setmaxnreg_takes(field, regs):
    other = {"producer": 24, "consumer": 240}
    with pytest.raises(ValueError, match=rf"^RegisterSplit: {field} = {regs} registers: setmaxnreg takes a "
                                         r"multiple of 8 in \[24, 256\]$"):
        RegisterSplit(**{**other, field: regs})


def _spec(**change):
    fields = dict(name="ab", producer="producer warp 0", consumer="consumers", stages=4, tx_bytes=1024,
                  producer_arrives=1, consumer_arrives=8)
    return PipelineSpec(**{**fields, **change})


def test_pipeline_arrive_counts_are_those_of_the_roles():
    spec = _spec()
    assert spec.check("K", releasing_threads=256) is spec  # 256 / 32 x 1
    assert _spec(consumer_arrives=32).check("K", releasing_threads=128, multicast_ctas=8).consumer_arrives == 32
    with pytest.raises(ValueError, match=r"^K: ab pipeline declares 8 consumer arrives per stage, but 128 releasing "
                                         r"threads / 32 x 1 multicasting CTAs = 4$"):
        spec.check("K", releasing_threads=128)
    with pytest.raises(ValueError, match=r"declares 8 consumer arrives per stage, but 256 releasing threads / 32 x 2 "
                                         r"multicasting CTAs = 16"):
        spec.check("K", releasing_threads=256, multicast_ctas=2)
    with pytest.raises(ValueError, match=r"^K: ab pipeline released by 100 threads, not whole warps$"):
        spec.check("K", releasing_threads=100)
    with pytest.raises(ValueError, match=r"^K: ab pipeline declares 2 producer arrives; a TMA producer arrives once"):
        _spec(producer_arrives=2).check("K", releasing_threads=256)
    for bad in (dict(stages=0), dict(tx_bytes=0)):
        with pytest.raises(ValueError, match=r"^K: ab pipeline has \d+ stages of \d+ bytes$"):
            _spec(**bad).check("K", releasing_threads=256)


def test_contract_table():
    table = contract_table([_spec(), _spec(name="V", stages=2)])
    assert table.splitlines() == [
        "| pipeline | producer -> consumer | full / empty arrives | stages |",
        "| --- | --- | --- | --- |",
        "| ab | producer warp 0 -> consumers | 1 / 8 | 4 |",
        "| V | producer warp 0 -> consumers | 1 / 8 | 2 |",
    ]


def test_named_barrier_ids():
    class Good(Barrier):
        A = 1
        B = 3  # + warpgroup: 3 and 4
        C = 15

    check_barriers("K", Good, {"B": 2})

    class Zero(Barrier):
        SYNC = 0

    with pytest.raises(ValueError, match=r"^K: named barrier SYNC \+ 0 = 0 is outside \[1, 15\]$"):
        check_barriers("K", Zero)

    class PastTheEnd(Barrier):
        TURN = 15

    with pytest.raises(ValueError, match=r"^K: named barrier TURN \+ 1 = 16 is outside \[1, 15\]$"):
        check_barriers("K", PastTheEnd, {"TURN": 2})

    class Overlapping(Barrier):
        EPILOGUE = 1  # + warpgroup: 1 and 2
        TURN = 2

    with pytest.raises(ValueError, match=r"^K: named barrier id 2 is both EPILOGUE \+ 1 and TURN \+ 0$"):
        check_barriers("K", Overlapping, {"EPILOGUE": 2})
    assert issubclass(Barrier, enum.IntEnum)


def test_the_kernels_pass_their_checks():
    """Each kernel builds its contracts from its configuration: every shipped one passes."""
    for barriers, spans in ((LceBarrier, LceSm90.BARRIER_SPANS), (LinearBarrier, LinearSm90.BARRIER_SPANS),
                            (FwdBarrier, IkboAttentionFwdSm90.BARRIER_SPANS)):
        check_barriers("kernel", barriers, spans)
    for cfg in LCE_SHIPPED_CONFIGS:
        k = LceSm90(cfg)
        assert k.ab.consumer_arrives == 4 * cfg.cluster and k.ab.stages >= 2, cfg
        assert k.THREADS == k.REGISTERS.threads == 384
    for cfg in LINEAR_SHIPPED_CONFIGS:
        k = LinearSm90(cfg)
        # each releasing warp arrives in every CTA whose loads land in the stage: its row and column tiles'
        peers = cfg.cluster_m + cfg.cluster_n - 1
        assert k.ab.consumer_arrives == 4 * peers * cfg.consumers_per_tile and k.ab.stages >= 2, cfg
        assert k.THREADS == k.REGISTERS.threads == 384
    assert set(ikbo_gemm.SHIPPED_CONFIGS) == set(LCE_SHIPPED_CONFIGS) | set(LINEAR_SHIPPED_CONFIGS)
    for cfg in ikbo_fa.SHIPPED_CONFIGS:
        k = IkboAttentionFwdSm90(cfg)
        assert sorted(k.pipelines) == ["K", "Q", "V"]
        # a consumer warpgroup per 64 rows of the tile, each warp of it releasing every stage
        assert all(p.consumer_arrives == cfg.tile_m // 16 and p.producer_arrives == 1 for p in k.pipelines.values())
        assert k.num_threads == 128 + 2 * cfg.tile_m == k.registers.threads


@pytest.mark.parametrize("kernel_class, barriers, configs", [
    (LceSm90, LceBarrier, LCE_SHIPPED_CONFIGS), (LinearSm90, LinearBarrier, LINEAR_SHIPPED_CONFIGS)])
def test_the_gemm_docstrings_state_the_contract_the_kernels_build(kernel_class, barriers, configs):
    """The pipeline table and named barriers of each GEMM kernel's docstring, counts evaluated over
    its fields, are those every shipped configuration builds."""
    for cfg in configs:
        assert contract_differences(kernel_class.__doc__, kernel_class(cfg), barriers) == [], cfg


def test_contract_differences_finds_each_kind_of_drift():
    k = LceSm90(LCE_SHIPPED_CONFIGS[-1])  # 8-CTA clusters
    doc = LceSm90.__doc__
    assert "| 1 / 4 x cluster | ab_stages |" in doc and "MMA_ORDER + c (256 threads" in doc
    drifts = {
        doc.replace("| 1 / 4 x cluster |", "| 1 / 4 |"): ["pipeline 'ab': empty arrives: the table's '4' is 4, the kernel's 32"],
        # 13: more stages than any configuration takes (at most 12)
        doc.replace("| ab_stages |", "| 13 |"): [
            f"pipeline 'ab': stages: the table's '13' is 13, the kernel's {k.ab_stages}"],
        doc.replace("| ab |", "| abc |"): ["the table's pipeline 'abc' is none the kernel builds",
                                          "pipeline 'ab' is missing from the table"],
        doc.replace("-> the consumer warpgroup owning", "-> the consumers owning"): [
            "pipeline 'ab': the table says producer warp 0 -> the consumers owning the tile, the kernel "
            "producer warp 0 -> the consumer warpgroup owning the tile"],
        doc.replace("MMA_ORDER + c (256 threads", "MMA_ORDER + c (128 threads"): [
            "barrier MMA_ORDER: the docstring says 128 threads, the kernel 256"],
        doc.replace("EPILOGUE + c (128", "EPILOGUE (128"): [
            "barrier EPILOGUE: the docstring's per-warpgroup offset (+ c) and the kernel's 2 ids disagree"],
        doc.replace("EPILOGUE + c (128", "EPILOG + c (128"): [
            "the docstring's barrier EPILOG is not a member of LceBarrier", "barrier EPILOGUE is missing from the docstring"],
    }
    for drifted, expected in drifts.items():
        assert drifted != doc
        assert contract_differences(drifted, k, LceBarrier) == expected
    assert contract_differences(doc, k, LceBarrier) == []


def test_a_wrong_arrive_count_fails_when_the_kernel_is_built(monkeypatch):
    """A consumer role that releases its stages with fewer threads than the pipeline counts
    fails on the host, with the arithmetic, instead of hanging the GPU."""
    monkeypatch.setattr(LceSm90, "TILE_OWNER_THREADS", 256)
    with pytest.raises(ValueError, match=r"LceSm90: ab pipeline declares 32 consumer arrives per stage, but 256 "
                                         r"releasing threads / 32 x 8 multicasting CTAs = 64"):
        LceSm90(ikbo_gemm.config.LceConfig(torch.float16, torch.int32, 152, 2, 4, 128))
    monkeypatch.setattr(IkboAttentionFwdSm90, "WARPGROUP_THREADS", 64)
    with pytest.raises(ValueError, match=r"IkboAttentionFwdSm90: Q pipeline declares 8 consumer arrives"):
        IkboAttentionFwdSm90(ikbo_fa.SHIPPED_CONFIGS[0])


def test_a_split_pair_exchange_of_other_bytes_fails_when_the_kernel_is_traced(monkeypatch):
    """The bytes a split pair's sender stores are counted as its stores are traced: where they
    differ from those the receiver arms its barrier with (which would hang the GPU), the
    compile raises."""
    build = IkboAttentionFwdSm90.__init__

    def off_by_16(self, cfg):
        build(self, cfg)
        self.pair_tx += 16

    monkeypatch.setattr(IkboAttentionFwdSm90, "__init__", off_by_16)
    cfg = next(c for c in ikbo_fa.SHIPPED_CONFIGS if c.split_pair)
    with pytest.raises(Exception, match=r"a split pair sends 136 bytes a thread, the peer expects 17424"):
        ikbo_fa.compile_config(cfg)
