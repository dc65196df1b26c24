"""Patch bf16_full_grad against real DeepSpeed (patches/bf16_full_grad/scenario.py), 2 ranks: bf16 ZeRO-1 with
``grad_accum_dtype: fp32`` (BF16_Optimizer), gradient accumulation 2; ``safe_get_full_grad``, ``safe_set_full_grad``
and ``safe_update_full_grad_vectorized`` at the end of each accumulation."""

import pytest

from harness import ds_before, load_proof, torchrun

pytestmark = pytest.mark.deepspeed
# written here from the tagged sdists (deepspeed/utils/tensor_fragment.py), not read from the patch's gate:
# tests/test_inert_gates.py compares the two.  Reading returns param.grad first before 0.19.8; writing exists from
# 0.15.3 (DeepSpeed #6590) and writes param.grad first in every release up to 0.19.8.
READS_WRONG = ds_before("0.19.8")
WRITES_EXIST = not ds_before("0.15.3")
AFFECTED = READS_WRONG or WRITES_EXIST


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    return torchrun("bf16_full_grad", 2, tmp_path_factory.mktemp("bf16fg"))


@pytest.fixture(scope="module")
def ranks(launched):
    return launched["ranks"]


def test_proof(ranks):
    without, with_, proven = load_proof("bf16_full_grad").judge(ranks)
    assert proven == AFFECTED, (without, with_)


def test_every_run_trained_with_the_optimizer_it_names(ranks):
    for rank in ranks:
        for call in ("get", "set", "update", "plain", "double"):
            for kind in ("without", "with"):
                run = rank[f"{call}/{kind}"]
                assert run["ok"], (call, kind, run.get("error"))
                assert bool(run.get("absent")) == (call in ("set", "update") and not WRITES_EXIST), (call, kind)
                if not run.get("absent"):
                    assert run["optimizer"] == "BF16_Optimizer", (call, kind, run["optimizer"])
        assert rank["other/get/without"]["optimizer"] == "DeepSpeedZeroOptimizer"


def test_the_optimizer_steps_with_the_average_over_the_ranks(ranks):
    """What the judge compares with: the optimizer's fp32 gradient is, bit for bit, the average over the ranks of the
    fp32 sums the hooks recorded independently, whole and the same on both ranks."""
    for rank in ranks:
        for call in ("get", "plain"):
            assert rank[f"{call}/without"]["buffers"] == rank[f"{call}/without"]["expected"], call
    assert ranks[0]["plain/without"]["buffers"] == ranks[1]["plain/without"]["buffers"]
    assert ranks[0]["plain/without"]["param_sha256"] == ranks[1]["plain/without"]["param_sha256"]


def test_reading(ranks):
    proof = load_proof("bf16_full_grad")
    for rank in ranks:
        assert proof.reads_the_buffer(rank["get/without"]) != READS_WRONG
        assert proof.reads_the_buffer(rank["get/with"])
    # without zeroshim each rank read its own numbers
    assert (ranks[0]["get/without"]["read"] != ranks[1]["get/without"]["read"]) == READS_WRONG


@pytest.mark.skipif(not WRITES_EXIST, reason="DeepSpeed < 0.15.3 has no safe_set_full_grad")
def test_writing(ranks):
    for rank in ranks:
        for call in ("set", "update"):
            without, with_ = rank[f"{call}/without"], rank[f"{call}/with"]
            # without: the step ignored the doubled gradients; with: it used them, bit for bit the doubled loss's run
            assert without["param_sha256"] == rank["plain/without"]["param_sha256"], call
            assert (with_["losses"], with_["param_sha256"]) == \
                (rank["double/without"]["losses"], rank["double/without"]["param_sha256"]), call


def test_runs_that_call_none_of_them_and_other_optimizers_are_left_alone(ranks):
    for rank in ranks:
        for key in ("plain", "double", "other/set", "other/update"):
            a, b = rank[f"{key}/without"], rank[f"{key}/with"]
            if key in ("other/set", "other/update") and not WRITES_EXIST:
                assert a.get("absent") and b.get("absent")
                continue
            assert (a["losses"], a["param_sha256"]) == (b["losses"], b["param_sha256"]), key
        assert rank["other/get/with"]["read"] == rank["other/get/without"]["read"]


def test_counted_and_said_once(launched, ranks):
    for rank in ranks:
        assert rank["status"]["state"] == ("applied" if AFFECTED else "skipped"), rank["status"]
        # 2 steps x 4 parameters, per run
        assert rank["stats"] == {"read": 8 if READS_WRONG else 0, "written": 16 if WRITES_EXIST else 0}
    log = launched["log"]
    assert log.count("zeroshim[bf16_full_grad]: safe_get_full_grad returned") == (1 if READS_WRONG else 0)
    assert log.count("zeroshim[bf16_full_grad]: safe_set_full_grad wrote") == (1 if WRITES_EXIST else 0)
